"""A framework's LR scheduler held on skipped steps without waiting for the device.

A framework steps its scheduler right after the optimizer step. Asking whether that step was
skipped would mean waiting for the device, because the skip is decided there. Instead,
:class:`HeldSchedules` steps the scheduler at once. It keeps the scheduler's state and its
optimizer's group settings from before the step, and if the step turns out to have been skipped
it puts back, one step late, the scheduler's state and the settings its step changed. It learns that from the step's :class:`~mixprec.StepResult`
when the result's host copy is free to read: before the next update, a checkpoint, or the end
of training. So every update uses the learning rate it would use if the host had waited.
Between a skipped step and the next update, code that reads the optimizer's ``lr`` directly
sees the advanced value; ``scheduler.get_last_lr()`` and ``state_dict()`` settle first and
give the held one.

>>> import torch
>>> from mixprec import StepResult
>>> w = torch.nn.Parameter(torch.ones(1))
>>> opt = torch.optim.SGD([w], lr=1.0)
>>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
>>> held = HeldSchedules()
>>> opt.step()  # (a step decided on the device, say)
>>> held.step(sched, type(sched).step, StepResult.lazy(lambda: {"skipped": True}))
>>> opt.param_groups[0]["lr"]  # stepped at once
0.5
>>> held.settle()  # the step was skipped: put back
>>> opt.param_groups[0]["lr"], sched.last_epoch
(1.0, 0)
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from mixprec.ledger import StepResult
from mixprec.stepping import group_settings, restore_scheduler, scheduler_state

__all__ = ["HeldSchedules"]


class HeldSchedules:
    """Scheduler steps taken before their optimizer step's outcome is known, each undone at
    :meth:`settle` if that step was skipped."""

    def __init__(self) -> None:
        self._unsettled: list[tuple[Any, StepResult, Any, list[dict[str, Any]]]] = []
        self._watched: set[int] = set()  # id() of the models and optimizers that settle before their state_dict
        self._classes: dict[tuple[type, str], type] = {}
        self._warned = False

    def hold(self, scheduler: Any, result_for: Callable[[Any], StepResult | None]) -> None:
        """Make ``scheduler.step()`` go through :meth:`step`, with ``result_for(scheduler)`` (its
        optimizer's last StepResult) as the result; its ``get_last_lr`` and ``state_dict`` settle
        first, and its ``load_state_dict`` forgets its unsettled steps. The scheduler keeps its
        identity and its ``state_dict`` (only its class changes, to a subclass of the same name), so
        checkpoints are unchanged."""
        schedules = self

        def members(cls: Any) -> dict[str, Any]:
            def step(sched: Any, *args: Any, **kwargs: Any) -> Any:
                return schedules.step(sched, cls.step, result_for(sched), *args, **kwargs)

            def load_state_dict(sched: Any, *args: Any, **kwargs: Any) -> Any:
                schedules.drop(sched)
                return cls.load_state_dict(sched, *args, **kwargs)

            return {"step": step, "load_state_dict": load_state_dict, **self._settling(cls, "get_last_lr", "state_dict")}

        self._swap(scheduler, "held", members)

    def settle_before_stepping(self, scheduler: Any) -> None:
        """Make ``scheduler.step()`` settle first (reading the last optimizer step's outcome then, at
        once): for a scheduler that is not held but may write the same optimizer's settings, such
        as an epoch-interval one beside a held step-interval one."""
        self._swap(scheduler, "settles", lambda cls: self._settling(cls, "step"))

    def _settling(self, cls: type, *names: str) -> dict[str, Any]:
        def settled(name: str) -> Callable[..., Any]:
            def call(sched: Any, *args: Any, **kwargs: Any) -> Any:
                self.settle()
                return getattr(cls, name)(sched, *args, **kwargs)
            return call

        return {name: settled(name) for name in names if hasattr(cls, name)}

    def _swap(self, scheduler: Any, kind: str, members: Callable[[type], dict[str, Any]]) -> None:
        cls = type(scheduler)
        if getattr(cls, "_mixprec_held", False) or getattr(cls, "_mixprec_settles", False):
            return
        made = self._classes.get((cls, kind))
        if made is None:
            def reduce(sched: Any, protocol: int) -> tuple[Any, ...]:  # pickled and copied as the class it was
                return _unswapped, (cls, sched.__dict__)

            made = type(cls.__name__, (cls,), {**members(cls), f"_mixprec_{kind}": True, "__module__": cls.__module__,
                                               "__reduce_ex__": reduce})
            self._classes[(cls, kind)] = made
        scheduler.__class__ = made

    def step(self, scheduler: Any, step: Callable[..., Any], result: StepResult | None, *args: Any, **kwargs: Any) -> Any:
        """``step(scheduler, *args, **kwargs)`` unless ``result`` (its optimizer's last step) was
        skipped. It reads the result now only where that is free (already on the host), where the
        step takes arguments (``ReduceLROnPlateau``'s metric), or where the scheduler has no
        ``state_dict``/``load_state_dict`` to put it back with (the unsettled steps are settled first
        then). Otherwise it steps at once and decides at :meth:`settle`."""
        if result is None:
            return step(scheduler, *args, **kwargs)
        restorable = callable(getattr(scheduler, "state_dict", None)) and callable(getattr(scheduler, "load_state_dict", None))
        if result.resolved or args or kwargs or not restorable:
            self.settle()
            return None if result.skipped else step(scheduler, *args, **kwargs)
        before = scheduler_state(scheduler)
        with warnings.catch_warnings():  # a first step that is skipped (and put back) has no optimizer.step()
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`")
            out = step(scheduler)
        self._unsettled.append((scheduler, result, before, group_settings(scheduler)))
        self._watch_optimizers(scheduler)
        return out

    def settle(self) -> None:
        """Put back every scheduler step whose optimizer step was skipped (newest first): the
        scheduler's state, and of its optimizer's group settings the ones that step changed. A
        setting something else changed since (another scheduler of the same optimizer that is not
        held, a callback) is left as it is, with a warning."""
        unsettled, self._unsettled = self._unsettled, []
        for scheduler, result, before, after in reversed(unsettled):
            if result.skipped:
                left = restore_scheduler(scheduler, before, after)
                if left and not self._warned:
                    self._warned = True
                    warnings.warn(
                        f"the optimizer's {sorted(set(left))} changed between a skipped step and the next update by "
                        f"something other than its scheduler {type(scheduler).__name__} (another scheduler of the same "
                        "optimizer, or code writing its param_groups): mixprec put the scheduler back and left those "
                        "settings as it found them, which still include that scheduler's step. Step every scheduler of "
                        "an optimizer through the framework (held alike), or combine them in one ChainedScheduler",
                        stacklevel=2,
                    )

    def drop(self, scheduler: Any = None) -> None:
        """Forget the unsettled steps (of ``scheduler``; None: all): their state was just replaced by a load."""
        self._unsettled = [u for u in self._unsettled if scheduler is not None and u[0] is not scheduler]

    def settle_before_saving(self, model: torch.nn.Module) -> None:
        """:meth:`settle` whenever ``model``'s ``state_dict`` is taken: the frameworks' checkpoints save
        the model before the optimizer and the schedulers (registered once per model)."""
        if id(model) not in self._watched:
            model.register_state_dict_pre_hook(_SettleFirst(self))
            self._watched.add(id(model))

    def _watch_optimizers(self, scheduler: Any) -> None:
        """:meth:`settle` before the state_dict of the scheduler's optimizer (each wrapper of it, down
        to the innermost) is taken, and :meth:`drop` before one is loaded (registered once each)."""
        opt = getattr(scheduler, "optimizer", None)
        while isinstance(opt, torch.optim.Optimizer):
            if id(opt) not in self._watched:
                self._watched.add(id(opt))
                try:
                    opt.register_state_dict_pre_hook(_SettleFirst(self))
                    opt.register_load_state_dict_pre_hook(_SettleFirst(self, drop=True))
                except AttributeError:  # a wrapper that never ran Optimizer.__init__ (Accelerate's): its inner one has them
                    pass
            opt = getattr(opt, "optimizer", None)



def _unswapped(cls: Any, state: dict[str, Any]) -> Any:
    """A held or settling scheduler, unpickled or copied: of its own class again."""
    scheduler = cls.__new__(cls)
    scheduler.__dict__.update(state)
    return scheduler


class _SettleFirst:
    """A ``state_dict`` pre-hook that settles (``drop``: a ``load_state_dict`` pre-hook that forgets)
    the unsettled steps of a :class:`HeldSchedules`. It holds it weakly, and a pickled or copied
    model carries a hook that does nothing (``torch.save(model)`` pickles its hooks)."""

    def __init__(self, schedules: HeldSchedules | None = None, drop: bool = False) -> None:
        self._schedules = None if schedules is None else weakref.ref(schedules)
        self._drop = drop

    def __call__(self, *_: Any) -> None:
        schedules = None if self._schedules is None else self._schedules()
        if schedules is not None:
            schedules.drop() if self._drop else schedules.settle()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_SettleFirst, ())

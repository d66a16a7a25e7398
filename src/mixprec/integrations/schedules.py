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

import copy
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.ledger import StepResult
from mixprec.stepping import group_settings, restore_scheduler

__all__ = ["HeldSchedules"]

#: the run-time subclasses a held or settling scheduler takes, by (its own class, kind)
_CLASSES: dict[tuple[type, str], type] = {}
#: each held or settling scheduler's HeldSchedules and (held) result source; kept out of the
#: scheduler's ``__dict__``, which its ``state_dict`` saves
_OWNERS: weakref.WeakKeyDictionary[Any, tuple[HeldSchedules, Callable[[Any], StepResult | None] | None]] = (
    weakref.WeakKeyDictionary()
)


@dataclass
class _Unsettled:
    """A scheduler step taken before its optimizer step's outcome is known; ``state`` (None once a
    load replaced the scheduler's) and ``groups`` (None once a load replaced the optimizer's) are
    what a skip puts back, ``after`` the group settings the step left."""

    scheduler: Any
    result: StepResult
    state: Any
    groups: list[dict[str, Any]] | None
    after: list[dict[str, Any]]


class HeldSchedules:
    """Scheduler steps taken before their optimizer step's outcome is known, each undone at
    :meth:`settle` if that step was skipped."""

    def __init__(self) -> None:
        self._unsettled: list[_Unsettled] = []
        self._watched: weakref.WeakSet[Any] = weakref.WeakSet()  # models and optimizers that settle before their state_dict
        self._warned = False

    def hold(self, scheduler: Any, result_for: Callable[[Any], StepResult | None]) -> bool:
        """Make ``scheduler.step()`` go through :meth:`step`, with ``result_for(scheduler)`` (its
        optimizer's last StepResult) as the result; its ``get_last_lr`` and ``state_dict`` settle
        first, and its ``load_state_dict`` forgets what its unsettled steps would put back of its
        state. The scheduler keeps its identity and its ``state_dict`` (only its class changes, to
        a subclass of the same name; :meth:`release` gives it back), so checkpoints are unchanged.
        A scheduler held before (by an earlier run) is taken over. One that cannot be (its class
        cannot change, or it cannot be a weak key) is left as it is: False."""
        return self._swap(scheduler, "held", result_for)

    def settle_before_stepping(self, scheduler: Any) -> bool:
        """Make ``scheduler.step()`` settle first (reading the last optimizer step's outcome then, at
        once): for a scheduler that is not held but may write the same optimizer's settings, such
        as an epoch-interval one beside a held step-interval one. False where it cannot be."""
        return self._swap(scheduler, "settles", None)

    def release(self, scheduler: Any) -> None:
        """Give ``scheduler`` its own class back (after :meth:`settle`: the end of a run)."""
        base = getattr(type(scheduler), "_mixprec_base", None)
        if base is not None and _OWNERS.get(scheduler, (None,))[0] is self:
            scheduler.__class__ = base
            del _OWNERS[scheduler]

    def _swap(self, scheduler: Any, kind: str, result_for: Callable[[Any], StepResult | None] | None) -> bool:
        cls = type(scheduler)
        base = getattr(cls, "_mixprec_base", cls)
        made = _CLASSES.get((base, kind))
        if made is None:
            made = _CLASSES[(base, kind)] = type(base.__name__, (base,), {
                **(_held_members(base) if kind == "held" else _settling(base, "step")),
                "_mixprec_base": base, "_mixprec_held": kind == "held", "__module__": base.__module__,
                "__reduce_ex__": lambda sched, protocol: (_unswapped, (base, sched.__dict__)),
            })
        try:
            _OWNERS[scheduler] = (self, result_for)
            scheduler.__class__ = made
        except TypeError:  # (unhashable, no weak references, or a layout its class cannot change from)
            if _weak_key(scheduler):
                _OWNERS.pop(scheduler, None)
            return False
        return True

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
        base = getattr(type(scheduler), "_mixprec_base", type(scheduler))  # (its own state_dict: no settling)
        state, groups = copy.deepcopy(base.state_dict(scheduler)), group_settings(scheduler)
        with warnings.catch_warnings():  # a first step that is skipped (and put back) has no optimizer.step()
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`")
            out = step(scheduler)
        self._unsettled.append(_Unsettled(scheduler, result, state, groups, group_settings(scheduler)))
        self._watch_optimizers(scheduler)
        return out

    def settle(self) -> None:
        """Put back every scheduler step whose optimizer step was skipped (newest first): the
        scheduler's state, and of its optimizer's group settings the ones that step changed. A
        setting something else changed since (another scheduler of the same optimizer that is not
        held, a callback) is left as it is, with a warning."""
        unsettled, self._unsettled = self._unsettled, []
        for held in reversed(unsettled):
            if not held.result.skipped:
                continue
            left = restore_scheduler(held.scheduler, (held.state, held.groups or []), held.after)
            if left and not self._warned:
                self._warned = True
                warnings.warn(
                    f"the optimizer's {sorted(set(left))} changed between a skipped step and the next update by "
                    f"something other than its scheduler {type(held.scheduler).__name__} (another scheduler of the "
                    "same optimizer, or code writing its param_groups): mixprec put the scheduler back and left those "
                    "settings as it found them, which still include that scheduler's step. Step every scheduler of "
                    "an optimizer through the framework (held alike), or combine them in one ChainedScheduler",
                    stacklevel=2,
                )

    def drop(self) -> None:
        """Forget the unsettled steps: the state they would put back was just replaced by a load."""
        self._unsettled = []

    def loaded_scheduler(self, scheduler: Any) -> None:
        """``scheduler``'s state was just loaded: a skip puts back none of it."""
        for held in self._unsettled:
            if held.scheduler is scheduler:
                held.state = None

    def loaded_optimizer(self, optimizer: Any) -> None:
        """``optimizer``'s state was just loaded: a skip puts back none of its group settings."""
        for held in self._unsettled:
            opt = getattr(held.scheduler, "optimizer", None)
            while opt is not None and opt is not optimizer:
                opt = getattr(opt, "optimizer", None)
            if opt is optimizer:
                held.groups = None

    def settle_before_saving(self, model: torch.nn.Module) -> None:
        """:meth:`settle` whenever ``model``'s ``state_dict`` is taken: the frameworks' checkpoints save
        the model before the optimizer and the schedulers (registered once per model)."""
        if model not in self._watched:
            model.register_state_dict_pre_hook(_SettleFirst(self))
            self._watched.add(model)

    def _watch_optimizers(self, scheduler: Any) -> None:
        """:meth:`settle` before the state_dict of the scheduler's optimizer (each wrapper of it, down
        to the innermost) is taken; a load of one forgets what the unsettled steps would put back
        of its settings (registered once each)."""
        opt = getattr(scheduler, "optimizer", None)
        while isinstance(opt, torch.optim.Optimizer):
            if opt not in self._watched:
                self._watched.add(opt)
                try:
                    opt.register_state_dict_pre_hook(_SettleFirst(self))
                    opt.register_load_state_dict_pre_hook(_SettleFirst(self, on_load=True))
                except AttributeError:  # a wrapper that never ran Optimizer.__init__ (Accelerate's): its inner one has them
                    pass
            opt = getattr(opt, "optimizer", None)


def _weak_key(obj: Any) -> bool:
    try:
        weakref.ref(obj)
        hash(obj)
    except TypeError:
        return False
    return True


def _owner(sched: Any) -> tuple[HeldSchedules, Callable[[Any], StepResult | None] | None] | None:
    return _OWNERS.get(sched)


def _settling(cls: Any, *names: str) -> dict[str, Any]:
    def settled(name: str) -> Callable[..., Any]:
        def call(sched: Any, *args: Any, **kwargs: Any) -> Any:
            owner = _owner(sched)
            if owner is not None:
                owner[0].settle()
            return getattr(cls, name)(sched, *args, **kwargs)
        return call

    return {name: settled(name) for name in names if hasattr(cls, name)}


def _held_members(cls: Any) -> dict[str, Any]:
    def step(sched: Any, *args: Any, **kwargs: Any) -> Any:
        owner = _owner(sched)
        if owner is None or owner[1] is None:
            return cls.step(sched, *args, **kwargs)
        return owner[0].step(sched, cls.step, owner[1](sched), *args, **kwargs)

    def load_state_dict(sched: Any, *args: Any, **kwargs: Any) -> Any:
        owner = _owner(sched)
        if owner is not None:
            owner[0].loaded_scheduler(sched)
        return cls.load_state_dict(sched, *args, **kwargs)

    return {"step": step, "load_state_dict": load_state_dict, **_settling(cls, "get_last_lr", "state_dict")}


def _unswapped(cls: Any, state: dict[str, Any]) -> Any:
    """A held or settling scheduler, unpickled or copied: of its own class again."""
    scheduler = cls.__new__(cls)
    scheduler.__dict__.update(state)
    return scheduler


class _SettleFirst:
    """A ``state_dict`` pre-hook that settles the unsettled steps of a :class:`HeldSchedules`
    (``on_load``: an optimizer's ``load_state_dict`` pre-hook that forgets what they would put back
    of its settings). It holds it weakly, and a pickled or copied model carries a hook that does
    nothing (``torch.save(model)`` pickles its hooks)."""

    def __init__(self, schedules: HeldSchedules | None = None, on_load: bool = False) -> None:
        self._schedules = None if schedules is None else weakref.ref(schedules)
        self._on_load = on_load

    def __call__(self, *args: Any) -> None:
        schedules = None if self._schedules is None else self._schedules()
        if schedules is None:
            return
        if self._on_load:
            schedules.loaded_optimizer(args[0])
        else:
            schedules.settle()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_SettleFirst, ())

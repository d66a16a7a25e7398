"""A framework's LR scheduler held on skipped steps without waiting for the device.

A framework steps its scheduler right after the optimizer step. Asking whether that step was
skipped would mean waiting for the device, because the skip is decided there. Instead,
:class:`HeldSchedules` steps the scheduler at once. It keeps the scheduler's state and its
optimizer's group settings from before the step, and puts them back one step late if the step
turns out to have been skipped. It learns that from the step's :class:`~mixprec.StepResult`
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
from collections.abc import Callable
from typing import Any

import torch

from mixprec.ledger import StepResult
from mixprec.stepping import restore_scheduler, scheduler_state

__all__ = ["HeldSchedules"]


class HeldSchedules:
    """Scheduler steps taken before their optimizer step's outcome is known, each undone at
    :meth:`settle` if that step was skipped."""

    def __init__(self) -> None:
        self._unsettled: list[tuple[Any, StepResult, Any]] = []
        self._watched: set[int] = set()  # id() of the models that settle before their state_dict
        self._held_classes: dict[type, type] = {}

    def hold(self, scheduler: Any, result_for: Callable[[Any], StepResult | None]) -> None:
        """Make ``scheduler.step()`` go through :meth:`step`, with ``result_for(scheduler)`` (its
        optimizer's last StepResult) as the result; its ``get_last_lr`` and ``state_dict`` settle
        first. The scheduler keeps its identity and its ``state_dict`` (only its class changes, to a
        subclass of the same name), so checkpoints are unchanged."""
        cls = type(scheduler)
        if getattr(cls, "_mixprec_held", False):
            return
        held = self._held_classes.get(cls)
        if held is None:
            schedules = self

            def step(sched: Any, *args: Any, **kwargs: Any) -> Any:
                return schedules.step(sched, cls.step, result_for(sched), *args, **kwargs)

            def settled(name: str) -> Callable[..., Any]:
                def read(sched: Any) -> Any:
                    schedules.settle()
                    return getattr(cls, name)(sched)
                return read

            members = {"step": step, **{name: settled(name) for name in ("get_last_lr", "state_dict") if hasattr(cls, name)}}
            held = type(cls.__name__, (cls,), {**members, "_mixprec_held": True, "__module__": cls.__module__})
            self._held_classes[cls] = held
        scheduler.__class__ = held

    def step(self, scheduler: Any, step: Callable[..., Any], result: StepResult | None, *args: Any, **kwargs: Any) -> Any:
        """``step(scheduler, *args, **kwargs)`` unless ``result`` (its optimizer's last step) was
        skipped. It reads the result now only where that is free (already on the host), where the
        step takes arguments (``ReduceLROnPlateau``'s metric), or where the scheduler has no
        ``state_dict``/``load_state_dict`` to put it back with. Otherwise it steps at once and
        decides at :meth:`settle`."""
        if result is None:
            return step(scheduler, *args, **kwargs)
        restorable = callable(getattr(scheduler, "state_dict", None)) and callable(getattr(scheduler, "load_state_dict", None))
        if result.resolved or args or kwargs or not restorable:
            return None if result.skipped else step(scheduler, *args, **kwargs)
        before = scheduler_state(scheduler)
        with warnings.catch_warnings():  # a first step that is skipped (and put back) has no optimizer.step()
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`")
            out = step(scheduler)
        self._unsettled.append((scheduler, result, before))
        return out

    def settle(self) -> None:
        """Put back every scheduler step whose optimizer step was skipped (newest first)."""
        unsettled, self._unsettled = self._unsettled, []
        for scheduler, result, before in reversed(unsettled):
            if result.skipped:
                restore_scheduler(scheduler, before)

    def settle_before_saving(self, model: torch.nn.Module) -> None:
        """:meth:`settle` whenever ``model``'s ``state_dict`` is taken: the frameworks' checkpoints save
        the model before the optimizer and the schedulers (registered once per model)."""
        if id(model) not in self._watched:
            model.register_state_dict_pre_hook(self._state_dict_pre_hook)
            self._watched.add(id(model))

    def _state_dict_pre_hook(self, *_: Any) -> None:
        self.settle()

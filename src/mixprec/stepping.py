"""``step()``: the update at an accumulation boundary, in stages an interruption can resume.

:class:`StepRunner` is the part of :class:`mixprec.MixedPrecision` that runs a step: the
skip decision, clipping, the update of every optimizer, then the bookkeeping (buffers,
the plan's ``after_step``, the loss scale, clearing gradients). Each stage is recorded in
the step's :class:`~mixprec.phases.StepPhases`, so an exception or a Ctrl-C anywhere leaves
a state from which ``state_dict()`` saves the last finished step and ``step()`` again
finishes this one exactly: nothing is decided, clipped, updated, counted or scheduled
twice. The state it reads is set up by ``MixedPrecision.__init__`` and ``prepare``.

The step is device-first: the decision, the loss scale and the masked update stay on the
device, and the host learns the outcome one step late (:class:`_Lagged`): the next
``step()`` reads it before its own update (the LR scheduler of step t is advanced before
step t+1's update, so every update uses the learning rate it would use if the host had
waited), as does anything that needs it at once (reading the :class:`StepResult`,
``last_step_skipped``, ``state_dict()``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from mixprec.buffers import BufferGuard
from mixprec.composable import ComposableSteps
from mixprec.explainer import OverflowExplainer
from mixprec.lagged import HostCopy
from mixprec.ledger import StepLedger, StepResult
from mixprec.optim import InBackwardOptimizer
from mixprec.options import check_ready
from mixprec.prepare import PreparedModel
from mixprec.scaling import ScaleRefused
from mixprec.step import REASONS, Decision, apply_update

__all__ = ["StepRunner", "group_settings", "restore_scheduler", "scheduler_state"]


class _Lagged:
    """A decided step whose host bookkeeping has not run yet: its values, copied to the host as
    soon as they were computed, and how far the bookkeeping got (each part runs once, also when
    an interruption makes it run again)."""

    __slots__ = ("copy", "decision", "result", "schedule_undo", "scheduled", "serial", "values")

    def __init__(self, decision: Decision, copy: HostCopy, serial: int) -> None:
        self.decision, self.copy, self.serial = decision, copy, serial
        self.values: dict[str, Any] | None = None  # the counted result
        self.result: StepResult | None = None
        self.scheduled = False
        self.schedule_undo: Any = None


class StepRunner(ComposableSteps):
    """``step()`` and its bookkeeping; a base of :class:`mixprec.MixedPrecision`, not used alone."""

    scheduler: Any
    tracer: Any
    max_consecutive_skips: int
    _buffers: BufferGuard
    _ledger: StepLedger
    _prepared: PreparedModel | None
    _explainer: OverflowExplainer | None = None  # (class defaults: sessions pickled before they existed)
    _step_serial: int = 0
    _lagged: _Lagged | None = None

    def step(self, *, zero_grad: bool = True) -> StepResult:
        """At an accumulation boundary: unscale, check, clip, step every optimizer (or none), clear grads.

        The returned :class:`StepResult` is read lazily: reading it at once waits for the
        device; at the next step it is free. ``zero_grad=False`` leaves the gradients to a
        framework that clears them itself (Lightning does, before the next backward; freeing
        them twice costs page faults).
        """
        if not isinstance(zero_grad, bool):
            raise TypeError(f"zero_grad= must be True or False, got {zero_grad!r}")
        check_ready(self.model, self.optimizers, "step()")
        if self._prepared is not None:
            self._prepared.check_dtypes("step()")
            self._prepared.check_bound(self.optimizers, "step()")
        phases = self._phases
        if not phases.step_ready(self.grad_accum_steps):
            return self._accumulating()
        try:
            self.settle_outcome(check=True)  # the last step's bookkeeping (its scheduler step first), before this update
            if phases.outcome is not None:  # an interrupted step() got past its update: finish it
                decision = phases.outcome
            elif self._in_backward is not None:  # the parameters were updated (or restored) during backward
                decision = Decision.known(self._in_backward_outcome(self._in_backward), None, self.device)
            else:
                decision = self._decide_and_update()
            phases.outcome = decision
            result = self._finish(decision, zero_grad)
        except BaseException:
            phases.interrupt()  # where it got to is recorded: state_dict() and step() again work
            raise
        if self.tracer is not None or self._in_backward is not None or (
            self._explainer is not None and self._explainer.armed
        ):  # at once: a tracer's record belongs to this step (before the next forward); in backward it was read
            self.settle_outcome(check=True)
        return result

    def _accumulating(self) -> StepResult:
        """The result of a step() between accumulation boundaries (nothing done)."""
        scale = self.scaler.scale_tensor().detach().clone() if self.scaler.is_enabled() else None
        lagged = self._lagged

        def values() -> dict[str, Any]:
            steps = self.optimizer_steps if lagged is None or lagged.values is None else lagged.values["optimizer_steps"]
            return {"scale": 1.0 if scale is None else float(scale), "accumulating": True, "optimizer_steps": steps}

        return StepResult.lazy(values) if lagged is not None or scale is not None else StepResult(
            accumulating=True, optimizer_steps=self._ledger.optimizer_steps)

    def _decide_and_update(self) -> Decision:
        """Unscale, measure, decide once for all optimizers and ranks, then clip and update.

        Each stage is recorded in :attr:`_phases`: after an interruption, the next call
        goes on where this one stopped (no second decision, clip or update). Nothing is
        read on the host here unless an optimizer cannot skip on the device."""
        phases = self._phases
        if phases.decision is None:
            self._unscale("step()")
            norm = self._norm(self._grads(), remember=False)
            phases.decision = self._decision.decide(norm, self.plan.nonfinite_flag(self.model), self.scaler, self.optimizers)  # type: ignore[arg-type]
        decision: Decision = phases.decision
        if self.clip_grad_norm is not None and not phases.clipped:
            # whatever the decision: a skipped step's gradients are cleared, and a non-finite norm clips nothing
            self._clip(self._grads(), self.clip_grad_norm, "step()", decision.norm, decision.skip_flag())
            phases.clipped = True
        apply_update(self.optimizers, decision, self.process_group, phases)
        return decision

    def _in_backward_outcome(self, in_backward: InBackwardOptimizer) -> str | None:
        if in_backward.release():  # a new backward is accepted again
            return None
        return "nonfinite_loss" if self._decision.loss_was_nonfinite() else "overflow"

    def _finish(self, decision: Decision, zero_grad: bool) -> StepResult:
        """After the update: buffers and plan, the loss scale (on the device), the outcome copied
        to the host for the bookkeeping of the next step; reset the step.

        Each part runs once even if an interruption makes ``step()`` call this again."""
        phases = self._phases
        if phases.result is None:
            if not decision.finished:  # once: an interruption after it must not restore or settle twice
                if decision.host is not None:
                    if decision.host[0] is not None:
                        self._buffers.restore()
                else:
                    self._buffers.restore_where(decision.skip_flag())  # (on the device: no read)
                self.plan.after_step(self.model)  # type: ignore[arg-type]
                self._buffers.commit()
                device = decision.code.device
                before = self.scaler.scale_tensor().to(device, torch.float32, copy=True)  # the scale the step ran with
                try:
                    self.scaler.settle(decision.code)
                except ScaleRefused:  # a skip the scaler refused to count (raise_at_min_scale): nothing was
                    self._reset_step(stepped=False)  # updated, so the step ends here; a save and a new backward work
                    if zero_grad:
                        self._clear_grads()
                    raise
                collapse = self._ledger.settle_collapse(decision.code, decision.norm, self.scaler)  # (on the device)
                decision.outcome = torch.stack([
                    decision.code, decision.norm.to(device, torch.float32), before,
                    self.scaler.scale_tensor().to(device, torch.float32), *collapse,
                ])
                decision.finished = True
            lagged = _Lagged(decision, HostCopy(decision.outcome), self._step_serial)  # type: ignore[arg-type]
            lagged.result = StepResult.lazy(lambda: self._settle(lagged))
            phases.result = lagged
        lagged = phases.result
        self._lagged = lagged
        self.last_result = lagged.result
        if decision.host is None:
            self._reset_step(undecided=True)
        else:
            self._reset_step(stepped=decision.host[0] is None)
        if zero_grad:
            self._clear_grads()
        return lagged.result  # type: ignore[no-any-return]

    def _replayed(self, decision: Decision) -> StepResult:
        """A CUDA graph replayed the step captured with ``decision`` (:mod:`mixprec.graphs`): its
        device tensors now hold this replay's outcome. Copy it to the host as an eager step does
        and leave the bookkeeping to the next step (or replay), one step late."""
        replay = copy.copy(decision)
        replay.host = None
        lagged = _Lagged(replay, HostCopy(decision.outcome), self._step_serial)  # type: ignore[arg-type]
        lagged.result = StepResult.lazy(lambda: self._settle(lagged))
        self._lagged = lagged
        self.last_result = lagged.result
        self._phases.finished(stepped=None)
        self._step_serial += 1
        return lagged.result

    def settle_outcome(self, *, check: bool = False) -> None:
        """Run the host bookkeeping of the last decided step now, if it has not run: count it,
        advance the LR scheduler (real steps only), let the overflow explainer see it. It reads
        the outcome copied to the host when the step was decided: free one step later, a wait
        for the device right after ``step()``. ``check`` (``step()`` passes it, before its own
        update): also raise what the counts imply (``max_consecutive_skips``, a collapsed loss
        scale), once; a read of the result leaves that to the next ``step()``."""
        lagged = self._lagged
        if lagged is None:
            return
        self._settle(lagged)
        if check and self._lagged is lagged:
            self._lagged = None
            diagnosis = self._explainer.diagnosis() if self._explainer is not None else None
            self._ledger.check(lagged.result, self.scaler, self.max_consecutive_skips, diagnosis)  # type: ignore[arg-type]

    def _settle(self, lagged: _Lagged) -> dict[str, Any]:
        if lagged.values is None:
            code, norm, ran_with, scale, *collapse = lagged.copy.values()
            reason = REASONS[int(code)]
            lagged.decision.host = (reason, norm)
            overflow = self.tracer.first_overflow() if reason is not None and self.tracer is not None else None
            if self.tracer is None and self._explainer is not None:  # traces by itself once skips persist
                # a tracer armed now sees the forward after the one that already ran since this step
                first = lagged.serial + (1 if self._step_serial == lagged.serial + 1 and self._phases.micro == 0 else 2)
                overflow = self._explainer.after_step(lagged.serial, reason, ran_with if reason is not None else None,
                                                      first_traced=first)
            if reason is None and self.tracer is not None:
                self.tracer.reset()
            counted = self._ledger.count(reason, norm if lagged.decision.measured else None, self.scaler, scale, overflow,
                                         collapse=collapse or None)
            lagged.values = counted.as_dict()
            if self._lagged is lagged:
                self._phases.learned(stepped=reason is None)
        values = lagged.values
        if values["stepped"] and self.scheduler is not None and not lagged.scheduled:
            self._step_scheduler(lagged)
        return values

    def _step_scheduler(self, lagged: _Lagged) -> None:
        """Step the scheduler exactly once for ``lagged``'s step, wherever an interruption lands: its
        state (and its optimizer's group settings: lr, momentum) is kept before it steps, and the
        next settling after an interruption inside it puts that state back and steps it again. A
        scheduler without ``state_dict``/``load_state_dict`` is stepped at most once (an
        interruption inside it then leaves whatever it had changed)."""
        scheduler = self.scheduler
        if not callable(getattr(scheduler, "state_dict", None)) or not callable(getattr(scheduler, "load_state_dict", None)):
            lagged.scheduled = True  # (first: a scheduler that raises is not stepped twice)
            scheduler.step()
            return
        if lagged.schedule_undo is None:
            lagged.schedule_undo = scheduler_state(scheduler)
        else:  # its step was interrupted: undo what it did, then take the step again
            restore_scheduler(scheduler, lagged.schedule_undo)
        scheduler.step()
        lagged.scheduled = True

    def _reset_step(self, stepped: bool | None = None, *, undecided: bool = False) -> None:
        """End the step (``stepped``: how it ended; None: a load or a failed backward dropped it;
        ``undecided``: it ended, decided on the device and not read yet)."""
        if undecided:
            self._phases.finished(stepped=None)
        elif stepped is None:
            self._phases.reset()
        else:
            self._phases.finished(stepped=stepped)
        self._step_serial += 1  # (the explainer takes each step once, however it ended)
        self._norm_memo.forget()
        self._decision.reset()
        if self._in_backward is not None:
            self._in_backward.reset()

    def _discard_step(self) -> None:
        """Drop the step in progress and its gradients (a backward raised halfway through)."""
        self._reset_step()
        self._clear_grads()

    def _clear_grads(self) -> None:
        for opt in self.optimizers:  # the wrappers also clear the model gradients they stand for
            opt.zero_grad(set_to_none=True)
        for p in self._prepared.uncovered if self._prepared is not None else ():
            p.grad = None

    @property
    def optimizer_steps(self) -> int:
        """Real optimizer steps taken so far (skipped steps not counted; reads the last step's outcome)."""
        self.settle_outcome()
        return self._ledger.optimizer_steps


def scheduler_state(scheduler: Any) -> tuple[Any, list[dict[str, Any]]]:
    """A copy of ``scheduler``'s state and of its optimizer's group settings (all but the parameters)."""
    return copy.deepcopy(scheduler.state_dict()), group_settings(scheduler)


def group_settings(scheduler: Any) -> list[dict[str, Any]]:
    """A copy of the group settings (all but the parameters) of ``scheduler``'s optimizer."""
    groups = getattr(getattr(scheduler, "optimizer", None), "param_groups", None) or []
    return [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in groups]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # (a value that does not compare to one bool)
        return a is b


def restore_scheduler(
    scheduler: Any, saved: tuple[Any, list[dict[str, Any]]], after: list[dict[str, Any]] | None = None
) -> list[str]:
    """Put ``scheduler`` and its optimizer's group settings back as :func:`scheduler_state` kept them.
    With ``after`` (:func:`group_settings` right after the step being undone), only the settings that
    step changed are put back, and of those only the ones nothing has changed since; returns the
    names of the ones left as they are because something else changed them."""
    state, settings = saved
    if state is not None:  # (None: nothing of the scheduler's own state to put back)
        scheduler.load_state_dict(copy.deepcopy(state))
    optimizer = getattr(scheduler, "optimizer", None)
    left: list[str] = []
    made_by_step = after if after is not None else [None] * len(settings)
    for group, kept, made in zip(getattr(optimizer, "param_groups", None) or [], settings, made_by_step, strict=False):
        for key, value in kept.items():
            held = group.get(key)
            if made is not None:
                if _same(value, made.get(key)):
                    continue  # the step did not change it
                if not _same(held, made.get(key)):
                    left.append(key)  # changed since the step, by something else
                    continue
            if isinstance(held, torch.Tensor) and isinstance(value, torch.Tensor) and held.shape == value.shape:
                with torch.no_grad():
                    held.copy_(value)  # a tensor lr (capturable optimizers) stays the same tensor
            else:
                group[key] = copy.deepcopy(value)
    return left

"""``step()``: the update at an accumulation boundary, in stages an interruption can resume.

:class:`StepRunner` is the part of :class:`mixprec.MixedPrecision` that runs a step: the
skip decision, clipping, the update of every optimizer, then the bookkeeping (buffers,
the plan's ``after_step``, the ledger, the scheduler, clearing gradients). Each stage is
recorded in the step's :class:`~mixprec.phases.StepPhases`, so an exception or a Ctrl-C
anywhere leaves a state from which ``state_dict()`` saves the last finished step and
``step()`` again finishes this one exactly: nothing is decided, clipped, updated, counted
or scheduled twice. The state it reads is set up by ``MixedPrecision.__init__`` and ``prepare``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from mixprec.buffers import BufferGuard
from mixprec.composable import ComposableSteps
from mixprec.explainer import OverflowExplainer
from mixprec.ledger import StepLedger, StepResult
from mixprec.optim import InBackwardOptimizer
from mixprec.options import check_ready
from mixprec.prepare import PreparedModel
from mixprec.step import apply_update

__all__ = ["StepRunner"]


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

    def step(self, *, zero_grad: bool = True) -> StepResult:
        """At an accumulation boundary: unscale, check, clip, step every optimizer (or none), clear grads.

        ``zero_grad=False`` leaves the gradients to a framework that clears them itself
        (Lightning does, before the next backward; freeing them twice costs page faults).
        """
        if not isinstance(zero_grad, bool):
            raise TypeError(f"zero_grad= must be True or False, got {zero_grad!r}")
        check_ready(self.model, self.optimizers, "step()")
        if self._prepared is not None:
            self._prepared.check_dtypes("step()")
            self._prepared.check_bound(self.optimizers, "step()")
        phases = self._phases
        if not phases.step_ready(self.grad_accum_steps):
            return StepResult(
                stepped=False, skipped=False, scale=self.scaler.get_scale(), grad_norm=None,
                accumulating=True, optimizer_steps=self._ledger.optimizer_steps,
            )
        try:
            if phases.outcome is not None:  # an interrupted step() got past its update: finish it
                reason, norm = phases.outcome
            elif self._in_backward is not None:  # the parameters were updated (or restored) during backward
                reason, norm = self._in_backward_outcome(self._in_backward), None
            else:
                reason, norm = self._decide_and_update()
            phases.outcome = (reason, norm)
            result = self._finish(reason, norm, zero_grad)
        except BaseException:
            phases.interrupt()  # where it got to is recorded: state_dict() and step() again work
            raise
        diagnosis = self._explainer.diagnosis() if self._explainer is not None else None
        self._ledger.check(result, self.scaler, self.max_consecutive_skips, diagnosis)  # the step is over; raise what it implies
        return result

    def _decide_and_update(self) -> tuple[str | None, float | None]:
        """Unscale, measure, decide once for all optimizers and ranks, then clip and update.

        Each stage is recorded in :attr:`_phases`: after an interruption, the next call
        goes on where this one stopped (no second decision, clip or update)."""
        phases = self._phases
        if phases.decision is None:
            self._unscale("step()")
            norm = self._norm(self._grads(), remember=False)
            reason = self._decision.decide(norm, self.plan.nonfinite_flag(self.model), self.scaler, self.optimizers)  # type: ignore[arg-type]
            phases.decision = (reason, self._decision.norm, norm)
        reason, host_norm, norm = phases.decision
        if reason is None and self.clip_grad_norm is not None and not phases.clipped:
            self._clip(self._grads(), self.clip_grad_norm, "step()", norm)
            phases.clipped = True
        if reason is None:
            reason = apply_update(self.optimizers, self.process_group, phases)
        return reason, host_norm

    def _in_backward_outcome(self, in_backward: InBackwardOptimizer) -> str | None:
        if in_backward.release():  # a new backward is accepted again
            return None
        return "nonfinite_loss" if self._decision.loss_was_nonfinite() else "overflow"

    def _finish(self, reason: str | None, norm: float | None, zero_grad: bool) -> StepResult:
        """After the decision: tracer, buffers and plan; count the step; scheduler; reset the step.

        Each part runs once even if an interruption makes ``step()`` call this again."""
        phases = self._phases
        if phases.result is None:
            overflow = self.tracer.first_overflow() if reason is not None and self.tracer is not None else None
            if self.tracer is None and self._explainer is not None:  # traces by itself once skips persist
                decided = self._step_serial  # (the same while an interrupted step is finished again)
                scale = self.scaler.get_scale() if reason is not None else None  # (no sync on a clean step)
                overflow = self._explainer.after_step(decided, reason, scale)  # (mixprec.explainer)
            if reason is None:
                if self.tracer is not None:
                    self.tracer.reset()
            else:
                self._buffers.restore()
            self.plan.after_step(self.model)  # type: ignore[arg-type]
            self._buffers.commit()
            try:
                phases.result = self._ledger.record(reason, norm, self.scaler, overflow)
            except BaseException:
                if reason is not None:  # a skip the scaler refused to count (raise_at_min_scale): nothing was
                    self._reset_step(stepped=False)  # updated, so the step ends here; a save and a new backward work
                    if zero_grad:
                        self._clear_grads()
                raise
        result = phases.result
        if reason is None and self.scheduler is not None and not phases.scheduled:
            self._step_scheduler()
        self.last_result = result
        self._reset_step(stepped=reason is None)
        if zero_grad:
            self._clear_grads()
        return result

    def _step_scheduler(self) -> None:
        """Step the scheduler exactly once for this step, wherever an interruption lands: its state
        (and its optimizer's group settings: lr, momentum) is kept before it steps, and a second
        ``step()`` after an interruption inside it puts that state back and steps it again. A
        scheduler without ``state_dict``/``load_state_dict`` is stepped at most once (an
        interruption inside it then leaves whatever it had changed)."""
        phases, scheduler = self._phases, self.scheduler
        if not callable(getattr(scheduler, "state_dict", None)) or not callable(getattr(scheduler, "load_state_dict", None)):
            phases.scheduled = True  # (first: a scheduler that raises is not stepped twice)
            scheduler.step()
            return
        if phases.schedule_undo is None:
            phases.schedule_undo = _scheduler_state(scheduler)
        else:  # its step was interrupted: undo what it did, then take the step again
            _restore_scheduler(scheduler, phases.schedule_undo)
        scheduler.step()
        phases.scheduled = True

    def _reset_step(self, stepped: bool | None = None) -> None:
        """End the step (``stepped``: how it ended; None: a load or a failed backward dropped it)."""
        if stepped is None:
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
        """Real optimizer steps taken so far (skipped steps not counted)."""
        return self._ledger.optimizer_steps


def _scheduler_state(scheduler: Any) -> tuple[Any, list[dict[str, Any]]]:
    """A copy of ``scheduler``'s state and of its optimizer's group settings (all but the parameters)."""
    optimizer = getattr(scheduler, "optimizer", None)
    groups = getattr(optimizer, "param_groups", None) or []
    return (
        copy.deepcopy(scheduler.state_dict()),
        [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in groups],
    )


def _restore_scheduler(scheduler: Any, saved: tuple[Any, list[dict[str, Any]]]) -> None:
    state, settings = saved
    scheduler.load_state_dict(copy.deepcopy(state))
    optimizer = getattr(scheduler, "optimizer", None)
    for group, kept in zip(getattr(optimizer, "param_groups", None) or [], settings, strict=False):
        for key, value in kept.items():
            held = group.get(key)
            if isinstance(held, torch.Tensor) and isinstance(value, torch.Tensor) and held.shape == value.shape:
                with torch.no_grad():
                    held.copy_(value)  # a tensor lr (capturable optimizers) stays the same tensor
            else:
                group[key] = copy.deepcopy(value)

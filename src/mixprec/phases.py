"""The step as one state machine: where a training step stands, and which call may come next.

Every entry into a step goes through :class:`StepPhases`: ``MixedPrecision.backward`` and
``step``, the composable halves a framework calls (``scale_loss``, ``micro_batch_done``,
``unscale_``, ``grad_norm``, ``clip_grad_norm_``, ``clip_grad_value_``) and
optimizer-in-backward. A call that fits the phase does its work; a call out of order
raises an error that names the order and the fix, never a silent no-op or a second clip.

The phases of one step (:class:`Phase`)::

    IDLE / STEPPED / SKIPPED --backward--> ACCUMULATING --backward at the boundary--> BACKWARD_DONE
    BACKWARD_DONE --unscale_() / grad_norm()--> UNSCALED --clip_grad_norm_()--> CLIPPED
    BACKWARD_DONE / UNSCALED / CLIPPED --step()--> STEPPED or SKIPPED

The boundary is where ``grad_accum_steps`` micro-batches were counted, or where a framework
said so (``micro_batch_done(boundary=True)``). More backwards after a boundary a framework
declared (or with ``grad_accum_steps=1``) add to the same step: manual accumulation.

``step()`` itself runs in stages (decide, clip, update each optimizer, finish) and records
how far it got, so an exception or a Ctrl-C anywhere leaves a state from which ``step()``
again finishes the same step exactly (nothing is decided, clipped or updated twice), and
from which ``state_dict()`` saves the state as of the last finished step.

>>> phases = StepPhases()
>>> phases.check_backward("backward()", 1)
>>> phases.pending += 1  # the loss was scaled; its backward runs
>>> phases.check_done("backward()", None)
>>> phases.backward_done(None, 1)
True
>>> phases.phase
<Phase.BACKWARD_DONE: 'backward done'>
>>> phases.finished(stepped=True)
>>> phases.gradients_ready("grad_norm()")
Traceback (most recent call last):
...
RuntimeError: grad_norm() called after step() with no backward since: step() used and cleared that step's gradients. Call grad_norm() between the backward and step() (one step: scale_loss() + backward + micro_batch_done(), or backward(loss), per micro-batch; at the boundary unscale_() / grad_norm() / clip_grad_norm_() if wanted; then step())
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["ORDER", "Phase", "StepPhases"]

ORDER = (
    "one step: scale_loss() + backward + micro_batch_done(), or backward(loss), per micro-batch; "
    "at the boundary unscale_() / grad_norm() / clip_grad_norm_() if wanted; then step()"
)


class Phase(enum.Enum):
    """Where the current step stands."""

    IDLE = "idle"  # no backward yet (a new session, or after a load)
    ACCUMULATING = "accumulating"  # backward(s) done, the accumulation boundary not reached
    BACKWARD_DONE = "backward done"  # at the boundary: step() runs the update
    UNSCALED = "unscaled"  # the gradients are true (unscaled, gathered)
    CLIPPED = "clipped"  # ... and clipped
    STEPPED = "stepped"  # the last step updated the parameters; nothing since
    SKIPPED = "skipped"  # the last step was skipped; nothing since


_BETWEEN_STEPS = (Phase.IDLE, Phase.STEPPED, Phase.SKIPPED)
_AT_BOUNDARY = (Phase.BACKWARD_DONE, Phase.UNSCALED, Phase.CLIPPED)


class StepPhases:
    """The one owner of a step's phase and of how far an interrupted ``step()`` got.

    Attributes:
        phase: the :class:`Phase`.
        micro: backwards counted since the last step.
        pending: losses scaled (``scale_loss``) whose micro-batch is not finished yet.
        loose: a finished backward's gradients sit in ``.grad``, not yet in the wrappers'
            wide accumulators (the next backward moves them there).
        published: the unscaled gradients were copied back into the model's ``.grad``.
        unscale_started: the plan's ``before_unscale`` ran for this step.
        decision: this step's skip decision (:class:`mixprec.step.Decision`), once made.
        clipped: ``step()`` applied the session's ``clip_grad_norm``.
        updated: optimizers whose ``step()`` returned in this step.
        outcome: the decision once every optimizer stepped (or none was to).
        result: the :class:`~mixprec.step.StepResult`, once the ledger counted the step.
        interrupted: an exception left ``step()`` before it finished.
    """

    __slots__ = (
        "clipped", "decision", "explicit", "interrupted", "loose", "micro", "outcome", "pending", "phase",
        "published", "result", "undecided", "unscale_started", "updated",
    )

    def __init__(self) -> None:
        self.phase = Phase.IDLE
        self.undecided = False
        self._clear()

    def _clear(self) -> None:
        self.micro = 0
        self.pending = 0
        self.explicit = False  # the last boundary was a framework's micro_batch_done(boundary=True)
        self.loose = False
        self.published = False
        self.unscale_started = False
        self.decision: Any = None
        self.clipped = False
        self.updated = 0
        self.outcome: Any = None
        self.result: Any = None
        self.interrupted = False

    # -------------------------------------------------------------- backward
    def check_backward(self, caller: str, grad_accum_steps: int) -> None:
        """Refuse a micro-batch's loss (``scale_loss`` / ``backward``) where no backward may run;
        the caller adds one to :attr:`pending` once the loss is scaled."""
        phase = self.phase
        if phase is Phase.ACCUMULATING or phase in _BETWEEN_STEPS:
            return
        if self.decision is not None:
            raise RuntimeError(
                f"{caller} called while a step() is unfinished (it was interrupted after its skip decision"
                f"{self._update_progress()}); call step() again to finish that step first"
            )
        if phase is not Phase.BACKWARD_DONE or self.unscale_started:  # (being) unscaled, or clipped
            raise RuntimeError(
                "a backward after unscale_() in the same step would mix scaled and unscaled gradients; "
                f"call step() first ({ORDER})"
            )
        if not self.explicit and grad_accum_steps > 1:
            raise RuntimeError(
                f"{caller} called after the accumulation boundary ({self.micro} of {grad_accum_steps} "
                "micro-batches) without step(): this micro-batch would belong to no step. Call step() after "
                "every backward (it returns accumulating=True until the boundary)"
            )
        # manual accumulation (a framework's boundary, or grad_accum_steps=1): it adds to this step

    def check_done(self, caller: str, boundary: bool | None) -> None:
        """Refuse ``micro_batch_done`` with no backward to count, or a bad ``boundary``."""
        if boundary is not None and not isinstance(boundary, bool):
            raise TypeError(f"boundary= must be True, False or None, got {boundary!r}")
        if self.pending == 0:
            raise RuntimeError(
                f"{caller} called without a backward since the last one: nothing would be counted. Call "
                "scale_loss(loss), run the backward of what it returns inside backward_context(), then "
                "micro_batch_done() (backward(loss) does all three)"
            )

    def backward_done(self, boundary: bool | None, grad_accum_steps: int) -> bool:
        """Count a finished backward; returns whether it ends the accumulation window."""
        self.pending = 0
        self.micro += 1
        self.explicit = boundary is not None
        at = boundary if boundary is not None else self.micro % grad_accum_steps == 0
        self.phase = Phase.BACKWARD_DONE if at else Phase.ACCUMULATING
        return at

    def backward_failed(self) -> None:
        """A backward raised: its gradients are partial, so the caller discards the step's."""
        self.phase = Phase.IDLE
        self._clear()

    # ------------------------------------------------------- at the boundary
    def gradients_ready(self, caller: str, grad_accum_steps: int = 1) -> None:
        """Refuse ``caller`` (unscale_, grad_norm, clipping) unless the step is at its boundary."""
        phase = self.phase
        if phase in _AT_BOUNDARY and self.pending == 0:
            return
        if self.pending:
            raise RuntimeError(
                f"{caller} called between scale_loss() and micro_batch_done(): the backward is not "
                f"finished. Call micro_batch_done() after the backward first ({ORDER})"
            )
        if phase is Phase.ACCUMULATING:
            raise RuntimeError(
                f"{caller} called in the middle of gradient accumulation ({self.micro} of {grad_accum_steps} "
                "micro-batches): the gradients are partial sums. Call it at the accumulation boundary, "
                "right before step()"
            )
        if phase is Phase.IDLE:
            raise RuntimeError(f"{caller} called before any backward(); call mp.backward(loss) first ({ORDER})")
        raise RuntimeError(
            f"{caller} called after step() with no backward since: step() used and cleared that step's "
            f"gradients. Call {caller} between the backward and step() ({ORDER})"
        )

    def unscaled(self) -> None:
        if self.phase is Phase.BACKWARD_DONE:
            self.phase = Phase.UNSCALED

    def clipped_by_caller(self) -> None:
        self.phase = Phase.CLIPPED

    # ------------------------------------------------------------------ step
    def step_ready(self, grad_accum_steps: int) -> bool:
        """Whether ``step()`` runs the update now (False: accumulating, nothing to do); refuse
        a ``step()`` out of order."""
        phase = self.phase
        if phase in _AT_BOUNDARY and self.pending == 0:
            return True
        if self.pending:
            raise RuntimeError(
                "step() called between scale_loss() and micro_batch_done(): the backward is not finished. "
                f"Call micro_batch_done() after the backward first ({ORDER})"
            )
        if phase is Phase.ACCUMULATING:
            return False
        if phase is Phase.IDLE:
            raise RuntimeError("step() called before any backward(); call mp.backward(loss) first")
        raise RuntimeError(
            "step() called again with no backward since the last step(): each step needs its own "
            f"backward; call mp.backward(loss) first ({ORDER})"
        )

    def interrupt(self) -> None:
        """An exception is leaving ``step()``: if the step is unfinished, say so (a save is then
        the state as of the last finished step)."""
        if self.phase in _AT_BOUNDARY:
            self.interrupted = True

    def _update_progress(self) -> str:
        if self.outcome is not None:
            return " and its update"
        return f" and the update of {self.updated} optimizer(s)" if self.updated else ""

    def mid_update(self) -> str | None:
        """Why a save now would be inconsistent (a step interrupted after its update began), or None."""
        if not self.interrupted or (self.updated == 0 and self.outcome is None):
            return None
        return (
            f"step() was interrupted after the update began{self._update_progress()}; the parameters "
            "are ahead of the counters and the loss scale. Call step() again to finish that step, then save"
        )

    def finished(self, *, stepped: bool | None) -> None:
        """The step is over: the next backward starts a new one. ``stepped=None``: decided on the
        device, not read yet; :attr:`phase` says ``STEPPED`` until :meth:`learned` says otherwise
        (:attr:`undecided` is True meanwhile)."""
        self.phase = Phase.SKIPPED if stepped is False else Phase.STEPPED
        self.undecided = stepped is None
        self._clear()

    def learned(self, stepped: bool) -> None:
        """The host read the outcome of a step that ended :attr:`undecided`."""
        if self.undecided and self.phase in (Phase.STEPPED, Phase.SKIPPED):
            self.phase = Phase.STEPPED if stepped else Phase.SKIPPED
        self.undecided = False

    def reset(self) -> None:
        """Forget the step in progress (a load replaced the state it belonged to)."""
        self.phase = Phase.IDLE
        self.undecided = False
        self._clear()

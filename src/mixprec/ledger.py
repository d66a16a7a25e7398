"""What a step leaves behind: the :class:`StepResult` and the :class:`StepLedger` of counters.

The ledger counts each decided step, updates the loss scaler, and turns counts into
diagnoses: too many skipped steps in a row, a scaled step on all-zero gradients, a loss
scale that collapsed until the gradients underflow (see :class:`StepLedger`).

>>> from mixprec.scaling import NoOpScaler
>>> ledger = StepLedger()
>>> ledger.record(None, 1.5, NoOpScaler()).optimizer_steps
1
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from mixprec.scaling import LossScaler

__all__ = ["StepLedger", "StepResult", "collapse_message", "skip_error", "warn_zero_grads"]


_FIELDS = ("stepped", "skipped", "scale", "grad_norm", "skip_reason", "accumulating", "optimizer_steps", "overflow")


class StepResult:
    """What :meth:`MixedPrecision.step` did.

    Attributes:
        stepped: the optimizers updated the parameters.
        skipped: an accumulation boundary was reached but the update was skipped
            (``skip_reason`` says why: ``"overflow"`` for inf/NaN gradients,
            ``"nonfinite_loss"`` for an inf/NaN loss, ``"nonfinite_plan"`` for an inf/NaN
            value only the plan saw (an fp8 layer's input or output gradient),
            ``"nonfinite_weights"`` for an update that would have written inf/NaN into
            low-precision weights; a skipped step changes nothing).
        scale: the loss scale after this step (what ``get_scale()`` returns next).
        grad_norm: the true (unscaled) gradient norm before clipping; None while
            accumulating.
        accumulating: not an accumulation boundary; nothing was done.
        optimizer_steps: real optimizer steps taken so far.
        overflow: diagnostics of the first non-finite module when overflow tracing is on.

    The step is decided on the device, so a result is read lazily: reading any attribute of
    it as soon as ``step()`` returned waits for the device (one synchronisation); read at the
    next step (or later) it is free, the values having been copied to the host meanwhile.
    Results compare equal when every attribute does.
    """

    __slots__ = ("_source", "_values")

    def __init__(
        self, stepped: bool = False, skipped: bool = False, scale: float = 1.0, grad_norm: float | None = None,
        skip_reason: str | None = None, accumulating: bool = False, optimizer_steps: int = 0, overflow: Any = None,
        *, source: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self._values: dict[str, Any] = {
            "stepped": stepped, "skipped": skipped, "scale": scale, "grad_norm": grad_norm,
            "skip_reason": skip_reason, "accumulating": accumulating, "optimizer_steps": optimizer_steps,
            "overflow": overflow,
        }
        self._source = source

    @classmethod
    def lazy(cls, source: Callable[[], dict[str, Any]]) -> StepResult:
        """A result whose values ``source`` gives on the first read (it may wait for the device)."""
        return cls(source=source)

    @property
    def resolved(self) -> bool:
        """Whether the values are on the host already (reading them waits for nothing)."""
        return self._source is None

    def _get(self, name: str) -> Any:
        source = self._source
        if source is not None:
            if source is _RESOLVING:
                raise RuntimeError("a StepResult was read while its own values were being read (from a scheduler or "
                                   "hook that the step's bookkeeping runs); read it after step() returned")
            self._source = _RESOLVING
            try:
                self._values.update(source())
            except BaseException:
                self._source = source
                raise
            self._source = None
        return self._values[name]

    def __reduce__(self) -> tuple[Any, ...]:
        return (StepResult, tuple(self._get(name) for name in _FIELDS))  # (read first: a plain copy)

    stepped = property(lambda self: self._get("stepped"), doc="the optimizers updated the parameters")
    skipped = property(lambda self: self._get("skipped"), doc="the update was skipped (see skip_reason)")
    scale = property(lambda self: self._get("scale"), doc="the loss scale after this step")
    grad_norm = property(lambda self: self._get("grad_norm"), doc="the true gradient norm before clipping")
    skip_reason = property(lambda self: self._get("skip_reason"), doc="why the update was skipped")
    accumulating = property(lambda self: self._get("accumulating"), doc="not an accumulation boundary")
    optimizer_steps = property(lambda self: self._get("optimizer_steps"), doc="real optimizer steps so far")
    overflow = property(lambda self: self._get("overflow"), doc="the first non-finite module, when traced")

    def as_dict(self) -> dict[str, Any]:
        """Every attribute by name (reads them all)."""
        return {name: self._get(name) for name in _FIELDS}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepResult):
            return NotImplemented
        mine, theirs = self.as_dict(), other.as_dict()
        return all(_same(mine[k], theirs[k]) for k in _FIELDS)

    def __hash__(self) -> int:
        return hash(tuple(_hashable(v) for v in self.as_dict().values()))

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items())
        return f"StepResult({fields})"


def _RESOLVING() -> dict[str, Any]:  # marks a StepResult whose values are being read (re-entrancy)
    raise AssertionError("never called")


def _hashable(value: Any) -> Any:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else value + 0.0  # (-0.0 and 0.0 hash alike, as they compare)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


# ------------------------------------------------------------------ accounting
class StepLedger:
    """The counters steps leave behind and what they imply: the scaler's update, the
    consecutive-skip limit, the zero-gradient warning, the scale-collapse guard, the
    :class:`StepResult`.

    Scale collapse: with fp16, overflows that come faster than the scale grows back it off
    step after step, until the scaled gradients underflow to zero and the optimizer steps on
    nothing (weight decay and momentum still move the weights). ``max_zero_grad_steps``
    consecutive steps on all-zero gradients at a loss scale below 1 (only repeated
    overflows take it there; the floor is 2**-126) are that diagnosis:
    ``on_scale_collapse="raise"`` raises it, ``"reset"`` warns and restarts the scale at
    ``restart_scale``. Skipped steps in between neither count nor break the run.
    """

    def __init__(
        self, max_zero_grad_steps: int | None = None, on_scale_collapse: str = "raise", restart_scale: float = 2.0**16
    ) -> None:
        self.optimizer_steps = 0
        self.consecutive_skips = 0
        self.zero_grad_steps = 0
        self.max_zero_grad_steps = max_zero_grad_steps
        self.on_scale_collapse = on_scale_collapse
        self.restart_scale = restart_scale
        self._warned_zero_grads = False
        self._zero_counter: torch.Tensor | None = None  # the device's count under on_scale_collapse="reset"

    def record(self, reason: str | None, grad_norm: float | None, scaler: LossScaler, overflow: Any = None) -> StepResult:
        """Count a step the host decided: the scaler updates on the host's word (``update()`` or
        ``skip()``), then :meth:`count`."""
        enabled = scaler.is_enabled()
        if reason is None or (reason == "overflow" and enabled):
            if enabled:
                scaler.update()  # an overflow backs the scale off
        else:
            scaler.skip()  # scaling cannot fix a forward overflow: keep the scale
        return self.count(reason, grad_norm, scaler, scaler.get_scale(), overflow, counted=True)

    def settle_collapse(self, code: torch.Tensor, norm: torch.Tensor, scaler: LossScaler) -> list[torch.Tensor]:
        """``on_scale_collapse="reset"``: count steps on all-zero gradients at a scale below 1 on the
        device and restart the scale there, before the next forward scales its loss (the host only
        learns of it one step later); returns ``[count, reset, the collapsed scale]`` for
        :meth:`count` (nothing where the guard is off, or only raises: that waits for the host)."""
        limit = self.max_zero_grad_steps
        if limit is None or self.on_scale_collapse != "reset" or not scaler.is_enabled():
            return []
        scale = scaler.scale_tensor()
        counter = self._zero_counter
        if counter is None or counter.device != scale.device:
            counter = torch.tensor(float(self.zero_grad_steps), device=scale.device)
        stepped = code.to(scale.device) == 0
        zero = stepped & (norm.to(scale.device) == 0) & (scale < 1.0)
        counter = torch.where(stepped, torch.where(zero, counter + 1, 0.0), counter)  # skips neither count nor break
        reset = counter >= limit
        collapsed = scale.clone()
        scaler.restart_where(reset, self.restart_scale)
        self._zero_counter = torch.where(reset, 0.0, counter)
        return [counter, reset.to(torch.float32), collapsed]

    def count(
        self, reason: str | None, grad_norm: float | None, scaler: LossScaler, scale: float, overflow: Any = None,
        *, counted: bool = False, collapse: list[float] | None = None,
    ) -> StepResult:
        """Count a decided step whose scale the scaler already settled on the device (``scale``:
        the scale after it, as the host read it); :meth:`check` raises what it implies.
        ``counted``: the scaler's own counters were kept already (:meth:`record`). ``collapse``:
        what :meth:`settle_collapse` did on the device for this step (the scale restarted there)."""
        enabled = scaler.is_enabled()
        if not counted:
            scaler.counted(reason)
        if reason is None:
            self.optimizer_steps += 1
            self.consecutive_skips = 0
        else:
            self.consecutive_skips += 1
        if collapse:
            count, reset, collapsed = collapse
            self.zero_grad_steps = 0 if reset else int(count)
            if reset:
                warnings.warn(
                    collapse_message(int(count), collapsed, self.restart_scale) + "; restarting it now",
                    RuntimeWarning,
                    stacklevel=5,
                )
        elif reason is None and enabled:
            self.zero_grad_steps = self.zero_grad_steps + 1 if grad_norm == 0.0 and scale < 1.0 else 0
            limit = self.max_zero_grad_steps
            if limit is not None and self.zero_grad_steps >= limit and self.on_scale_collapse == "reset":
                warnings.warn(
                    collapse_message(self.zero_grad_steps, scale, self.restart_scale) + "; restarting it now",
                    RuntimeWarning,
                    stacklevel=4,
                )
                scaler.update(new_scale=torch.tensor(self.restart_scale))  # clamped into the scaler's bounds
                scale, self.zero_grad_steps = scaler.get_scale(), 0
        return StepResult(
            stepped=reason is None, skipped=reason is not None, scale=scale, grad_norm=grad_norm,
            skip_reason=reason, optimizer_steps=self.optimizer_steps, overflow=overflow,
        )

    def check(
        self, result: StepResult, scaler: LossScaler, max_consecutive_skips: int, diagnosis: str | None = None
    ) -> None:
        """After a finished step: raise after ``max_consecutive_skips`` skips in a row (with
        ``diagnosis``, the traced overflow, when there is one) or a collapsed scale; warn
        (once) about a scaled step on all-zero gradients."""
        if result.skipped and self.consecutive_skips >= max_consecutive_skips:
            error = skip_error(result.skip_reason or "overflow", self.consecutive_skips, result.grad_norm, result.scale)
            if diagnosis is not None:
                error = RuntimeError(f"{error} Diagnosis: {diagnosis}.")
            raise error
        if not result.stepped or result.grad_norm != 0.0 or not scaler.is_enabled():
            return
        if not self._warned_zero_grads:
            self._warned_zero_grads = True
            warn_zero_grads(result.scale)
        limit = self.max_zero_grad_steps
        if limit is not None and self.zero_grad_steps >= limit:
            raise RuntimeError(collapse_message(self.zero_grad_steps, result.scale, self.restart_scale))

    def load(self, state: Any) -> None:
        """Take the counters from a (validated) session state dict."""
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        self.zero_grad_steps = int(state.get("zero_grad_steps", 0))  # absent in checkpoints before the guard
        self._zero_counter = None


# ------------------------------------------------------------------ messages
def skip_error(reason: str, n: int, norm: float | None, scale: float) -> RuntimeError:
    """The error raised after ``n`` consecutive skipped steps, naming the cause and the fix."""
    if reason == "nonfinite_loss":
        return RuntimeError(
            f"{n} consecutive steps were skipped because the loss itself was inf/NaN: the forward pass "
            "overflows, which loss scaling cannot fix. Look for activations beyond the dtype's range "
            "(mixprec.trace_overflow names the first module), keep that part in fp32 with "
            "OpPolicy(fp32_modules=...), or lower the learning rate."
        )
    if reason == "nonfinite_plan":
        return RuntimeError(
            f"{n} consecutive steps were skipped because the plan's layers saw inf/NaN values (for "
            "fp8-mixed: an input, weight or output gradient of an fp8 linear layer). Look for the first "
            "non-finite activation (MixedPrecision(trace_overflow=True)), check the data, or keep that "
            "layer out of fp8 (convert_to_fp8(module_filter=...))."
        )
    if reason == "nonfinite_weights":
        return RuntimeError(
            f"{n} consecutive steps were skipped because the update would have written inf/NaN into "
            "the low-precision weights: they outgrow the dtype's range. Lower the learning rate, add "
            "weight decay, or use a bf16 or master-weight plan."
        )
    return RuntimeError(
        f"{n} consecutive steps were skipped because the gradients were inf/NaN (last norm {norm}); "
        f"the loss scale is now {scale:g}. The gradients overflow whatever the scale: "
        "check the learning rate and the data, or use a bf16 plan."
    )


def collapse_message(n: int, scale: float, restart_scale: float) -> str:
    """The diagnosis of a collapsed loss scale (see :class:`StepLedger`)."""
    return (
        f"{n} consecutive optimizer steps ran on all-zero gradients with the loss scale collapsed to {scale:g}: "
        "overflows backed it off faster than it grows back, until the scaled fp16 gradients underflow to zero and "
        "nothing trains (weight decay and momentum still move the weights). Find what overflows "
        "(MixedPrecision(trace_overflow=True) names the first module), bound the scale "
        "(DynamicLossScaler(min_scale=...)) or let it grow back sooner (a smaller growth_interval), or use a bf16 "
        f"plan; MixedPrecision(on_scale_collapse='reset') restarts the scale at {restart_scale:g} instead of raising"
    )


def warn_zero_grads(scale: float) -> None:
    """Warn (once per session, the caller decides) that a scaled step ran on all-zero gradients."""
    warnings.warn(
        f"an optimizer step ran on all-zero gradients with loss scale {scale:g}: "
        "with fp16 the gradients may have underflowed (the scale is too small or the loss is zero). "
        "Check the loss, raise min_scale= of the DynamicLossScaler, or use a bf16 plan.",
        RuntimeWarning,
        stacklevel=4,  # warn_zero_grads <- StepLedger.check <- step() <- the loop
    )

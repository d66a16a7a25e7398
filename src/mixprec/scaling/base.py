"""The machinery every loss scaler shares: per-optimizer state machine, unscaling, skipping.

A loss scaler multiplies the loss before ``backward()`` so that small fp16
gradients do not flush to zero, divides the gradients back before the optimizer
step ("unscale"), and skips any step whose gradients hold inf/NaN. The subclasses
only decide how the scale evolves (:meth:`LossScaler._update_scale`).

The call sequence, and the errors for breaking it, follow ``torch.amp.GradScaler``::

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)        # optional, e.g. to clip gradients
    scaler.step(optimizer)            # skipped when gradients are not finite
    scaler.update()

The scale and every counter live in tensors, so none of ``scale``, ``unscale_``,
``update`` (nor ``step`` with an optimizer that accepts ``grad_scale`` /
``found_inf``, such as ``torch.optim.AdamW(fused=True)``) waits for the device.
:meth:`LossScaler.get_scale` is the documented synchronisation point.

The scale always stays in [:data:`SCALE_FLOOR`, :data:`SCALE_CEILING`] = [2**-126, fp32 max],
where both the scale and its reciprocal are finite fp32 numbers.
"""

from __future__ import annotations

import copy
import enum
import inspect
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from mixprec.nested import first_tensor, map_tensors
from mixprec.process_groups import check_group
from mixprec.scaling._checks import (
    SCALE_CEILING,
    SCALE_FLOOR,
    boolean,
    check_optimizer,
    new_scale_value,
    parse_device,
    scale_value,
)
from mixprec.scaling.grads import grad_tensors
from mixprec.scaling.state import ScalerState

__all__ = ["SCALE_CEILING", "SCALE_FLOOR", "LossScaler", "OptState", "ScaleRefused", "grad_tensors"]

T = TypeVar("T")


class ScaleRefused(RuntimeError):
    """``update()`` / ``settle()`` refused to back off a scale already at its lower bound
    (``raise_at_min_scale``): nothing was changed."""


class OptState(enum.Enum):
    """Where one optimizer stands in the current iteration."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass
class _OptimizerRecord:
    stage: OptState = OptState.READY
    found_inf: torch.Tensor | None = None
    # The found-inf flag as the host read it in step() (None: not read, e.g. fused optimizers).
    host_found: bool | None = None


class LossScaler(ScalerState):
    """Base class: the state machine shared by dynamic, constant and no-op scalers.

    Subclasses implement :meth:`_update_scale` (and usually ``__init__``,
    ``state_dict`` and ``load_state_dict``). A disabled scaler is the identity:
    ``scale`` returns its input, ``step`` calls ``optimizer.step()``. torch's
    ``GradScaler`` helper methods come from :class:`~mixprec.scaling.compat.GradScalerCompat`.
    """

    def __init__(
        self,
        init_scale: float,
        *,
        enabled: bool = True,
        process_group: Any = None,
        device: str | torch.device | None = None,
    ) -> None:
        value = scale_value("init_scale", init_scale, "pass e.g. init_scale=65536.0 (2**16, torch's default)")
        self._enabled = boolean("enabled", enabled, "pass enabled=True or enabled=False")
        # The device torch's GradScaler was asked for. The state moves to the loss's device on
        # the first scale() (as torch initialises it lazily there), so no device is touched here.
        self._device_hint = parse_device(device)
        self._process_group = check_group(process_group)
        self._scale = torch.full((), value, dtype=torch.float32)
        # Counters: what the host knows stays a Python int; overflows are a tensor (no sync).
        self._steps = 0
        self._forced_skips = 0
        self._overflow_steps = torch.zeros((), dtype=torch.int64)
        self._records: defaultdict[int, _OptimizerRecord] = defaultdict(_OptimizerRecord)
        # Whether the last iteration skipped: a host bool when known without a sync, else a tensor.
        self._last_skipped: bool | torch.Tensor = False

    # ------------------------------------------------------------------ state
    def is_enabled(self) -> bool:
        """Whether this scaler scales at all (a disabled scaler is the identity)."""
        return self._enabled

    @property
    def device(self) -> torch.device:
        """Where the state tensors live now (the loss's device after the first ``scale()``)."""
        return self._scale.device

    def get_scale(self) -> float:
        """The current scale as a Python float. This synchronises with the device."""
        return float(self._scale.item()) if self._enabled else 1.0

    def scale_tensor(self) -> torch.Tensor:
        """The current scale as a 0-dim fp32 tensor (no synchronisation)."""
        return self._scale

    @property
    def skipped_steps(self) -> int:
        """Iterations skipped so far (any cause). Synchronises with the device."""
        return self._forced_skips + int(self._overflow_steps.item())

    @property
    def overflow_steps(self) -> int:
        """Iterations whose gradients held inf/NaN. Synchronises with the device."""
        return int(self._overflow_steps.item())

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last iteration (ended by ``update()`` or ``skip()``) skipped its step.

        With several optimizers: whether any of them skipped. False before the first
        iteration and for a disabled scaler. Free (no synchronisation) after ``skip()`` and
        after ``step()`` with an ordinary optimizer, whose flag ``step()`` already read; after
        a fused optimizer's ``step()`` or ``sync_found_inf()`` it reads one flag from the
        device, once (the answer is cached).
        """
        value = self._last_skipped
        if isinstance(value, torch.Tensor):
            value = bool(value.item())
            self._last_skipped = value
        return value

    # ---------------------------------------------------------------- scaling
    def scale(self, outputs: T) -> T:
        """Multiply ``outputs`` (a tensor, or nested lists/tuples/dicts of tensors) by the scale.

        >>> import torch
        >>> from mixprec import DynamicLossScaler
        >>> DynamicLossScaler(init_scale=8.0).scale(torch.tensor(0.5))
        tensor(4.)
        """
        if not self._enabled:
            return outputs
        first = first_tensor(outputs)
        if first is None:
            raise TypeError(
                f"scale() expects a tensor or a (nested) list/tuple/dict of tensors, got {type(outputs).__name__}"
            )
        self._to_device(first.device)
        scale = self._scale
        return map_tensors(lambda t: t * scale.to(device=t.device, non_blocking=True), outputs)  # type: ignore[no-any-return]

    def _record(self, optimizer: torch.optim.Optimizer) -> _OptimizerRecord:
        return self._records[id(optimizer)]

    def _set_found_inf(self, optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
        self._record(optimizer).found_inf = flag

    def unscale_(self, optimizer: torch.optim.Optimizer, *, sync: bool = True) -> None:
        """Divide ``optimizer``'s gradients by the scale, in place, and record whether any is inf/NaN.

        fp16 and bf16 gradients are accepted (computed in fp32). Call it at most once per
        optimizer per iteration, after all gradients are accumulated. ``sync=False`` skips
        the cross-rank all-reduce of the flag: for a caller that makes one decision for
        several optimizers and ranks and then calls :meth:`decided`.
        """
        check_optimizer(optimizer, "unscale_")
        record = self._record(optimizer) if self._enabled else None
        if record is not None and record.stage is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(); "
                "call it once per optimizer per iteration."
            )
        if record is not None and record.stage is OptState.STEPPED:
            raise RuntimeError(
                "unscale_() is being called after step(); call unscale_() before step() and update() after both."
            )
        prepare_grads = getattr(optimizer, "prepare_grads", None)
        if prepare_grads is not None:  # a mixprec wrapper: e.g. the model's grads into the fp32 masters
            prepare_grads()  # also when disabled: the gradients are then true, and gathered
        if record is None:
            return
        record.found_inf = self._check_grads(optimizer, self._inv_scale(), sync)
        record.stage = OptState.UNSCALED

    def found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The found-inf flag recorded for ``optimizer`` this iteration (None before unscale_/step)."""
        rec = self._records.get(id(optimizer))
        return None if rec is None else rec.found_inf

    def sync_found_inf(self, optimizers: Iterable[torch.optim.Optimizer]) -> torch.Tensor:
        """Make one skip decision for several already-unscaled optimizers.

        Every optimizer's flag becomes the maximum over all of them, so either all step or
        none does. Returns the combined 0/1 flag (a tensor; no synchronisation).
        """
        opts = list(optimizers)
        flags = []
        for opt in opts:
            rec = self._records.get(id(opt))
            if rec is None or rec.found_inf is None:
                raise RuntimeError("sync_found_inf() needs unscale_() to have been called on every optimizer first.")
            flags.append(rec.found_inf)
        combined = torch.stack(flags).amax() if flags else torch.zeros((), device=self._scale.device)
        for opt in opts:
            self._records[id(opt)].found_inf = combined
            self._records[id(opt)].host_found = None
        return combined

    def decided(self, optimizers: Iterable[torch.optim.Optimizer], found_inf: torch.Tensor, skipped: bool | None) -> None:
        """Record a skip decision made elsewhere for ``optimizers`` (already unscaled).

        ``found_inf`` is the 0/1 flag every rank agreed on and ``skipped`` its value as the
        host read it, so :meth:`update` needs no further synchronisation (None: not read; the
        decision stays on the device, and :meth:`settle` ends the iteration without a read).
        """
        for opt in optimizers:
            rec = self._records.get(id(opt))
            if rec is None or rec.found_inf is None:
                raise RuntimeError("decided() needs unscale_() to have been called on every optimizer first.")
            rec.found_inf = found_inf
            rec.host_found = skipped

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless already done) and call ``optimizer.step(*args, **kwargs)`` unless gradients are inf/NaN.

        Returns what ``optimizer.step`` returns, or None when the step is skipped.
        Optimizers with ``_step_supports_amp_scaling`` (fused Adam/AdamW/SGD) get what
        ``torch.amp.GradScaler`` gives them: ``grad_scale`` and ``found_inf`` attributes for
        the duration of the call (they unscale and skip inside their own kernel), or, if
        their ``step`` takes a ``grad_scaler`` argument, this scaler (deprecated in torch,
        with torch's FutureWarning).
        """
        check_optimizer(optimizer, "step")
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("step(closure=...) is not supported while loss scaling is enabled.")
        record = self._record(optimizer)
        if record.stage is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update(); call update() first.")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if "grad_scaler" in inspect.signature(optimizer.step).parameters:
                warnings.warn(
                    "GradScaler is going to stop passing itself as a keyword argument to the passed "
                    "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                    "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
                    FutureWarning,
                    stacklevel=2,
                )
                retval = optimizer.step(*args, **{**kwargs, "grad_scaler": self})
                record.stage = OptState.STEPPED
                return retval
            if record.stage is OptState.READY:
                record.found_inf = self._check_grads(
                    optimizer, torch.ones((), dtype=torch.float32, device=self._scale.device)
                )
                grad_scale: torch.Tensor | None = self._scale * getattr(optimizer, "grad_scale", 1)
            else:
                grad_scale = getattr(optimizer, "grad_scale", None)
            optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
            optimizer.found_inf = record.found_inf  # type: ignore[attr-defined]
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
            record.stage = OptState.STEPPED
            return retval

        if record.stage is OptState.READY:
            self.unscale_(optimizer)
        assert record.found_inf is not None  # set by unscale_
        retval = None
        record.host_found = bool(record.found_inf.item())
        if not record.host_found:
            retval = optimizer.step(*args, **kwargs)
        record.stage = OptState.STEPPED
        return retval

    def _last_flag(self, flags: list[_OptimizerRecord]) -> tuple[torch.Tensor, bool | torch.Tensor]:
        """(found-inf count over ``flags`` on the scale's device, skipped as a host bool if known)."""
        tensors = [rec.found_inf.to(self._scale.device) for rec in flags if rec.found_inf is not None]
        found = tensors[0]
        for flag in tensors[1:]:
            found = found + flag
        host = [rec.host_found for rec in flags]
        skipped: bool | torch.Tensor = any(host) if all(h is not None for h in host) else found > 0  # type: ignore[arg-type]
        return found, skipped

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration: adjust the scale from the recorded inf checks (or set ``new_scale``).

        Call once per iteration, after ``step`` for every optimizer. ``new_scale`` (a number
        or a one-element tensor) must be finite and in [SCALE_FLOOR, SCALE_CEILING]; a tensor
        is read once to check it (a synchronisation, outside the per-step path).
        """
        if not self._enabled:
            self._records.clear()
            return
        records = [rec for rec in self._records.values() if rec.found_inf is not None]
        if new_scale is not None:
            value = new_scale_value(new_scale)
            self._set_scale(value, from_tensor=isinstance(new_scale, torch.Tensor))
            self._last_skipped = self._last_flag(records)[1] if records else False
            self._records.clear()
            return
        if not records:
            raise RuntimeError(
                "update() found no inf checks for this iteration; call step(optimizer) "
                "(or unscale_(optimizer)) before update()."
            )
        found, skipped = self._last_flag(records)
        found_bool = found > 0
        try:
            self._update_scale(found, found_bool)  # first: it may refuse (raise_at_min_scale)
        except RuntimeError:
            self._records.clear()  # the iteration is over all the same: scale and counters stay, the next one starts clean
            raise
        self._steps += 1
        self._overflow_steps += found_bool.to(self._overflow_steps.device)
        self._last_skipped = skipped
        self._records.clear()

    def settle(self, code: torch.Tensor) -> None:
        """End the iteration from a skip decision made on the device, without a host read.

        ``code`` is a 0-dim tensor (:class:`mixprec.step.Decision`): 0, the update happened, and
        2, the gradients overflowed, update the scale as :meth:`update` does (from the found-inf
        flags recorded this iteration); 1, 3 and 4 (a non-finite loss, plan value or updated
        weight) keep the scale and its counters as :meth:`skip` does. The state tensors are
        updated in place (the same tensors every step). The host's counters (``steps``, the
        skips of those kinds) follow in :meth:`counted`, once the host knows the outcome.
        """
        keep = (code == 1) | (code >= 3)
        if not self._enabled:
            self._records.clear()
            self._last_skipped = code > 0
            return
        records = [rec for rec in self._records.values() if rec.found_inf is not None]
        if not records:
            raise RuntimeError(
                "settle() found no inf checks for this iteration; unscale_(optimizer) every optimizer first."
            )
        found, _ = self._last_flag(records)
        found_bool = found > 0
        keep = keep.to(found_bool.device)
        state = self._tensors()
        before = {name: t.clone() for name, t in state.items()}
        try:
            self._update_scale(found, found_bool, keep)  # first: it may refuse (raise_at_min_scale)
        except RuntimeError:
            self._records.clear()
            raise
        with torch.no_grad():
            for name, tensor in state.items():  # kept where the skip keeps the scale; the same tensors
                tensor.copy_(torch.where(keep, before[name], getattr(self, name)))
                setattr(self, name, tensor)
        self._overflow_steps += (found_bool & ~keep).to(self._overflow_steps.device)
        self._last_skipped = keep | found_bool
        self._records.clear()

    @torch.no_grad()
    def restart_where(self, flag: torch.Tensor, scale: float) -> None:
        """Set the scale to ``scale`` (clamped into this scaler's bounds, as ``update(new_scale=tensor)``
        does) where ``flag`` (a 0-dim bool tensor) is true, on the device; the counters are kept."""
        value = self._clamped(float(scale))
        self._scale.copy_(torch.where(flag.to(self._scale.device), torch.full_like(self._scale, value), self._scale))

    def counted(self, reason: str | None) -> None:
        """The host's side of :meth:`settle`, once it knows the outcome (``reason``: None for a step,
        else the skip reason): the iteration and, for a skip that keeps the scale, the skip are
        counted as :meth:`update` and :meth:`skip` count them."""
        keeps = reason is not None and reason != "overflow"
        if not self._enabled:
            if reason is not None:
                self._steps += 1
                self._forced_skips += 1
            return
        self._steps += 1
        if keeps:
            self._forced_skips += 1

    def skip(self) -> None:
        """Abandon this iteration without changing the scale (for instance a non-finite loss).

        Counts a skipped step and forgets the per-optimizer state, so the next iteration
        starts clean. Scaling cannot fix a forward overflow, so the scale is kept.
        """
        self._records.clear()
        self._steps += 1
        self._forced_skips += 1
        self._last_skipped = True

    # ------------------------------------------------------------- checkpoint
    def validate_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state_dict``, changing nothing.

        (It loads into a private copy of this scaler, so callers can check every part of a
        checkpoint before they change any.)
        """
        probe = copy.copy(self)
        probe.__dict__.update({k: v.clone() for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)})
        probe._records = defaultdict(_OptimizerRecord)
        probe.load_state_dict(state_dict)

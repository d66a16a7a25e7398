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
"""

from __future__ import annotations

import enum
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["LossScaler", "OptState"]

T = TypeVar("T")

_FP64_RECIPROCAL_UNSUPPORTED = ("mps",)


class OptState(enum.Enum):
    """Where one optimizer stands in the current iteration."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass
class _OptimizerRecord:
    stage: OptState = OptState.READY
    found_inf: torch.Tensor | None = None


def _resolve_group(process_group: Any) -> Any:
    """``None`` -> the default group when more than one rank is initialised, else no sync."""
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def _grad_tensors(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    """The gradient values of every parameter of ``optimizer`` (sparse ones coalesced if low precision)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                # Duplicate indices are summed by coalesce(); in fp16 that sum can overflow
                # although every stored value is finite, so check the coalesced values.
                if grad.dtype in (torch.float16, torch.bfloat16) and not grad.is_coalesced():
                    grad = grad.coalesce()
                    param.grad = grad
                yield grad._values()
            else:
                yield grad


class LossScaler:
    """Base class: the state machine shared by dynamic, constant and no-op scalers.

    Subclasses implement :meth:`_update_scale` (and usually ``__init__``,
    ``state_dict`` and ``load_state_dict``). A disabled scaler is the identity:
    ``scale`` returns its input, ``step`` calls ``optimizer.step()``.
    """

    def __init__(self, init_scale: float, *, enabled: bool = True, process_group: Any = None) -> None:
        if not isinstance(init_scale, int | float) or isinstance(init_scale, bool):
            raise TypeError(f"init_scale must be a number, got {init_scale!r}")
        if not math.isfinite(init_scale) or init_scale <= 0:
            raise ValueError(f"init_scale must be a finite positive number, got {init_scale!r}")
        self._enabled = bool(enabled)
        self._process_group = process_group
        self._scale = torch.full((), float(init_scale), dtype=torch.float32)
        # Counters: what the host knows stays a Python int; overflows are a tensor (no sync).
        self._steps = 0
        self._forced_skips = 0
        self._overflow_steps = torch.zeros((), dtype=torch.int64)
        self._records: defaultdict[int, _OptimizerRecord] = defaultdict(_OptimizerRecord)

    # ------------------------------------------------------------------ state
    def is_enabled(self) -> bool:
        """Whether this scaler scales at all (a disabled scaler is the identity)."""
        return self._enabled

    @property
    def device(self) -> torch.device:
        return self._scale.device

    def _tensors(self) -> dict[str, torch.Tensor]:
        """Every state tensor, by attribute name (moved together to the loss's device)."""
        return {"_scale": self._scale}

    def _to_device(self, device: torch.device) -> None:
        if device == self._scale.device:
            return
        for name, tensor in self._tensors().items():
            setattr(self, name, tensor.to(device))
        self._overflow_steps = self._overflow_steps.to(device)

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
        first = _first_tensor(outputs)
        if first is None:
            raise TypeError(
                f"scale() expects a tensor or a (nested) list/tuple/dict of tensors, got {type(outputs).__name__}"
            )
        self._to_device(first.device)
        return _apply(outputs, self._scale)  # type: ignore[return-value]

    def _record(self, optimizer: torch.optim.Optimizer) -> _OptimizerRecord:
        return self._records[id(optimizer)]

    def _check_grads(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor) -> torch.Tensor:
        """Multiply every gradient by ``inv_scale`` in place; return a 0/1 found-inf flag (all ranks agree)."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        with torch.no_grad():
            for grad in _grad_tensors(optimizer):
                groups[(grad.device, grad.dtype)].append(grad)
            per_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
            for (device, _dtype), grads in groups.items():
                if device not in per_device:
                    per_device[device] = (
                        torch.zeros((), dtype=torch.float32, device=device),
                        inv_scale.to(device),
                    )
                dev_found, dev_inv = per_device[device]
                torch._amp_foreach_non_finite_check_and_unscale_(grads, dev_found, dev_inv)
            if len(per_device) == 1 and self._scale.device in per_device:
                found_inf = per_device[self._scale.device][0]
            else:
                found_inf = torch.zeros((), dtype=torch.float32, device=self._scale.device)
                for dev_found, _ in per_device.values():
                    found_inf = torch.maximum(found_inf, dev_found.to(found_inf.device))
        group = _resolve_group(self._process_group)
        if group is not None:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
        return found_inf

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale, in place, and record whether any is inf/NaN.

        fp16 and bf16 gradients are accepted (computed in fp32). Call it at most once per
        optimizer per iteration, after all gradients are accumulated.
        """
        if not self._enabled:
            return
        record = self._record(optimizer)
        if record.stage is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(); "
                "call it once per optimizer per iteration."
            )
        if record.stage is OptState.STEPPED:
            raise RuntimeError(
                "unscale_() is being called after step(); call unscale_() before step() and update() after both."
            )
        if self._scale.device.type in _FP64_RECIPROCAL_UNSUPPORTED:
            inv_scale = self._scale.reciprocal()
        else:
            # fp32 division can be imprecise under some compile options: take the reciprocal in fp64.
            inv_scale = self._scale.double().reciprocal().float()
        record.found_inf = self._check_grads(optimizer, inv_scale)
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
        return combined

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless already done) and call ``optimizer.step(*args, **kwargs)`` unless gradients are inf/NaN.

        Returns what ``optimizer.step`` returns, or None when the step is skipped.
        Optimizers with ``_step_supports_amp_scaling`` (fused Adam/AdamW/SGD) receive
        ``grad_scale`` and ``found_inf`` and unscale/skip inside their own kernel.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("step(closure=...) is not supported while loss scaling is enabled.")
        record = self._record(optimizer)
        if record.stage is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update(); call update() first.")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
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
        if not record.found_inf.item():
            retval = optimizer.step(*args, **kwargs)
        record.stage = OptState.STEPPED
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration: adjust the scale from the recorded inf checks (or set ``new_scale``).

        Call once per iteration, after ``step`` for every optimizer.
        """
        if not self._enabled:
            self._records.clear()
            return
        if new_scale is not None:
            self._set_scale(new_scale)
            self._records.clear()
            return
        flags = [rec.found_inf for rec in self._records.values() if rec.found_inf is not None]
        if not flags:
            raise RuntimeError(
                "update() found no inf checks for this iteration; call step(optimizer) "
                "(or unscale_(optimizer)) before update()."
            )
        found = flags[0]
        for flag in flags[1:]:
            found = found + flag
        found_bool = found > 0
        self._steps += 1
        self._overflow_steps += found_bool
        self._update_scale(found, found_bool)
        self._records.clear()

    def skip(self) -> None:
        """Abandon this iteration without changing the scale (for instance a non-finite loss).

        Counts a skipped step and forgets the per-optimizer state, so the next iteration
        starts clean. Scaling cannot fix a forward overflow, so the scale is kept.
        """
        self._records.clear()
        self._steps += 1
        self._forced_skips += 1

    def _set_scale(self, new_scale: float | torch.Tensor) -> None:
        if isinstance(new_scale, torch.Tensor):
            if new_scale.numel() != 1 or new_scale.requires_grad:
                raise ValueError(
                    "new_scale must be a float or a one-element tensor that does not require grad, "
                    f"got shape {tuple(new_scale.shape)} (requires_grad={new_scale.requires_grad})"
                )
            self._scale.copy_(new_scale.reshape(()).to(self._scale))
            return
        if not isinstance(new_scale, int | float) or not math.isfinite(new_scale) or new_scale <= 0:
            raise ValueError(f"new_scale must be a finite positive number, got {new_scale!r}")
        self._scale.fill_(float(new_scale))

    def _update_scale(self, found_inf: torch.Tensor, found_bool: torch.Tensor) -> None:
        """Evolve the scale given this iteration's found-inf count (fp32) and flag (bool)."""

    # ------------------------------------------------------------- checkpoint
    def _counter_state(self) -> dict[str, int]:
        overflows = int(self._overflow_steps.item())
        return {"steps": self._steps, "skipped_steps": self._forced_skips + overflows, "overflow_steps": overflows}

    def _load_counter_state(self, state: Mapping[str, Any]) -> None:
        steps = _get_int(state, "steps", default=0, minimum=0)
        skipped = _get_int(state, "skipped_steps", default=0, minimum=0)
        overflows = _get_int(state, "overflow_steps", default=0, minimum=0)
        if skipped < overflows:
            raise ValueError(
                f"scaler state_dict has skipped_steps={skipped} < overflow_steps={overflows}; every overflow is a skip"
            )
        self._steps, self._forced_skips = steps, skipped - overflows
        self._overflow_steps = torch.tensor(overflows, dtype=torch.int64, device=self._scale.device)

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        raise NotImplementedError


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, list | tuple):
        for item in obj:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _apply(obj: Any, scale: torch.Tensor) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj * scale.to(device=obj.device, non_blocking=True)
    if isinstance(obj, Mapping):
        return type(obj)({k: _apply(v, scale) for k, v in obj.items()})  # type: ignore[call-arg]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_apply(v, scale) for v in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(_apply(v, scale) for v in obj)
    raise TypeError(f"scale() cannot scale an object of type {type(obj).__name__}")


def _get_number(state: Mapping[str, Any], key: str, default: float | None = None) -> float:
    if key not in state:
        if default is None:
            raise ValueError(f"scaler state_dict is missing {key!r}; was it produced by state_dict()?")
        return default
    value = state[key]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"scaler state_dict[{key!r}] must be a number, got {value!r}")
    return float(value)


def _get_int(state: Mapping[str, Any], key: str, default: int | None = None, minimum: int | None = None) -> int:
    value = _get_number(state, key, None if default is None else float(default))
    if value != int(value):
        raise ValueError(f"scaler state_dict[{key!r}] must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"scaler state_dict[{key!r}] must be >= {minimum}, got {int(value)}")
    return int(value)

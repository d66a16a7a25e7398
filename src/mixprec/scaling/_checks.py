"""Argument and state-dict checks shared by the loss scalers.

Every check raises before anything is changed: ``TypeError`` for a value of the wrong
kind, ``ValueError`` for one out of range, each naming the argument (or state key), the
value, and the fix.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["SCALE_CEILING", "SCALE_FLOOR"]

#: The smallest loss scale: 2**-126, the smallest normal fp32 number. Its reciprocal
#: (2**126) is finite in fp32, so unscaling never multiplies by inf; being normal, it is not
#: flushed to zero on hardware that flushes subnormals. Backoff never goes below it.
SCALE_FLOOR: float = 2.0**-126
#: The largest loss scale: the fp32 maximum (about 3.4e38). Growth never exceeds it (a
#: grown scale that is not finite is discarded, as in torch).
SCALE_CEILING: float = float(torch.finfo(torch.float32).max)

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

_SCALE_RANGE = "[2**-126, 3.4028234663852886e+38] (both the scale and 1/scale finite in fp32)"


def show(value: object) -> str:
    """``repr(value)``, shortened, and safe for integers too large to print."""
    try:
        text = repr(value)
    except ValueError:  # int too large to convert to str
        return f"<int of {value.bit_length()} bits>" if isinstance(value, int) else f"<{type(value).__name__}>"
    except Exception:
        return f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def real(name: str, value: object, fix: str) -> float:
    """``value`` as a float; TypeError unless it is a real number (bool excluded)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {show(value)} ({type(value).__name__}); {fix}")
    try:
        return float(value)
    except (OverflowError, ValueError):
        raise ValueError(f"{name}={show(value)} does not fit in a float; {fix}") from None


def fp32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value (the scale and its bounds are fp32)."""
    return float(torch.tensor(x, dtype=torch.float32))


def scale_value(name: str, value: object, fix: str) -> float:
    """A loss scale: a finite number in [SCALE_FLOOR, SCALE_CEILING], rounded to fp32."""
    x = real(name, value, fix)
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{name} must be a finite positive number, got {show(value)}; {fix}")
    if not SCALE_FLOOR <= x <= SCALE_CEILING:
        raise ValueError(f"{name}={show(value)} is outside the usable range {_SCALE_RANGE}; {fix}")
    return fp32(x)


def positive_int(name: str, value: object, fix: str, maximum: int = INT32_MAX) -> int:
    """An integer in [1, maximum]; TypeError for non-integers (bool excluded)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {show(value)} ({type(value).__name__}); {fix}")
    v = int(value)
    if v < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {show(value)}; {fix}")
    if v > maximum:
        raise ValueError(f"{name} must be an integer <= {maximum}, got {show(value)}; {fix}")
    return v


def boolean(name: str, value: object, fix: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {show(value)} ({type(value).__name__}); {fix}")
    return value


def check_optimizer(optimizer: object, call: str) -> None:
    """TypeError unless ``optimizer`` looks like a torch optimizer (``step()`` and ``param_groups``)."""
    if not hasattr(optimizer, "param_groups") or not callable(getattr(optimizer, "step", None)):
        raise TypeError(
            f"{call}() expects a torch.optim.Optimizer (an object with step() and param_groups), "
            f"got {show(optimizer)} ({type(optimizer).__name__}); pass the optimizer instance itself, "
            f"e.g. scaler.{call}(optimizer)"
        )


def parse_device(device: object) -> torch.device | None:
    """``device`` (a str, a torch.device or None) as a torch.device, or None."""
    if device is None:
        return None
    if not isinstance(device, str | torch.device):
        raise TypeError(
            f"device must be a str or torch.device such as 'cuda' or 'cpu', got {show(device)} "
            f"({type(device).__name__}); pass e.g. device='cuda'"
        )
    try:
        return torch.device(device)
    except RuntimeError:
        raise ValueError(f"device={show(device)} is not a device torch knows; pass e.g. device='cuda' or 'cpu'") from None


def new_scale_value(new_scale: object) -> float:
    """``update(new_scale=...)``'s argument (a number or a one-element tensor) as a checked scale."""
    fix = "pass a finite scale in [2**-126, 3.4e38], e.g. update(65536.0)"
    if isinstance(new_scale, torch.Tensor):
        if new_scale.numel() != 1 or new_scale.requires_grad:
            raise ValueError(
                "new_scale must be a float or a one-element tensor that does not require grad, "
                f"got shape {tuple(new_scale.shape)} (requires_grad={new_scale.requires_grad}); {fix}"
            )
        if new_scale.is_complex() or new_scale.dtype == torch.bool:
            raise TypeError(f"new_scale must be a real-valued tensor, got dtype {new_scale.dtype}; {fix}")
        value: object = new_scale.detach().reshape(()).item()
        return scale_value("new_scale", value, fix)
    if isinstance(new_scale, bool) or not isinstance(new_scale, numbers.Real):
        raise TypeError(
            f"new_scale must be a number or a one-element tensor, got {show(new_scale)} "
            f"({type(new_scale).__name__}); {fix}"
        )
    return scale_value("new_scale", new_scale, fix)


# ----------------------------------------------------------------- state dicts
_MISSING: Any = object()


def check_keys(state: Mapping[Any, Any], required: set[str], allowed: set[str]) -> None:
    """Missing and unexpected keys, all named in one ValueError."""
    bad = [k for k in state if not isinstance(k, str)]
    if bad:
        raise ValueError(
            f"scaler state_dict keys must be strings, got {', '.join(show(k) for k in bad[:5])}; "
            "pass what the scaler's state_dict() returned"
        )
    missing = sorted(required - set(state))
    if missing:
        raise ValueError(
            f"scaler state_dict is missing {', '.join(repr(k) for k in missing)}; "
            "was it produced by state_dict()? Pass what the scaler's state_dict() returned"
        )
    unexpected = sorted(set(state) - allowed)
    if unexpected:
        raise ValueError(
            f"scaler state_dict has unexpected keys {', '.join(repr(k) for k in unexpected)}; "
            f"this scaler reads only {sorted(allowed)}"
        )


def _plain(value: object) -> object:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool:
        return value.item()
    return value


def state_number(state: Mapping[str, Any], key: str, default: Any = _MISSING) -> float:
    """``state[key]`` as a float (one-element tensors are read); ValueError if it is not a number."""
    if key not in state:
        if default is _MISSING:
            raise ValueError(f"scaler state_dict is missing {key!r}; was it produced by state_dict()?")
        return float(default)
    value = _plain(state[key])
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"scaler state_dict[{key!r}] must be a number, got {show(value)}")
    try:
        return float(value)
    except (OverflowError, ValueError):
        raise ValueError(f"scaler state_dict[{key!r}]={show(value)} does not fit in a float") from None


def state_int(
    state: Mapping[str, Any], key: str, default: Any = _MISSING, minimum: int = 0, maximum: int = INT64_MAX
) -> int:
    """``state[key]`` as an int in [minimum, maximum] (integral floats accepted)."""
    if key not in state:
        if default is _MISSING:
            raise ValueError(f"scaler state_dict is missing {key!r}; was it produced by state_dict()?")
        return int(default)
    value = _plain(state[key])
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        v = int(value)
    else:
        x = state_number(state, key)
        if not math.isfinite(x) or x != int(x):
            raise ValueError(f"scaler state_dict[{key!r}] must be an integer, got {show(value)}")
        v = int(x)
    if v < minimum:
        raise ValueError(f"scaler state_dict[{key!r}] must be >= {minimum}, got {show(v)}")
    if v > maximum:
        raise ValueError(f"scaler state_dict[{key!r}] must be <= {maximum}, got {show(v)}")
    return v


def state_str(state: Mapping[str, Any], key: str, default: Any = _MISSING) -> str:
    if key not in state:
        if default is _MISSING:
            raise ValueError(f"scaler state_dict is missing {key!r}; was it produced by state_dict()?")
        return str(default)
    value = state[key]
    if not isinstance(value, str):
        raise ValueError(f"scaler state_dict[{key!r}] must be a string, got {show(value)}")
    return value


def parse_counters(state: Mapping[str, Any]) -> tuple[int, int, int]:
    """(steps, forced skips, overflow steps), checked for consistency."""
    steps = state_int(state, "steps", default=0)
    skipped = state_int(state, "skipped_steps", default=0)
    overflows = state_int(state, "overflow_steps", default=0)
    if skipped < overflows:
        raise ValueError(
            f"scaler state_dict has skipped_steps={skipped} < overflow_steps={overflows}; every overflow is a skip"
        )
    if skipped > steps:
        raise ValueError(
            f"scaler state_dict has skipped_steps={skipped} > steps={steps}; every skip is a step"
        )
    return steps, skipped - overflows, overflows


def state_scale(state: Mapping[str, Any], key: str) -> float:
    """``state[key]`` as a loss scale in [SCALE_FLOOR, SCALE_CEILING]."""
    x = state_number(state, key)
    fix = f"the checkpoint is corrupt or its run had lost its scale; set state_dict[{key!r}] to a usable scale such as 65536.0"
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"scaler state_dict[{key!r}] must be finite and positive, got {show(state[key])}; {fix}")
    if not SCALE_FLOOR <= x <= SCALE_CEILING:
        raise ValueError(f"scaler state_dict[{key!r}]={show(state[key])} is outside the usable range {_SCALE_RANGE}; {fix}")
    return fp32(x)

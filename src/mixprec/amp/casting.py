"""How the engine casts an op's inputs: autocast's rules for one op call.

An input is *eligible* when it is a floating tensor on the autocast device and not
float64 (autocast's rule). An op of class ``low`` gets its eligible inputs in the
autocast dtype, ``fp32`` in float32, ``promote`` in the widest eligible input type.
Nested arguments (lists, tuples, namedtuples, dicts, dataclasses) are walked with
:mod:`mixprec.nested`; the common case, tensors passed directly, is checked first.

>>> import torch
>>> from mixprec.policy import Precision
>>> from mixprec.amp.casting import cast_call, target_dtype
>>> a, b = torch.ones(2), torch.ones(2, dtype=torch.bfloat16)
>>> target_dtype(Precision.PROMOTE, (a, b), {}, "cpu", torch.bfloat16)
torch.float32
>>> args, kwargs = cast_call(([a, b],), {"out": None}, "cpu", torch.bfloat16)
>>> [t.dtype for t in args[0]], kwargs
([torch.bfloat16, torch.bfloat16], {'out': None})
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from mixprec.nested import first_tensor, map_tensors, tensors
from mixprec.policy import Precision

__all__ = ["cast_call", "device_type_of", "eligible", "run_in", "target_dtype"]

_Tensor = torch.Tensor


def eligible(t: torch.Tensor, device_type: str) -> bool:
    """autocast's rule: floating, on the autocast device, and never float64."""
    return t.is_floating_point() and t.dtype is not torch.float64 and t.device.type == device_type


def cast_call(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], device_type: str, dtype: torch.dtype
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with their eligible floating tensors (nested too) cast to ``dtype``."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.dtype is not dtype and eligible(t, device_type):
            return t.to(dtype)
        return t

    # This runs on every intercepted op call: tensor arguments are cast without a walk.
    new_args = tuple(cast(a) if isinstance(a, _Tensor) else _cast_nested(a, cast) for a in args)
    new_kwargs = {
        k: cast(v) if isinstance(v, _Tensor) else _cast_nested(v, cast) for k, v in kwargs.items()
    }
    return new_args, new_kwargs


def _cast_nested(value: Any, cast: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    # Plain lists / tuples of tensors (cat, stack) are cast one level deep without the
    # generic walker; anything else goes through it.
    kind = type(value)
    if kind is list:
        return [cast(v) if isinstance(v, _Tensor) else map_tensors(cast, v) for v in value]
    if kind is tuple:
        return tuple(cast(v) if isinstance(v, _Tensor) else map_tensors(cast, v) for v in value)
    return map_tensors(cast, value)


def _widest(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], device_type: str, low: torch.dtype
) -> torch.dtype:
    """The promote target: fp32 if any eligible input is fp32 or the inputs mix two
    low-precision types, else the one low-precision type (the autocast dtype if none)."""
    kinds: set[torch.dtype] = set()
    for value in (*args, *kwargs.values()):
        for t in _shallow_tensors(value):
            if eligible(t, device_type):
                kinds.add(t.dtype)
    if not kinds:
        return low
    if torch.float32 in kinds or len(kinds) > 1:
        return torch.float32
    return kinds.pop()


def _shallow_tensors(value: Any) -> Iterable[torch.Tensor]:
    # The tensors in one argument, in order: a tensor, or a plain list / tuple of tensors
    # (cat, stack), without starting the generic walker.
    if isinstance(value, _Tensor):
        return (value,)
    kind = type(value)
    if (kind is list or kind is tuple) and all(isinstance(v, _Tensor) for v in value):
        return value  # type: ignore[no-any-return]
    return tensors(value)


def target_dtype(
    precision: Precision,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    device_type: str,
    low: torch.dtype,
) -> torch.dtype:
    """The dtype an op of class ``precision`` runs in, given its arguments and the autocast dtype ``low``."""
    if precision is Precision.LOW:
        return low
    if precision is Precision.FP32:
        return torch.float32
    return _widest(args, kwargs, device_type, low)


def device_type_of(args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None) -> str | None:
    """The device type of the first tensor in ``args`` then ``kwargs`` (depth first), or None."""
    if args:  # the common cases, without walking: a tensor or a list of tensors first
        first = args[0]
        if isinstance(first, _Tensor):
            return first.device.type
        if type(first) in (list, tuple) and first and isinstance(first[0], _Tensor):
            return first[0].device.type
    found = first_tensor((args, kwargs))
    return None if found is None else found.device.type


def run_in(
    func: Callable[..., Any],
    precision: Precision,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    device_type: str,
    low: torch.dtype,
) -> Any:
    """Run ``func`` as autocast runs an op of class ``precision``: cast, then autocast off."""
    target = target_dtype(precision, args, kwargs, device_type, low)
    args, kwargs = cast_call(args, kwargs, device_type, target)
    with torch.autocast(device_type, enabled=False):
        return func(*args, **kwargs)

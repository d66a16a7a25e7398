"""Floating-point formats as data, and the one place dtype names are parsed.

Every other module receives a :class:`torch.dtype` or a :class:`Format`; strings
such as ``"bf16"`` or ``"e4m3"`` become those here and nowhere else.

>>> from mixprec.dtypes import Format, parse_dtype
>>> parse_dtype("bf16")
torch.bfloat16
>>> Format.E4M3.max
448.0
>>> Format.from_dtype(parse_dtype("half")).max
65504.0
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Collection
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from mixprec.nested import map_tensors

__all__ = [
    "LOW_PRECISION_DTYPES", "Format", "cast_floating", "cast_module_", "check_frozen_casts", "dtype_name",
    "frozen_low_ids", "lossy_frozen_casts", "parse_dtype",
]

_ALIASES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
    "e4m3": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "fp8_e5m2": torch.float8_e5m2,
    "float8_e5m2": torch.float8_e5m2,
}

LOW_PRECISION_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """Turn a dtype or a dtype name ("bf16", "half", "e4m3", ...) into a torch.dtype."""
    if isinstance(value, torch.dtype):
        return value
    if not isinstance(value, str):
        raise TypeError(f"expected a torch.dtype or a dtype name, got {value!r}")
    key = value.strip().lower().removeprefix("torch.")
    try:
        return _ALIASES[key]
    except KeyError:
        valid = ", ".join(sorted(_ALIASES))
        raise ValueError(f"unknown dtype {value!r}; expected one of: {valid}") from None


def cast_floating(value: Any, dtype: torch.dtype, *, include_float64: bool = False) -> Any:
    """Cast every floating tensor in ``value`` (nested containers, see :mod:`mixprec.nested`) to ``dtype``.

    Other leaves are returned as they are; float64 tensors too, unless ``include_float64``.

    >>> import torch
    >>> out = cast_floating({"x": torch.ones(1), "i": torch.ones(1, dtype=torch.int64)}, torch.bfloat16)
    >>> out["x"].dtype, out["i"].dtype
    (torch.bfloat16, torch.int64)
    """
    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.dtype != dtype and (include_float64 or t.dtype != torch.float64):
            return t.to(dtype)
        return t

    return map_tensors(cast, value)


def _cast_tensor_(t: torch.Tensor, dtype: torch.dtype) -> bool:
    if not t.is_floating_point() or t.dtype == dtype:
        return False
    if is_traceable_wrapper_subclass(t):  # a DTensor (tensor parallelism): the wrapper and its local shard at once
        _swap_cast_(t, dtype)
        return True
    t.data = t.data.to(dtype)
    if t.grad is not None:
        t.grad = t.grad.to(dtype)
    return True


def _swap_cast_(t: torch.Tensor, dtype: torch.dtype) -> None:
    """Cast a tensor subclass that wraps other tensors (a DTensor and its ``_local_tensor``) in
    place, keeping the Python object (optimizers built over it still hold it), as
    ``nn.Module.to()`` does: ``t.data = ...`` would relabel the wrapper and leave its local shard
    in the old dtype (the first matmul then fails on mixed dtypes)."""
    grad = t.grad
    t.grad = None  # (a gradient held keeps a second reference that swap_tensors refuses)
    with torch.no_grad():
        cast = t.detach().to(dtype)
    new = torch.nn.Parameter(cast, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else cast
    try:
        torch.utils.swap_tensors(t, new)
    except Exception:
        t.grad = grad
        raise
    if grad is not None:
        t.grad = grad.to(dtype)


def cast_module_(
    model: torch.nn.Module,
    dtype: torch.dtype,
    *,
    keep: tuple[type[torch.nn.Module], ...] = (),
    keep_dtype: torch.dtype = torch.float32,
    only_from: tuple[torch.dtype, ...] | None = None,
    skip: Collection[int] = (),
) -> dict[torch.Tensor, torch.Tensor]:
    """Cast floating parameters and buffers of ``model`` to ``dtype`` in place.

    Modules of the types in ``keep`` (and their buffers) get ``keep_dtype`` instead.
    With ``only_from``, only tensors of those dtypes are cast; tensors whose ``id`` is in
    ``skip`` are left as they are (fp32 islands, a frozen base kept as loaded). Parameter objects keep
    their identity, so optimizers built earlier still hold them; integer buffers are
    never touched. Returns the fp32 values of the parameters that were cast down
    (to seed fp32 master weights without a rounding loss).
    """
    originals: dict[torch.Tensor, torch.Tensor] = {}
    seen: set[int] = set()
    for module in model.modules():
        target = keep_dtype if keep and isinstance(module, keep) else dtype
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        for t in tensors:
            if id(t) in seen or id(t) in skip or (only_from is not None and t.dtype not in only_from):
                continue
            seen.add(id(t))
            down = t.is_floating_point() and torch.finfo(target).bits < torch.finfo(t.dtype).bits
            if down and isinstance(t, torch.nn.Parameter):
                originals[t] = t.detach().to(torch.float32, copy=True)
            _cast_tensor_(t, target)
    return originals


def _frozen_low(t: torch.Tensor) -> bool:
    """A frozen (``requires_grad=False``) fp16/bf16 parameter."""
    return isinstance(t, torch.nn.Parameter) and not t.requires_grad and t.dtype in LOW_PRECISION_DTYPES


def frozen_low_ids(model: torch.nn.Module, *, except_in: tuple[type[torch.nn.Module], ...] = ()) -> set[int]:
    """ids of the frozen fp16/bf16 parameters of ``model`` (a LoRA base loaded in half precision),
    except those of modules of the types in ``except_in``."""
    return {
        id(t) for module in model.modules() if not (except_in and isinstance(module, except_in))
        for t in module.parameters(recurse=False) if _frozen_low(t)
    }


def lossy_frozen_casts(
    model: torch.nn.Module,
    dtype: torch.dtype,
    *,
    keep: tuple[type[torch.nn.Module], ...] = (),
    keep_dtype: torch.dtype = torch.float32,
    skip: Collection[int] = (),
    narrowing: bool = True,
) -> list[tuple[str, torch.dtype, torch.dtype]]:
    """(name, dtype, target) of each frozen (``requires_grad=False``) floating parameter that
    :func:`cast_module_` with these arguments would round between fp16 and bf16 (lossy both
    ways), and with ``narrowing`` also to fewer bits (fp32 to half). Nothing is cast. A frozen
    parameter gets no fp32 master or compensation, so such a cast loses its value for good."""
    found = []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        target = keep_dtype if keep and isinstance(module, keep) else dtype
        for name, t in module.named_parameters(recurse=False):
            if id(t) in seen or id(t) in skip or t.requires_grad or not t.is_floating_point() or t.dtype == target:
                continue
            seen.add(id(t))
            narrower = narrowing and torch.finfo(target).bits < torch.finfo(t.dtype).bits
            if narrower or (t.dtype in LOW_PRECISION_DTYPES and target in LOW_PRECISION_DTYPES):
                found.append((f"{module_name}.{name}" if module_name else name, t.dtype, target))
    return found


def check_frozen_casts(
    plan_name: str,
    casts: list[tuple[str, torch.dtype, torch.dtype]],
    convert: bool,
    known_plans: Collection[str] = (),
) -> None:
    """Refuse the lossy casts :func:`lossy_frozen_casts` found unless ``convert`` (the plan's
    ``convert_frozen=True``); then warn once, naming them. ``known_plans``: the plan names
    the message may suggest (the plan in the base's own dtype, where there is one)."""
    if not casts:
        return
    names = ", ".join(name for name, _, _ in casts[:5]) + (f", ... ({len(casts)} in all)" if len(casts) > 5 else "")
    sources = sorted({dtype_name(c[1]) for c in casts})
    source, target = " and ".join(sources), dtype_name(casts[0][2])
    narrowing = any(torch.finfo(c[2]).bits < torch.finfo(c[1]).bits for c in casts)
    if convert:
        warnings.warn(
            f"plan {plan_name!r} rounds {len(casts)} frozen {source} parameter(s) to {target} in place "
            f"(convert_frozen=True): {names}. They have no fp32 master: the stored base is no longer the one loaded",
            UserWarning,
            stacklevel=3,
        )
        return
    own = ""
    twin = plan_name.replace(target, sources[0])
    if len(sources) == 1 and sources[0] != "fp32" and twin in known_plans:
        own = f"train in the base's own dtype ({twin!r}), "
    accept = "which also halves the base" if narrowing else "the base keeps its size"
    raise ValueError(
        f"plan {plan_name!r} would round {len(casts)} frozen parameter(s) loaded in {source} to {target} "
        f"({names}): frozen parameters get no fp32 master, so the values loaded would be lost (a later merge or "
        f"save keeps the rounding). Use a '*-mixed' plan (the frozen base stays as loaded and is cast per op), "
        f"{own}or accept the rounding ({accept}): get_plan({plan_name!r}, convert_frozen=True)"
    )


def dtype_name(dtype: torch.dtype) -> str:
    """Short display name: torch.bfloat16 -> 'bf16'."""
    return _SHORT.get(dtype, str(dtype).removeprefix("torch."))


_SHORT = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.float8_e4m3fn: "e4m3",
    torch.float8_e5m2: "e5m2",
}


class Format(enum.Enum):
    """A floating-point format and its facts (largest finite value, smallest normal, epsilon)."""

    FP32 = (torch.float32, 8, 23)
    BF16 = (torch.bfloat16, 8, 7)
    FP16 = (torch.float16, 5, 10)
    E4M3 = (torch.float8_e4m3fn, 4, 3)
    E5M2 = (torch.float8_e5m2, 5, 2)

    def __init__(self, dtype: torch.dtype, exponent_bits: int, mantissa_bits: int) -> None:
        self.dtype = dtype
        self.exponent_bits = exponent_bits
        self.mantissa_bits = mantissa_bits
        info = torch.finfo(dtype)
        self.max = float(info.max)
        self.tiny = float(info.tiny)
        self.eps = float(info.eps)
        self.bits = info.bits

    @classmethod
    def from_dtype(cls, dtype: torch.dtype | str) -> Format:
        dt = parse_dtype(dtype)
        for member in cls:
            if member.dtype == dt:
                return member
        raise ValueError(f"no floating-point format for dtype {dt}")

    @property
    def short_name(self) -> str:
        return dtype_name(self.dtype)

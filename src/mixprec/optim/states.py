"""Optimizer state precision between steps: fp32, bf16, or 8-bit blockwise (fp16 is refused).

The low-precision wrappers keep each per-element state tensor of a low-precision parameter
(Adam's moments, SGD's momentum) in ``state_dtype`` between steps and expand it to fp32 for
the update. ``"8bit"`` (:data:`Q8`) keeps it as 8-bit blockwise dynamic quantization, as
bitsandbytes' and torchao's 8-bit optimizers: a uint8 code per element under the state's
own key (shaped like the parameter) and one fp32 absmax per block of :data:`BLOCK` elements
under ``key + "_absmax"`` (:mod:`mixprec.optim.quant`); signed codes for first moments and
momentum, unsigned for second moments. One byte per element and 1/64 of a byte per block
scale, against 4 (fp32) or 2 (bf16).

>>> import torch
>>> parse_state_dtype("8bit"), parse_state_dtype("bf16"), parse_state_dtype(None)
(torch.uint8, torch.bfloat16, None)
>>> state = {}
>>> put(state, "exp_avg_sq", torch.full((300,), 0.25), Q8)
>>> sorted(state), state["exp_avg_sq"].dtype, tuple(state["exp_avg_sq_absmax"].shape)
(['exp_avg_sq', 'exp_avg_sq_absmax'], torch.uint8, (2,))
>>> float(value(state, "exp_avg_sq")[0])
0.25
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from mixprec.dtypes import parse_dtype
from mixprec.optim.quant import dequantize_blockwise, quantize_flat

__all__ = [
    "ABSMAX",
    "BLOCK",
    "FP16_REFUSAL",
    "Q8",
    "Held",
    "describe",
    "element_bytes",
    "expand_for_step",
    "is_param_state",
    "is_scale_key",
    "keep_after_step",
    "parse_state_dtype",
    "put",
    "signed_key",
    "tensor_bytes",
    "value",
]

#: the state dtype that stands for 8-bit blockwise quantization (its codes' dtype)
Q8 = torch.uint8
#: elements per quantization block
BLOCK = 256
#: the suffix of the key that holds a quantized state's per-block scales
ABSMAX = "_absmax"

# keys whose values are never negative (torch's Adam family, RMSprop, Adagrad, Adamax, Adadelta)
_UNSIGNED = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "exp_inf", "acc_delta")


def parse_state_dtype(value: Any) -> torch.dtype | None:
    """``None`` / ``"fp32"`` / ``"bf16"`` / ``"8bit"`` (or a torch dtype) as the dtype the state is kept
    in: None for fp32 kept as the inner optimizer makes it, :data:`Q8` for 8-bit. ``"fp16"`` is refused
    (:data:`FP16_REFUSAL`: it holds neither a small second moment nor a large first one)."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in ("8bit", "8-bit", "int8", "q8", "uint8"):
        return Q8
    try:
        dtype = parse_dtype(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"state_dtype must be 'fp32', 'bf16' or '8bit' (8-bit blockwise), got {value!r}"
        ) from exc
    if dtype == Q8:
        return Q8
    if dtype == torch.float16:
        raise ValueError(FP16_REFUSAL)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"state_dtype must be 'fp32', 'bf16' or '8bit' (8-bit blockwise), got {value!r}")
    return dtype


#: why ``state_dtype="fp16"`` is refused, and the ways that work
FP16_REFUSAL = (
    "state_dtype='fp16' cannot hold optimizer state: Adam's second moment (the squared gradient) flushes to zero "
    "below 6e-8, so gradients under about 2.4e-4 get updates several times too large, and a first moment or "
    "momentum above 65504 (a gradient of 1e5 or more) becomes inf and then NaN in the weights. Use "
    "state_dtype='bf16' (the same 2 bytes, with fp32's range) or '8bit' (1 byte, a scale per 256-element block); "
    "a checkpoint saved with fp16 state loads into either, converted"
)


def describe(dtype: torch.dtype | None) -> str:
    """A state dtype in words (``explain()``)."""
    if dtype == Q8:
        return f"8-bit blockwise (dynamic map, {BLOCK}-element blocks, fp32 scale each)"
    return {None: "fp32", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def element_bytes(dtype: torch.dtype | None) -> float:
    """Bytes per element of a state tensor kept in ``dtype`` (8-bit: the code and its share of a scale)."""
    if dtype == Q8:
        return 1 + 4 / BLOCK
    return (dtype or torch.float32).itemsize


def tensor_bytes(numel: int, dtype: torch.dtype | None) -> int:
    """Bytes of one state tensor of ``numel`` elements kept in ``dtype`` (8-bit: codes and scales)."""
    if dtype == Q8:
        return numel + 4 * _blocks(numel)
    return numel * (dtype or torch.float32).itemsize


def chunk_numel(numel: int, dtype: torch.dtype | None) -> int:
    """The fast path's chunk size for state kept in ``dtype``: whole 8-bit blocks (a multiple of
    :data:`BLOCK`), so a parameter cut into pieces is cut between blocks."""
    return -(-numel // BLOCK) * BLOCK if dtype == Q8 else numel


@torch.no_grad()
def conform(state: dict[Any, Any], param: torch.Tensor, dtype: torch.dtype | None) -> None:
    """Bring ``param``'s per-element state to ``dtype`` (8-bit codes and scales, or floating; None
    is fp32) where it is kept otherwise (an optimizer wrapped after it already held state, say bf16
    moments of a torch optimizer that stepped on the bf16 weights): one check per key."""
    target = dtype or torch.float32
    for key in [k for k in state if not is_scale_key(k)]:
        held = state[key]
        if not isinstance(held, torch.Tensor) or held.shape != param.shape or key == "step":
            continue
        if dtype == Q8 and held.dtype != Q8 and held.is_floating_point():
            put(state, key, held.float(), Q8)
        elif dtype != Q8 and held.dtype == Q8 and f"{key}{ABSMAX}" in state:
            state[key] = value(state, key).to(target)
            del state[f"{key}{ABSMAX}"]
        elif dtype != Q8 and held.is_floating_point() and held.dtype != target:
            state[key] = held.to(target)


def signed_key(key: Any) -> bool:
    return str(key) not in _UNSIGNED


def is_scale_key(key: Any) -> bool:
    return isinstance(key, str) and key.endswith(ABSMAX)


def _blocks(numel: int) -> int:
    return -(-numel // BLOCK)


@torch.no_grad()
def put(state: dict[Any, Any], key: Any, value32: torch.Tensor, dtype: torch.dtype | None) -> None:
    """Keep ``value32`` (fp32) as ``state[key]`` in ``dtype``, in the existing tensors where they fit."""
    if dtype != Q8:
        target = dtype or torch.float32
        cur = state.get(key)
        if isinstance(cur, torch.Tensor) and cur.dtype == target and cur.shape == value32.shape:
            cur.copy_(value32)
        else:
            state[key] = value32.to(target, copy=True)
        return
    codes, scales = state.get(key), state.get(f"{key}{ABSMAX}")
    if not (isinstance(codes, torch.Tensor) and codes.dtype == Q8 and codes.shape == value32.shape
            and isinstance(scales, torch.Tensor) and scales.numel() == _blocks(value32.numel())):
        codes = torch.empty(value32.shape, dtype=Q8, device=value32.device)
        scales = torch.empty(_blocks(value32.numel()), dtype=torch.float32, device=value32.device)
        state[key], state[f"{key}{ABSMAX}"] = codes, scales
    quantize_flat(value32.reshape(-1).float(), codes.view(-1), scales, signed_key(key), BLOCK)


def value(state: Mapping[Any, Any], key: Any, out: torch.Tensor | None = None) -> torch.Tensor:
    """``state[key]`` as fp32 (into ``out`` when given)."""
    held = state[key]
    scales = state.get(f"{key}{ABSMAX}") if isinstance(key, str) else None
    if held.dtype == Q8 and scales is not None:
        return dequantize_blockwise(held, scales, signed=signed_key(key), block=BLOCK, out=out)
    if out is None:
        return held.float() if held.dtype != torch.float32 else held
    return out.copy_(held)


def piece_views(
    state: Mapping[Any, Any], key: Any, start: int, end: int, whole: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(codes or values, scales or None) of elements ``start:end`` of ``state[key]`` (a fast-path
    piece: ``start`` is a multiple of :data:`BLOCK` whenever the piece is not the whole tensor)."""
    held = state[key]
    scales = state.get(f"{key}{ABSMAX}") if isinstance(key, str) and held.dtype == Q8 else None
    part = held if whole else held.view(-1)[start:end]
    if scales is None:
        return part, None
    return part, scales[start // BLOCK : _blocks(end)]


def _scales(scales: torch.Tensor | None) -> torch.Tensor:
    if scales is None:
        raise ValueError("an 8-bit optimizer state without its per-block scales ('<key>_absmax')")
    return scales


def _layout(pieces: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> tuple[list[int], int]:
    """The first block of each piece in one padded run of whole blocks, and the run's block count."""
    starts, total = [], 0
    for codes, _ in pieces:
        starts.append(total)
        total += _blocks(codes.numel())
    return starts, total


def expand_pieces(pieces: Sequence[tuple[torch.Tensor, torch.Tensor | None]], keys: Sequence[Any],
                  out: Sequence[torch.Tensor]) -> None:
    """Dequantize each (codes, scales) of ``pieces`` (one state key) into the fp32 ``out`` views:
    the pieces are laid out block-aligned in one run and dequantized at once (a few kernels
    for a whole chunk, not a few per parameter)."""
    starts, total = _layout(pieces)
    device = pieces[0][0].device
    codes = torch.zeros(total * BLOCK, dtype=Q8, device=device)
    spans = [(b * BLOCK, b * BLOCK + c.numel()) for b, (c, _) in zip(starts, pieces, strict=True)]
    torch._foreach_copy_([codes[a:e] for a, e in spans], [c.reshape(-1) for c, _ in pieces])
    scales = torch.cat([_scales(sc) for _, sc in pieces])
    values = dequantize_blockwise(codes, scales, signed=signed_key(keys[0]), block=BLOCK)
    torch._foreach_copy_([o.view(-1) for o in out], [values[a:e] for a, e in spans])


def store_pieces(pieces: Sequence[tuple[torch.Tensor, torch.Tensor | None]], keys: Sequence[Any],
                 values: Sequence[torch.Tensor]) -> None:
    """Quantize the fp32 ``values`` (one state key) into each (codes, scales) of ``pieces``, all at once
    (zero padding between pieces never raises a block's absmax)."""
    starts, total = _layout(pieces)
    device = pieces[0][0].device
    flat = torch.zeros(total * BLOCK, dtype=torch.float32, device=device)
    spans = [(b * BLOCK, b * BLOCK + c.numel()) for b, (c, _) in zip(starts, pieces, strict=True)]
    torch._foreach_copy_([flat[a:e] for a, e in spans], [v.reshape(-1) for v in values])
    codes = torch.empty(total * BLOCK, dtype=Q8, device=device)
    scales = torch.empty(total, dtype=torch.float32, device=device)
    quantize_flat(flat, codes, scales, signed_key(keys[0]), BLOCK)
    torch._foreach_copy_([c.view(-1) for c, _ in pieces], [codes[a:e] for a, e in spans])
    torch._foreach_copy_([_scales(sc) for _, sc in pieces],
                         [scales[b : b + _blocks(c.numel())] for b, (c, _) in zip(starts, pieces, strict=True)])


def is_param_state(key: Any, value: Any, param: torch.Tensor) -> bool:
    """A per-element state tensor of ``param`` (kept in ``state_dtype``); never the step count
    (8-bit codes count too; their per-block scales do not)."""
    if key == "step" or not isinstance(value, torch.Tensor) or value.shape != param.shape:
        return False
    return value.is_floating_point() or value.dtype == Q8


class Held(NamedTuple):
    """One parameter's state during a generic-path step: what the inner optimizer sees (fp32), the
    low-precision tensors it came from (by key), and the 8-bit block scales kept beside them."""

    expanded: dict[Any, Any]
    stored: dict[Any, torch.Tensor]
    scales: dict[Any, torch.Tensor]


def expand_for_step(state: dict[Any, Any], param: torch.Tensor, buffer: Callable[[int], torch.Tensor]) -> Held:
    """``param``'s state expanded for an fp32 step of the inner optimizer: each per-element
    low-precision state into the fp32 scratch ``buffer(slot)`` (8-bit decoded, bf16 cast), the rest as it is."""
    held = Held({}, {}, {})
    for slot, (key, low) in enumerate(list(state.items()), start=2):
        if is_scale_key(key):
            held.scales[key] = low
        elif is_param_state(key, low, param) and low.dtype != torch.float32:
            held.stored[key] = low
            held.expanded[key] = value(state, key, out=buffer(slot)) if low.dtype == Q8 else buffer(slot).copy_(low)
        else:
            held.expanded[key] = low
    return held


def keep_after_step(new: dict[Any, Any], held: Held | None, param: torch.Tensor, dtype: torch.dtype | None,
                    scratch_ptrs: set[int]) -> dict[Any, Any]:
    """The inner optimizer's state after an fp32 step, stored back: into the tensors it was expanded
    from (``held``), state the step created in ``dtype`` (None: as created; copied off the scratch)."""
    stored, scales = (held.stored, held.scales) if held is not None else ({}, {})
    out: dict[Any, Any] = {}
    for key, value32 in list(new.items()):
        if key in stored and stored[key].dtype == Q8:
            kept = {key: stored[key], f"{key}{ABSMAX}": scales[f"{key}{ABSMAX}"]}
            put(kept, key, value32, Q8)
            out.update(kept)
        elif key in stored:
            out[key] = stored[key].copy_(value32)
        elif is_param_state(key, value32, param):
            target = value32.dtype if dtype is None else dtype
            if target == Q8:
                put(out, key, value32, target)  # created by this step
            elif value32.dtype != target or value32.untyped_storage().data_ptr() in scratch_ptrs:
                out[key] = value32.to(target, copy=True)  # created by this step
            else:
                out[key] = value32
        else:
            out[key] = value32
    return out

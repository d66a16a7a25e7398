"""Optimizer state precision between steps: fp32, bf16, or a block-coded byte (fp16 is refused).

The low-precision wrappers keep each per-element state tensor of a low-precision parameter
(Adam's moments, SGD's momentum) in ``state_dtype`` between steps and expand it to fp32 for
the update. The float forms are cast. The block-coded forms (:class:`BlockCodec`, one table:
:data:`BLOCKWISE`) keep one byte per element under the state's own key (shaped like the
parameter) and one fp32 scale per block of :data:`BLOCK` elements under ``key + "_absmax"``:

- ``"8bit"`` (:data:`Q8`): 8-bit blockwise dynamic quantization, as bitsandbytes' and torchao's
  8-bit optimizers (:mod:`mixprec.optim.quant`); signed codes for first moments and momentum,
  unsigned for second moments;
- ``"fp8"`` (:data:`FP8`): e4m3 values scaled to the block's absmax; a second moment keeps its
  square root (e4m3's range then covers the gradients' range, not its square).

One byte per element and 1/64 of a byte per block scale, against 4 (fp32) or 2 (bf16). A new form
is one :class:`BlockCodec` in :data:`BLOCKWISE`, where every route, check and load reads it.

>>> import torch
>>> parse_state_dtype("8bit"), parse_state_dtype("bf16"), parse_state_dtype(None), parse_state_dtype("fp8")
(torch.uint8, torch.bfloat16, None, torch.float8_e4m3fn)
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
from mixprec.optim import quant

__all__ = [
    "ABSMAX",
    "BLOCK",
    "BLOCKWISE",
    "FP8",
    "FP16_REFUSAL",
    "Q8",
    "BlockCodec",
    "Held",
    "block_codec",
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
    """``None`` / ``"fp32"`` / ``"bf16"`` / ``"8bit"`` / ``"fp8"`` (or a torch dtype) as the dtype the state
    is kept in: None for fp32 kept as the inner optimizer makes it, a :class:`BlockCodec`'s dtype for
    a block-coded form. ``"fp16"`` is refused (:data:`FP16_REFUSAL`: it holds neither a small second
    moment nor a large first one)."""
    if value is None:
        return None
    if isinstance(value, str):
        word = value.strip().lower()
        for codec in BLOCKWISE.values():
            if word in codec.spellings:
                return codec.dtype
    if isinstance(value, torch.dtype) and value in BLOCKWISE:
        return value
    try:
        dtype = parse_dtype(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"state_dtype must be {_CHOICES}, got {value!r}") from exc
    if dtype == torch.float16:
        raise ValueError(FP16_REFUSAL)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"state_dtype must be {_CHOICES}, got {value!r}")
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
    codec = block_codec(dtype)
    if codec is not None:
        return codec.words
    return {None: "fp32", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def element_bytes(dtype: torch.dtype | None) -> float:
    """Bytes per element of a state tensor kept in ``dtype`` (block-coded: the code and its share of a scale)."""
    if block_codec(dtype) is not None:
        return 1 + 4 / BLOCK
    return (dtype or torch.float32).itemsize


def tensor_bytes(numel: int, dtype: torch.dtype | None) -> int:
    """Bytes of one state tensor of ``numel`` elements kept in ``dtype`` (block-coded: codes and scales)."""
    if block_codec(dtype) is not None:
        return numel + 4 * _blocks(numel)
    return numel * (dtype or torch.float32).itemsize


def chunk_numel(numel: int, dtype: torch.dtype | None) -> int:
    """The fast path's chunk size for state kept in ``dtype``: whole blocks of a block-coded form (a
    multiple of :data:`BLOCK`), so a parameter cut into pieces is cut between blocks."""
    return -(-numel // BLOCK) * BLOCK if block_codec(dtype) is not None else numel


@torch.no_grad()
def conform(state: dict[Any, Any], param: torch.Tensor, dtype: torch.dtype | None) -> None:
    """Bring ``param``'s per-element state to ``dtype`` (block codes and scales, or floating; None
    is fp32) where it is kept otherwise (an optimizer wrapped after it already held state, say bf16
    moments of a torch optimizer that stepped on the bf16 weights): one check per key."""
    target = dtype or torch.float32
    coding = block_codec(dtype) is not None
    for key in [k for k in state if not is_scale_key(k)]:
        held = state[key]
        if not isinstance(held, torch.Tensor) or held.shape != param.shape or key == "step":
            continue
        coded = is_coded(state, key)
        if coding and not (coded and held.dtype == target) and (coded or held.is_floating_point()):
            put(state, key, value(state, key) if coded else held.float(), target)
        elif not coding and coded:
            state[key] = value(state, key).to(target)
            del state[f"{key}{ABSMAX}"]
        elif not coding and held.is_floating_point() and held.dtype != target:
            state[key] = held.to(target)


def is_coded(state: Mapping[Any, Any], key: Any) -> bool:
    """Whether ``state[key]`` holds block codes (a :class:`BlockCodec`'s dtype, its scales beside it)."""
    held = state.get(key)
    return isinstance(held, torch.Tensor) and held.dtype in BLOCKWISE and f"{key}{ABSMAX}" in state


def signed_key(key: Any) -> bool:
    return str(key) not in _UNSIGNED


def is_scale_key(key: Any) -> bool:
    return isinstance(key, str) and key.endswith(ABSMAX)


def _blocks(numel: int) -> int:
    return -(-numel // BLOCK)


@torch.no_grad()
def put(state: dict[Any, Any], key: Any, value32: torch.Tensor, dtype: torch.dtype | None) -> None:
    """Keep ``value32`` (fp32) as ``state[key]`` in ``dtype``, in the existing tensors where they fit."""
    codec = block_codec(dtype)
    if codec is None:
        target = dtype or torch.float32
        cur = state.get(key)
        if isinstance(cur, torch.Tensor) and cur.dtype == target and cur.shape == value32.shape:
            cur.copy_(value32)
        else:
            state[key] = value32.to(target, copy=True)
        return
    codes, scales = state.get(key), state.get(f"{key}{ABSMAX}")
    if not (isinstance(codes, torch.Tensor) and codes.dtype == codec.dtype and codes.shape == value32.shape
            and isinstance(scales, torch.Tensor) and scales.numel() == _blocks(value32.numel())):
        codes = torch.empty(value32.shape, dtype=codec.dtype, device=value32.device)
        scales = torch.empty(_blocks(value32.numel()), dtype=torch.float32, device=value32.device)
        state[key], state[f"{key}{ABSMAX}"] = codes, scales
    codec.encode(value32.reshape(-1).float(), codes.view(-1), scales, signed_key(key))


def value(state: Mapping[Any, Any], key: Any, out: torch.Tensor | None = None) -> torch.Tensor:
    """``state[key]`` as fp32 (into ``out`` when given)."""
    held = state[key]
    if isinstance(key, str) and is_coded(state, key):
        return BLOCKWISE[held.dtype].decode(held, state[f"{key}{ABSMAX}"], signed_key(key), out)
    if out is None:
        return held.float() if held.dtype != torch.float32 else held
    return out.copy_(held)


def piece_views(
    state: Mapping[Any, Any], key: Any, start: int, end: int, whole: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(codes or values, scales or None) of elements ``start:end`` of ``state[key]`` (a fast-path
    piece: ``start`` is a multiple of :data:`BLOCK` whenever the piece is not the whole tensor)."""
    held = state[key]
    scales = state.get(f"{key}{ABSMAX}") if isinstance(key, str) and held.dtype in BLOCKWISE else None
    part = held if whole else held.view(-1)[start:end]
    if scales is None:
        return part, None
    return part, scales[start // BLOCK : _blocks(end)]


def _scales(scales: torch.Tensor | None) -> torch.Tensor:
    if scales is None:
        raise ValueError("a block-coded optimizer state without its per-block scales ('<key>_absmax')")
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
    device, codec = pieces[0][0].device, BLOCKWISE[pieces[0][0].dtype]
    codes = torch.zeros(total * BLOCK, dtype=codec.dtype, device=device)
    spans = [(b * BLOCK, b * BLOCK + c.numel()) for b, (c, _) in zip(starts, pieces, strict=True)]
    torch._foreach_copy_([codes[a:e] for a, e in spans], [c.reshape(-1) for c, _ in pieces])
    scales = torch.cat([_scales(sc) for _, sc in pieces])
    values = codec.decode(codes, scales, signed_key(keys[0]), None)
    torch._foreach_copy_([o.view(-1) for o in out], [values[a:e] for a, e in spans])


def store_pieces(pieces: Sequence[tuple[torch.Tensor, torch.Tensor | None]], keys: Sequence[Any],
                 values: Sequence[torch.Tensor]) -> None:
    """Quantize the fp32 ``values`` (one state key) into each (codes, scales) of ``pieces``, all at once
    (zero padding between pieces never raises a block's absmax)."""
    starts, total = _layout(pieces)
    device, codec = pieces[0][0].device, BLOCKWISE[pieces[0][0].dtype]
    flat = torch.zeros(total * BLOCK, dtype=torch.float32, device=device)
    spans = [(b * BLOCK, b * BLOCK + c.numel()) for b, (c, _) in zip(starts, pieces, strict=True)]
    torch._foreach_copy_([flat[a:e] for a, e in spans], [v.reshape(-1) for v in values])
    codes = torch.empty(total * BLOCK, dtype=codec.dtype, device=device)
    scales = torch.empty(total, dtype=torch.float32, device=device)
    codec.encode(flat, codes, scales, signed_key(keys[0]))
    torch._foreach_copy_([c.view(-1) for c, _ in pieces], [codes[a:e] for a, e in spans])
    torch._foreach_copy_([_scales(sc) for _, sc in pieces],
                         [scales[b : b + _blocks(c.numel())] for b, (c, _) in zip(starts, pieces, strict=True)])


def is_param_state(key: Any, value: Any, param: torch.Tensor) -> bool:
    """A per-element state tensor of ``param`` (kept in ``state_dtype``); never the step count
    (block codes count too; their per-block scales do not)."""
    if key == "step" or not isinstance(value, torch.Tensor) or value.shape != param.shape:
        return False
    return value.is_floating_point() or value.dtype in BLOCKWISE


class Held(NamedTuple):
    """One parameter's state during a generic-path step: what the inner optimizer sees (fp32), the
    low-precision tensors it came from (by key), and the block scales kept beside them."""

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
            held.expanded[key] = value(state, key, out=buffer(slot)) if is_coded(state, key) else buffer(slot).copy_(low)
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
        if key in stored and f"{key}{ABSMAX}" in scales:
            kept = {key: stored[key], f"{key}{ABSMAX}": scales[f"{key}{ABSMAX}"]}
            put(kept, key, value32, stored[key].dtype)
            out.update(kept)
        elif key in stored:
            out[key] = stored[key].copy_(value32)
        elif is_param_state(key, value32, param):
            target = value32.dtype if dtype is None else dtype
            if block_codec(target) is not None:
                put(out, key, value32, target)  # created by this step
            elif value32.dtype != target or value32.untyped_storage().data_ptr() in scratch_ptrs:
                out[key] = value32.to(target, copy=True)  # created by this step
            else:
                out[key] = value32
        else:
            out[key] = value32
    return out


# ------------------------------------------------------------------ the block-coded forms, one table
class BlockCodec(NamedTuple):
    """A stored form of one byte per element and one fp32 scale per :data:`BLOCK` elements: how it
    becomes fp32 and goes back, eagerly (``encode`` / ``decode`` over flat tensors of whole blocks but
    the last) and inside a compiled loop (``fused_*``, over whole blocks, with the constant ``tables``
    it reads), ``signed`` telling a first moment from a second one (:func:`signed_key`)."""

    name: str
    label: str  # in messages ("8-bit codes")
    dtype: torch.dtype  # its codes' dtype: the state_dtype that stands for it
    spellings: tuple[str, ...]
    words: str  # explain()
    encode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], None]  # (flat fp32, codes, scales, signed)
    decode: Callable[[torch.Tensor, torch.Tensor, bool, torch.Tensor | None], torch.Tensor]  # (codes, scales, signed, out)
    tables: Callable[[torch.device], list[torch.Tensor]]
    fused_load: Callable[[torch.Tensor, torch.Tensor, bool, list[torch.Tensor]], torch.Tensor]
    fused_store: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, list[torch.Tensor], torch.Tensor | None], None]


def block_codec(dtype: torch.dtype | None) -> BlockCodec | None:
    """The :class:`BlockCodec` of state dtype ``dtype`` (None for a float form)."""
    return BLOCKWISE.get(dtype) if dtype is not None else None


def kept(keep: torch.Tensor | None, held: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """What a compiled loop writes into ``held``: ``new``, or ``held`` itself where ``keep`` (a 0-dim
    bool: the step is skipped, decided on the device) is set."""
    return new if keep is None else torch.where(keep, held, new.to(held.dtype))


def _rows(flat: torch.Tensor) -> list[torch.Tensor]:
    """``flat`` as (rows, BLOCK) of its whole blocks and one row of the rest (views)."""
    whole = flat.numel() - flat.numel() % BLOCK
    return [flat[:whole].view(-1, BLOCK)] + ([flat[whole:].view(1, -1)] if whole < flat.numel() else [])


# 8-bit dynamic quantization (mixprec.optim.quant: bitsandbytes' map, an exact nearest-code search)
def q8_tables(device: torch.device) -> list[torch.Tensor]:
    """[signed map, signed lookup, signed points, unsigned map, unsigned lookup, unsigned points]."""
    out = []
    for signed in (True, False):
        out.append(quant.dynamic_map(signed, device))
        out.extend(quant.lookup_tables(signed, device))
    return out


def q8_load(codes: torch.Tensor, scales: torch.Tensor, signed: bool, tables: list[torch.Tensor]) -> torch.Tensor:
    """fp32 values of 8-bit ``codes`` inside a compiled loop (:func:`mixprec.optim.quant.dequantize_blockwise`)."""
    index = torch.arange(codes.numel(), device=codes.device).view(codes.shape) // BLOCK
    return tables[0 if signed else 3][codes.to(torch.int32)] * scales[index]


def q8_store(value: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, signed: bool, tables: list[torch.Tensor],
             keep: torch.Tensor | None = None) -> None:
    """``value`` (whole blocks) quantized into ``codes`` and ``scales`` inside a compiled loop as
    :func:`mixprec.optim.quant.quantize_flat` does (its lookup table and decision points: the same
    codes for the same values)."""
    table, points = tables[1:3] if signed else tables[4:6]
    blocks = value.reshape(-1, BLOCK)
    absmax = blocks.abs().amax(1)
    scaled = blocks / torch.where(absmax > 0, absmax, 1.0).unsqueeze(1)
    run = (scaled.view(torch.int32) >> 16) & 0xFFFF  # the nearest code: quant._nearest_codes
    first = table[run]
    new = (first + (scaled >= points[first]).to(torch.int32)).to(torch.uint8)
    codes.view(-1, BLOCK).copy_(kept(keep, codes.view(-1, BLOCK), new))
    scales.copy_(kept(keep, scales, absmax))


# fp8: e4m3 values of each block scaled to its absmax (a second moment: of its square root)
FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0  # e4m3's largest finite value


def _fp8_codes(rows: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, fp32 scales) of the blocks ``rows`` (the same arithmetic eagerly and compiled)."""
    y = rows if signed else rows.sqrt()
    absmax = y.abs().amax(1)
    return (y / torch.where(absmax > 0, absmax, 1.0).unsqueeze(1) * _FP8_MAX).to(FP8), absmax


def _fp8_values(codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    y = codes.float() * (scales / _FP8_MAX).unsqueeze(1)
    return y if signed else y * y


def _fp8_encode(flat: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> None:
    at = 0
    for rows, part in zip(_rows(flat), _rows(codes), strict=True):
        new, absmax = _fp8_codes(rows, signed)
        part.copy_(new)
        scales[at : at + rows.shape[0]].copy_(absmax)
        at += rows.shape[0]


def _fp8_decode(codes: torch.Tensor, scales: torch.Tensor, signed: bool, out: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device) if out is None else out
    at = 0
    for rows, part in zip(_rows(codes.reshape(-1)), _rows(out.view(-1)), strict=True):
        part.copy_(_fp8_values(rows, scales[at : at + rows.shape[0]], signed))
        at += rows.shape[0]
    return out


def _fp8_store(value: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, signed: bool, tables: list[torch.Tensor],
               keep: torch.Tensor | None = None) -> None:
    new, absmax = _fp8_codes(value.reshape(-1, BLOCK), signed)
    held = codes.view(-1, BLOCK).view(torch.uint8)  # (the skip's select on the bits: inductor has no fp8 where)
    held.copy_(kept(keep, held, new.view(torch.uint8)))
    scales.copy_(kept(keep, scales, absmax))


#: every block-coded state form, by its codes' dtype
BLOCKWISE: dict[torch.dtype, BlockCodec] = {
    codec.dtype: codec for codec in (
        BlockCodec("8bit", "8-bit", Q8, ("8bit", "8-bit", "int8", "q8", "uint8"),
                   f"8-bit blockwise (dynamic map, {BLOCK}-element blocks, fp32 scale each)",
                   lambda flat, codes, scales, signed: quant.quantize_flat(flat, codes, scales, signed, BLOCK),
                   lambda codes, scales, signed, out: quant.dequantize_blockwise(codes, scales, signed=signed, out=out),
                   q8_tables, q8_load, q8_store),
        BlockCodec("fp8", "fp8", FP8, ("fp8", "float8", "e4m3", "fp8-e4m3"),
                   f"fp8 e4m3 blockwise ({BLOCK}-element blocks, fp32 scale each; second moments as square roots)",
                   _fp8_encode, _fp8_decode, lambda device: [],
                   lambda codes, scales, signed, tables: _fp8_values(codes.reshape(-1, BLOCK), scales, signed).view(codes.shape),
                   _fp8_store),
    )
}
_CHOICES = "'fp32', 'bf16' or " + " or ".join(f"'{c.name}'" for c in BLOCKWISE.values()) + " (one byte, blockwise)"

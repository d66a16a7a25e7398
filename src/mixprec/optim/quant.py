"""Compact optimizer state: fp32 masters as bf16 weight + 16-bit remainder, and 8-bit blockwise moments.

Pure tensor functions: :class:`~mixprec.optim.RemainderOptimizer` keeps its masters with the first two.

:func:`split_master` stores an fp32 master as the bf16 weight (torch's round-to-nearest-even cast,
``master.to(torch.bfloat16)`` bit for bit) and an int16 remainder; :func:`join_master` gives the
master back exactly. Read the master's bits as an int32 ``M = H * 2**16 + L`` (``H = M >> 16``,
``0 <= L < 2**16``) and the weight's as an int16 ``W``. Rounding to nearest adds 0 or 1 to the bit
pattern's high half: ``W = H`` when ``L < 0x8000``, ``W = H + 1`` when ``L > 0x8000``, either on a
tie ``L == 0x8000``. This holds for both signs (the sign bit is untouched), +-0, subnormals, a carry
into the next binade and the carry from bf16's largest finite value to inf. ``rem`` is ``L`` read as
an int16, negative exactly when ``L >= 0x8000``, so ``M = (W << 16) + rem`` (int32, ``rem`` sign
extended) except on a tie rounded down (``L == 0x8000``, ``W == H``), where ``M = (W << 16) + 0x8000``:
65537 masters sit next to an even bf16 value and a 16-bit code has 65536. Those elements are kept
apart as an int64 tensor of flat indices (row-major over the tensor's shape), about one per 2**17
random masters and usually empty. The rule needs only round-to-nearest, whatever the tie rule.

- A finite master above bf16's largest value (``0x7F7F8000 <= |M| <= 0x7F7FFFFF``) casts to an
  infinite weight, as torch's cast does, with a negative remainder: the model sees inf, the master
  joins back exactly. Infinite masters join back exactly.
- A NaN master gives a NaN weight and joins back to a NaN; its sign and payload are not kept (torch's
  cast writes its own NaN, 0xFFFF on the CPU's vectorised path).

:func:`quantize_blockwise` stores a tensor (an Adam moment) as uint8 codes and one fp32 absmax per
block of ``block`` consecutive elements (the last block may be partial): each element becomes the
nearest entry of :func:`dynamic_map` to ``x / absmax``, and ``dequantize_blockwise`` gives
``map[code] * absmax``. Use ``signed=True`` for ``exp_avg`` and ``signed=False`` for ``exp_avg_sq``.

>>> import torch
>>> master = torch.randn(1000)
>>> weight, rem, ties = split_master(master)
>>> torch.equal(weight.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
True
>>> torch.equal(join_master(weight, rem, ties).view(torch.int32), master.view(torch.int32))
True
>>> codes, absmax = quantize_blockwise(master, signed=True)
>>> codes.dtype, tuple(absmax.shape), blockwise_nbytes(1000, 256)
(torch.uint8, (4,), 1016)
>>> float((dequantize_blockwise(codes, absmax, signed=True) - master).abs().max()) < 0.01 * float(absmax.max())
True
"""

from __future__ import annotations

import sys
from functools import cache

import torch

__all__ = [
    "blockwise_nbytes",
    "dequantize_blockwise",
    "dynamic_map",
    "join_master",
    "quantize_blockwise",
    "quantize_blockwise_into",
    "quantize_flat",
    "split_master",
    "split_master_into",
]

_LO, _HI = (0, 1) if sys.byteorder == "little" else (1, 0)  # where an int32's 16-bit halves sit in memory
_CHUNK = 1 << 22  # elements quantized at a time: bounds the temporaries


def _tensor(
    fn: str, name: str, t: object, dtype: torch.dtype | None, like: tuple[torch.Size, torch.device] | None = None
) -> torch.Tensor:
    """``t`` checked: a tensor of ``dtype`` (None: any floating dtype), of ``like``'s shape and on its device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}(): {name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is None and not t.is_floating_point():
        raise TypeError(f"{fn}(): {name} must be a floating-point tensor, got {t.dtype}; pass {name}.float()")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{fn}(): {name} must be {dtype}, got {t.dtype}; pass a {dtype} tensor")
    if like is not None and t.shape != like[0]:
        raise ValueError(f"{fn}(): {name} has shape {tuple(t.shape)}, expected {tuple(like[0])}; pass one per element")
    if like is not None and t.device != like[1]:
        raise ValueError(f"{fn}(): {name} is on {t.device}, expected {like[1]}; move it with .to({str(like[1])!r})")
    return t


def _out(fn: str, name: str, t: object, dtype: torch.dtype, like: tuple[torch.Size, torch.device]) -> torch.Tensor:
    """An output tensor checked as :func:`_tensor`, and contiguous (it is written through flat views)."""
    t = _tensor(fn, name, t, dtype, like)
    if not t.is_contiguous():
        raise ValueError(f"{fn}(): {name} must be contiguous; allocate it with torch.empty(shape, dtype={dtype})")
    return t


def _like(t: torch.Tensor) -> tuple[torch.Size, torch.device]:
    return t.shape, t.device


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) 16-bit halves of a contiguous 4-byte tensor, as flat int16 views (no copy)."""
    pairs = t.view(-1).view(torch.int16).view(-1, 2)
    return pairs[:, _LO], pairs[:, _HI]


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``master`` as (bf16 weight, int16 remainder, int64 flat indices of ties rounded down); see the module.

    The weight is ``master.to(torch.bfloat16)`` bit for bit; :func:`join_master` gives ``master`` back.
    """
    master = _tensor("split_master", "master", master, torch.float32)
    weight = torch.empty(master.shape, dtype=torch.bfloat16, device=master.device)
    rem = torch.empty(master.shape, dtype=torch.int16, device=master.device)
    return weight, rem, split_master_into(master, weight, rem)


def split_master_into(master: torch.Tensor, weight_out: torch.Tensor, rem_out: torch.Tensor) -> torch.Tensor:
    """:func:`split_master` into existing contiguous bf16 ``weight_out`` and int16 ``rem_out``; returns the ties.

    ``weight_out`` and ``rem_out`` have ``master``'s shape and must not overlap it.
    """
    fn = "split_master_into"
    master = _tensor(fn, "master", master, torch.float32)
    _out(fn, "weight_out", weight_out, torch.bfloat16, _like(master))
    _out(fn, "rem_out", rem_out, torch.int16, _like(master))
    weight_out.copy_(master)  # torch's round-to-nearest-even cast
    lo, hi = _halves(master.contiguous())
    rem_out.view(-1).copy_(lo)
    tied = (lo == -32768).nonzero().view(-1)  # L == 0x8000, rounded up or down
    return tied[hi[tied] == weight_out.view(-1).view(torch.int16)[tied]]  # rounded down: W == H


def join_master(
    weight: torch.Tensor, rem: torch.Tensor, ties: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The fp32 master that :func:`split_master` split into ``weight``, ``rem`` and ``ties``, bit for bit.

    The low half of each result is ``rem``; the high half is ``W - 1`` where ``rem < 0``, else ``W``
    (that is, ``(W << 16) + rem``), and ``W`` at the flat indices ``ties``. Written into ``out``
    (contiguous fp32, ``weight``'s shape) when given; returns it.
    """
    fn = "join_master"
    weight = _tensor(fn, "weight", weight, torch.bfloat16)
    rem = _tensor(fn, "rem", rem, torch.int16, _like(weight))
    ties = _tensor(fn, "ties", ties, torch.int64)
    if ties.dim() != 1 or ties.device != weight.device:
        raise ValueError(
            f"{fn}(): ties must be the 1-D index tensor split_master returned (on {weight.device}), "
            f"got shape {tuple(ties.shape)} on {ties.device}"
        )
    if out is None:
        out = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    out = _out(fn, "out", out, torch.float32, _like(weight))
    lo, hi = _halves(out)
    lo.copy_(rem.reshape(-1))
    w = weight.reshape(-1).view(torch.int16)
    hi.copy_(w).add_(lo >> 15)  # rem's sign bit, extended: -1 where rem < 0
    hi[ties] = w[ties]
    return out


def _build_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)``, value for value."""
    parts = [torch.tensor([0.0, 1.0])]
    for i in range(7):  # decade (10**(i-6) * 0.1, 10**(i-6)]: the midpoints of n equal steps
        n = 2**i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1, n + 1)
        means = (edges[:-1] + edges[1:]) / 2.0
        parts.append(10 ** (i - 6) * means)
        if signed:
            parts.append(-(10 ** (i - 6)) * means)
    return torch.cat(parts).sort().values


@cache
def _maps(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    qmap = _build_map(signed).to(device)
    return qmap, (qmap[:-1] + qmap[1:]) / 2  # the map and the 255 decision points between its entries


@cache
def _lookup(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(code of the smallest value of each of the 2**16 runs of fp32 values sharing their top 16
    bits, the decision point above each code): the nearest code of ``x`` is ``c + (x >= point[c])``
    with ``c`` the code of ``x``'s run, since no run in [-1, 1] holds two decision points (a run is
    2**-8 of its values wide, the map's entries at least 2**-7 apart relative to theirs; checked)."""
    midpoints = _maps(signed, torch.device("cpu"))[1].double()
    high = torch.arange(1 << 16, dtype=torch.int64)
    ends = torch.stack([(high << 16), (high << 16) | 0xFFFF]).to(torch.int32).view(torch.float32).double()
    low_end, high_end = ends.min(0).values.nan_to_num(0.0), ends.max(0).values.nan_to_num(0.0)
    low_end, high_end = low_end.clamp(-1.0, 1.0), high_end.clamp(-1.0, 1.0)
    first = torch.searchsorted(midpoints, low_end, right=True)
    last = torch.searchsorted(midpoints, high_end, right=True)
    if int((last - first).max()) > 1:  # pragma: no cover - a property of the map, checked once
        raise AssertionError("a run of fp32 values holds two decision points of the 8-bit map")
    points = torch.cat([midpoints, torch.tensor([float("inf")], dtype=torch.float64)]).float()
    return first.to(torch.int32).to(device), points.to(device)


def lookup_tables(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 code of each run of 2**16 fp32 values, fp32 decision point above each code) that
    :func:`quantize_flat` finds the nearest code with; cached, do not write into them."""
    return _lookup(signed, device)


def _nearest_codes(scaled: torch.Tensor, signed: bool) -> torch.Tensor:
    """The nearest code (int32) of each fp32 ``scaled`` value in [-1, 1] (a tie: the larger)."""
    table, points = _lookup(signed, scaled.device)
    run = scaled.view(torch.int32).bitwise_right_shift(16).bitwise_and_(0xFFFF)
    first = torch.index_select(table, 0, run.view(-1)).view(scaled.shape)
    return first.add_(scaled >= torch.index_select(points, 0, first.view(-1)).view(scaled.shape))


def dynamic_map(signed: bool, device: torch.device | str | None = None) -> torch.Tensor:
    """The 256 sorted fp32 values an 8-bit code stands for (times the block's absmax); cached, do not write into it.

    The dynamic (tree) map of bitsandbytes' 8-bit optimizers (Dettmers 2015, 2021), built as its
    ``create_dynamic_map``: 0, 1.0, and for each decade ``d = 10**-6, ..., 10**-1, 1`` the midpoints
    of ``n`` equal steps of ``[0.1 d, d]`` (as a code: the sign bit if signed, a run of zeros counting
    decades down from 1, a 1 marker bit, the rest a linear fraction). Signed: ``n = 1, 2, ..., 64``,
    127 values of each sign; the most negative is -0.99296875, not -1. Unsigned: ``n = 2, 4, ..., 128``,
    254 positive values. Entries within a decade are ``0.9 d / n`` apart: the largest gap is 0.0140625
    (signed) and 0.00703125 (unsigned), and values below about 1e-3 of the absmax lose most digits.
    """
    if not isinstance(signed, bool):
        raise TypeError(f"dynamic_map(): signed must be True or False, got {signed!r}")
    return _maps(signed, torch.device(device if device is not None else "cpu"))[0]


def blockwise_nbytes(numel: int, block: int = 256) -> int:
    """Bytes :func:`quantize_blockwise` keeps for ``numel`` elements: one uint8 code each, 4 per fp32 absmax."""
    _check_block("blockwise_nbytes", block)
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"blockwise_nbytes(): numel must be an int >= 0, got {numel!r}")
    return numel + 4 * -(-numel // block)


def _check_block(fn: str, block: object, signed: object = True) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{fn}(): block must be a positive int, got {block!r}; pass e.g. block=256")
    if not isinstance(signed, bool):
        raise TypeError(f"{fn}(): signed must be True or False, got {signed!r}")
    return block


def _spans(numel: int, block: int) -> list[tuple[int, int, int]]:
    """(first element, end, rows) of each piece: whole blocks, at most about ``_CHUNK`` elements, then the tail."""
    full = numel // block * block
    step = max(1, _CHUNK // block) * block
    spans = [(s, min(s + step, full), (min(s + step, full) - s) // block) for s in range(0, full, step)]
    return [*spans, (full, numel, 1)] if full < numel else spans


def quantize_blockwise(x: torch.Tensor, *, signed: bool, block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes of ``x``'s shape, fp32 absmax of each block): ``x`` flattened in ``block``-long blocks.

    Each element becomes the code nearest ``x / absmax`` in :func:`dynamic_map` (a tie goes to the
    larger value). An all-zero block has absmax 0 and codes that decode to 0; zeros stay exact. A
    block holding inf or NaN gets an inf or NaN absmax (``absmax.isfinite().all()`` detects it) and
    decodes to non-finite values: nothing is raised. ``signed=False`` refuses negative values.
    """
    fn = "quantize_blockwise"
    x = _tensor(fn, "x", x, None)
    _check_block(fn, block, signed)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    absmax = torch.empty(-(-x.numel() // block), dtype=torch.float32, device=x.device)
    quantize_blockwise_into(x, codes, absmax, signed=signed, block=block)
    return codes, absmax


def quantize_blockwise_into(
    x: torch.Tensor, codes_out: torch.Tensor, absmax_out: torch.Tensor, *, signed: bool, block: int = 256
) -> None:
    """:func:`quantize_blockwise` into existing contiguous ``codes_out`` (uint8, ``x``'s shape) and ``absmax_out``.

    ``absmax_out`` is fp32 of shape ``(ceil(x.numel() / block),)``.
    """
    fn = "quantize_blockwise_into"
    x = _tensor(fn, "x", x, None)
    _check_block(fn, block, signed)
    _out(fn, "codes_out", codes_out, torch.uint8, _like(x))
    _out(fn, "absmax_out", absmax_out, torch.float32, (torch.Size([-(-x.numel() // block)]), x.device))
    flat = x.reshape(-1)
    if not signed and bool((flat < 0).any()):
        raise ValueError(f"{fn}(): signed=False needs x >= 0 (exp_avg_sq), got negative values; pass signed=True")
    quantize_flat(flat, codes_out.view(-1), absmax_out, signed, block)


def quantize_flat(flat: torch.Tensor, codes: torch.Tensor, absmax_out: torch.Tensor, signed: bool, block: int) -> None:
    """:func:`quantize_blockwise_into` on flat contiguous tensors, unchecked (the optimizer's hot path:
    the arguments are not validated and ``signed=False`` does not refuse negative values)."""
    for start, end, rows in _spans(flat.numel(), block):
        part = flat[start:end].view(rows, -1).float()
        absmax = absmax_out[start // block : start // block + rows]
        torch.amax(part.abs(), dim=1, out=absmax)
        scaled = part / torch.where(absmax > 0, absmax, 1.0).unsqueeze(1)  # an all-zero block divides by 1
        codes[start:end].copy_(_nearest_codes(scaled.contiguous(), signed).view(-1))


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, *, signed: bool, block: int = 256, out: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 ``dynamic_map(signed)[codes] * absmax`` of each block: the inverse of :func:`quantize_blockwise`.

    ``signed`` and ``block`` must be the ones the codes were made with. Written into ``out``
    (contiguous fp32, ``codes``' shape) when given; returns it.
    """
    fn = "dequantize_blockwise"
    codes = _tensor(fn, "codes", codes, torch.uint8)
    _check_block(fn, block, signed)
    _tensor(fn, "absmax", absmax, torch.float32, (torch.Size([-(-codes.numel() // block)]), codes.device))
    if out is None:
        out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    out = _out(fn, "out", out, torch.float32, _like(codes))
    qmap, flat, values = _maps(signed, codes.device)[0], codes.reshape(-1), out.view(-1)
    for start, end, rows in _spans(flat.numel(), block):
        torch.index_select(qmap, 0, flat[start:end].int(), out=values[start:end])
        values[start:end].view(rows, -1).mul_(absmax[start // block : start // block + rows].unsqueeze(1))
    return out

"""The codecs: how each stored form of a weight or an optimizer state becomes fp32 and goes back.

The update rule (:mod:`mixprec.optim.rule`) runs on fp32 values; this module is where the
stored forms are read into them and written back from them, once per encoding:

- weights: round to nearest, Kahan (weight + compensation), stochastic rounding (16 noise bits
  below a bf16 weight's, truncated) and remainder masters (the bf16 weight, an int16 remainder
  and the sparse list of ties rounded down: :func:`mixprec.optim.quant.join_master`);
- states: fp32, bf16 and 8-bit blockwise (:mod:`mixprec.optim.states`, whose bytes
  :mod:`mixprec.optim.quant` lays out; fp16 state is refused, an fp16 checkpoint converts).

Each comes in the forms its executors need: over a chunk of :class:`~mixprec.optim.fast.Piece`
runs (the eager fast path, a handful of ``_foreach`` kernels; the generic path gives one whole
piece; remainder masters have a one-tensor form too) and inside one loop a compiler fuses
(``fused_*``: the compiled route; the native C kernel is their sanctioned mirror). Stochastic
rounding draws one noise stream on every route (:class:`Noise`): :func:`hash16` of each element's
position in its param group's call XOR a 32-bit seed mixed from a checkpointed call count, so
the routes that step an element give it the same noise bits (the eager stores add it on the CPU
in the native kernel's one-pass loop where that is built, else in torch operations: the same bits).

>>> import torch
>>> from mixprec.optim.fast import Piece
>>> w, comp = torch.ones(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16)
>>> value = torch.tensor([1.0 + 2**-10])  # not a bf16 value
>>> kahan_store([Piece(w, 0, 1)], [value], [comp]); float(w[0]), float(comp[0])
(1.0, 0.0009765625)
>>> out = torch.empty(1); kahan_load([Piece(w, 0, 1)], [out], [comp]); float(out[0]) == 1.0 + 2**-10
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import Any, NamedTuple

import torch

from mixprec.optim import native_build, quant
from mixprec.optim import states as qstates
from mixprec.optim.states import kept, q8_tables

__all__ = [
    "SCREEN", "Noise", "between", "call_noise", "compact_agrees", "compact_codes", "compact_lookup",
    "compact_q8_tables", "flagged", "flat_views", "fused_load_state", "fused_load_weight",
    "fused_remainder_finish", "fused_remainder_inputs", "fused_store_state", "fused_store_weight", "hash16", "hash16_",
    "kahan_load", "kahan_store", "load_state", "nearest_load", "nearest_store", "new_state", "noise_bytes", "positions",
    "remainder_load", "remainder_master", "remainder_split",
    "remainder_store", "same_weight", "screened_nonzero", "seed32", "shift_ties", "stochastic_round",
    "stochastic_store", "ties_of",
]

_TIE_FIX = 1 << 16  # a tie rounded down decodes one bf16 unit low: its bits are 0x10000 higher
#: elements per block of the screens in front of the sparse searches (:func:`screened_nonzero`)
SCREEN = 1024


# ------------------------------------------------------------------ states, eager (chunks of pieces)
def flat_views(shaped: Sequence[Any], device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One flat fp32 buffer and a view of it shaped like each of ``shaped`` (tensors or pieces)."""
    total = sum(p.numel() for p in shaped)
    flat = torch.empty(total, dtype=torch.float32, device=device)
    views, offset = [], 0
    for p in shaped:
        views.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    return flat, views


def load_state(
    pieces: Sequence[Any], states: list[dict[Any, Any]], key: str, device: torch.device
) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], None]]:
    """(fp32 working tensors of ``state[key]`` over ``pieces``, the function that writes them back):
    8-bit codes dequantized (quantized back), bf16 expanded, fp32 state itself."""
    if qstates.is_coded(states[0], key):
        held = [qstates.piece_views(s, key, pc.start, pc.end, pc.whole) for pc, s in zip(pieces, states, strict=True)]
        keys = [key] * len(pieces)
        _, values = flat_views(pieces, device)
        qstates.expand_pieces(held, keys, values)
        return values, lambda new: qstates.store_pieces(held, keys, new)
    low = [pc.of(s[key]) for pc, s in zip(pieces, states, strict=True)]
    if all(t.dtype == torch.float32 for t in low):
        values = low  # updated in place
    else:
        _, values = flat_views(low, device)
        torch._foreach_copy_(values, low)
    return values, lambda new: None if new is low else torch._foreach_copy_(low, new)


def new_state(state: dict[Any, Any], key: str, param: torch.Tensor, dtype: torch.dtype, *, like: bool = True) -> None:
    """A zero state tensor of ``param`` under ``key``, stored in ``dtype`` (block-coded: codes and
    scales; ``like``: laid out as ``param``, else contiguous)."""
    if qstates.block_codec(dtype) is not None or not like:
        qstates.put(state, key, torch.zeros(param.shape, dtype=torch.float32, device=param.device), dtype)
    else:
        state[key] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)


# ---------------------------------------------------------- weights, eager (chunks) and one tensor
def nearest_load(pieces: Sequence[Any], values: list[torch.Tensor]) -> None:
    torch._foreach_copy_(values, [pc.value for pc in pieces])


def nearest_store(pieces: Sequence[Any], values: list[torch.Tensor]) -> None:
    torch._foreach_copy_([pc.value for pc in pieces], values)  # round to nearest even


def kahan_load(pieces: Sequence[Any], values: list[torch.Tensor], comps: list[torch.Tensor]) -> None:
    """weight + compensation (``comps``: each piece's run of its compensation)."""
    torch._foreach_copy_(values, [pc.value for pc in pieces])
    torch._foreach_add_(values, comps)


def kahan_store(pieces: Sequence[Any], values: list[torch.Tensor], comps: list[torch.Tensor]) -> None:
    """The weight rounded to nearest, what rounding dropped into the compensation (``values`` are scratch)."""
    targets = [pc.value for pc in pieces]
    torch._foreach_copy_(targets, values)
    torch._foreach_sub_(values, targets)
    torch._foreach_copy_(comps, values)


class Noise(NamedTuple):
    """The stochastic-rounding noise of one call (one param group's step): element ``i`` of a
    weight gets :func:`hash16` of ``(firsts[id(weight)] + i) ^ seed``, whichever route steps it."""

    seed: int  # 32 bits: :func:`seed32` of the wrapper's call count, the shard index mixed in
    firsts: dict[int, int]  # id(weight) -> the position of its first element in the call


def call_noise(count: int, shard: int, params: Sequence[torch.Tensor]) -> Noise:
    """The :class:`Noise` of call number ``count`` over ``params`` (in the group's order); ``shard``:
    the FSDP2 shard index (0 unsharded), so that shards do not round their element ``i`` alike."""
    firsts, first = {}, 0
    for p in params:
        firsts[id(p)] = first
        first += p.numel()
    return Noise(seed32(count + (shard << 40)), firsts)


def positions(pieces: Sequence[Any], noise: Noise, device: torch.device) -> torch.Tensor:
    """Each element's position in the call, over a chunk of pieces (flat int64)."""
    out = torch.empty(sum(pc.numel() for pc in pieces), dtype=torch.int64, device=device)
    at = 0
    for pc in pieces:
        first = noise.firsts[id(pc.param)] + pc.start
        torch.arange(first, first + pc.numel(), out=out[at : at + pc.numel()])
        at += pc.numel()
    return out


def noise_bytes(device: torch.device) -> int:
    """Scratch bytes per element :func:`stochastic_store` takes on ``device``: none in the native loop
    (the CPU, where the kernel can be built), else int64 positions, their hash's temporary and the bits."""
    return 0 if device.type == "cpu" and native_build.status(build=False)[0] else 20


def stochastic_store(pieces: Sequence[Any], values: list[torch.Tensor], flat: torch.Tensor, noise: Noise) -> None:
    """bf16 weights rounded up or down at random: 16 noise bits (:class:`Noise`) added below the
    kept ones, truncated; ``values`` are consecutive views of ``flat``."""
    lib = native_build.library() if flat.device.type == "cpu" and flat.is_contiguous() else None
    if lib is not None:  # the native kernel's loop: the same bits in one pass
        at = 0
        for pc in pieces:
            lib.mp_sr_bits(flat.data_ptr() + 4 * at, pc.numel(), noise.firsts[id(pc.param)] + pc.start, noise.seed)
            at += pc.numel()
    else:
        wide = max((noise.firsts[id(pc.param)] + pc.start + pc.numel() for pc in pieces), default=0) > 1 << 32
        bits = hash16_(positions(pieces, noise, flat.device).bitwise_xor_(noise.seed), wide=wide)
        flat.view(torch.int32).add_(bits).bitwise_and_(-65536)  # keep the top 16 bits: exactly a bf16 value
    torch._foreach_copy_([pc.value for pc in pieces], values)


def stochastic_round(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 up or down at random, E[result] == x (one tensor)."""
    x = x.to(torch.float32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    bits = (x.view(torch.int32) + noise) & -65536  # keep the top 16 bits: exactly a bf16 value
    return bits.view(torch.float32).to(torch.bfloat16)


def remainder_master(weight: torch.Tensor, rem: torch.Tensor, ties: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The exact fp32 master of a bf16 weight, its int16 remainder and ties (one tensor)."""
    return quant.join_master(weight, rem, ties, out=out)


def remainder_split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bf16 weight, int16 remainder, ties rounded down) of an fp32 master (one tensor)."""
    return quant.split_master(master)


def remainder_load(pieces: Sequence[Any], values: list[torch.Tensor], rems: list[torch.Tensor],
                   ties: list[torch.Tensor]) -> None:
    """The exact fp32 masters: each weight's bits shifted up 16, plus its int16 remainder (``rems``),
    one unit more at its ties rounded down (``ties``: each parameter's, sorted flat indices)."""
    torch._foreach_copy_(values, [pc.value for pc in pieces])  # exact: the weight's bits, shifted up 16
    ints = [v.view(torch.int32) for v in values]
    torch._foreach_add_(ints, rems)  # int16, sign-extended
    for pc, v, t in zip(pieces, ints, ties, strict=True):
        if t.numel():  # rare: most weights have none (no device sync then)
            inside = t if pc.whole else between(t, pc.start, pc.end) - pc.start
            v.view(-1)[inside] += _TIE_FIX


def remainder_store(pieces: Sequence[Any], values: list[torch.Tensor], flat: torch.Tensor,
                    rems: list[torch.Tensor]) -> list[torch.Tensor]:
    """Split the new masters: the weights (round to nearest even), the remainders (into ``rems``,
    flat), and each piece's new ties rounded down (sorted flat indices of its parameter), returned."""
    torch._foreach_copy_([pc.value for pc in pieces], values)  # round to nearest even
    low = torch.empty(flat.numel(), dtype=torch.int16, device=flat.device)
    low.copy_(flat.view(torch.int32))  # int32 -> int16 keeps the low half, bit for bit
    offsets = [0]
    for pc in pieces:
        offsets.append(offsets[-1] + pc.end - pc.start)
    torch._foreach_copy_(rems, [low[offsets[i] : offsets[i + 1]] for i in range(len(pieces))])
    tied = ties_of(flat, low)
    cuts = torch.searchsorted(tied, torch.tensor(offsets, device=tied.device)).tolist() if tied.numel() else None
    return [tied[cuts[i] : cuts[i + 1]] - offsets[i] + pc.start if cuts is not None else tied
            for i, pc in enumerate(pieces)]


def ties_of(flat: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The sorted positions of the fp32 values in ``flat`` exactly halfway between two bf16
    values and rounded down to even: low 17 bits 0x8000. ``low`` holds their low halves (int16).

    A tie's low half is 0x8000, int16's minimum: one block minimum per 1024 elements (a fast
    reduction) screens out nearly every block; only the few left are tested element by element.
    """
    bits = flat.view(torch.int32)
    if flat.device.type != "cpu":  # one nonzero, one host sync per chunk: the screen would cost three
        return ((bits & 0x1FFFF) == 0x8000).nonzero().view(-1)
    whole = low.numel() - low.numel() % SCREEN
    blocks = bits[:whole].view(-1, SCREEN)
    return screened_nonzero(
        low[:whole].view(-1, SCREEN).amin(1) == -32768,
        lambda ids: (blocks[ids] & 0x1FFFF) == 0x8000,
        (bits[whole:] & 0x1FFFF) == 0x8000,
    )


def between(ties: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The sorted ``ties`` in ``[start, end)``."""
    lo, hi = torch.searchsorted(ties, torch.tensor([start, end], device=ties.device)).tolist()
    return ties[lo:hi]


def same_weight(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two bf16 tensors hold the same bits (NaNs of any payload count as the same)."""
    same = a.view(torch.int16) == b.contiguous().view(torch.int16)
    return bool((same | (a.isnan() & b.isnan())).all())


def screened_nonzero(suspects: torch.Tensor, exact: Callable[[torch.Tensor], torch.Tensor],
                     tail: torch.Tensor) -> torch.Tensor:
    """The sorted positions of a sparse property, found without testing every element: ``suspects``
    (one bool per block of :data:`SCREEN` elements, from a cheap block reduction) says which blocks
    may hold one, ``exact(blocks)`` tests those blocks element by element (a (k, SCREEN) bool),
    and ``tail`` is the exact test of the elements after the whole blocks."""
    found = []
    blocks = suspects.nonzero().view(-1)
    if blocks.numel():
        hit = exact(blocks).nonzero()
        found.append(blocks[hit[:, 0]] * SCREEN + hit[:, 1])
    if tail.numel():
        found.append(tail.nonzero().view(-1) + suspects.numel() * SCREEN)
    return torch.cat(found) if found else torch.empty(0, dtype=torch.int64, device=suspects.device)


def flagged(flags: torch.Tensor) -> torch.Tensor:
    """The sorted positions of the nonzero bytes of a flat uint8 ``flags``, nearly all zero: on
    the CPU one block maximum per :data:`SCREEN` elements screens out nearly every block first."""
    if flags.device.type != "cpu":  # one nonzero, one host sync
        return flags.nonzero().view(-1)
    whole = flags.numel() - flags.numel() % SCREEN
    blocks = flags[:whole].view(-1, SCREEN)
    return screened_nonzero(blocks.amax(1) != 0, lambda ids: blocks[ids] != 0, flags[whole:] != 0)


# --------------------------------------------------------------- weights and states, fused (compiled)
def fused_load_weight(rounding: str, p: torch.Tensor, comp: torch.Tensor | None) -> torch.Tensor:
    """The fp32 weight inside a compiled loop: plus the Kahan compensation, or the remainder
    master rebuilt (``comp``: the int16 remainder viewed as bf16, the ties raised before)."""
    if rounding == "remainder":
        assert comp is not None
        low = comp.float().view(torch.int32) >> 16  # sign-extended (bf16 -> fp32 shifts the bits up 16 exactly)
        return (p.float().view(torch.int32) + low).view(torch.float32)
    w = p.float()
    return w + comp.float() if rounding == "kahan" and comp is not None else w


def fused_store_weight(rounding: str, p: torch.Tensor, w: torch.Tensor, comp: torch.Tensor | None,
                       flags: list[torch.Tensor], position: torch.Tensor | None,
                       keep: torch.Tensor | None = None) -> None:
    """The new fp32 weight ``w`` stored inside a compiled loop. Stochastic: 16 noise bits of
    :func:`hash16` of each element's ``position`` (its index in the call XOR the seed).
    Remainder: the weight rounded to nearest even, and ``flags`` (uint8, uint8, int8 shaped like
    ``p``) get whether each element is a tie rounded down and the new remainder's low and high
    byte, for :func:`fused_remainder_finish` (uint8 kernels vectorize, int16 ones do not).
    ``keep``: see :func:`kept` (not for remainders, whose ties the host lists)."""
    if rounding == "stochastic":
        assert position is not None
        p.copy_(kept(keep, p, ((w.view(torch.int32) + hash16(position)) & -65536).view(torch.float32)))
    elif rounding == "remainder":
        assert keep is None, "a remainder step is not masked on the device"
        bits = w.view(torch.int32)
        p.copy_(w.to(p.dtype))  # round to nearest even: bf16-master's weight
        # a tie: low 17 bits 0x8000; (x - 1) >> 31 is -1 (0xFF as a byte) for x == 0, else 0
        # (for 0 <= x < 2**17): a comparison would cost the loop 20x more on the CPU
        flags[0].copy_(((((bits & 0x1FFFF) ^ 0x8000) - 1) >> 31).to(torch.uint8))
        flags[1].copy_((bits & 0xFF).to(torch.uint8))
        flags[2].copy_(((bits << 16) >> 24).to(torch.int8))  # the high byte, sign-extended
    else:
        low = w.to(p.dtype)
        p.copy_(kept(keep, p, low))
        if rounding == "kahan" and comp is not None:
            comp.copy_(kept(keep, comp, w - low.float()))


def shift_ties(p: torch.Tensor, ties: torch.Tensor, units: int) -> None:
    """Raise (``units=1``) or lower (-1) the bf16 weights of ``p`` at the flat indices ``ties`` by
    one unit: a tie rounded down joins one unit low, so the compiled loop needs no list."""
    p.detach().view(torch.int16).view(-1)[ties] += units


def fused_remainder_inputs(rems: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """(the int16 remainders viewed as bf16, whose fp32 conversion inductor vectorizes; the three
    lists of flag tensors :func:`fused_store_weight` writes) for a compiled remainder step."""
    flags = [[torch.empty(r.shape, dtype=dtype, device=r.device) for r in rems]
             for dtype in (torch.uint8, torch.uint8, torch.int8)]
    return [r.view(torch.bfloat16) for r in rems], flags


def fused_remainder_finish(rems: list[torch.Tensor], flags: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """After the compiled loop: each remainder (int16, in place) from its two bytes; returns the new
    ties rounded down of each weight (sorted flat indices)."""
    rems = [r.view(torch.int16) for r in rems]  # high byte * 256 + low byte, in int16
    torch._foreach_copy_(rems, flags[2])
    torch._foreach_mul_(rems, 256)
    torch._foreach_add_(rems, flags[1])
    return [flagged(f.view(-1)) for f in flags[0]]


def fused_load_state(form: str | None, held: torch.Tensor, scales: torch.Tensor | None, signed: bool,
                     tables: list[torch.Tensor]) -> torch.Tensor:
    """A moment as fp32 inside a compiled loop: block codes through their codec (``form``: its name,
    :data:`~mixprec.optim.states.BLOCKWISE`; ``tables``: its constants), a float state cast."""
    if form is None or scales is None:
        return held.float()
    return _codec(form).fused_load(held, scales, signed, tables)


def fused_store_state(form: str | None, value: torch.Tensor, held: torch.Tensor, scales: torch.Tensor | None,
                      signed: bool, tables: list[torch.Tensor], keep: torch.Tensor | None = None) -> None:
    """The new fp32 moment stored inside a compiled loop: by its block codec, or cast; ``keep``: see
    :func:`~mixprec.optim.states.kept`."""
    if form is None or scales is None:
        held.copy_(kept(keep, held, value))
    else:
        _codec(form).fused_store(value, held, scales, signed, tables, keep)


def _codec(form: str) -> qstates.BlockCodec:
    return next(c for c in qstates.BLOCKWISE.values() if c.name == form)


@cache
def compact_q8_tables(e0: int) -> list[torch.Tensor]:
    """[signed map, lookup, points, unsigned map, lookup, points, signed compact lookup, unsigned
    compact lookup] (the native kernel's: see ``COMPACT_E0`` in :file:`native_adam.c`), the compact ones checked
    against the full lookup and decision points at every run's ends and around every point."""
    out = q8_tables(torch.device("cpu"))
    compact = []
    for first, points in (out[1:3], out[4:6]):
        table = compact_lookup(first, points, e0)
        compact_agrees(table, first, points, e0)
        compact.append(table)
    return out + compact


def compact_lookup(first: torch.Tensor, points: torch.Tensor, e0: int) -> torch.Tensor:
    runs = torch.arange(1 << 16, dtype=torch.int64)
    code = first.to(torch.int64)
    point = points[first.long()].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    inside = (point >> 16) == runs  # the decision point above the run's first code lies in the run
    negative = (runs >> 15) == 1
    low = point & 0xFFFF
    threshold = torch.where(inside, torch.where(negative, low ^ 0xFFFF, low), torch.full_like(low, 1 << 16))
    entry = (code | (threshold << 8)).view(2, 256, 128)  # sign, exponent, the top 7 bits of the mantissa
    return entry[:, e0:128].contiguous().view(-1).to(torch.int32)


def compact_codes(table: torch.Tensor, e0: int, x: torch.Tensor) -> torch.Tensor:
    """The codes the compact lookup gives fp32 values ``x`` in [-1, 1] (the kernel's arithmetic)."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    exponent = ((bits >> 23) & 0xFF).clamp(min=e0) - e0
    at = (bits >> 31) * ((128 - e0) * 128) + exponent * 128 + ((bits >> 16) & 0x7F)
    entry = table.to(torch.int64)[at]
    key = (bits & 0xFFFF) ^ torch.where((bits >> 31) == 1, 0xFFFF, 0)
    return (entry & 0xFF) + (key >= (entry >> 8)).to(torch.int64)


def compact_agrees(table: torch.Tensor, first: torch.Tensor, points: torch.Tensor, e0: int) -> None:
    ends = torch.arange(1 << 16, dtype=torch.int64) << 16
    near = points[:-1].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = torch.cat([ends, ends | 0xFFFF, ends | 0x7FFF, near - 1, near, near + 1])
    x = (bits & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    x = x[(x.abs() <= 1.0)]  # the scaled values of a finite block
    expect = first.long()[(x.view(torch.int32).to(torch.int64) >> 16) & 0xFFFF]
    expect = expect + (x >= points[expect]).to(torch.int64)
    if not torch.equal(compact_codes(table, e0, x), expect):  # pragma: no cover - a property of the map
        raise AssertionError("the native kernel's compact 8-bit lookup disagrees with mixprec.optim.quant's")


def seed32(count: int) -> int:
    """A well-mixed 32-bit seed of a call count (splitmix64's finaliser, top 32 bits)."""
    z = (count * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 32


#: the factor a position's high 32 bits are folded into its low ones with (:func:`hash16`)
FOLD = 0x9E3779B1


def hash16(x: torch.Tensor) -> torch.Tensor:
    """16 well-mixed bits of each int64 ``x`` (>= 0, below 2**63: a position XOR a 32-bit seed): its
    high 32 bits times :data:`FOLD` XORed into its low 32 bits (nothing for ``x`` below 2**32), then a
    multiply-xorshift hash of those; products stay below 2**63."""
    x = (x & 0xFFFFFFFF) ^ (((x >> 32) * FOLD) & 0xFFFFFFFF)
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    return (x & 0xFFFF).to(torch.int32)


def hash16_(x: torch.Tensor, *, wide: bool = True) -> torch.Tensor:
    """:func:`hash16` computed in place in ``x`` (int64 scratch): one temporary of ``x``'s size.
    ``wide=False``: the caller knows every ``x`` is below 2**32 (the fold is then skipped)."""
    if wide:
        x.bitwise_xor_((x >> 32).mul_(FOLD))
    x.bitwise_and_(0xFFFFFFFF)
    for shift, factor in ((16, 0x7FEB352D), (15, 0x5BD1E995)):
        x.bitwise_xor_(x >> shift).mul_(factor).bitwise_and_(0xFFFFFFFF)
    x.bitwise_xor_(x >> 16)
    return (x & 0xFFFF).to(torch.int32)

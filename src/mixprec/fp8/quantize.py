"""Quantise to a real torch fp8 dtype: ``x * scale`` -> clamp to ``±fmt_max`` -> ``.to(float8)``.

Finite values beyond the format's range saturate at ``±fmt_max``; ``data.float() * inv_scale``
gives back the dequantised values. The same bytes feed the native fp8 GEMM and the emulated one.

A tensor that holds any inf or NaN is never saturated into range: it quantises to all NaN
(E4M3 has no inf), so whatever is computed from it is NaN too and the overflow cannot pass
unnoticed. Deciding per tensor instead of per element costs no extra pass: the fp8 layer
already has the tensor's amax, and the NaN rides on the multiplication by the scale.

>>> import torch
>>> from mixprec.dtypes import Format
>>> from mixprec.fp8 import quantize
>>> q = quantize(torch.tensor([1.0, 3.0, 1000.0]), torch.tensor(1.0), Format.E4M3)
>>> q.data.dtype, q.dequantize()
(torch.float8_e4m3fn, tensor([  1.,   3., 448.]))
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mixprec.compiling import call_compiled
from mixprec.dtypes import Format
from mixprec.fp8.gemm import widen

__all__ = ["Quantized", "fused_quantize", "quantize", "quantize_with_stats"]


class Quantized(NamedTuple):
    """fp8 ``data`` and the fp32 ``inv_scale`` (1 / scale) that dequantises it."""

    data: torch.Tensor
    inv_scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * inv_scale`` in fp32, then cast to ``dtype``."""
        return (self.data.float() * self.inv_scale).to(dtype)


def _scaled(x: torch.Tensor, scale: torch.Tensor, finite: torch.Tensor | None) -> torch.Tensor:
    """``x * scale`` in fp32 (a new tensor), or all NaN when ``x`` is not finite."""
    if finite is None:
        finite = torch.isfinite(x).all()
    # A 0-dim op: a non-finite tensor is multiplied by NaN, which survives clamp and cast.
    multiplier = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    if x.dtype == torch.float32:
        return x * multiplier
    return x.float().mul_(multiplier)


def quantize(
    x: torch.Tensor, scale: torch.Tensor, fmt: Format, *, finite: torch.Tensor | None = None
) -> Quantized:
    """Quantise ``x`` with an fp32 ``scale`` (a 0-dim tensor) to ``fmt`` (E4M3 or E5M2).

    ``finite`` (a 0-dim bool tensor) says whether every element of ``x`` is finite, when
    the caller knows it already (from the amax); otherwise it is computed here. A
    non-finite ``x`` gives all-NaN data (see the module docstring).

    >>> import torch
    >>> from mixprec.dtypes import Format
    >>> quantize(torch.tensor([1.0, float("inf")]), torch.tensor(1.0), Format.E5M2).dequantize()
    tensor([nan, nan])
    """
    scaled = _scaled(x, scale, finite)
    data = scaled.clamp_(-fmt.max, fmt.max).to(fmt.dtype)  # ``scaled`` is our own temporary
    return Quantized(data, scale.reciprocal())


def quantize_with_stats(
    x: torch.Tensor, scale: torch.Tensor, fmt: Format, *, finite: torch.Tensor | None = None
) -> tuple[Quantized, torch.Tensor]:
    """:func:`quantize`, plus ``tensor([saturation, underflow])`` as fp32 fractions.

    ``saturation``: fraction of all elements whose scaled magnitude exceeded ``fmt_max``
    and was clamped. ``underflow``: fraction of the non-zero elements that became zero.
    Both are computed on the device, without a host sync.

    >>> import torch
    >>> from mixprec.dtypes import Format
    >>> _, s = quantize_with_stats(torch.tensor([1e-9, 1.0, 500.0, 0.0]), torch.tensor(1.0), Format.E4M3)
    >>> s
    tensor([0.2500, 0.3333])
    """
    scaled = _scaled(x, scale, finite)
    # Saturated: counted before the clamp, with two compares and no |x| temporary.
    saturated = torch.count_nonzero(scaled > fmt.max) + torch.count_nonzero(scaled < -fmt.max)
    data = scaled.clamp_(-fmt.max, fmt.max).to(fmt.dtype)  # ``scaled`` is our own temporary
    # Flushed: zero fp8 codes (0x00 and -0 at 0x80) among the non-zero inputs, counted on
    # the one-byte codes rather than on the fp32 values.
    zero_after = torch.count_nonzero((data.view(torch.uint8) & 0x7F) == 0)
    nonzero_before = torch.count_nonzero(x)  # one pass, no boolean temporary
    # clamped: a non-finite tensor becomes NaN codes, so its zero inputs are not zero codes
    flushed = (zero_after - (x.numel() - nonzero_before)).clamp(min=0)
    nonzero = nonzero_before.clamp(min=1)
    stats = torch.stack([saturated / max(x.numel(), 1), flushed / nonzero]).float()
    return Quantized(data, scale.reciprocal()), stats


def _fused(
    x: torch.Tensor, scale: torch.Tensor, finite: torch.Tensor, fmt_max: float, dtype: torch.dtype, stats: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`quantize_with_stats` (or :func:`quantize`) and the fp32 widening, as one kernel."""
    multiplier = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    scaled = x.float() * multiplier
    # a non-finite tensor quantises to the NaN code with the sign bit clear, as eagerly
    data = torch.where(finite, scaled.clamp(-fmt_max, fmt_max), float("nan")).to(dtype)
    wide = data.float()
    if not stats:
        return data, wide, None
    saturated = (scaled > fmt_max).sum() + (scaled < -fmt_max).sum()
    nonzero_before = (x != 0).sum()
    flushed = ((wide == 0).sum() - (x.numel() - nonzero_before)).clamp(min=0)
    fractions = torch.stack([saturated / max(x.numel(), 1), flushed / nonzero_before.clamp(min=1)]).float()
    return data, wide, fractions


def fused_quantize(
    x: torch.Tensor, scale: torch.Tensor, fmt: Format, *, finite: torch.Tensor, stats: bool
) -> tuple[Quantized, torch.Tensor, torch.Tensor | None]:
    """:func:`quantize` (``stats=False``) or :func:`quantize_with_stats`, plus the fp8 values
    widened to fp32 (what the emulated GEMM multiplies), from one compiled kernel.

    The same codes, widened values and statistics as the eager functions, bit for bit,
    in about a fifth of the time on CPU (one pass instead of seven). Runs them instead
    where :func:`mixprec.compiling.call_compiled` does not compile (not a plain CPU
    tensor, or no working compiler: one warning). Shapes are dynamic: one compilation
    serves every layer of a format and input dtype.

    >>> import torch
    >>> x = torch.tensor([[1.0, 3.0, 1000.0, 0.0]])
    >>> q, wide, s = fused_quantize(x, torch.tensor(1.0), Format.E4M3, finite=torch.tensor(True), stats=True)
    >>> wide, s
    (tensor([[  1.,   3., 448.,   0.]]), tensor([0.2500, 0.0000]))
    """
    def eager(
        x: torch.Tensor, scale: torch.Tensor, finite: torch.Tensor, fmt_max: float, dtype: torch.dtype, stats: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if stats:
            q, fractions = quantize_with_stats(x, scale, fmt, finite=finite)
            return q.data, widen(q.data), fractions
        data = quantize(x, scale, fmt, finite=finite).data
        return data, widen(data), None

    data, wide, fractions = call_compiled(
        _fused, x, scale, finite, float(fmt.max), fmt.dtype, stats, eager=eager
    )
    return Quantized(data, scale.reciprocal()), wide, fractions

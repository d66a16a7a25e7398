"""A residual MLP with LayerNorm for low-dimensional inputs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FRAGILE_GAIN", "FRAGILE_OFFSET", "MLP", "FragileMLP", "MLPConfig", "ScaledNormProjection"]


@dataclass(frozen=True)
class MLPConfig:
    """Shape of an :class:`MLP`."""

    in_features: int
    width: int
    num_blocks: int
    num_classes: int


class _ResidualBlock(nn.Module):
    """``x + fc2(gelu(fc1(ln(x))))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


class MLP(nn.Module):
    """Input projection, pre-LN residual blocks, final LayerNorm and a linear head.

    ``forward(x)`` maps ``(B, in_features)`` to logits ``(B, num_classes)``.
    """

    def __init__(self, config: MLPConfig) -> None:
        """Build the layers of ``config``."""
        super().__init__()
        c = config
        self.config = config
        self.embed = nn.Linear(c.in_features, c.width)
        self.blocks = nn.Sequential(*(_ResidualBlock(c.width) for _ in range(c.num_blocks)))
        self.ln_f = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Class logits for a batch of points."""
        return self.head(self.ln_f(self.blocks(self.embed(x))))


class ScaledNormProjection(nn.Module):
    """``layer_norm(linear(x) * gain + offset)`` in one module: the normalisation undoes the
    gain and the offset, so the output is well scaled, but the pre-norm tensor is not.

    With a large ``gain`` (e.g. 2**17, like unscaled attention logits or an energy term)
    the pre-norm values exceed fp16's largest value (65504) and become inf; with a large
    ``offset`` (e.g. 1000, like a constant bias feature) they sit where bf16's spacing
    (4 to 8) is larger than the signal, which the norm's mean subtraction then exposes.
    fp32 computes both exactly enough. Everything is one module (no child modules) so a
    precision diagnosis can point at it and an fp32 island can cover it.
    """

    def __init__(self, width: int, *, gain: float = 1.0, offset: float = 0.0) -> None:
        """A ``width`` x ``width`` projection with its LayerNorm; ``gain`` and ``offset`` are constants."""
        super().__init__()
        bound = 1.0 / math.sqrt(width)
        self.weight = nn.Parameter(torch.empty(width, width).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(width).uniform_(-bound, bound))
        self.norm_weight = nn.Parameter(torch.ones(width))
        self.norm_bias = nn.Parameter(torch.zeros(width))
        self.gain = float(gain)
        self.offset = float(offset)

    def forward(self, x: Tensor) -> Tensor:
        """The normalised projection of ``x``."""
        h = F.linear(x, self.weight, self.bias) * self.gain + self.offset
        return F.layer_norm(h, h.shape[-1:], self.norm_weight, self.norm_bias)

    def extra_repr(self) -> str:
        return f"width={self.weight.shape[0]}, gain={self.gain:g}, offset={self.offset:g}"


class _FragileBlock(nn.Module):
    """``x + out(gelu(proj(ln(x))))`` with a :class:`ScaledNormProjection` as ``proj``."""

    def __init__(self, width: int, *, gain: float = 1.0, offset: float = 0.0) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.proj = ScaledNormProjection(width, gain=gain, offset=offset)
        self.act = nn.GELU()
        self.out = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.out(self.act(self.proj(self.ln(x))))


FRAGILE_GAIN = 2.0**17
"""Gain of the fragile MLP's fp16-overflowing block: its pre-norm values reach ~1e5 > 65504."""
FRAGILE_OFFSET = 1000.0
"""Offset of the fragile MLP's bf16-cancelling block: bf16 spaces values 8 apart there."""


class FragileMLP(MLP):
    """An :class:`MLP` with two numerically fragile blocks after its ordinary ones.

    ``overflow`` (gain :data:`FRAGILE_GAIN`) overflows in fp16 (inf, then NaN loss);
    ``cancel`` (offset :data:`FRAGILE_OFFSET`) loses its signal to bf16 (and part of it to
    fp16) rounding. fp32 trains it normally. It exists to show what
    :func:`mixprec.diagnostics.advise` finds: an fp32 island on each fragile
    ``proj`` brings the plans back within tolerance of fp32.
    """

    def __init__(self, config: MLPConfig) -> None:
        """Build the layers of ``config`` plus the two fragile blocks."""
        super().__init__(config)
        self.overflow = _FragileBlock(config.width, gain=FRAGILE_GAIN)
        self.cancel = _FragileBlock(config.width, offset=FRAGILE_OFFSET)

    def forward(self, x: Tensor) -> Tensor:
        """Class logits for a batch of points."""
        h = self.cancel(self.overflow(self.blocks(self.embed(x))))
        return self.head(self.ln_f(h))

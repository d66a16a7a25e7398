"""A residual MLP with LayerNorm for low-dimensional inputs."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

__all__ = ["MLP", "MLPConfig"]


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

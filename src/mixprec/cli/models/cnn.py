"""A small ResNet-style CNN for 32x32 RGB images."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

__all__ = ["BasicBlock", "ResNet", "ResNetConfig"]


@dataclass(frozen=True)
class ResNetConfig:
    """Shape of a :class:`ResNet`: one stage per width, the first at full resolution."""

    widths: tuple[int, ...]
    blocks_per_stage: int
    num_classes: int = 10
    in_channels: int = 3


def _conv_bn(c_in: int, c_out: int, *, kernel: int = 3, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(c_out),
    )


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a residual connection (projected when shapes change)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        """A block from ``c_in`` to ``c_out`` channels, downsampling by ``stride``."""
        super().__init__()
        self.conv1 = _conv_bn(c_in, c_out, stride=stride)
        self.conv2 = _conv_bn(c_out, c_out)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = (
            _conv_bn(c_in, c_out, kernel=1, stride=stride)
            if stride != 1 or c_in != c_out
            else nn.Identity()
        )

    def forward(self, x: Tensor) -> Tensor:
        """``relu(conv2(relu(conv1(x))) + shortcut(x))``."""
        y = self.conv2(self.relu(self.conv1(x)))
        return self.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    """conv-BN-ReLU stem, residual stages (each after the first halves the resolution),
    global average pooling and a linear head.

    ``forward(images)`` maps ``(B, 3, H, W)`` to logits ``(B, num_classes)``.
    """

    def __init__(self, config: ResNetConfig) -> None:
        """Build the stages of ``config``."""
        super().__init__()
        self.config = config
        c = config
        self.stem = nn.Sequential(_conv_bn(c.in_channels, c.widths[0]), nn.ReLU())
        stages: list[nn.Module] = []
        c_in = c.widths[0]
        for i, width in enumerate(c.widths):
            for j in range(c.blocks_per_stage):
                stride = 2 if i > 0 and j == 0 else 1
                stages.append(BasicBlock(c_in, width, stride))
                c_in = width
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(c_in, c.num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, images: Tensor) -> Tensor:
        """Class logits for a batch of images."""
        x = self.stages(self.stem(images))
        return self.head(self.pool(x).flatten(1))

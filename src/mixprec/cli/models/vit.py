"""A small Vision Transformer for 32x32 RGB images."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mixprec.cli.models.layers import TransformerBlock

__all__ = ["ViT", "ViTConfig"]


@dataclass(frozen=True)
class ViTConfig:
    """Shape of a :class:`ViT`."""

    image_size: int
    patch_size: int
    num_layers: int
    dim: int
    num_heads: int
    num_classes: int = 10
    in_channels: int = 3


class ViT(nn.Module):
    """Conv patch embedding, class token, learned positions, pre-LN encoder blocks,
    final LayerNorm and a linear head on the class token.

    ``forward(images)`` maps ``(B, 3, image_size, image_size)`` to logits
    ``(B, num_classes)``.
    """

    def __init__(self, config: ViTConfig) -> None:
        """Build the layers of ``config``."""
        super().__init__()
        c = config
        if c.image_size % c.patch_size:
            raise ValueError(
                f"ViT: image_size={c.image_size} is not a multiple of patch_size={c.patch_size}"
            )
        self.config = config
        num_patches = (c.image_size // c.patch_size) ** 2
        self.patch_embed = nn.Conv2d(c.in_channels, c.dim, c.patch_size, stride=c.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.dim))
        self.pos_emb = nn.Parameter(0.02 * torch.randn(1, num_patches + 1, c.dim))
        self.blocks = nn.ModuleList(
            TransformerBlock(c.dim, c.num_heads, causal=False) for _ in range(c.num_layers)
        )
        self.ln_f = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.num_classes)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, images: Tensor) -> Tensor:
        """Class logits for a batch of images."""
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, patches, dim)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat((cls, x), dim=1) + self.pos_emb
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x[:, 0]))

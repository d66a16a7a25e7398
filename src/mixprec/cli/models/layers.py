"""Transformer building blocks shared by the GPT and ViT models."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FeedForward", "SelfAttention", "TransformerBlock"]


class SelfAttention(nn.Module):
    """Multi-head self-attention through :func:`torch.nn.functional.scaled_dot_product_attention`."""

    def __init__(self, dim: int, num_heads: int, *, causal: bool) -> None:
        """``dim`` must be a multiple of ``num_heads``; ``causal`` masks future positions."""
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"SelfAttention: dim={dim} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.causal = causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        """Attend over the sequence dimension of ``x`` (batch, seq, dim)."""
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.num_heads, d // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (b, heads, t, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    """Position-wise two-layer MLP with GELU."""

    def __init__(self, dim: int, hidden: int) -> None:
        """Map ``dim`` -> ``hidden`` -> ``dim``."""
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.proj = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the MLP to the last dimension."""
        return self.proj(self.act(self.fc(x)))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, dim: int, num_heads: int, *, mlp_ratio: int = 4, causal: bool) -> None:
        """A block of width ``dim`` with ``num_heads`` heads and an MLP ``mlp_ratio`` wide."""
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, num_heads, causal=causal)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = FeedForward(dim, mlp_ratio * dim)

    def forward(self, x: Tensor) -> Tensor:
        """Apply attention then the MLP, each as a residual branch."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

"""A decoder-only transformer language model (GPT-2 layout) and its token loss."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixprec.cli.models.layers import TransformerBlock

__all__ = ["GPT", "GPTConfig", "TokenCrossEntropy"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`."""

    vocab_size: int
    seq_len: int
    num_layers: int
    dim: int
    num_heads: int
    tie_weights: bool = False


class GPT(nn.Module):
    """Token + learned position embedding, pre-LN causal blocks, final LayerNorm, LM head.

    ``forward(tokens)`` maps int64 tokens ``(B, T)`` with ``T <= seq_len`` to logits
    ``(B, T, vocab_size)``.
    """

    def __init__(self, config: GPTConfig) -> None:
        """Build the layers of ``config`` with GPT-2 style initialisation."""
        super().__init__()
        self.config = config
        c = config
        self.tok_emb = nn.Embedding(c.vocab_size, c.dim)
        self.pos_emb = nn.Embedding(c.seq_len, c.dim)
        self.blocks = nn.ModuleList(
            TransformerBlock(c.dim, c.num_heads, causal=True) for _ in range(c.num_layers)
        )
        self.ln_f = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab_size, bias=False)
        self._init_weights()
        if c.tie_weights:
            self.head.weight = self.tok_emb.weight

    def _init_weights(self) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.config.num_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                std = residual_std if name.endswith(".proj") else 0.02
                nn.init.normal_(module.weight, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: Tensor) -> Tensor:
        """Next-token logits for every position of ``tokens``."""
        if tokens.dim() != 2:
            raise ValueError(f"GPT expects tokens of shape (batch, seq), got {tuple(tokens.shape)}")
        t = tokens.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"GPT: sequence of length {t} exceeds seq_len={self.config.seq_len}")
        positions = torch.arange(t, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class TokenCrossEntropy(nn.Module):
    """Cross-entropy of logits ``(B, T, V)`` against targets ``(B, T)``, averaged over tokens."""

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token loss."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

"""Buffers a skipped step must not change: a snapshot taken at the first forward of a step.

BatchNorm updates its running statistics in forward, before anyone knows whether the
step will be skipped; :class:`BufferGuard` lets the front door undo that.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BufferGuard", "persistent_buffers"]


class BufferGuard:
    """Keeps what a skipped step's forward wrote into persistent buffers from sticking.

    BatchNorm updates its running statistics in forward, before anyone knows whether the
    step will be skipped. The guard copies the model's persistent buffers at the first
    training-mode forward of each step (a forward pre-hook on the prepared model) and
    copies them back when the step is skipped. Models without persistent buffers get no hook.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._saved: list[torch.Tensor] = []
        self._taken = False
        self._module: torch.nn.Module | None = None

    def install(self, prepared: torch.nn.Module, inner: torch.nn.Module) -> None:
        buffers = [b for _, b in persistent_buffers(inner)]
        if not buffers:
            return
        self._buffers = buffers
        self._module = inner
        prepared.register_forward_pre_hook(self._pre_forward)

    @torch.compiler.disable
    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._taken or self._module is None or not self._module.training:
            return
        with torch.no_grad():
            if len(self._saved) != len(self._buffers) or any(
                s.shape != b.shape or s.dtype != b.dtype or s.device != b.device
                for s, b in zip(self._saved, self._buffers, strict=True)
            ):
                self._saved = [b.detach().clone() for b in self._buffers]
            else:
                for s, b in zip(self._saved, self._buffers, strict=True):
                    s.copy_(b)
        self._taken = True

    def restore(self) -> None:
        if not self._taken:
            return
        with torch.no_grad():
            for s, b in zip(self._saved, self._buffers, strict=True):
                b.copy_(s)

    def commit(self) -> None:
        self._taken = False


def persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = []
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for name, buf in module.named_buffers(recurse=False):
            if buf is None or name in skip or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append((f"{mod_name}.{name}" if mod_name else name, buf))
    return out

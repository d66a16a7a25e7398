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
    training-mode forward of each step and copies them back when the step is skipped.
    The forward pre-hooks sit on the modules that own persistent buffers, so the snapshot
    is taken however the model is called (a framework's training step often calls
    submodules directly, never the root); a compiled model gets one hook on the compiled
    wrapper instead (hooks inside a compiled graph would break it). Models without
    persistent buffers get no hook.
    """

    def __init__(self) -> None:
        # (module, name): looked up at every snapshot, so buffers a framework replaced after
        # prepare() (``model.to(device)``) are the ones guarded
        self._slots: list[tuple[torch.nn.Module, str]] = []
        self._saved: list[torch.Tensor] = []
        self._taken = False

    def install(self, prepared: torch.nn.Module, inner: torch.nn.Module) -> None:
        owners = dict(inner.named_modules())
        self._slots = [(owners[qual.rpartition(".")[0]], qual.rpartition(".")[2]) for qual, _ in persistent_buffers(inner)]
        if not self._slots:
            return
        if prepared is not inner:  # torch.compile's wrapper: its own hooks run eagerly
            prepared.register_forward_pre_hook(self._pre_forward)
            return
        for module in {id(m): m for m, _ in self._slots}.values():
            module.register_forward_pre_hook(self._pre_forward)

    def _buffers(self) -> list[torch.Tensor]:
        return [getattr(module, name) for module, name in self._slots]

    @torch.compiler.disable
    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._taken or not module.training:
            return
        buffers = self._buffers()
        with torch.no_grad():
            if len(self._saved) != len(buffers) or any(
                s.shape != b.shape or s.dtype != b.dtype or s.device != b.device
                for s, b in zip(self._saved, buffers, strict=True)
            ):
                self._saved = [b.detach().clone() for b in buffers]
            else:
                torch._foreach_copy_(self._saved, buffers)
        self._taken = True

    def restore(self) -> None:
        if not self._taken:
            return
        with torch.no_grad():
            torch._foreach_copy_(self._buffers(), self._saved)

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

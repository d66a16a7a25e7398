"""Buffers a skipped step must not change: a snapshot taken at the first forward of a step.

BatchNorm updates its running statistics in forward, before anyone knows whether the
step will be skipped; :class:`BufferGuard` lets the front door undo that.

The guard belongs to one run (one :class:`~mixprec.MixedPrecision`: it snapshots at the
first forward of each of its steps and restores when that step is skipped). A copy of
the prepared model (``copy.deepcopy``, an EMA or evaluation copy; ``torch.save`` then
``torch.load``) is no part of that run: its forward pre-hooks copy and pickle as a no-op,
so the copy takes no snapshots, holds none of the run's, and updates its own statistics
as any module does.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.compiling import eager_only

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
        hook = _Snapshot(self)
        if prepared is not inner:  # torch.compile's wrapper: its own hooks run eagerly
            prepared.register_forward_pre_hook(hook)
            return
        for module in {id(m): m for m, _ in self._slots}.values():
            module.register_forward_pre_hook(hook)

    def _buffers(self) -> list[torch.Tensor]:
        return [getattr(module, name) for module, name in self._slots]

    def _snapshot(self) -> None:
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

    def restore_where(self, skip: torch.Tensor) -> None:
        """:meth:`restore` where ``skip`` (a 0-dim 0/1 tensor on the device) is 1, without reading it."""
        if not self._taken:
            return
        with torch.no_grad():
            keep = skip.to(torch.bool)
            for buffer, saved in zip(self._buffers(), self._saved, strict=True):
                buffer.copy_(torch.where(keep.to(buffer.device), saved, buffer))

    def commit(self) -> None:
        self._taken = False


# Pickled models name _unguarded_hook: keep its name.
class _Snapshot:
    """The forward pre-hook :meth:`BufferGuard.install` registers: the guard's snapshot at the
    first training-mode forward of a step. A copy or pickle of the model gets
    :func:`_unguarded` (a no-op) in its place: the guard is the run's, not the copy's."""

    __slots__ = ("guard",)

    def __init__(self, guard: BufferGuard) -> None:
        self.guard = guard

    @eager_only
    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        guard = self.guard
        if guard._taken or not module.training:
            return
        guard._snapshot()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unguarded_hook, ())


def _unguarded(module: torch.nn.Module, args: Any) -> None:
    """What a copy of a prepared model runs where the original snapshots its buffers: nothing."""


def _unguarded_hook() -> Any:
    return _unguarded


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

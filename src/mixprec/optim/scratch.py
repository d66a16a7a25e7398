"""Per-step scratch tensors without per-step host work: views of one flat buffer, made once.

A step that needs a temporary tensor per parameter (the fp32 gradients of fp32 masters, the
copies an undo keeps) would allocate one tensor per parameter per step: host work, and one
kernel launch or allocator call each, that grows with the model. :class:`FlatViews` makes the
views once (one flat buffer per device and dtype, a view per tensor) and keeps them while the
tensors they stand for keep their shapes; its memory is held only while in use: between
steps the flat buffers' storage is resized to zero bytes (the views stay valid objects, as
FSDP keeps its unsharded parameters), and the next :meth:`FlatViews.take` gives it back.

>>> import torch
>>> scratch = FlatViews()
>>> a, b = scratch.take([torch.zeros(2, 3), torch.zeros(4)])
>>> a.shape, b.shape, a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
(torch.Size([2, 3]), torch.Size([4]), True)
>>> scratch.release(); a.untyped_storage().nbytes()
0
>>> c, d = scratch.take([torch.zeros(2, 3), torch.zeros(4)]); c is a
True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["FlatViews", "int_views"]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class FlatViews:
    """Views shaped like a list of tensors, in one flat buffer per (device, dtype); see the module."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype  # the views' dtype (None: each tensor's own)
        self._key: tuple[tuple[torch.Size, torch.device, torch.dtype], ...] | None = None
        self._views: list[torch.Tensor] = []
        self._flats: list[torch.Tensor] = []

    def take(self, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Views shaped (and placed) like ``like``: the same ones as last time when the shapes
        are, with their memory allocated again (its contents are undefined)."""
        key = tuple((t.shape, t.device, self.dtype or t.dtype) for t in like)
        if key != self._key:
            self._build(key)
        for flat in self._flats:
            storage = flat.untyped_storage()
            wanted = flat.numel() * flat.element_size()
            if storage.nbytes() != wanted:
                storage.resize_(wanted)
        return self._views

    def _build(self, key: tuple[tuple[torch.Size, torch.device, torch.dtype], ...]) -> None:
        places: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, (_, device, dtype) in enumerate(key):
            places.setdefault((device, dtype), []).append(i)
        views: list[torch.Tensor] = [torch.empty(0)] * len(key)
        flats = []
        for (device, dtype), where in places.items():
            sizes = [key[i][0].numel() for i in where]
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            for i, part in zip(where, torch.split(flat, sizes), strict=True):
                views[i] = part.view(key[i][0])
            flats.append(flat)
        self._key, self._views, self._flats = key, views, flats

    def release(self) -> None:
        """Free the memory (the views stay, zero bytes behind them, until the next :meth:`take`)."""
        for flat in self._flats:
            flat.untyped_storage().resize_(0)

    def held_bytes(self) -> int:
        """Bytes allocated now."""
        return sum(flat.untyped_storage().nbytes() for flat in self._flats)


def int_views(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's bits as an integer tensor of its element size (a view; a 0-dim tensor as one
    element): exact integer arithmetic on any dtype's bit patterns."""
    out = []
    for t in tensors:
        flat = t.reshape(1) if t.dim() == 0 else t
        out.append(flat.view(_BITS[t.element_size()]))
    return out

"""Accounting live tensor storages: every storage an op creates, until it is freed.

A ``TorchDispatchMode`` sees each op's outputs; a finaliser on each storage notices when
it is freed. This works on any device, including CPUs, which have no allocator
high-water mark.

>>> import torch
>>> live = LiveStorages()
>>> with live.tracking():
...     x = torch.ones(256)  # 1 KiB
...     y = x * 2            # 1 KiB more
...     del x, y
>>> live.peak, live.live
(2048, 0)
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["LiveStorages"]


class LiveStorages:
    """Counts the bytes of live tensor storages: registered ones plus every storage an
    op creates while the dispatch mode is active; freed ones are noticed by finalisers."""

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self.dynamic: set[int] = set()

    def _free(self, key: int) -> None:
        size = self.sizes.pop(key, 0)
        self.live -= size
        self.dynamic.discard(key)

    def add(self, t: torch.Tensor, *, dynamic: bool) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        size = storage.nbytes()
        old = self.sizes.get(key)
        if old is None:
            self.sizes[key] = size
            self.live += size
            if dynamic:
                self.dynamic.add(key)
            weakref.finalize(storage, self._free, key)
        elif size > old:  # resized in place
            self.sizes[key] = size
            self.live += size - old
        if self.live > self.peak:
            self.peak = self.live

    def dynamic_bytes(self) -> int:
        return sum(self.sizes[k] for k in self.dynamic if k in self.sizes)

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.device.type != "meta":
                        tracker.add(t, dynamic=True)
                return out

        real_resize = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:  # scratch kept as views, resized (FlatViews)
            out = real_resize(storage, size)
            tracker._resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        try:
            with _Mode():
                yield
        finally:
            torch.UntypedStorage.resize_ = real_resize  # type: ignore[method-assign]

    def _resized(self, storage: torch.UntypedStorage) -> None:
        """A storage resized in place: its new size counts (a new one from now on, if unseen)."""
        key = storage._cdata
        size = storage.nbytes()
        old = self.sizes.get(key)
        if old is None:
            if size:
                self.sizes[key] = size
                self.live += size
                self.dynamic.add(key)
                weakref.finalize(storage, self._free, key)
        else:
            self.sizes[key] = size
            self.live += size - old
        self.peak = max(self.peak, self.live)

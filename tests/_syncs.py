"""Counting (or refusing) what a step reads back from the device, on any machine.

On a GPU, a host read of a device value (``.item()``, ``bool(t)``, ``.tolist()``, ``.cpu()``,
a data-dependent shape as ``nonzero``) waits for every kernel queued before it: the CPU's
run-ahead drains and the GPU idles while the host launches what comes next. On a CPU these
are free, and CPU tensors serve ``tolist``/``item``/``__bool__`` without the dispatcher, so
this module counts both: aten ops that read back (``_local_scalar_dense``, ``item``,
``nonzero``, ``equal``, ``is_nonzero``) through a ``TorchDispatchMode``, and the Python-level
reads by patching ``torch.Tensor``'s methods. What mixprec copies to the host on purpose,
one step late (:func:`mixprec.lagged.is_host_copy`), is not a device read and is not counted.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READ_OPS = ("_local_scalar_dense", "item", "nonzero", "equal", "is_nonzero")
_METHODS = ("tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "item")


def _host_copy(t: torch.Tensor) -> bool:
    try:
        from mixprec.lagged import is_host_copy
    except ImportError:  # pragma: no cover - before the lagged outcome existed
        return False
    return is_host_copy(t)


class SyncCounter(TorchDispatchMode):
    """Counts device reads (``counts``: by name; ``where``: the first stack of each) and aten ops
    (``ops``); with ``strict``, the first read raises ``AssertionError`` naming it."""

    def __init__(self, strict: bool = False) -> None:
        super().__init__()
        self.strict = strict
        self.counts: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()
        self.where: dict[str, str] = {}
        self.depth = 0  # inside a patched method: its own aten read is the same read

    def read(self, name: str) -> None:
        self.counts[name] += 1
        stack = "".join(traceback.format_stack(limit=16)[:-2])
        self.where.setdefault(name, stack)
        if self.strict:
            raise AssertionError(f"a host read of a device value ({name}) inside the guarded step:\n{stack}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name in READ_OPS and self.depth == 0 and not any(
            _host_copy(a) for a in args if isinstance(a, torch.Tensor)
        ):
            self.read(name)
        return func(*args, **(kwargs or {}))

    @property
    def reads(self) -> int:
        return sum(self.counts.values())


@contextlib.contextmanager
def count_syncs(strict: bool = False) -> Iterator[SyncCounter]:
    """Count (``strict``: refuse) the device reads of the code inside."""
    counter = SyncCounter(strict)
    originals = {name: getattr(torch.Tensor, name) for name in _METHODS}

    def patched(name: str):  # type: ignore[no-untyped-def]
        real = originals[name]

        def method(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            if counter.depth == 0 and not _host_copy(self):
                counter.read(f"Tensor.{name}")
            counter.depth += 1
            try:
                return real(self, *args, **kwargs)
            finally:
                counter.depth -= 1

        return method

    for name in _METHODS:
        setattr(torch.Tensor, name, patched(name))
    try:
        with counter:
            yield counter
    finally:
        for name, real in originals.items():
            setattr(torch.Tensor, name, real)


class LateReads:
    """Refuses a read of a lagged host copy (:class:`mixprec.lagged.HostCopy`) in the step that made
    it, from the ``warmup + 1``-th step on. A copy is free to read one step later (its copy has long
    finished); read in its own step, right after it was enqueued, it waits for the device on a GPU.
    :func:`count_syncs` does not count such a read (it is a host copy), so a framework's hook that
    asks for the step's outcome at once passes there and is caught here. ``guard(new_step=True)``
    wraps an optimizer step, ``guard()`` what follows it within the same step (a scheduler's step);
    reads outside the guards (a checkpoint, the end of training) are allowed."""

    def __init__(self, monkeypatch, warmup: int = 3) -> None:  # type: ignore[no-untyped-def]
        from mixprec.lagged import HostCopy

        self.step, self.calls, self.warmup, self._inside = 0, 0, warmup, False
        made: dict[int, int] = {}  # id(host copy) -> the step that made it
        init, values = HostCopy.__init__, HostCopy.values

        def making(copy, tensor):  # type: ignore[no-untyped-def]
            init(copy, tensor)
            made[id(copy)] = self.step

        def reading(copy):  # type: ignore[no-untyped-def]
            if self._inside and self.step > warmup and made.get(id(copy)) == self.step and copy._values is None:
                raise AssertionError(f"step {self.step} read the host copy it made (a wait for the device)")
            return values(copy)

        monkeypatch.setattr(HostCopy, "__init__", making)
        monkeypatch.setattr(HostCopy, "values", reading)

    @contextlib.contextmanager
    def guard(self, new_step: bool = False) -> Iterator[None]:
        """Also refuse every device read inside (:func:`count_syncs`, strict), after the warm-up."""
        self.calls += 1
        self.step += new_step
        self._inside = True
        try:
            with count_syncs(strict=self.step > self.warmup):
                yield
        finally:
            self._inside = False

    def wrap(self, fn, new_step: bool = False):  # type: ignore[no-untyped-def]
        """``fn`` run inside :meth:`guard`."""

        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            with self.guard(new_step):
                return fn(*args, **kwargs)

        return call

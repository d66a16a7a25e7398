"""Device values the host learns one step late, when reading them is free.

A host read of a device value (``.item()``, ``bool(t)``, ``.tolist()``) waits for every kernel
queued before it: on a GPU the CPU's run-ahead drains and the GPU idles while the host
launches what comes next. A step's outcome (skipped or not, the gradient norm, the new loss
scale) is needed on the host only for bookkeeping (the LR scheduler, counters, logs), which can
wait one step. :class:`HostCopy` enqueues a copy of a few values into host memory right after
they are computed (pinned memory and a CUDA event on a GPU: no wait) and reads them later;
by then the copy has long finished, so the read does not wait for the device's later work.

>>> import torch
>>> copy = HostCopy(torch.tensor([0.0, 2.5]))
>>> copy.values()
[0.0, 2.5]
>>> is_host_copy(copy.tensor)
True
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["HostCopy", "host_float", "host_floats", "is_host_copy"]

_HOST_COPIES: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()  # by id


def is_host_copy(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the host memory of a :class:`HostCopy`: reading it reads the host,
    not the device (the sync counters of the tests skip it)."""
    return _HOST_COPIES.get(id(tensor)) is tensor


def host_float(tensor: Any) -> float:
    """The value of a one-element tensor kept in host memory by design, whatever device the model is
    on (the step counts of torch's non-fused optimizers and of mixprec's low-precision wrappers: CPU
    tensors beside parameters on any device): reading it waits for no device, so the sync counters
    skip it. A Python number is returned as a float; a tensor on a device (a fused optimizer's
    state loaded beside its parameters) is read from there, a wait the counters see."""
    if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
        _HOST_COPIES[id(tensor)] = tensor
    return float(tensor)


def host_floats(tensors: Sequence[Any]) -> list[float]:
    """:func:`host_float` of each, in one read where they are one-element tensors alike (the step
    counts of many weights)."""
    try:
        stacked = torch.stack(list(tensors)).reshape(-1)
    except (RuntimeError, TypeError):  # numbers, other shapes or devices: one by one
        return [host_float(t) for t in tensors]
    if stacked.numel() != len(tensors):
        return [host_float(t) for t in tensors]
    if stacked.device.type == "cpu":
        _HOST_COPIES[id(stacked)] = stacked
    return [float(v) for v in stacked.tolist()]


class HostCopy:
    """A copy of a small 1-D tensor in host memory, enqueued now and read later.

    On CUDA the copy goes into pinned memory without waiting and a CUDA event marks its end:
    :meth:`values` then waits for that event only, long done by the next step. On the CPU it
    is an ordinary copy. Elsewhere (an accelerator without events) the copy waits for the
    device, once, when it is made.
    """

    __slots__ = ("_event", "_values", "tensor")

    def __init__(self, values: torch.Tensor) -> None:
        flat = values.detach().reshape(-1)
        self._event: torch.cuda.Event | None = None
        self._values: list[float] | None = None
        if flat.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # a step being captured in a CUDA graph (mixprec.graphs): nothing runs now, so there is
            # nothing to copy; every replay copies its own outcome after it ran
            host = torch.full(flat.shape, float("nan"), dtype=flat.dtype)
            self._values = [float("nan")] * flat.numel()
        elif flat.device.type == "cuda":
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(flat.device))  # the stream the copy was queued on
        else:
            host = flat.to("cpu", copy=True)
        _HOST_COPIES[id(host)] = host
        self.tensor = host

    def ready(self) -> bool:
        """Whether :meth:`values` would return without waiting."""
        return self._event is None or self._values is not None or bool(self._event.query())

    def values(self) -> list[float]:
        """The copied values (waits for the copy only: it was enqueued right after they were computed)."""
        if self._values is None:
            if self._event is not None and not self._event.query():  # (done by the next step: no wait at all)
                self._event.synchronize()
            self._values = [float(v) for v in self.tensor.tolist()]
        return self._values

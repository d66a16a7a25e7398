"""DDP communication hook that reduces gradients in a plan's reduce dtype, counting what it sends.

Two paths, chosen by the reduce dtype:

- **32/64-bit** (the default, fp32): the bucket is cast to the reduce dtype (a no-op
  for fp32 gradients), divided by the world size and all-reduced, then copied back
  into the bucket. This is what DDP does by default, in the dtype the plan names.
- **16-bit** (bf16 / fp16): each rank sends its gradients in the reduce dtype, but
  the sum is accumulated in fp32 on receipt. A plain 16-bit all-reduce would round
  every partial sum to 16 bits (gloo and NCCL add in the tensor's dtype: on two gloo
  ranks, ``1 + 2**-8`` in bf16 all-reduces to ``1.0``). Instead the hook runs the
  two halves of a ring all-reduce itself: an all-to-all hands rank ``r`` the ``r``-th
  chunk of every rank's 16-bit bucket (reduce-scatter), rank ``r`` adds them in fp32
  and rounds the sum once, and an all-gather returns the 16-bit chunks to every rank.
  Both collectives only move data, so the bytes on the wire are exactly those of a
  16-bit all-reduce (half of fp32), and every rank receives bit-identical gradients.

Gradients are divided by the world size before they are cast (as torch's
``fp16_compress_hook`` does), so a sum of large fp16 gradients does not overflow
on the way.

>>> import torch
>>> hook = GradReduceHook(torch.bfloat16)
>>> hook.stats.calls, hook.reduce_dtype
(0, torch.bfloat16)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from mixprec.dtypes import dtype_name
from mixprec.process_groups import resolve_group, world_size

__all__ = ["GradReduceHook", "ReduceStats", "run_hook"]

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


@dataclass
class ReduceStats:
    """What a :class:`GradReduceHook` has reduced on this rank since the last :meth:`reset`.

    Attributes:
        calls: hook invocations (one per DDP bucket per synchronised backward; none on
            ``no_sync`` micro-batches).
        elements: gradient elements reduced.
        payload_bytes: ``elements`` times the reduce dtype's size: the gradient as it
            is communicated.
        wire_bytes: bytes this rank sends to its peers, for a ring all-reduce
            (``2 (n - 1)`` chunks of ``1/n`` of the bucket) and for the all-to-all
            plus all-gather of the 16-bit path (the same count).
    """

    calls: int = 0
    elements: int = 0
    payload_bytes: int = 0
    wire_bytes: int = 0

    def reset(self) -> None:
        """Set every counter back to zero."""
        self.calls = self.elements = self.payload_bytes = self.wire_bytes = 0

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict."""
        return asdict(self)


class GradReduceHook:
    """A DDP communication hook: average gradients across ranks in ``reduce_dtype``.

    Args:
        reduce_dtype: dtype the gradients are communicated in (fp32, fp64, bf16, fp16).
        process_group: group to reduce over (default: the DDP model's group, or the
            default group).

    Register it with :func:`mixprec.distributed.wrap_ddp` (which does it for you), or
    directly: ``ddp_model.register_comm_hook(hook, run_hook)``.
    """

    def __init__(self, reduce_dtype: torch.dtype = torch.float32, process_group: Any = None) -> None:
        if not isinstance(reduce_dtype, torch.dtype) or not reduce_dtype.is_floating_point:
            raise TypeError(f"reduce_dtype must be a floating torch.dtype, got {reduce_dtype!r}")
        if reduce_dtype.itemsize < 2:
            raise ValueError(
                f"gradients cannot be reduced in {dtype_name(reduce_dtype)}: an 8-bit gradient needs "
                "per-tensor scales; use bf16 or fp32 as the plan's reduce_dtype"
            )
        self.reduce_dtype = reduce_dtype
        self.process_group = process_group
        self.stats = ReduceStats()

    def __repr__(self) -> str:
        return f"GradReduceHook(reduce_dtype={dtype_name(self.reduce_dtype)})"

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        group = resolve_group(self.process_group)
        n = world_size(group)
        self._count(buf.numel(), n)
        if group is None or n == 1:
            return _completed(buf)
        if self.reduce_dtype in _SIXTEEN_BIT:
            return self._exchange(buf, n, group)
        return self._all_reduce(buf, n, group)

    def _count(self, numel: int, n: int) -> None:
        size = self.reduce_dtype.itemsize
        chunk = -(-numel // n)
        s = self.stats
        s.calls += 1
        s.elements += numel
        s.payload_bytes += numel * size
        s.wire_bytes += 2 * (n - 1) * chunk * size

    def _all_reduce(self, buf: torch.Tensor, n: int, group: Any) -> torch.futures.Future[torch.Tensor]:
        if buf.dtype == self.reduce_dtype:
            tensor = buf.div_(n)
        else:
            tensor = buf.to(self.reduce_dtype).div_(n)
        fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()  # type: ignore[union-attr]

        def finish(f: torch.futures.Future[Any]) -> torch.Tensor:
            out = f.value()[0]
            if out is not buf:
                buf.copy_(out)
            return buf

        return fut.then(finish)

    def _exchange(self, buf: torch.Tensor, n: int, group: Any) -> torch.futures.Future[torch.Tensor]:
        numel = buf.numel()
        chunk = -(-numel // n)
        send = torch.zeros(chunk * n, dtype=self.reduce_dtype, device=buf.device)
        send[:numel].copy_(torch.div(buf.to(torch.float32), n))
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        # Row k holds rank k's copy of this rank's chunk: add them in fp32, round once.
        reduced = received.view(n, chunk).to(torch.float32).sum(dim=0).to(self.reduce_dtype)
        gathered = torch.empty_like(send)
        _all_gather_single(gathered, reduced, group)
        buf.copy_(gathered[:numel])
        return _completed(buf)


def run_hook(state: GradReduceHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The ``hook`` to pass to ``DistributedDataParallel.register_comm_hook`` with a :class:`GradReduceHook` as state."""
    return state(bucket)


# DDP checks the annotations as objects; postponed evaluation (PEP 563) left strings.
run_hook.__annotations__ = {
    "state": GradReduceHook,
    "bucket": getattr(dist, "GradBucket", Any),  # absent from builds without torch.distributed
    "return": torch.futures.Future[torch.Tensor],
}


def _completed(buf: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    devices: list[torch.device | str | int] | None = [buf.device] if buf.device.type == "cuda" else None
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=devices)
    fut.set_result(buf)
    return fut


def _all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    gather = getattr(dist, "all_gather_single", None)  # torch >= 2.13; older: all_gather_into_tensor
    if gather is None:
        gather = dist.all_gather_into_tensor
    gather(output, input, group=group)

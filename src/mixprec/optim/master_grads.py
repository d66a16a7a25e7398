"""Moving gradients between a low-precision model and its fp32 masters.

:class:`MasterGrads` is the gradient half of :class:`~mixprec.optim.MasterWeightOptimizer`:
it gathers the model parameters' low-precision ``.grad`` into the masters' fp32 ``.grad``
at step time, adds micro-batches up in fp32 buffers between steps, and shows the masters'
gradients in the model again for a framework that clips ``model.parameters()``.

>>> import torch
>>> p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
>>> m = torch.nn.Parameter(torch.ones(3))
>>> grads = MasterGrads()
>>> grads.add_pair(p, m)
>>> p.grad = torch.full((3,), 0.5, dtype=torch.bfloat16)
>>> grads.accumulate(); p.grad = torch.full((3,), 0.25, dtype=torch.bfloat16)
>>> grads.prepare(); m.grad
tensor([0.7500, 0.7500, 0.7500])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mixprec.optim.footprint import nbytes
from mixprec.optim.scratch import FlatViews
from mixprec.optim.shards import is_dtensor, local_of, wrap_like

__all__ = ["MasterGrads"]


def _placed_as(g: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``g`` placed as ``ref`` (a DTensor gradient whose placement differs from its parameter's,
    e.g. a partial sum, is redistributed once: a collective over the mesh); else ``g``."""
    if is_dtensor(g) and is_dtensor(ref):
        dt: Any = g
        if tuple(dt.placements) != tuple(ref.placements):  # type: ignore[attr-defined]
            return dt.redistribute(ref.device_mesh, ref.placements)  # type: ignore[attr-defined,no-any-return]
    return g


def _foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """One foreach copy over this rank's parts (DTensors of tensor parallelism by their local
    shards: DTensor has no rule for a list mixing them with plain tensors)."""
    torch._foreach_copy_([local_of(t) for t in dst], [local_of(t) for t in src])


def _foreach_add_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    torch._foreach_add_([local_of(t) for t in dst], [local_of(t) for t in src])


@dataclass
class _Gathered:
    """What :meth:`MasterGrads.prepare` read for one parameter."""

    grad: torch.Tensor | None  # the model gradient it read (None: there was none)
    grad_version: int
    master_version: int  # version of the master's .grad right after the gather
    accumulated: bool  # the master grad includes fp32-accumulated micro-batches


class MasterGrads:
    """The gradients of (model parameter, fp32 master) pairs: gathered, accumulated, published."""

    def __init__(self) -> None:
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        self._acc: list[torch.Tensor | None] = []
        self._gathered: list[_Gathered] | None = None
        self._scratch = FlatViews(torch.float32)  # the masters' fp32 gradients: views made once

    def add_pair(self, param: torch.nn.Parameter, master: torch.nn.Parameter) -> None:
        """Track one more model parameter and its master."""
        self.pairs.append((param, master))
        self._acc.append(None)

    def reorder(self, position: dict[int, int]) -> None:
        """Sort the pairs (with what is kept per pair) by ``position[id(master)]``."""
        order = sorted(range(len(self.pairs)), key=lambda i: position.get(id(self.pairs[i][1]), len(position)))
        self.pairs[:] = [self.pairs[i] for i in order]
        self._acc[:] = [self._acc[i] for i in order]
        if self._gathered is not None:
            self._gathered = [self._gathered[i] for i in order]

    @property
    def gathered(self) -> bool:
        """Whether :meth:`prepare` ran since the last :meth:`release`."""
        return self._gathered is not None

    def accumulation_bytes(self) -> int:
        """Bytes of the fp32 buffers holding accumulated micro-batches now."""
        return sum(nbytes(a) for a in self._acc if a is not None)

    @torch.no_grad()
    def prepare(self) -> None:
        """Gather the model's gradients into the masters' fp32 ``.grad`` (see
        :meth:`~mixprec.optim.MasterWeightOptimizer.prepare_grads`)."""
        if self._gathered is not None:
            self._regather_changed()
            return
        read: list[tuple[torch.Tensor | None, bool]] = []
        dense_src: list[torch.Tensor] = []
        dense_dst: list[torch.Tensor] = []
        flat: list[torch.nn.Parameter] = []  # masters whose gradient is a view of the step's flat scratch
        flat_src: list[torch.Tensor] = []
        acc_dst: list[torch.Tensor] = []
        acc_src: list[torch.Tensor] = []
        for i, (p, m) in enumerate(self.pairs):
            g, acc = p.grad, self._acc[i]
            if g is not None:
                g = _placed_as(g, m)
            self._acc[i] = None
            if g is None:
                m.grad = acc
            elif acc is not None:
                m.grad = acc
                if g.is_sparse:
                    acc.add_(g.to(torch.float32))
                else:
                    acc_dst.append(acc)
                    acc_src.append(g)
            elif g.is_sparse:
                m.grad = g.to(torch.float32)
            elif m.is_contiguous():
                flat.append(m)
                flat_src.append(g)
            else:
                m.grad = torch.empty_like(m, memory_format=torch.preserve_format)
                dense_dst.append(m.grad)
                dense_src.append(g)
            read.append((p.grad, acc is not None))
        if flat:  # the same views every step while the same masters have gradients: no per-parameter work
            views = self._scratch.take([local_of(m) for m in flat])  # (a DTensor master: its local shard)
            for m, grad in zip(flat, self._wrapped(flat, views), strict=True):
                m.grad = grad
            dense_dst, dense_src = [*views, *dense_dst], [*flat_src, *dense_src]
        if dense_dst:
            _foreach_copy_(dense_dst, dense_src)
        if acc_dst:
            _foreach_add_(acc_dst, acc_src)
        self._gathered = [self._record(i, g, accumulated) for i, (g, accumulated) in enumerate(read)]

    def _wrapped(self, masters: list[torch.nn.Parameter], views: list[torch.Tensor]) -> list[torch.Tensor]:
        """The scratch ``views`` as the masters' gradients: plain views as they are, and for DTensor
        masters (tensor parallelism) DTensors over them, made once while the views stay."""
        if not any(map(is_dtensor, masters)):
            return views
        cached = getattr(self, "_wrappers", None)
        if cached is None or len(cached[0]) != len(views) or any(a is not b for a, b in zip(cached[0], views, strict=True)):
            cached = (list(views), [wrap_like(v, m) if is_dtensor(m) else v for v, m in zip(views, masters, strict=True)])
            self._wrappers = cached
        return cached[1]

    def _record(self, i: int, grad: torch.Tensor | None, accumulated: bool) -> _Gathered:
        master_grad = self.pairs[i][1].grad
        return _Gathered(
            grad=grad,
            grad_version=-1 if grad is None else grad._version,
            master_version=-1 if master_grad is None else master_grad._version,
            accumulated=accumulated,
        )

    def _regather_changed(self) -> None:
        gathered = self._gathered
        if gathered is None:
            raise RuntimeError("nothing was gathered yet: call prepare() first")
        for i, (p, m) in enumerate(self.pairs):
            rec = gathered[i]
            g = p.grad
            if g is rec.grad and (g is None or g._version == rec.grad_version):
                continue  # unchanged since the gather: the master gradient is the truth
            master_version = -1 if m.grad is None else m.grad._version
            if rec.accumulated or master_version != rec.master_version:
                where = "fp32-accumulated micro-batches" if rec.accumulated else "the master gradient was modified"
                raise RuntimeError(
                    f"the model gradient of a {tuple(p.shape)} parameter changed after prepare_grads() although "
                    f"{where} since: the two disagree. Modify gradients on one side only: either "
                    "before prepare_grads() in the model's .grad, or after it in the optimizer's "
                    "param_groups (the fp32 masters); or call publish_grads() after changing the masters"
                )
            m.grad = None if g is None else _placed_as(g, m).to(torch.float32, copy=True)
            gathered[i] = self._record(i, g, False)

    @torch.no_grad()
    def publish(self) -> None:
        """Copy the masters' fp32 gradients back into the model's ``.grad`` (rounded to its dtype)."""
        if self._gathered is None:
            self.prepare()
        gathered = self._gathered
        if gathered is None:  # pragma: no cover - prepare() always records
            raise RuntimeError("prepare() recorded nothing")
        dst, src = [], []
        for p, m in self.pairs:
            if m.grad is None:
                p.grad = None
            elif (m.grad.is_sparse or p.grad is None or p.grad.is_sparse or p.grad.shape != p.shape
                  or local_of(p.grad).shape != local_of(m.grad).shape):
                p.grad = m.grad.to(p.dtype)
            else:
                dst.append(p.grad)
                src.append(m.grad)
        if dst:
            _foreach_copy_(dst, src)
        for i, (p, _) in enumerate(self.pairs):
            gathered[i] = self._record(i, p.grad, False)

    @torch.no_grad()
    def accumulate(self) -> None:
        """Add the model's low-precision gradients into fp32 buffers and free them."""
        if self._gathered is not None:
            raise RuntimeError(
                "accumulate_grads() called after prepare_grads() in the same step; accumulate every "
                "micro-batch first, then prepare_grads() / step() once at the accumulation boundary"
            )
        add_dst, add_src = [], []
        for i, (p, m) in enumerate(self.pairs):
            g = p.grad
            if g is None:
                continue
            acc = self._acc[i]
            g = _placed_as(g, m)
            if acc is None:
                self._acc[i] = g.to(torch.float32, copy=True)
            elif g.is_sparse or acc.is_sparse:
                self._acc[i] = acc + g.to(torch.float32)
            else:
                add_dst.append(acc)
                add_src.append(g)
            p.grad = None
        if add_dst:
            _foreach_add_(add_dst, add_src)

    def release(self) -> None:
        """Free the masters' gradients and the accumulation buffers (after a step, on zero_grad)."""
        for _, m in self.pairs:
            m.grad = None
        self._scratch.release()
        self._acc = [None] * len(self.pairs)
        self._gathered = None

    def __getstate__(self) -> dict[str, object]:
        state = {**self.__dict__, "_scratch": FlatViews(torch.float32)}  # (a copy makes its own views)
        state.pop("_wrappers", None)
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update({"_scratch": FlatViews(torch.float32), **state})

"""The forward hooks of an :class:`~mixprec.tracing.OverflowTracer`, one :class:`Site` per module.

A copy or a pickle of a traced model is not traced: its sites are :data:`UNTRACED`. Pickles
name :func:`untraced_site` as ``mixprec.tracing._untraced_site`` (its name before this
module was split out; :mod:`mixprec.tracing` still holds it, and ``_Site`` and
``_Untraced``, under their earlier names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec.nested import floating_tensors, shard_local
from mixprec.tracing.records import BWD_IN, BWD_OUT, FWD_IN, FWD_OUT

if TYPE_CHECKING:
    from mixprec.tracing import OverflowTracer

__all__ = ["UNTRACED", "Site", "Untraced", "untraced_site"]


class Site:
    """One :class:`OverflowTracer` at one module of the traced model; its bound methods
    :meth:`pre` and :meth:`post` are the module's forward hooks (as fast as closures, and
    picklable).

    The tracer belongs to the run that reads it (the front door resets it at each step), so
    a copy of the model (``copy.deepcopy``, ``torch.save`` then ``torch.load``) is not
    traced: a site copies and pickles as :data:`UNTRACED`, whose tracer is idle, and the
    original's tracer never sees the copy's calls. (Tensor hooks on parameters are dropped
    by torch's own copies and pickles.)
    """

    __slots__ = ("index", "tracer")

    def __init__(self, tracer: OverflowTracer | Untraced, index: int) -> None:
        self.tracer: OverflowTracer = tracer  # type: ignore[assignment]  # Untraced: idle, never past the checks
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        return (untraced_site, ())

    def pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        tracer, index = self.tracer, self.index
        if index == 0 and tracer._reported:
            tracer.reset()  # a finding was handed out: this forward starts the next step
        if tracer._idle or not tracer.backward or not torch.is_grad_enabled():
            return
        call = tracer._calls[index]
        for t in floating_tensors(args):
            if t.requires_grad:
                t.register_hook(tracer._grad_hook(index, BWD_IN, call))

    def inputs(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The model's floating inputs, positional and keyword: a NaN or +inf there is the data's
        (-inf alone is not counted: additive attention masks hold it by design)."""
        tracer = self.tracer
        if tracer._reported:
            tracer.reset()  # a finding was handed out: this forward starts the next step
        if tracer._idle:
            return
        for t in floating_tensors((args, kwargs)):
            t = shard_local(t)  # (a DTensor input: this rank's shard)
            try:
                largest = t.detach().amax() if t.numel() else None
            except (RuntimeError, NotImplementedError):  # a dtype without a reduction kernel (fp8)
                largest = None
            if largest is not None:
                tracer._records.append((0, FWD_IN, tracer._calls[0], t.dtype, largest))
        if len(tracer._records) >= tracer.max_records:
            tracer._resolve()

    def post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        tracer, index = self.tracer, self.index
        if tracer._idle:
            return
        call = tracer._calls[index]
        tracer._calls[index] = call + 1
        for t in floating_tensors(output):
            tracer._record(index, FWD_OUT, call, t)
            if tracer.backward and t.requires_grad:
                t.register_hook(tracer._grad_hook(index, BWD_OUT, call))


class Untraced:
    """Stands for the tracer in a copy of a traced model: idle, so the hooks return at once."""

    __slots__ = ()
    _reported = False
    _idle = True
    backward = False


UNTRACED = Site(Untraced(), -1)


def untraced_site() -> Site:
    return UNTRACED


# Pickles of traced models name this function: under its earlier name, where it still is.
untraced_site.__module__, untraced_site.__qualname__ = "mixprec.tracing", "_untraced_site"

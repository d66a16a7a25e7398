"""Casting a model's inputs to a plan's dtype, and the fp32 originals that islands read.

Plans without autocast (bf16-pure, fp16-pure) compute with low-precision weights, so the
model's floating inputs must arrive in that dtype: :func:`cast_inputs` casts a batch (a
nest of tensors; integer and bool tensors such as token ids stay as they are), and
:class:`InputCast` is the forward pre-hook that does it for a model
(:func:`mixprec.islands.install_input_cast` installs it). Each cast tensor can be recorded
with the tensor it came from, so that an fp32 island fed that input directly computes with
the unrounded value (:func:`fp32_inputs`; 1e5 stays 1e5 under fp16, not inf).

The hooks hold the dtype, nothing else: ``copy.deepcopy(model)`` and a pickled model
(``torch.save``) cast their inputs the same way. Pickles name :class:`InputCast` and
:func:`end_input_cast`: keep the names.

>>> import torch
>>> from mixprec.inputs import cast_inputs
>>> x, ids = cast_inputs((torch.ones(2), torch.arange(2)), torch.bfloat16)
>>> x.dtype, ids.dtype
(torch.bfloat16, torch.int64)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from mixprec.nested import map_tensors

__all__ = ["InputCast", "cast_inputs", "end_input_cast", "fp32_inputs", "input_originals", "original_of"]

# A table maps id(cast tensor) -> (cast tensor, the input it was cast from); the stack holds
# the tables of the casts in force (a model's forward, a framework's step).
_Originals = dict[int, tuple[torch.Tensor, torch.Tensor]]


class _InputOriginals(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Originals] = []


_INPUT_ORIGINALS = _InputOriginals()


def original_of(t: torch.Tensor) -> torch.Tensor:
    for table in reversed(_INPUT_ORIGINALS.stack):
        hit = table.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
    return t


def fp32_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The inputs with their floating tensors in fp32 (float64 kept); tensors an input cast
    produced are replaced by the inputs they were cast from (fp32 values, not rounded)."""

    def to_fp32(t: torch.Tensor) -> torch.Tensor:
        if _INPUT_ORIGINALS.stack:
            t = original_of(t)
        if t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
            return t.to(torch.float32)
        return t

    return map_tensors(to_fp32, args), {k: map_tensors(to_fp32, v) for k, v in kwargs.items()}


def cast_inputs(value: Any, dtype: torch.dtype, originals: _Originals | None = None) -> Any:
    """``value`` (a batch, a nest of tensors) with its floating tensors cast to ``dtype``.

    Integer and bool tensors (token ids, masks) are left as they are; float64 is cast too.
    With ``originals``, each cast tensor is recorded there with the tensor it came from, so
    that an fp32 island it reaches while :func:`input_originals` holds the table gets the
    unrounded value.
    """

    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.dtype != dtype:
            low = t.to(dtype)
            if originals is not None:
                originals[id(low)] = (low, t)
            return low
        return t

    return map_tensors(cast, value)


@contextlib.contextmanager
def input_originals(originals: _Originals) -> Iterator[None]:
    """Inside, fp32 islands that receive a tensor recorded by :func:`cast_inputs` get the
    input it was cast from (a framework casts a batch before its step: an island fed that
    batch directly sees 1e5, not fp16's inf)."""
    _INPUT_ORIGINALS.stack.append(originals)
    try:
        yield
    finally:
        _INPUT_ORIGINALS.stack.pop()


# Pickled models name InputCast, end_input_cast, _new_island and _call_island: keep the names.
class InputCast:
    """Its bound :meth:`before` is the forward pre-hook :func:`install_input_cast` registers
    (as fast as a closure, and picklable): casts the floating inputs to :attr:`dtype` and
    records their originals for the islands (until :func:`end_input_cast`, the forward hook
    registered with it, runs).

    It holds only the dtype, never the model: ``copy.deepcopy(model)`` and ``torch.save(model)``
    carry it, and the copy casts its own inputs as the original does.
    """

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        table: _Originals = {}
        _INPUT_ORIGINALS.stack.append(table)
        dtype = self.dtype
        return cast_inputs(args, dtype, table), cast_inputs(kwargs, dtype, table)

    def __reduce__(self) -> tuple[Any, ...]:
        return (InputCast, (self.dtype,))

    def __repr__(self) -> str:
        return f"InputCast({self.dtype})"


def end_input_cast(module: nn.Module, args: Any, output: Any) -> None:
    """The forward hook :func:`install_input_cast` registers (always called): the model's
    forward is over, its table of originals leaves the stack."""
    if _INPUT_ORIGINALS.stack:
        _INPUT_ORIGINALS.stack.pop()

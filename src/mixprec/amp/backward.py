"""Autograd re-entry: running ``backward()`` with a policy mode still on the stack.

A ``TorchFunctionMode`` is popped while its handler runs, and ``Tensor.backward`` /
``torch.autograd.backward`` dispatch to modes first: so ``backward()`` called under
the mode would start the autograd engine with the mode gone, and the engine carries
the mode stack it starts with into backward (checkpoint recomputation, ``custom_bwd``
code). The mode therefore starts the engine itself, with itself pushed again
(:func:`backward_with_mode`); :class:`~mixprec.amp.context.autocast_backward` is the
user-facing context built on it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["BACKWARD_ENTRY_NAMES", "backward_with_mode"]

#: The Python-level names under which ``backward()`` reaches a TorchFunctionMode.
BACKWARD_ENTRY_NAMES = frozenset({"backward"})


def _plain_tensors(values: tuple[Any, ...]) -> bool:
    return all(type(v) in (torch.Tensor, torch.nn.Parameter) for v in values)


def backward_with_mode(mode: TorchFunctionMode, func: Any, args: Any, kwargs: Any) -> Any:
    """Run ``Tensor.backward`` / ``torch.autograd.backward`` with ``mode`` on the stack.

    Falls back to calling ``func`` (the mode then sits out backward) for arguments
    this does not handle: tensor subclasses, the deprecated ``grad_variables``, or a
    PyTorch without the helpers used here.
    """
    make_grads = getattr(torch.autograd, "_make_grads", None)
    to_tuple = getattr(torch.autograd, "_tensor_or_tensors_to_tuple", None)
    run_engine = getattr(torch.autograd.graph, "_engine_run_backward", None)
    try:
        if func is torch.Tensor.backward:
            bound = _signature(func).bind(*args, **kwargs)
            a = bound.arguments
            tensors, grads = a["self"], a.get("gradient")
        elif func is torch.autograd.backward:
            bound = _signature(func).bind(*args, **kwargs)
            a = bound.arguments
            if a.get("grad_variables") is not None:
                raise TypeError("grad_variables")
            tensors, grads = a["tensors"], a.get("grad_tensors")
        else:
            raise TypeError(func)
        retain_graph, create_graph = a.get("retain_graph"), a.get("create_graph", False)
        inputs = a.get("inputs")
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        if inputs is None:
            inputs_tuple: tuple[Any, ...] = ()
        elif isinstance(inputs, torch.Tensor):
            inputs_tuple = (inputs,)
        elif isinstance(inputs, list | tuple):
            inputs_tuple = tuple(inputs)
        else:
            raise TypeError(inputs)
        if (
            make_grads is None
            or to_tuple is None
            or run_engine is None
            or (not inputs_tuple and inputs is not None)
            or not _plain_tensors(tensors + inputs_tuple)
        ):
            raise TypeError("unsupported")
    except TypeError:
        return func(*args, **kwargs)
    grad_tensors = make_grads(tensors, to_tuple(grads, len(tensors)), is_grads_batched=False)
    if retain_graph is None:
        retain_graph = create_graph
    with mode:
        run_engine(
            tensors,
            grad_tensors,
            retain_graph,
            create_graph,
            inputs_tuple,
            allow_unreachable=True,
            accumulate_grad=True,
        )
    return None


@functools.cache
def _signature(func: Any) -> inspect.Signature:
    return inspect.signature(func)  # read once per backward entry point, not per backward

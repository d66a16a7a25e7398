"""The persistent training state of a prepared model and its optimizer, by tensor class.

The optimizer tells its own facts: a mixprec wrapper (any
:class:`~mixprec.optim.WrappedOptimizer`, also one a new plan brings) through its
:meth:`~mixprec.optim.WrappedOptimizer.state_bytes`,
:meth:`~mixprec.optim.WrappedOptimizer.state_tensors` and
:meth:`~mixprec.optim.WrappedOptimizer.step_transient_bytes` hooks; a plain torch
optimizer is sized generically (:mod:`mixprec.optim.footprint`). Nothing here knows a
wrapper class or an optimizer class by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics import _args as check
from mixprec.diagnostics.memory.results import STATE_CLASSES
from mixprec.optim import WrappedOptimizer
from mixprec.optim.footprint import (
    nbytes,
    optimizer_state_bytes,
    state_tensors,
    unique_tensors,
    update_transient_bytes,
)

__all__ = [
    "WRAPPER_CLASSES",
    "OptimizerSpec",
    "optimizer_factory",
    "optimizer_tensors",
    "state_bytes",
    "step_transient_bytes",
    "training_state_bytes_per_param",
]

OptimizerSpec = str | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

#: the classes an optimizer wrapper's ``state_bytes()`` may report
WRAPPER_CLASSES: tuple[str, ...] = ("master_weights", "grad_accumulation", "optimizer_state", "compensation")

_OPTIMIZERS: dict[str, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}


def optimizer_factory(optimizer: OptimizerSpec) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """``params -> optimizer`` for a name (``"adamw"``, ``"adam"``, ``"sgd"``, ``"sgd-momentum"``) or a callable."""
    if callable(optimizer):
        return optimizer
    if not isinstance(optimizer, str):
        raise TypeError(
            f"optimizer must be one of {', '.join(repr(k) for k in _OPTIMIZERS)} or a callable params -> "
            f"torch.optim.Optimizer, got {optimizer!r} ({type(optimizer).__name__}); pass e.g. optimizer='adamw'"
        )
    if isinstance(optimizer, str):
        key = optimizer.strip().lower().replace("_", "-")
        if key in _OPTIMIZERS:
            return _OPTIMIZERS[key]
    raise ValueError(
        f"unknown optimizer {optimizer!r}; expected one of {', '.join(repr(k) for k in _OPTIMIZERS)} "
        "or a callable params -> torch.optim.Optimizer"
    )


def _wrapper_bytes(optimizer: WrappedOptimizer) -> dict[str, int]:
    reported = optimizer.state_bytes()
    if not isinstance(reported, dict):
        raise TypeError(
            f"{type(optimizer).__name__}.state_bytes() returned a {type(reported).__name__}; it must return a "
            f"dict of bytes by class (keys among {', '.join(WRAPPER_CLASSES)})"
        )
    for key, value in reported.items():
        if key not in WRAPPER_CLASSES:
            raise ValueError(
                f"{type(optimizer).__name__}.state_bytes() reported class {key!r}; expected keys among "
                f"{', '.join(WRAPPER_CLASSES)}"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"{type(optimizer).__name__}.state_bytes()[{key!r}] is {value!r}; expected a byte count (int >= 0)"
            )
    return reported


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Persistent bytes by class (:data:`~mixprec.diagnostics.memory.results.STATE_CLASSES`) of
    a prepared model and its (wrapped) optimizer.

    Gradients are counted as the step holds them (whether or not ``.grad`` is set now);
    optimizer state is counted where it exists, and predicted where it is not created yet.
    Parameters the optimizer holds but the model lacks count as master weights, unless a
    wrapper reports ``master_weights`` itself.
    """
    out = dict.fromkeys(STATE_CLASSES, 0)
    params = unique_tensors(model.parameters())
    out["weights"] = sum(nbytes(p) for p in params)
    out["buffers"] = sum(nbytes(b) for b in unique_tensors(model.buffers()))
    out["grads"] = sum(nbytes(p) for p in params if p.requires_grad)  # fp32 master grads exist only in a step
    if optimizer is None:
        return out
    if isinstance(optimizer, WrappedOptimizer):
        reported = _wrapper_bytes(optimizer)
    else:
        reported = {"optimizer_state": optimizer_state_bytes(optimizer)}
    for key, value in reported.items():
        out[key] += value
    if "master_weights" not in reported:
        model_ids = {id(p) for p in params}
        extra = unique_tensors(q for g in optimizer.param_groups for q in g["params"] if id(q) not in model_ids)
        out["master_weights"] += sum(nbytes(q) for q in extra)  # parameters only the optimizer has
    return out


def step_transient_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Peak temporaries of one step of ``optimizer`` (its wrapper's own account, else the
    plain optimizer's update temporaries)."""
    if optimizer is None:
        return 0
    if isinstance(optimizer, WrappedOptimizer):
        return int(optimizer.step_transient_bytes())
    return update_transient_bytes(optimizer)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every tensor ``optimizer`` holds now: its parameters, their gradients and its state."""
    for group in optimizer.param_groups:
        for q in group["params"]:
            yield q
            if q.grad is not None:
                yield q.grad
    if isinstance(optimizer, WrappedOptimizer):
        yield from optimizer.state_tensors()
    else:
        yield from state_tensors(optimizer)


def training_state_bytes_per_param(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, *, per: str = "parameter"
) -> dict[str, float]:
    """Persistent training-state bytes per model parameter, by class, for a prepared
    ``model`` and the (wrapped) ``optimizer`` :meth:`MixedPrecision.prepare` returned.

    ``per="trainable"`` divides by the trainable (``requires_grad``) parameters instead: the
    figure that matters for LoRA, where a frozen base holds weights only.

    Keys: ``weights``, ``buffers``, ``grads``, ``master_weights``, ``grad_accumulation``,
    ``optimizer_state``, ``compensation`` and ``total``. Gradients count as the step
    holds them; optimizer state not created yet is predicted (see :func:`state_bytes`).

    >>> import torch
    >>> from mixprec import MixedPrecision
    >>> from mixprec.diagnostics import training_state_bytes_per_param
    >>> model = torch.nn.Linear(64, 64, bias=False)
    >>> mp = MixedPrecision("fp32")
    >>> model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters()))
    >>> training_state_bytes_per_param(model, opt)["total"]  # 4 weight + 4 grad + 8 AdamW state
    16.0009765625
    """
    check.model(model, "training_state_bytes_per_param()")
    check.optimizer(optimizer, "training_state_bytes_per_param()")
    if per not in ("parameter", "trainable"):
        raise ValueError(f"training_state_bytes_per_param(): per must be 'parameter' or 'trainable', got {per!r}")
    state = state_bytes(model, optimizer)
    n = max(sum(p.numel() for p in unique_tensors(model.parameters()) if per == "parameter" or p.requires_grad), 1)
    out: dict[str, Any] = {k: v / n for k, v in state.items()}
    out["total"] = sum(out.values())
    return out

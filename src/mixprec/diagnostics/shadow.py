"""Shadow copies: a model prepared by a plan beside the original, and running a batch through it.

What :func:`~mixprec.diagnostics.compare`, :func:`~mixprec.diagnostics.headroom` and the
memory diagnostics share: a deep copy of the model prepared through
:func:`mixprec.prepare.prepare_model` (the plan's own dtypes, islands and input casting), the
rules that split a batch into positional / keyword inputs and targets, and the loss used
when no criterion is given (a fixed random projection of the outputs).

>>> import torch
>>> from mixprec.diagnostics.shadow import prepare_copy, run_loss
>>> net = torch.nn.Linear(4, 2)
>>> shadow = prepare_copy(net, "bf16-master")
>>> shadow.model.weight.dtype, net.weight.dtype
(torch.bfloat16, torch.float32)
>>> run_loss(shadow, torch.randn(3, 4)).dtype
torch.float32
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.nested import floating_tensors
from mixprec.plans import Plan, get_plan
from mixprec.prepare import Fp32Criterion, prepare_model

__all__ = ["PreparedCopy", "keep_fp32_islands", "prepare_copy", "projection_loss", "run_loss", "split_batch"]


@dataclass
class PreparedCopy:
    """A deep copy of a model prepared by a plan, with the context its forward runs in."""

    model: nn.Module
    plan: Plan
    device_type: str
    criterion: Any
    initial_scale: float

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return self.plan.autocast(self.device_type)


def prepare_copy(model: nn.Module, plan: str | Plan, criterion: Any = None) -> PreparedCopy:
    """A deep copy of ``model`` prepared by ``plan`` as the session prepares models
    (:func:`mixprec.prepare.prepare_model`: conversion, islands, input casting), without an
    optimizer."""
    prepared = prepare_model(copy.deepcopy(model), get_plan(plan))
    keep_fp32_islands(prepared.model)
    scaler = prepared.plan.make_scaler()
    scale = float(scaler.get_scale()) if scaler.is_enabled() else 1.0
    wrapped = Fp32Criterion(criterion) if criterion is not None else None
    return PreparedCopy(prepared.module, prepared.plan, prepared.device.type, wrapped, scale)


def keep_fp32_islands(model: nn.Module) -> None:
    """Keep fp32 islands in fp32 after a plan cast the whole model down."""
    from mixprec.dtypes import LOW_PRECISION_DTYPES, cast_module_
    from mixprec.islands import is_fp32_island

    for module in model.modules():
        if is_fp32_island(module):
            cast_module_(module, torch.float32, only_from=LOW_PRECISION_DTYPES)


def split_batch(batch: Any, criterion: Any) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """``(args, kwargs, targets)`` of a batch: ``(inputs, targets)`` with a criterion, else the
    inputs alone; inputs are a tensor (or any other object: one positional argument), a
    tuple of positional arguments or a dict of keyword arguments."""
    if criterion is not None:
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            raise ValueError(
                "with a criterion, batch must be (inputs, targets); got "
                f"{type(batch).__name__}{f' of length {len(batch)}' if isinstance(batch, tuple | list) else ''}"
            )
        inputs, targets = batch
    else:
        inputs, targets = batch, None
    if isinstance(inputs, dict):
        return (), dict(inputs), targets
    if isinstance(inputs, tuple):
        return inputs, {}, targets
    return (inputs,), {}, targets


def projection_loss(output: Any) -> torch.Tensor:
    """A fixed random projection of the outputs: the same gradient direction for every run."""
    total: torch.Tensor | None = None
    generator = torch.Generator().manual_seed(0)
    for t in floating_tensors(output):
        probe = torch.randn(t.shape, generator=generator).to(t.device) / max(t.numel(), 1) ** 0.5
        term = (t.float() * probe).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("the model returned no floating-point tensor; pass a criterion to compute a loss")
    return total


def run_loss(prepared: PreparedCopy, batch: Any, criterion: Any = None) -> torch.Tensor:
    """Forward ``batch`` through a prepared copy under its plan and return the fp32 loss."""
    args, kwargs, targets = split_batch(batch, criterion)
    with prepared.autocast():
        output = prepared.model(*args, **kwargs)
    if criterion is None:
        return projection_loss(output)
    crit = prepared.criterion if prepared.criterion is not None else criterion
    return crit(output, targets).float()

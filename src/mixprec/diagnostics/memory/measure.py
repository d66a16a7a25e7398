"""Measuring training memory: real steps through :class:`~mixprec.MixedPrecision`, every live storage accounted.

The persistent state present at the start of the measured step is registered, then
every storage created during the step is counted until it is freed
(:class:`~mixprec.diagnostics.memory.live.LiveStorages`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics import _args as check
from mixprec.diagnostics.memory.live import LiveStorages
from mixprec.diagnostics.memory.results import MemoryEstimate
from mixprec.diagnostics.memory.state import (
    OptimizerSpec,
    optimizer_factory,
    optimizer_tensors,
    state_bytes,
)
from mixprec.diagnostics.shadow import projection_loss, split_batch
from mixprec.optim.footprint import nbytes, unique_tensors
from mixprec.plans import Plan, get_plan

__all__ = ["measure_memory"]


def _grad_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(nbytes(t.grad) for t in unique_tensors(tensors) if t.grad is not None)


def measure_memory(
    model_factory: Callable[[], nn.Module],
    plan: str | Plan,
    batch_fn: Callable[[], Any],
    *,
    optimizer: OptimizerSpec = "adamw",
    criterion: Any = None,
    warmup_steps: int = 1,
    session_options: Mapping[str, Any] | None = None,
) -> MemoryEstimate:
    """Measure the memory of one training step through :class:`~mixprec.MixedPrecision`.

    Args:
        model_factory: builds a fresh model (as for :func:`estimate_memory`).
        plan: a plan name or :class:`~mixprec.Plan`.
        batch_fn: returns one batch (``(inputs, targets)`` with a criterion, else the inputs).
        optimizer: as for :func:`estimate_memory`.
        criterion: the loss function (without one, a fixed projection of the outputs).
        warmup_steps: steps run before the measured one (optimizers create their state
            on the first step).
        session_options: keyword arguments of :class:`~mixprec.MixedPrecision` besides
            the plan, e.g. ``{"optimizer_in_backward": True}``.

    Storages are accounted live (see the module docs): ``peak`` is the largest sum of
    live bytes during the measured step; ``activations`` is what the forward left
    alive when it ended; gradients are read when backward ended; the persistent classes
    after the step.
    """
    from mixprec.session import MixedPrecision

    check.factory(model_factory, "model_factory", "measure_memory()", "model", "MyModel()")
    check.factory(batch_fn, "batch_fn", "measure_memory()", "batch", "torch.randn(8, 32)")
    check.criterion(criterion, "measure_memory()")
    plan = get_plan(plan)
    make_opt = optimizer_factory(optimizer)
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    mp = MixedPrecision(plan, **_session_options(session_options))  # every option checked before a model is built
    model = built_model(model_factory, "measure_memory()")
    opt = make_opt(model.parameters())
    if criterion is not None:
        model, opt, crit = mp.prepare(model, opt, criterion=criterion)
    else:
        (model, opt), crit = mp.prepare(model, opt), None

    def loss_of(batch: Any) -> torch.Tensor:
        args, kwargs, targets = split_batch(batch, criterion)
        with mp.autocast():
            output = model(*args, **kwargs)
        if crit is None:
            return projection_loss(output)
        return crit(output, targets)

    for _ in range(warmup_steps):
        mp.backward(loss_of(batch_fn()))
        mp.step()

    batch = batch_fn()
    live = LiveStorages()
    for t in [*model.parameters(), *model.buffers(), *optimizer_tensors(opt)]:
        live.add(t, dynamic=False)
    for p in model.parameters():
        if p.grad is not None:
            live.add(p.grad, dynamic=False)
    live.peak = live.live
    with live.tracking():
        loss = loss_of(batch)
        activations = live.dynamic_bytes()
        mp.backward(loss)
        grads = _grad_bytes(model.parameters())
        model_ids = {id(p) for p in model.parameters()}
        masters = [q for g in opt.param_groups for q in g["params"] if id(q) not in model_ids]
        grad_accumulation = _grad_bytes(masters)
        mp.step()
    del loss
    state = state_bytes(model, opt)
    by_class = {**state, "grads": grads, "grad_accumulation": grad_accumulation, "activations": activations}
    n = sum(p.numel() for p in unique_tensors(model.parameters()))
    trainable = sum(p.numel() for p in unique_tensors(model.parameters()) if p.requires_grad)
    return MemoryEstimate(plan.name, "measured", by_class, int(live.peak), n, (), trainable)


def built_model(model_factory: Callable[[], Any], call: str) -> nn.Module:
    """``model_factory()``, refused unless it is an ``nn.Module``."""
    model = model_factory()
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{call}: model_factory() returned {check.show(model)}, not a torch.nn.Module; it must build and "
            "return a fresh model, e.g. model_factory=lambda: MyModel()"
        )
    return model


def _session_options(options: Any) -> dict[str, Any]:
    """``session_options`` as keyword arguments, refused before anything is built if unusable."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(
            f"session_options must be a dict of MixedPrecision keyword arguments, got {type(options).__name__}; "
            'e.g. session_options={"optimizer_in_backward": True}'
        )
    if "plan" in options:
        raise ValueError(
            f"session_options names the plan ({options['plan']!r}); pass it as measure_memory's plan "
            "argument instead and keep session_options for the other MixedPrecision arguments"
        )
    return dict(options)

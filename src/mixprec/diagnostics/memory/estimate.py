"""Estimating training memory without running the model: fake tensors and traced passes.

The model is copied with *fake* tensors (shapes and dtypes only, no storage), prepared by
the plan through :class:`~mixprec.MixedPrecision` (so the dtypes are the plan's own), the
optimizer is wrapped the same way, and one forward is traced to collect the tensors
autograd saves, then a fake backward is traced too. The optimizer's state and step
temporaries come from the optimizer itself (see :mod:`mixprec.diagnostics.memory.state`).
The peak of a step is then modelled as the persistent state plus the largest of
(activations + the first gradients of backward), the traced backward's own peak, and
(gradients + the optimizer step's temporaries).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics import _args as check
from mixprec.diagnostics.memory.live import LiveStorages
from mixprec.diagnostics.memory.results import PERSISTENT_CLASSES, MemoryEstimate
from mixprec.diagnostics.memory.state import (
    OptimizerSpec,
    optimizer_factory,
    state_bytes,
    step_transient_bytes,
)
from mixprec.diagnostics.shadow import keep_fp32_islands, projection_loss, split_batch
from mixprec.nested import map_tensors, tensors
from mixprec.optim.footprint import unique_tensors
from mixprec.plans import Plan, get_plan

__all__ = ["estimate_memory"]


def _storage_key(t: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def _fake_copy(model: nn.Module, mode: Any) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are fake (no storage)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(mode.from_tensor(p.detach()), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = mode.from_tensor(b)
    return copy.deepcopy(model, memo)


def _traced_activations(
    model: nn.Module,
    run: Callable[[], torch.Tensor],
    persistent: Iterable[torch.Tensor],
) -> tuple[int, int]:
    """Bytes of the distinct storages one forward keeps for backward (plus the loss and
    what it saved), excluding ``persistent`` tensors (the state and the batch itself);
    and the largest of them."""
    exclude = {_storage_key(t) for t in persistent}
    saved: dict[Any, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in exclude:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    key = _storage_key(loss)
    if key not in exclude:
        saved[key] = loss.untyped_storage().nbytes()
    return sum(saved.values()), max(saved.values(), default=0)


def _traced_backward_peak(model: nn.Module, run: Callable[[], torch.Tensor], persistent: Iterable[torch.Tensor]) -> int:
    """The largest sum of bytes alive during one (fake) forward and backward, besides ``persistent``:
    activations, gradients as backward makes them, and every temporary of both passes."""
    live = LiveStorages()
    for t in persistent:
        live.add(t, dynamic=False)
    base = live.live
    live.peak = base
    with live.tracking():
        loss = run()
        loss.backward()
        del loss
    for p in model.parameters():
        p.grad = None
    return live.peak - base


def _persistent_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    held: list[torch.Tensor] = [*model.parameters(), *model.buffers()]
    if optimizer is not None:
        for group in optimizer.param_groups:
            held.extend(group["params"])
    return held


def estimate_memory(
    model: nn.Module,
    plan: str | Plan,
    *,
    optimizer: OptimizerSpec = "adamw",
    batch: Any = None,
    criterion: Any = None,
) -> MemoryEstimate:
    """Estimate training memory of ``model`` under ``plan`` without running it.

    Args:
        model: the model as built (fp32 usually); it is not modified.
        plan: a plan name or :class:`~mixprec.Plan`.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"``, ``"sgd-momentum"``, or a callable
            ``params -> torch.optim.Optimizer``.
        batch: one batch, to estimate activations (``(inputs, targets)`` with a
            criterion, else the inputs, as for :func:`~mixprec.diagnostics.compare`).
            Without it, activations are 0 and the peak covers the training state only.
        criterion: the loss function (its saved tensors count as activations).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mixprec.session import MixedPrecision

    check.model(model, "estimate_memory()")
    check.criterion(criterion, "estimate_memory()")
    # A private copy: the fake model must leave nothing in the caller's plan (an fp8
    # recipe keeps scaling state that would then hold fake tensors).
    plan = copy.deepcopy(get_plan(plan))
    make_opt = optimizer_factory(optimizer)
    notes: list[str] = []
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = _fake_copy(model, mode)
    activations = largest = backward_peak = 0
    mp = MixedPrecision(plan)  # outside the fake mode: the loss scaler reads its real scale
    with mode:
        opt = make_opt(fake.parameters())
        if criterion is not None:
            prepared, opt, crit = mp.prepare(fake, opt, criterion=criterion)
        else:
            (prepared, opt), crit = mp.prepare(fake, opt), None
        keep_fp32_islands(prepared)
        if batch is not None:
            args, kwargs, targets = map_tensors(mode.from_tensor, split_batch(batch, criterion))

            def run() -> torch.Tensor:
                with mp.autocast():
                    output = prepared(*args, **kwargs)
                if crit is None:
                    return projection_loss(output)
                return crit(output, targets)

            held = [*_persistent_tensors(prepared, opt), *tensors((args, kwargs, targets))]
            activations, largest = _traced_activations(prepared, run, held)
            backward_peak = _traced_backward_peak(prepared, run, held)
        else:
            notes.append("no batch given: activations not estimated")
    # Outside the fake mode: the optimizer predicts the state its first step creates by
    # stepping storage-free meta copies, which reads real (host) step counters.
    state = state_bytes(prepared, opt)
    transient = step_transient_bytes(opt)
    by_class = {**state, "activations": activations}
    persistent = sum(state[k] for k in PERSISTENT_CLASSES)
    grads = state["grads"] + state["grad_accumulation"]
    # Backward starts with every activation alive and makes gradients as large as the
    # activations (the largest one bounds what coexists); the step holds every gradient
    # and its temporaries once the activations are gone.
    # The traced (fake) backward covers what the rule misses: temporaries of custom
    # backward passes, such as fp8 layers widening their operands for an emulated GEMM.
    peak = persistent + max(activations + largest, backward_peak, grads + transient)
    n = sum(p.numel() for p in unique_tensors(model.parameters()))
    trainable = sum(p.numel() for p in unique_tensors(model.parameters()) if p.requires_grad)
    return MemoryEstimate(plan.name, "estimated", by_class, int(peak), n, tuple(notes), trainable)

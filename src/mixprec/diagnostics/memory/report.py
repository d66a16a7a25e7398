"""Estimated and measured memory side by side, for several plans."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from mixprec.diagnostics import _args as check
from mixprec.diagnostics.memory.estimate import estimate_memory
from mixprec.diagnostics.memory.measure import built_model, measure_memory
from mixprec.diagnostics.memory.results import MemoryEstimate, MemoryReport
from mixprec.diagnostics.memory.state import OptimizerSpec
from mixprec.plans import Plan, get_plan

__all__ = ["memory_report"]


def memory_report(
    model_factory: Callable[[], nn.Module],
    plans: Sequence[str | Plan] = ("fp32", "bf16-mixed", "bf16-master"),
    batch_fn: Callable[[], Any] | None = None,
    *,
    optimizer: OptimizerSpec = "adamw",
    criterion: Any = None,
    measure: bool = True,
) -> MemoryReport:
    """Estimated (and, with ``measure=True`` and a ``batch_fn``, measured) memory of
    ``model_factory()`` under each plan, side by side.

    >>> import torch
    >>> from mixprec.diagnostics import memory_report
    >>> report = memory_report(lambda: torch.nn.Linear(32, 32), ("fp32", "bf16-master"),
    ...                        lambda: torch.randn(8, 32))
    >>> print(str(report).splitlines()[0])
    class               fp32 est  fp32 meas  bf16-master est  bf16-master meas
    """
    call = "memory_report()"
    check.factory(model_factory, "model_factory", call, "model", "MyModel()")
    if batch_fn is not None:
        check.factory(batch_fn, "batch_fn", call, "batch", "torch.randn(8, 32)")
    check.criterion(criterion, call)
    check.flag(measure, "measure", call)
    if isinstance(plans, str | Plan) or not isinstance(plans, Sequence):
        example = f"({plans!r},)" if isinstance(plans, str) else "('fp32', 'bf16-mixed')"
        raise TypeError(
            f"{call}: plans must be a sequence of plan names or Plans, got {check.show(plans)}; pass e.g. plans={example}"
        )
    chosen = [get_plan(p) for p in plans]  # every name checked before anything runs
    estimates: dict[str, MemoryEstimate] = {}
    measurements: dict[str, MemoryEstimate] = {}
    model = built_model(model_factory, call)
    batch = batch_fn() if batch_fn is not None else None
    for plan in chosen:
        try:
            estimate = estimate_memory(model, plan, optimizer=optimizer, batch=batch, criterion=criterion)
        except ValueError as exc:  # a frozen base the plan would round: report it as converted, and say so
            if "convert_frozen=True" not in str(exc):
                raise
            plan = dataclasses.replace(plan, convert_frozen=True)
            estimate = estimate_memory(model, plan, optimizer=optimizer, batch=batch, criterion=criterion)
            note = "frozen parameters rounded to the plan's dtype, as with convert_frozen=True (refused without it)"
            estimate = dataclasses.replace(estimate, notes=(*estimate.notes, note))
        estimates[plan.name] = estimate
        if measure and batch_fn is not None:
            measurements[plan.name] = measure_memory(
                model_factory, plan, batch_fn, optimizer=optimizer, criterion=criterion
            )
    return MemoryReport(estimates, measurements)

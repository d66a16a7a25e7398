"""Memory of a training step: measured peaks, estimated peaks, and the largest batch a budget holds."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mixprec.cli.harness.rows import TORCH_AUTOCAST
from mixprec.cli.harness.workloads import Workload
from mixprec.plans import Plan

__all__ = ["estimate_peaks", "max_batch_for", "measure_peak"]


def measure_peak(workload: Workload, plan: str | Plan, batch: int, seed: int) -> int | None:
    """Peak bytes of one training step of ``workload`` under ``plan``, measured by
    :func:`mixprec.diagnostics.memory.measure_memory` (every live storage accounted, so it
    works on CPUs too). None for the plain torch.autocast loop, which it does not run."""
    if plan == TORCH_AUTOCAST:
        return None
    from mixprec.diagnostics.memory import measure_memory

    task = workload.make(seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return measure_memory(lambda: workload.make(seed).model, plan, lambda: task.batch(batch, generator),
                              criterion=task.criterion, warmup_steps=1).peak


def estimate_peaks(workload: Workload, plan: str, batches: Sequence[int], seed: int) -> list[int] | None:
    """Estimated peak bytes of a step at each batch size (:func:`mixprec.diagnostics.memory.estimate_memory`:
    fake tensors, nothing computed). None for the plain torch.autocast loop."""
    if plan == TORCH_AUTOCAST:
        return None
    from mixprec.diagnostics.memory import estimate_memory

    task = workload.make(seed)
    generator = torch.Generator().manual_seed(seed)
    return [
        estimate_memory(task.model, plan, batch=task.batch(b, generator), criterion=task.criterion).peak
        for b in batches
    ]


def max_batch_for(budget: int, batches: Sequence[int], peaks: Sequence[int]) -> tuple[int, float, float]:
    """The largest batch whose peak fits ``budget``, from a line through two (batch, peak) points.

    Returns (max batch, fixed bytes, bytes per sample); the max batch is 0 when not even
    the fixed part fits.

    >>> max_batch_for(1000, [2, 4], [300, 500])
    (9, 100.0, 100.0)
    """
    (b1, b2), (p1, p2) = batches, peaks
    per_sample = max((p2 - p1) / (b2 - b1), 1.0)
    fixed = p1 - per_sample * b1
    return max(math.floor((budget - fixed) / per_sample), 0), float(fixed), float(per_sample)

"""Benchmarks are data: a :class:`Row` is ``(model, plan, batch)``, with the two baselines
(the "fp32" plan and the plain ``torch.autocast`` loop) named here.

>>> [(r.model, r.plan) for r in plan_rows(["mlp"], ["bf16-mixed"])]
[('mlp', 'fp32'), ('mlp', 'torch-autocast'), ('mlp', 'bf16-mixed')]
>>> plan_label(TORCH_AUTOCAST), is_fp16_plan("O2")
('torch.autocast (bf16)', True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mixprec.plans import PLANS, get_plan, resolve_plan_name

__all__ = ["FP32", "TORCH_AUTOCAST", "Row", "default_plans", "is_fp16_plan", "plan_compute_dtype", "plan_label",
           "plan_rows"]

FP32 = "fp32"
TORCH_AUTOCAST = "torch-autocast"
"""Row name of the plain ``torch.autocast`` bf16 loop (not a mixprec plan)."""

_BF16_AUTOCAST_LABEL = "torch.autocast (bf16)"


def plan_compute_dtype(plan: str) -> torch.dtype:
    """The dtype a row computes in (the plain torch.autocast loop: bf16)."""
    return torch.bfloat16 if plan == TORCH_AUTOCAST else get_plan(plan).compute_dtype


def is_fp16_plan(plan: str) -> bool:
    """True for plans that compute in fp16 (no fast path on most CPUs)."""
    return plan_compute_dtype(plan) == torch.float16


def default_plans(device_type: str = "cpu", *, include_fp16: bool = False) -> list[str]:
    """Every canonical plan; fp16 plans are left out on CPU unless ``include_fp16``."""
    skip_fp16 = device_type == "cpu" and not include_fp16
    return [p for p in PLANS if not (skip_fp16 and is_fp16_plan(p))]


def plan_label(plan: str) -> str:
    """How a row is named in tables."""
    return _BF16_AUTOCAST_LABEL if plan == TORCH_AUTOCAST else plan


@dataclass(frozen=True)
class Row:
    """One benchmark row: a model (workload name), a plan (or ``"torch-autocast"``), a batch size."""

    model: str
    plan: str
    batch: int | None = None


def plan_rows(
    models: Sequence[str], plans: Sequence[str], *, batch: int | None = None, baselines: bool = True
) -> list[Row]:
    """Rows for every model x plan, with the fp32 and plain torch.autocast baselines first."""
    names = [resolve_plan_name(p) if p != TORCH_AUTOCAST else p for p in plans]
    if baselines:
        names = [FP32, TORCH_AUTOCAST, *(p for p in names if p not in (FP32, TORCH_AUTOCAST))]
    names = list(dict.fromkeys(names))
    return [Row(model, plan, batch) for model in models for plan in names]

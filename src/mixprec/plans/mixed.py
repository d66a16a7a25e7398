"""Mixed precision ("bf16-mixed", "fp16-mixed", "O1"): fp32 weights, low-precision compute via autocast."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mixprec.plans.base import Plan

__all__ = ["MixedPlan"]


@dataclass(frozen=True)
class MixedPlan(Plan):
    """fp32 weights, grads and optimizer state; matmuls and convolutions in bf16/fp16 under autocast."""

    family: ClassVar[str] = "mixed"
    supports_fsdp: ClassVar[bool] = True
    summary: ClassVar[str] = "fp32 weights, low-precision compute through autocast"

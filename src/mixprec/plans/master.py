"""Low-precision model with fp32 master weights ("bf16-master", "fp16-master", "O2")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mixprec.islands import cast_outside_islands
from mixprec.optim import MasterWeightOptimizer
from mixprec.plans.base import NORM_LAYERS, Plan

__all__ = ["MasterPlan"]


@dataclass(frozen=True)
class MasterPlan(Plan):
    """bf16/fp16 weights and compute; fp32 masters in the optimizer, fp32 norm layers, fp32 grad accumulation.

    Norm layers (BatchNorm, LayerNorm, GroupNorm, RMSNorm, ...) and their buffers stay
    fp32; integer buffers are never touched. Low-precision gradients are moved into
    fp32 master gradients as soon as autograd produces them.
    """

    accumulate_grads_in_fp32_hooks: bool = True

    family: ClassVar[str] = "master"
    summary: ClassVar[str] = "low-precision weights and compute, fp32 master weights, norm layers and gradient accumulation"

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.compute_dtype

    @property
    def master_dtype(self) -> torch.dtype:
        return torch.float32

    def tensor_dtypes(self) -> dict[str, str]:
        rows = super().tensor_dtypes()
        rows["weights"] += " (norm layers fp32)"
        return rows

    @classmethod
    def optimizer_kind(cls) -> str:
        return "master"

    def convert_model(self, model: torch.nn.Module) -> dict[torch.Tensor, torch.Tensor]:
        # fp32 islands are marked first and never cast down, so they keep their exact values.
        return cast_outside_islands(model, self.compute_dtype, self.policy, keep=NORM_LAYERS, keep_dtype=torch.float32)

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, fp32_values: dict[torch.Tensor, torch.Tensor]
    ) -> torch.optim.Optimizer:
        return MasterWeightOptimizer(
            optimizer, master_values=fp32_values, accumulate_grads_in_fp32=self.accumulate_grads_in_fp32_hooks
        )

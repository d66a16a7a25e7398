"""Pure low precision ("bf16-pure", "fp16-pure", "O3"): every weight, gradient and state in bf16/fp16."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from mixprec.islands import cast_outside_islands
from mixprec.optim import LowPrecisionOptimizer
from mixprec.optim.compiled import CompileSetting, check_compile_setting
from mixprec.optim.states import describe as describe_state
from mixprec.plans.base import Plan

__all__ = ["PurePlan"]


@dataclass(frozen=True)
class PurePlan(Plan):
    """The whole model in low precision, no master weights, no autocast (apex O3).

    Floating inputs of the model are cast to the low dtype by a forward pre-hook
    (installed by the front door). The optimizer's arithmetic runs in fp32 inside
    ``step()`` and its results are rounded back (:class:`~mixprec.optim.LowPrecisionOptimizer`).
    Optimizer state is kept in ``state_dtype``, by default the weight dtype for bf16
    and fp32 for fp16 (fp16 cannot hold Adam's second moment: g² underflows below
    6e-8). The fastest and smallest plan, and the least accurate: updates smaller
    than half a unit in the last place are lost (see "bf16-kahan" for the remedy).
    ``optimizer_compile``: True runs Adam/AdamW updates through ``torch.compile``; the
    default "auto" keeps torch's fused kernel, already one pass for this plan.
    """

    state_dtype: torch.dtype | None = None
    optimizer_compile: CompileSetting = "auto"

    family: ClassVar[str] = "pure"
    supports_optimizer_in_backward: ClassVar[bool] = True
    supports_fsdp: ClassVar[bool] = True  # sharded as stored; the wrapper steps local shards
    supports_sparse_grads: ClassVar[bool] = False  # the wrapper expands gradients to fp32 densely
    summary: ClassVar[str] = "low precision everything, no master weights"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_compile_setting(self.optimizer_compile, "optimizer_compile")

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.compute_dtype

    @property
    def uses_autocast(self) -> bool:
        return False

    @property
    def optimizer_state_dtype(self) -> torch.dtype:
        if self.state_dtype is not None:
            return self.state_dtype
        return torch.float32 if self.compute_dtype == torch.float16 else self.compute_dtype

    def tensor_dtypes(self) -> dict[str, str]:
        rows = super().tensor_dtypes()
        rows["compute"] = rows["activations"] = rows["weights"] + " (no autocast; model inputs cast)"
        rows["optimizer state"] = f"{describe_state(self.optimizer_state_dtype)} (fp32 math inside step)"
        return rows

    def convert_model(self, model: torch.nn.Module) -> dict[torch.Tensor, torch.Tensor]:
        # fp32 islands are marked first and never cast down (a 1e5 weight stays 1e5 under fp16);
        # their outputs go back to the model's dtype, whatever their inputs were.
        return cast_outside_islands(model, self.compute_dtype, self.policy, output_dtype=self.compute_dtype,
                                    plan_name=self.name, convert_frozen=self.convert_frozen,
                                    known_plans=("bf16-pure", "fp16-pure"))

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, fp32_values: dict[torch.Tensor, torch.Tensor]
    ) -> torch.optim.Optimizer:
        return LowPrecisionOptimizer(optimizer, state_dtype=self.optimizer_state_dtype, compile=self.optimizer_compile)

    def autocast(self, device_type: str = "cpu") -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

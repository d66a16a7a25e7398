"""bf16 weights without master copies, updated with Kahan compensation ("bf16-kahan") or stochastic rounding ("bf16-sr")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from mixprec.dtypes import dtype_name
from mixprec.islands import cast_outside_islands
from mixprec.optim import KahanOptimizer, StochasticRoundingOptimizer
from mixprec.optim.compiled import CompileSetting, check_compile_setting
from mixprec.optim.kinds import StateKind
from mixprec.optim.states import describe as describe_state
from mixprec.plans.base import NORM_LAYERS, Plan

__all__ = ["LowBitPlan"]


@dataclass(frozen=True)
class LowBitPlan(Plan):
    """bf16 weights and compute under autocast; the optimizer updates bf16 weights without losing small updates.

    ``rounding="kahan"`` keeps a bf16 compensation buffer per weight; ``"stochastic"``
    rounds updates stochastically. Adam/AdamW updates of large param groups (2**20
    elements or more) run as one ``torch.compile``d loop per parameter where
    torch.compile works (``optimizer_compile="auto"``; 3-4x faster steps on CPU after a
    compilation of seconds to a minute); ``True`` compiles every group, ``False`` none. Optimizer state is kept in ``state_dtype``
    (bf16 by default: 10 bytes per parameter for AdamW with Kahan). Norm layers
    (a negligible share of the parameters) stay fp32, so they accept both bf16
    activations and fp32 ones coming from fp32-list ops or fp32 islands.
    """

    rounding: Literal["kahan", "stochastic"] = "kahan"
    state_dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    optimizer_compile: CompileSetting = "auto"

    family: ClassVar[str] = "lowbit"
    supports_optimizer_in_backward: ClassVar[bool] = True
    supports_fsdp: ClassVar[bool] = True  # sharded as stored; the wrapper steps local shards
    supports_sparse_grads: ClassVar[bool] = False  # the wrapper expands gradients to fp32 densely
    summary: ClassVar[str] = "bf16 weights and compute, compensated updates, no fp32 master"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_compile_setting(self.optimizer_compile, "optimizer_compile")
        if self.rounding not in ("kahan", "stochastic"):
            raise ValueError(f"rounding must be 'kahan' or 'stochastic', got {self.rounding!r}")
        if self.rounding == "stochastic" and self.compute_dtype != torch.bfloat16:
            raise ValueError(f"stochastic rounding needs bf16 weights, got {dtype_name(self.compute_dtype)}")

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.compute_dtype

    @property
    def optimizer_state_dtype(self) -> torch.dtype:
        return self.state_dtype

    def tensor_dtypes(self) -> dict[str, str]:
        rows = super().tensor_dtypes()
        rows["weights"] += " (norm layers fp32)"
        if self.rounding == "kahan":
            rows["master weights"] = f"none ({dtype_name(self.weight_dtype)} Kahan compensation per weight)"
        else:
            rows["master weights"] = "none (stochastic rounding of each update)"
        rows["optimizer state"] = f"{describe_state(self.state_dtype)} between steps, fp32 math inside step"
        return rows

    def state_kinds(self) -> tuple[StateKind, ...]:
        return (KahanOptimizer if self.rounding == "kahan" else StochasticRoundingOptimizer).state_kinds

    def fingerprint(self) -> dict[str, str]:
        return {**super().fingerprint(), "optimizer": self.rounding}

    def convert_model(self, model: torch.nn.Module) -> dict[torch.Tensor, torch.Tensor]:
        # fp32 islands are marked first and never cast down, so they keep their exact values.
        return cast_outside_islands(model, self.compute_dtype, self.policy, keep=NORM_LAYERS, keep_dtype=torch.float32,
                                    plan_name=self.name, convert_frozen=self.convert_frozen,
                                    keeps_fp32_values=self.rounding == "kahan")  # (no fp16 twin to suggest)

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, fp32_values: dict[torch.Tensor, torch.Tensor]
    ) -> torch.optim.Optimizer:
        if self.rounding == "kahan":
            return KahanOptimizer(optimizer, state_dtype=self.state_dtype, compile=self.optimizer_compile)
        return StochasticRoundingOptimizer(
            optimizer, state_dtype=self.state_dtype, seed=self.seed, compile=self.optimizer_compile
        )

"""Low-precision model with fp32 master weights ("bf16-master", "fp16-master", "O2")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mixprec.dtypes import dtype_name
from mixprec.islands import cast_outside_islands
from mixprec.optim import MasterWeightOptimizer, RemainderOptimizer
from mixprec.optim.compiled import CompileSetting, check_compile_setting
from mixprec.optim.kinds import StateKind
from mixprec.optim.states import describe as describe_state
from mixprec.plans.base import NORM_LAYERS, Plan

__all__ = ["MasterPlan"]


@dataclass(frozen=True)
class MasterPlan(Plan):
    """bf16/fp16 weights and compute; fp32 masters in the optimizer, fp32 norm layers, fp32 grad accumulation.

    Norm layers (BatchNorm, LayerNorm, GroupNorm, RMSNorm, ...) and their buffers stay
    fp32; integer buffers are never touched. Gradients stay in the model's low-precision
    ``.grad`` (where DDP, ``zero_grad`` and clipping see them) and are gathered into the
    fp32 masters at step time; micro-batches accumulate in fp32 through
    :meth:`MasterWeightOptimizer.accumulate_grads`.

    ``remainders=True`` (bf16 only) keeps each fp32 master as the bf16 weight plus an int16
    remainder (:class:`~mixprec.optim.RemainderOptimizer`): the same weights and losses bit
    for bit, 14 bytes of training state per parameter with AdamW instead of 16 (12 with
    ``optimizer_in_backward=True``). Micro-batches then add up in the weights' bf16 ``.grad``.
    ``optimizer_compile`` chooses its update route (:class:`~mixprec.optim.RemainderOptimizer`'s
    ``compile``): ``"auto"`` compiles Adam/AdamW for large groups when ``state_dtype`` is bf16,
    and keeps torch's fused kernel, bit for bit ``bf16-master``, with fp32 state.

    ``accumulate_grads_in_fp32_hooks`` is kept for compatibility and must stay False:
    moving gradients out of the model as autograd produced them hid them from
    ``model.zero_grad()`` and from a DDP wrapped later.
    """

    accumulate_grads_in_fp32_hooks: bool = False
    remainders: bool = False
    state_dtype: torch.dtype | None = None
    optimizer_compile: CompileSetting = "auto"

    family: ClassVar[str] = "master"
    supports_fsdp: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.accumulate_grads_in_fp32_hooks:
            raise ValueError(
                f"accumulate_grads_in_fp32_hooks=True is no longer supported by plan {self.name!r}: gradients "
                "stay in the model's .grad and are gathered into the fp32 masters at step time; for fp32 "
                "accumulation over micro-batches, call optimizer.accumulate_grads() after each non-boundary "
                "backward (MixedPrecision(grad_accum_steps=...) does). Leave the option at False."
            )
        if not isinstance(self.remainders, bool):
            raise TypeError(f"remainders must be True or False, got {self.remainders!r}")
        check_compile_setting(self.optimizer_compile, "optimizer_compile")
        if self.optimizer_compile != "auto" and not self.remainders:
            raise ValueError(
                f"optimizer_compile={self.optimizer_compile!r} on plan {self.name!r}: fp32 masters step with torch's "
                "fused kernel and have no compiled route. Pass remainders=True, or leave optimizer_compile at 'auto'"
            )
        if self.remainders and self.compute_dtype != torch.bfloat16:
            raise ValueError(
                f"remainders=True needs bf16 weights, plan {self.name!r} has {dtype_name(self.compute_dtype)}: an fp16 "
                "weight is not the high half of its fp32 master. Use get_plan('bf16-master', remainders=True), or "
                "keep fp32 masters (remainders=False)"
            )
        if self.state_dtype not in (None, torch.float32) and not self.remainders:
            raise ValueError(
                f"state_dtype={describe_state(self.state_dtype)} on plan {self.name!r}: with fp32 masters the inner "
                "optimizer keeps its own fp32 state. Use get_plan('bf16-master', remainders=True, state_dtype=...) "
                "(the masters then live in the bf16 weights and their remainders, the state in the dtype asked "
                "for), or a pure, Kahan or stochastic-rounding plan"
            )

    @property  # type: ignore[misc]
    def supports_sparse_grads(self) -> bool:  # type: ignore[override]
        return not self.remainders  # the remainder wrapper expands gradients to fp32 densely

    @property  # type: ignore[misc]
    def summary(self) -> str:  # type: ignore[override]
        if self.remainders:
            return "bf16 weights and compute, exact fp32 masters kept as bf16 weight + int16 remainder, fp32 norm layers"
        return "low-precision weights and compute, fp32 master weights, norm layers and gradient accumulation"

    @property
    def optimizer_state_dtype(self) -> torch.dtype:
        return self.state_dtype or torch.float32

    @property  # type: ignore[misc]
    def supports_optimizer_in_backward(self) -> bool:  # type: ignore[override]
        return self.remainders

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.compute_dtype

    @property
    def master_dtype(self) -> torch.dtype:
        return torch.float32

    def tensor_dtypes(self) -> dict[str, str]:
        rows = super().tensor_dtypes()
        rows["weights"] += " (norm layers fp32)"
        rows["optimizer state"] = describe_state(self.state_dtype) + (" between steps, fp32 math inside step"
                                                                     if self.state_dtype else "")
        if self.remainders:
            rows["grad accumulation"] = "bf16 (in the weights' .grad)"
            rows["master weights"] = "fp32, kept as the bf16 weight + an int16 remainder"
        return rows

    def fingerprint(self) -> dict[str, str]:
        return {**super().fingerprint(), **({"optimizer": "remainder"} if self.remainders else {})}

    @classmethod
    def optimizer_kind(cls) -> str:
        return "master"

    def convert_model(self, model: torch.nn.Module) -> dict[torch.Tensor, torch.Tensor]:
        # fp32 islands are marked first and never cast down, so they keep their exact values.
        return cast_outside_islands(model, self.compute_dtype, self.policy, keep=NORM_LAYERS, keep_dtype=torch.float32,
                                    plan_name=self.name, convert_frozen=self.convert_frozen,
                                    keeps_fp32_values=True, known_plans=("bf16-master", "fp16-master"))

    def state_kinds(self) -> tuple[StateKind, ...]:
        if self.remainders:
            return RemainderOptimizer.state_kinds
        return (MasterWeightOptimizer.master_kind, *MasterWeightOptimizer.state_kinds)

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, fp32_values: dict[torch.Tensor, torch.Tensor]
    ) -> torch.optim.Optimizer:
        # Every optimizer of an fp16 plan is guarded, so any of them can undo its step when
        # another one refused a non-finite update (also one holding only fp32 parameters).
        if self.remainders:
            return RemainderOptimizer(optimizer, master_values=fp32_values, state_dtype=self.state_dtype,
                                      compile=self.optimizer_compile)
        guard = True if self.compute_dtype == torch.float16 else None
        return MasterWeightOptimizer(optimizer, master_values=fp32_values, guard_nonfinite=guard)

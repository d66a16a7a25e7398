"""The plan as it runs on an FSDP2 model: :class:`ShardedPlan`, and the checks of its model.

FSDP2 casts the gathered parameters itself, so the plan does not convert the model or
wrap the optimizer, except under the plans whose low-precision weights are the shards
(pure, Kahan, stochastic rounding: :func:`keeps_low_shards`), whose optimizer wrapper steps
each rank's local shard. :func:`mixprec.distributed.sharded_plan` makes one from a plan.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from mixprec.dtypes import dtype_name
from mixprec.plans import Plan

__all__ = ["LOW_SHARD_FAMILIES", "ShardedPlan", "base_of", "check_fp8_layers", "check_low_shards", "keeps_low_shards"]


#: plan families whose weights are low precision without a master: sharded as they are stored
LOW_SHARD_FAMILIES = ("pure", "lowbit")


def keeps_low_shards(plan: Plan) -> bool:
    """True for a plan whose bf16/fp16 weights are themselves the FSDP2 shards (pure, Kahan,
    stochastic rounding): no master, the optimizer wrapper steps the local shards."""
    base = plan.base if isinstance(plan, ShardedPlan) and plan.base is not None else plan
    return base.family in LOW_SHARD_FAMILIES


def base_of(plan: Plan) -> Plan:
    """The plan a :class:`ShardedPlan` runs as (its base), or ``plan`` itself."""
    return plan.base if isinstance(plan, ShardedPlan) and plan.base is not None else plan


@dataclass(frozen=True)
class ShardedPlan(Plan):
    """A plan as it runs on an FSDP2 model: FSDP casts, the fp32 shards are the masters.

    Made by :func:`sharded_plan` (the front door does it when it is given an FSDP2 model).
    The model is not converted and the optimizer is not wrapped; forward and backward
    run in the base plan's autocast.
    """

    base: Plan | None = None
    param_dtype: torch.dtype | None = None

    family: ClassVar[str] = "fsdp2"
    supports_fsdp: ClassVar[bool] = True
    summary: ClassVar[str] = "FSDP2: fp32 parameter shards (the masters); all-gather and compute per the policy"

    @property
    def base_family(self) -> str:
        return self.base.family if self.base is not None else "mixed"

    @property
    def low_shards(self) -> bool:
        """The weights are low precision without a master (pure, Kahan, SR): the shards themselves."""
        return keeps_low_shards(self)

    @property
    def weight_dtype(self) -> torch.dtype:
        if self.low_shards:
            assert self.base is not None
            return self.base.weight_dtype
        return self.param_dtype or torch.float32

    @property
    def uses_autocast(self) -> bool:
        return self.base.uses_autocast if self.base is not None else super().uses_autocast

    @property
    def master_dtype(self) -> torch.dtype | None:
        return torch.float32 if self.param_dtype is not None else None

    @property
    def optimizer_state_dtype(self) -> torch.dtype:
        if self.low_shards:
            assert self.base is not None
            return self.base.optimizer_state_dtype
        return super().optimizer_state_dtype

    @property
    def grad_accum_dtype(self) -> torch.dtype:
        return self.weight_dtype if self.low_shards else torch.float32

    def state_kinds(self) -> tuple[Any, ...]:
        return self.base.state_kinds() if self.low_shards and self.base is not None else ()

    def tensor_dtypes(self) -> dict[str, str]:
        if self.low_shards:
            assert self.base is not None
            rows = self.base.tensor_dtypes()
            low = dtype_name(self.weight_dtype)
            rows["weights"] = f"{low} shards, all-gathered as stored (norm layers fp32 units)"
            rows["grads"] = f"{low} unsharded, reduce-scattered in {dtype_name(self.reduce_dtype)} into {low} shards"
            rows["all-reduce"] = f"{dtype_name(self.reduce_dtype)} (reduce-scatter)"
            return rows
        rows = super().tensor_dtypes()
        gathered = dtype_name(self.weight_dtype)
        rows["weights"] = f"fp32 shards; all-gathered as {gathered}" + (
            " (norm layers fp32)" if self.param_dtype is not None else ""
        )
        rows["grads"] = f"{gathered} unsharded, reduce-scattered in {dtype_name(self.reduce_dtype)} into fp32 shards"
        rows["master weights"] = "the fp32 shards" if self.param_dtype is not None else "none"
        rows["all-reduce"] = f"{dtype_name(self.reduce_dtype)} (reduce-scatter)"
        return rows

    def fingerprint(self) -> dict[str, str]:
        base = self.base.fingerprint() if self.base is not None else super().fingerprint()
        if self.low_shards:  # the base plan's own optimizer wrapper steps the shards
            return {**base, "family": f"fsdp2-{self.base_family}"}
        return {**base, "family": f"fsdp2-{self.base_family}", "optimizer": "plain"}

    def convert_model(self, model: torch.nn.Module) -> dict[torch.Tensor, torch.Tensor]:
        if self.low_shards:
            check_low_shards(model, self)
        if self.base_family == "fp8":
            check_fp8_layers(model, self)
        return {}

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, fp32_values: dict[torch.Tensor, torch.Tensor]
    ) -> torch.optim.Optimizer:
        if self.low_shards and self.base is not None:
            return self.base.wrap_optimizer(optimizer, {})
        return optimizer

    # The base plan's step hooks still apply on shards (its own layers, its flags).
    def before_unscale(self, model: torch.nn.Module, process_group: Any) -> None:
        if self.base is not None:
            self.base.before_unscale(model, process_group)

    def nonfinite_flag(self, model: torch.nn.Module) -> torch.Tensor | None:
        return self.base.nonfinite_flag(model) if self.base is not None else None

    def after_step(self, model: torch.nn.Module) -> None:
        if self.base is not None:
            self.base.after_step(model)

    def backward_context(self, device_type: str = "cpu") -> contextlib.AbstractContextManager[Any]:
        return self.base.backward_context(device_type) if self.base is not None else super().backward_context(device_type)

    @contextlib.contextmanager
    def autocast(self, device_type: str = "cpu") -> Iterator[None]:
        if self.base is None:
            with super().autocast(device_type):
                yield
            return
        with self.base.autocast(device_type):
            yield


def check_low_shards(model: torch.nn.Module, plan: ShardedPlan) -> None:
    """Refuse a model sharded in fp32 under a plan whose low-precision weights are the shards
    (pure, Kahan, SR): FSDP2 shards hold the weights as they were when ``fully_shard`` ran, and
    casting them afterwards would replace every parameter under the optimizer."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if trainable and not any(p.dtype == plan.weight_dtype for p in trainable):
        raise ValueError(
            f"plan {plan.name!r} trains {dtype_name(plan.weight_dtype)} weights without masters, but this FSDP2 model "
            f"was sharded with {dtype_name(trainable[0].dtype)} weights: under FSDP2 the shards are the weights, "
            "converted before sharding. Shard with mixprec.distributed.fully_shard_model(model, plan, ...) (it "
            "converts, then shards), then build the optimizer and prepare; with transformers' load-time sharding, "
            f"load in that dtype: from_pretrained(..., dtype=torch.{str(plan.weight_dtype).split('.')[-1]}, "
            "distributed_config=...) (norm layers then stay in it too)"
        )


def check_fp8_layers(model: torch.nn.Module, plan: ShardedPlan) -> None:
    """Refuse an FSDP2 model without fp8 layers under an fp8 plan: its Linear layers become fp8
    layers before sharding (replacing them afterwards would replace the sharded parameters)."""
    from mixprec.fp8.linear import Fp8Linear

    if not any(isinstance(m, Fp8Linear) or getattr(m, "_mixprec_fp8_converted", False) for m in model.modules()):
        raise ValueError(
            f"plan {plan.name!r} computes its Linear layers in fp8, but this FSDP2 model holds no fp8 layers: under "
            "FSDP2 they are swapped in before sharding. Shard with mixprec.distributed.fully_shard_model(model, plan, "
            "...) (it converts, then shards), then build the optimizer and prepare; with transformers' load-time "
            "sharding, load the model unsharded and shard it that way"
        )

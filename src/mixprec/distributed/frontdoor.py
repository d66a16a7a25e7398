"""What :class:`mixprec.MixedPrecision` asks of the distributed layer when it prepares a model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mixprec.distributed.ddp import check_prewrapped, is_ddp, plan_for_ddp
from mixprec.distributed.fsdp import (
    check_sharded_policy,
    check_tensor_parallel,
    has_fsdp,
    sharded_plan,
)
from mixprec.plans import Plan

__all__ = ["ddp_arguments", "plan_for_model"]


def plan_for_model(plan: Plan, model: torch.nn.Module, *, ddp: bool) -> Plan:
    """The plan ``prepare()`` applies to ``model``.

    - an FSDP2 model (``fully_shard`` on it or on a module inside): the plan as FSDP2 runs it (:func:`~mixprec.distributed.sharded_plan`);
    - ``ddp=True``: the plan as DDP runs it (:func:`~mixprec.distributed.plan_for_ddp`);
    - a model the user already wrapped in DDP: the plan, if it leaves the weights fp32;
    - anything else: the plan itself.
    """
    check_tensor_parallel(plan, model)
    if has_fsdp(model):  # the root or any module inside it (a framework shards inside its wrapper)
        if ddp:
            raise ValueError("prepare(ddp=True) got an FSDP2 model; it is already data-parallel, drop ddp=")
        sharded = sharded_plan(plan)
        check_sharded_policy(model, sharded)
        return sharded
    if is_ddp(model):
        if ddp:
            raise ValueError(
                "prepare(ddp=True) got a model that is already DistributedDataParallel; pass the inner module"
            )
        check_prewrapped(model, plan)
        return plan
    return plan_for_ddp(plan) if ddp else plan


def ddp_arguments(ddp: bool | Mapping[str, Any], process_group: Any) -> dict[str, Any]:
    """Keyword arguments for DDP from ``prepare(ddp=...)`` and the session's process group."""
    if not isinstance(ddp, bool | Mapping):
        raise TypeError(f"ddp= must be True/False or a dict of DistributedDataParallel arguments, got {ddp!r}")
    kwargs = dict(ddp) if isinstance(ddp, Mapping) else {}
    if process_group is not None:
        kwargs.setdefault("process_group", process_group)
    return kwargs

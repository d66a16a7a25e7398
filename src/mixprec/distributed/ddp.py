"""DistributedDataParallel with gradients reduced in the plan's reduce dtype.

With the front door, pass ``ddp=True`` (or a dict of DDP arguments) to
:meth:`mixprec.MixedPrecision.prepare`: the model is converted for the plan first and
wrapped afterwards (DDP must see the final parameter dtypes), master-weight plans
gather gradients at step time (DDP's reducer owns ``.grad``), and ``mp.autocast()``
skips the all-reduce on micro-batches that are not accumulation boundaries::

    mp = MixedPrecision(get_plan("bf16-mixed", reduce_dtype=torch.bfloat16), grad_accum_steps=2)
    model, opt = mp.prepare(model, opt, ddp=True)          # or ddp={"device_ids": [local_rank]}
    for x, y in batches:
        with mp.autocast():
            loss = criterion(model(x), y)
        mp.backward(loss)
        mp.step()

Without the front door, :func:`wrap_ddp` wraps a model yourself.

>>> from mixprec.distributed import plan_for_ddp
>>> plan_for_ddp("bf16-master").accumulate_grads_in_fp32_hooks
False
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from mixprec.distributed.comm import GradReduceHook, ReduceStats, run_hook
from mixprec.plans import Plan, get_plan

__all__ = ["check_prewrapped", "is_ddp", "plan_for_ddp", "reduce_stats", "wrap_ddp"]

_HOOK_ATTR = "mixprec_reduce_hook"


def is_ddp(model: Any) -> bool:
    """True for a DistributedDataParallel model (also inside ``torch.compile``)."""
    model = getattr(model, "_orig_mod", model)
    return isinstance(model, DistributedDataParallel)


def plan_for_ddp(plan: str | Plan) -> Plan:
    """``plan`` as it runs under DDP.

    Every plan runs unchanged under DDP: master-weight plans keep gradients in the
    model's ``.grad`` (where DDP reduces them) and gather them into the fp32 masters at
    step time. Kept so code that prepares a plan for DDP explicitly keeps working.
    """
    return get_plan(plan)


def check_prewrapped(model: torch.nn.Module, plan: Plan) -> None:
    """Refuse a model the user wrapped in DDP when the plan must change its parameter dtypes.

    DDP sizes its gradient buckets from the parameter dtypes it saw when it was built;
    casting the parameters afterwards breaks the reducer.
    """
    if plan.weight_dtype == torch.float32:
        return
    raise ValueError(
        f"prepare() got a model already wrapped in DistributedDataParallel, but plan {plan.name!r} "
        f"casts its weights to {plan.weight_dtype}, which DDP does not allow after it is built. "
        "Pass the unwrapped model and let mixprec wrap it after the conversion: "
        "mp.prepare(model, optimizer, ddp=True) (or ddp={...DDP arguments...})."
    )


def _check_no_grad_hooks(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        if getattr(p, "_post_accumulate_grad_hooks", None):
            raise ValueError(
                f"parameter {name!r} has a post-accumulate-grad hook (a master-weight optimizer prepared "
                "without DDP moves gradients out of .grad, where DDP's reducer expects them). Wrap through "
                "the front door instead: mp.prepare(model, optimizer, ddp=True)."
            )


def wrap_ddp(model: torch.nn.Module, plan: str | Plan = "bf16-mixed", **ddp_kwargs: Any) -> DistributedDataParallel:
    """Wrap ``model`` in DistributedDataParallel, reducing gradients in ``plan.reduce_dtype``.

    Args:
        model: the model, already converted for the plan (its parameters have their final
            dtypes: DDP cannot follow a later cast).
        plan: a plan name or :class:`~mixprec.Plan`; only its ``reduce_dtype`` is used here.
        **ddp_kwargs: passed to ``DistributedDataParallel`` (``device_ids`` defaults to the
            model's CUDA device when it has one).

    Returns the DDP model. Its :class:`~mixprec.distributed.GradReduceHook` (with byte
    counters) is available from :func:`reduce_stats`.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "wrap_ddp() needs an initialised process group; call torch.distributed.init_process_group() "
            "first (torchrun sets the environment for init_process_group('nccl') or ('gloo'))"
        )
    if is_ddp(model):
        raise TypeError("wrap_ddp() got a model that is already DistributedDataParallel; pass the inner module")
    plan = get_plan(plan)
    _check_no_grad_hooks(model)
    first = next(iter(model.parameters()), None)
    if first is not None and first.device.type == "cuda" and "device_ids" not in ddp_kwargs:
        ddp_kwargs["device_ids"] = [first.device]
    ddp = DistributedDataParallel(model, **ddp_kwargs)
    hook = GradReduceHook(plan.reduce_dtype, process_group=ddp.process_group)
    ddp.register_comm_hook(hook, run_hook)
    setattr(ddp, _HOOK_ATTR, hook)
    return ddp


def reduce_stats(model: torch.nn.Module) -> ReduceStats:
    """The byte and call counters of the communication hook :func:`wrap_ddp` installed on ``model``.

    Accepts the DDP model or a ``torch.compile`` of it.
    """
    inner = getattr(model, "_orig_mod", model)
    hook = getattr(inner, _HOOK_ATTR, None)
    if not isinstance(hook, GradReduceHook):
        raise ValueError(
            "this model has no mixprec communication hook; wrap it with mixprec.distributed.wrap_ddp() "
            "or prepare(..., ddp=True)"
        )
    return hook.stats

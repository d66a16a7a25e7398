"""FSDP2 (``fully_shard``) under a precision plan.

FSDP2 keeps each rank's shard of every parameter in its original dtype and casts the
all-gathered (unsharded) parameters to ``MixedPrecisionPolicy.param_dtype`` for the
forward and backward. That is master-weight training by construction: the fp32 shards
are the masters, the optimizer updates them, and no separate master copy exists.
:func:`fsdp_policy` derives the policy from a plan:

============  =====================  ======================  ==================================
plan family   ``param_dtype``        ``reduce_dtype``        how it computes
============  =====================  ======================  ==================================
fp32 / tf32   None (fp32)            ``plan.reduce_dtype``   fp32
``*-mixed``   None (fp32)            ``plan.reduce_dtype``   autocast casts per op, as without FSDP
``*-master``  the compute dtype      ``plan.reduce_dtype``   bf16/fp16 weights; norm layers in
                                                              one fp32 unit

``*-pure``     None (as stored)       ``plan.reduce_dtype``   bf16/fp16 shards, no master: the
``*-kahan``                                                   optimizer wrapper steps each rank's
``bf16-sr``                                                   local shard (compensation sharded
                                                              like the weights); norm layers in
                                                              one fp32 unit, islands in their own
============  =====================  ======================  ==================================

The plans without masters keep their low-precision weights as the shards themselves:
:func:`fully_shard_model` converts the model for the plan first (the plan's casts, islands,
fp32 norm layers), then shards it. Their optimizer wrappers update elementwise, so each
rank steps its own shard (Adam, AdamW and SGD, and the other elementwise torch optimizers);
Kahan compensation and optimizer state are DTensors sharded like the weights, and
stochastic rounding draws different noise per shard (replicas of one shard, under HSDP,
the same). fp8 plans swap their Linear layers for fp8 layers before sharding: FSDP2 gathers
the fp32 weights, the layers quantise them, and the amaxes are MAX-reduced over the ranks once
per step, as under DDP. Remainder masters (``remainders=True``: FSDP2's fp32 shards are the
masters already) are refused.

>>> from mixprec.distributed import fsdp_policy
>>> policy = fsdp_policy("bf16-master")
>>> policy.param_dtype, policy.reduce_dtype
(torch.bfloat16, torch.float32)

With the front door::

    mp = MixedPrecision("bf16-master")
    model = fully_shard_model(model, mp.plan, units=(Block,))   # after init_process_group
    opt = torch.optim.AdamW(model.parameters())                 # over the fp32 shards
    model, opt = mp.prepare(model, opt)                         # sees FSDP2: no cast, no master copy

The loss scaler unscales and checks the local shards (the found-inf flag is
all-reduced), and ``StepResult.grad_norm`` is the norm of the whole (unsharded)
gradient: squared norms of the local shards are summed across the shard group.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mixprec.distributed.fsdp_plan import LOW_SHARD_FAMILIES as LOW_SHARD_FAMILIES
from mixprec.distributed.fsdp_plan import ShardedPlan, base_of, keeps_low_shards
from mixprec.distributed.fsdp_plan import check_fp8_layers as check_fp8_layers
from mixprec.distributed.fsdp_plan import check_low_shards as check_low_shards
from mixprec.dtypes import dtype_name
from mixprec.plans import NORM_LAYERS, Plan, get_plan

__all__ = [
    "ShardedPlan",
    "check_tensor_parallel",
    "fsdp_policy",
    "fully_shard_model",
    "has_dtensor",
    "has_fsdp",
    "is_fsdp",
    "local_tensor",
    "sharded_plan",
    "tensor_parallel",
    "total_grad_norm",
]


def _fsdp_api() -> Any:
    """The module holding ``fully_shard``, ``MixedPrecisionPolicy`` and ``FSDPModule``."""
    if not dist.is_available():
        raise RuntimeError("FSDP2 needs torch.distributed, which this torch build lacks")
    try:
        import torch.distributed.fsdp as api

        if hasattr(api, "fully_shard"):
            return api
    except ImportError:  # pragma: no cover - very old torch
        pass
    try:  # torch 2.4 / 2.5
        import torch.distributed._composable.fsdp as api  # type: ignore[no-redef]
    except ImportError as e:  # pragma: no cover
        raise RuntimeError(f"this torch ({torch.__version__}) has no FSDP2 (fully_shard); upgrade to torch >= 2.5") from e
    return api


def fsdp_policy(plan: str | Plan) -> Any:
    """The ``MixedPrecisionPolicy`` for FSDP2 that makes it compute as ``plan`` says.

    ``param_dtype`` is the plan's weight dtype when that is a low-precision dtype
    (master plans) and None otherwise; ``reduce_dtype`` is ``plan.reduce_dtype``.
    """
    plan = get_plan(plan)
    base = plan.base if isinstance(plan, ShardedPlan) and plan.base is not None else plan
    if not base.supports_fsdp:
        raise ValueError(
            f"plan {plan.name!r} ({base.family}) is not supported under FSDP2: its layers are not written for "
            "sharded parameters. Use a '*-mixed', '*-master', '*-pure', '*-kahan' or 'bf16-sr' plan."
        )
    if getattr(base, "remainders", False):
        raise ValueError(
            f"plan {plan.name!r} keeps its masters as remainders (remainders=True), which FSDP2 does not need: its "
            "fp32 shards are the masters, sharded (4 B per parameter / world size). Use get_plan('bf16-master') "
            "under FSDP2, or 'bf16-kahan' for 2 B of compensation per parameter and bf16 optimizer state."
        )
    weight = plan.weight_dtype
    # low-precision shards (pure, Kahan, SR) are all-gathered as they are stored
    param_dtype = None if weight == torch.float32 or keeps_low_shards(base) else weight
    return _fsdp_api().MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=plan.reduce_dtype, output_dtype=None, cast_forward_inputs=True
    )


def is_fsdp(model: Any) -> bool:
    """True for a module ``fully_shard`` was applied to (FSDP2)."""
    if "torch.distributed.fsdp" not in sys.modules and "torch.distributed._composable.fsdp" not in sys.modules:
        return False  # nothing can have been sharded without importing FSDP
    model = getattr(model, "_orig_mod", model)
    try:
        return isinstance(model, _fsdp_api().FSDPModule)
    except (RuntimeError, AttributeError):  # pragma: no cover
        return False


def has_fsdp(model: Any) -> bool:
    """True when ``fully_shard`` was applied to ``model`` or to any module inside it (FSDP2):
    frameworks shard inside a wrapper (Lightning's ``configure_model`` shards ``self.net``)."""
    if "torch.distributed.fsdp" not in sys.modules and "torch.distributed._composable.fsdp" not in sys.modules:
        return False  # nothing can have been sharded without importing FSDP
    model = getattr(model, "_orig_mod", model)
    return isinstance(model, torch.nn.Module) and any(is_fsdp(m) for m in model.modules())


def _gather_dtypes(model: torch.nn.Module) -> dict[str, torch.dtype | None]:
    """The ``param_dtype`` each FSDP2 unit of ``model`` that holds parameters all-gathers in, by
    module name; norm-layer units (fp32 by design: :func:`fully_shard_model` makes them so) left out."""
    found: dict[str, torch.dtype | None] = {}
    for name, module in model.named_modules():
        if not is_fsdp(module) or isinstance(module, NORM_LAYERS):
            continue
        state = module._get_fsdp_state()  # type: ignore[operator]
        group = getattr(state, "_fsdp_param_group", None)
        if group is not None and getattr(group, "mp_policy", None) is not None:
            found[name or "<root>"] = group.mp_policy.param_dtype
    return found


def check_sharded_policy(model: torch.nn.Module, plan: ShardedPlan) -> None:
    """Refuse a model sharded without the plan's all-gather dtype: under a master plan
    (``plan.param_dtype`` bf16/fp16) every FSDP2 unit but norm layers must gather the fp32
    shards in that dtype, or those units would compute in another dtype than the plan says,
    without a word. (fp32 shards under a mixed plan are cast per op by autocast: any policy.)"""
    if plan.low_shards:
        _check_low_units(model, plan)
        return
    if plan.param_dtype is None:
        return
    wrong = {name: dtype for name, dtype in _gather_dtypes(model).items() if dtype != plan.param_dtype}
    if not wrong:
        return
    units = ", ".join(f"{name} ({dtype_name(dtype) if dtype is not None else 'fp32: no param_dtype'})"
                      for name, dtype in sorted(wrong.items())[:4]) + (", ..." if len(wrong) > 4 else "")
    raise ValueError(
        f"plan {plan.name!r} under FSDP2 all-gathers the fp32 shards in {dtype_name(plan.param_dtype)}, but "
        f"{len(wrong)} fully_shard unit(s) of this model gather otherwise: {units}; they would compute in that "
        "dtype. Pass mp_policy=mixprec.distributed.fsdp_policy(plan) to each fully_shard call (in Lightning's "
        "configure_model too), or shard with mixprec.distributed.fully_shard_model(module, plan, mesh=...)"
        + (" (transformers' load-time sharding: DistributedConfig(..., fsdp_mixed_precision=True))"
           if plan.param_dtype == torch.bfloat16 else
           " (transformers' load-time sharding gathers in fp32, or bf16 with fsdp_mixed_precision=True, never in "
           "fp16: there train 'fp16-mixed' loaded in fp32, or 'fp16-pure' loaded with dtype=torch.float16)"
           if plan.param_dtype == torch.float16 else "")
        + "; or use a '*-mixed' plan, which casts per op"
    )


def _check_low_units(model: torch.nn.Module, plan: ShardedPlan) -> None:
    """Under a plan whose low-precision weights are the shards, every FSDP2 unit must gather its
    weights as they are stored (``param_dtype`` None or their own dtype) and hold one dtype:
    an fp32 norm layer gathered in bf16 would compute in bf16, a unit of bf16 and fp32 weights
    fails in FSDP's first backward."""
    seen: set[int] = set()
    for name, module in model.named_modules():
        if not is_fsdp(module):
            continue
        state = module._get_fsdp_state()  # type: ignore[operator]
        group = getattr(state, "_fsdp_param_group", None)
        if group is None or id(group) in seen:
            continue
        seen.add(id(group))
        dtypes = {fp.sharded_param.dtype for fp in group.fsdp_params if fp.sharded_param.requires_grad}
        gather = getattr(group.mp_policy, "param_dtype", None)
        unit = name or "<root>"
        if len(dtypes) > 1 or (gather is not None and dtypes and gather not in dtypes):
            stored = ", ".join(sorted(dtype_name(d) for d in dtypes))
            raise ValueError(
                f"plan {plan.name!r} under FSDP2 keeps its weights as the shards and gathers them as stored, but unit "
                f"{unit!r} holds {stored} weights" + (f" gathered as {dtype_name(gather)}" if gather is not None else "")
                + ": shard with mixprec.distributed.fully_shard_model(model, plan, ...) (fp32 norm layers and islands "
                "go to fp32 units), or pass mp_policy=fsdp_policy(plan) and keep fp32 layers in units of their own"
            )


def tensor_parallel(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds DTensor parameters that FSDP2 did not make alone: tensor parallelism
    (``parallelize_module``), by itself or under FSDP2 (2-D: FSDP2 sharded parameters that were
    DTensors already; HSDP's 2-D shards are not)."""
    params = list(model.parameters())
    if not has_dtensor(params):
        return False
    if not has_fsdp(model):
        return True
    for module in model.modules():  # FSDP2 records whether each parameter it sharded was a DTensor already
        if is_fsdp(module):
            group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)  # type: ignore[operator]
            if group is not None and any(getattr(fp, "is_dtensor", False) for fp in group.fsdp_params):
                return True
    return False


def check_tensor_parallel(plan: Plan, model: torch.nn.Module) -> None:
    """Refuse a plan that does not run on tensor-parallel (DTensor) weights, naming what does."""
    if base_of(plan).family != "fp8" or not tensor_parallel(model):
        return
    raise ValueError(
        f"plan {plan.name!r} under tensor parallelism (parallelize_module) is not supported: its fp8 layers quantise "
        "whole weights, and a tensor-parallel Linear holds one shard as a DTensor. Use 'bf16-mixed' or "
        "'bf16-master' (every other plan runs on tensor-parallel models, with FSDP2 too), or fp8-mixed under DDP or "
        "FSDP2 alone (fully_shard_model(model, 'fp8-mixed'))"
    )


def fully_shard_model(
    model: torch.nn.Module,
    plan: str | Plan,
    *,
    mesh: Any = None,
    units: Sequence[type[torch.nn.Module]] | Callable[[str, torch.nn.Module], bool] = (),
    **fully_shard_kwargs: Any,
) -> torch.nn.Module:
    """Apply FSDP2 to ``model`` with the policy of ``plan``, bottom-up.

    Args:
        model: an fp32 model on its device (CPU with gloo, or CUDA with NCCL). Under a plan
            without masters (pure, Kahan, SR) it is first converted as the plan says (its
            low-precision weights become the shards; fp32 norm layers and islands their own units).
        plan: the plan the run uses (also pass it to :class:`~mixprec.MixedPrecision`).
        mesh: a 1-D ``DeviceMesh`` (default: all ranks, on the model's device type).
        units: module classes (or a ``(qualified_name, module) -> bool`` predicate) that each
            become their own FSDP unit, e.g. the transformer block class; the root is
            always one. Norm layers a plan keeps in fp32 while the rest gathers in low
            precision form one fp32 unit together, gathered at the first of them and kept
            until the backward; fp32 islands (pure, Kahan and SR plans) are fp32 units of
            their own.
        **fully_shard_kwargs: passed to ``fully_shard`` (``reshard_after_forward``, ...).

    Returns the same module object, now an ``FSDPModule``.
    """
    plan = get_plan(plan)
    check_tensor_parallel(plan, model)
    api = _fsdp_api()
    policy = fsdp_policy(plan)
    low_shards = keeps_low_shards(plan)
    fp8 = base_of(plan).family == "fp8"
    if low_shards or fp8:
        if has_fsdp(model):
            what = "a plan without masters" if low_shards else "an fp8 plan (its Linear layers become fp8 layers)"
            raise ValueError(
                f"fully_shard_model(plan={plan.name!r}) got a model already sharded: {what} converts "
                "the model before sharding it. Pass the unsharded model"
            )
        _convert_for(model, base_of(plan))
        if fp8:  # (a model whose Linear layers are none of them eligible holds no fp8 layer, rightly)
            model._mixprec_fp8_converted = True  # type: ignore[assignment]
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        first = next(iter(model.parameters()), None)
        device_type = first.device.type if first is not None else "cpu"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    match = units if callable(units) else _by_class(tuple(units))
    fp32_policy = api.MixedPrecisionPolicy(param_dtype=None, reduce_dtype=plan.reduce_dtype)
    modules = list(model.named_modules())

    def fp32_own(module: torch.nn.Module) -> bool:  # its own parameters stay fp32 while the rest gathers low
        own = list(module.parameters(recurse=False))
        return bool(own) and (
            (policy.param_dtype is not None and isinstance(module, NORM_LAYERS))
            or (low_shards and any(p.dtype != plan.weight_dtype for p in own))
        )

    # norm layers (leaves, a negligible share of the weights): one fp32 unit for all of them,
    # gathered at the first and kept until the backward, instead of a unit (a gather and four
    # hooks of host time) each
    norms = [m for _, m in modules if m is not model and isinstance(m, NORM_LAYERS) and fp32_own(m)]
    if norms:
        api.fully_shard(norms, mesh=mesh, mp_policy=fp32_policy, **{**fully_shard_kwargs, "reshard_after_forward": False})
    grouped = {id(m) for m in norms}
    for name, module in reversed(modules):  # children before parents
        if module is model or id(module) in grouped:
            continue
        if fp32_own(module):  # an fp32 island: its own fp32 unit (a unit all-gathers one dtype)
            api.fully_shard(module, mesh=mesh, mp_policy=fp32_policy, **fully_shard_kwargs)
        elif match(name, module):
            api.fully_shard(module, mesh=mesh, mp_policy=policy, **fully_shard_kwargs)
    api.fully_shard(model, mesh=mesh, mp_policy=policy, **fully_shard_kwargs)
    return model


def _convert_for(model: torch.nn.Module, plan: Plan) -> None:
    """Cast an unsharded ``model`` as ``plan`` does at ``prepare()`` (its islands back in fp32)."""
    from mixprec.islands import apply_fp32_islands

    plan.convert_model(model)
    if plan.policy is not None and plan.policy.fp32_modules:
        apply_fp32_islands(model, plan.policy)


def _by_class(classes: tuple[type[torch.nn.Module], ...]) -> Callable[[str, torch.nn.Module], bool]:
    def match(name: str, module: torch.nn.Module) -> bool:
        return bool(classes) and isinstance(module, classes)

    return match


def sharded_plan(plan: str | Plan) -> ShardedPlan:
    """``plan`` as it runs on an FSDP2 model (see :class:`ShardedPlan`); refuses unsupported plans."""
    plan = get_plan(plan)
    if isinstance(plan, ShardedPlan):
        return plan
    policy = fsdp_policy(plan)
    return ShardedPlan(
        name=plan.name,
        compute_dtype=plan.compute_dtype,
        scaling=plan.scaling,
        policy=plan.policy,
        reduce_dtype=plan.reduce_dtype,
        base=plan,
        param_dtype=policy.param_dtype,
    )


# ------------------------------------------------------------------ sharded gradients
def _dtensor_type() -> Any:
    mod = sys.modules.get("torch.distributed.tensor")
    return None if mod is None else getattr(mod, "DTensor", None)


def has_dtensor(tensors: Sequence[torch.Tensor]) -> bool:
    """True if any of ``tensors`` is a DTensor (cheap: False without importing DTensor)."""
    cls = _dtensor_type()
    return cls is not None and any(isinstance(t, cls) for t in tensors)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a tensor sharing its storage), or ``t`` itself."""
    cls = _dtensor_type()
    if cls is not None and isinstance(t, cls):
        return t._local_tensor  # the storage itself: in-place ops act on the shard
    return t


def total_grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all of ``grads`` taken together, as if no tensor were sharded.

    Plain tensors count as they are (under DDP they are identical on every rank).
    For DTensors the squared norms of the local shards are summed over every mesh
    dimension the tensor is sharded (or partial) on; replicated dimensions are not
    counted twice. The result is an fp32 0-dim tensor, equal on all ranks.
    """
    if not grads:
        return torch.zeros(())
    cls = _dtensor_type()
    device = local_tensor(grads[0]).device
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    plain: list[torch.Tensor] = []
    sharded: dict[tuple[Any, tuple[Any, ...]], list[torch.Tensor]] = {}
    for g in grads:
        if cls is not None and isinstance(g, cls):
            sharded.setdefault((g.device_mesh, tuple(g.placements)), []).append(g._local_tensor)
        else:
            plain.append(g)
    if plain:
        total_sq = total_sq + _sum_of_squares(plain, device)
    for (mesh, placements), locals_ in sharded.items():
        sq = _sum_of_squares(locals_, device)
        for mesh_dim, placement in enumerate(placements):
            if placement.is_replicate():
                continue
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=mesh.get_group(mesh_dim))
        total_sq = total_sq + sq
    return total_sq.sqrt()


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    norms: list[torch.Tensor] = []
    for ts in groups.values():
        norms.extend(n.to(device) for n in torch._foreach_norm(ts, 2.0, dtype=torch.float32))
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(norms).square().sum()

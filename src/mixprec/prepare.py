"""Preparing a model and its optimizers for a plan: what :meth:`mixprec.MixedPrecision.prepare` does.

The steps, in order: choose the plan as it runs on this model (FSDP2, DDP), convert
the model (:meth:`Plan.convert_model`), turn fp32 islands back to fp32, cast inputs for
plans without autocast (:attr:`Plan.input_dtype`), wrap in DDP after the conversion, and
compile. Optimizers are checked against the prepared model and wrapped by the plan.
The diagnostics use the same functions to prepare shadow copies.

A prepared model stays an ordinary module: ``copy.deepcopy``, ``torch.save`` /
``torch.load(..., weights_only=False)`` and ``state_dict`` / ``load_state_dict`` of a copy
behave as for the original. What mixprec puts on the model is picklable and refers to the
model it sits on. A copy (an EMA or evaluation copy) keeps what makes it compute in the
plan's precision: its dtypes, fp32 islands (:mod:`mixprec.islands`), the pure plans' input
cast, fp8 layers and their state, and load hooks that reach no optimizer of the run
(:mod:`mixprec.optim.follow`). It is not part of the run, so it does not carry the
session's objects: the buffer guard's and the overflow tracer's hooks become no-ops in
the copy (:mod:`mixprec.buffers`, :mod:`mixprec.tracing`).

>>> import torch
>>> from mixprec.plans import get_plan
>>> from mixprec.prepare import prepare_model, wrap_optimizers
>>> model = torch.nn.Linear(4, 2)
>>> prepared = prepare_model(model, get_plan("bf16-pure"))
>>> model.weight.dtype, prepared.plan.input_dtype
(torch.bfloat16, torch.bfloat16)
>>> opt, = wrap_optimizers(prepared, [torch.optim.SGD(model.parameters(), lr=0.1)])
>>> type(opt).__name__
'LowPrecisionOptimizer'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec.compiling import check_compiler
from mixprec.distributed.ddp import is_ddp, wrap_ddp
from mixprec.distributed.frontdoor import ddp_arguments, plan_for_model
from mixprec.distributed.fsdp import has_dtensor, has_fsdp
from mixprec.dtypes import cast_floating
from mixprec.islands import (
    apply_fp32_islands,
    fp32_island_names,
    install_input_cast,
    match_fp32_modules,
)
from mixprec.nested import first_tensor
from mixprec.optim.follow import Seeds, install_load_hooks, register
from mixprec.plans import Plan
from mixprec.tracing import OverflowTracer

__all__ = ["Fp32Criterion", "PreparedModel", "check_optimizers", "check_parameters", "check_shared", "prepare_model", "wrap_optimizers"]


@dataclass
class PreparedModel:
    """What :func:`prepare_model` made of a model.

    Attributes:
        model: the converted model (wrapped in DDP when asked); its parameters are the
            ones optimizers must hold.
        module: what the training loop calls (``model``, or ``torch.compile(model)``).
        plan: the plan as it runs on this model (FSDP2 and DDP adjust it).
        device: the device the model lives on.
        ddp: gradients are reduced by DDP (asked for, or the model arrived wrapped).
        fp32_values: fp32 values of what the conversion cast down (seeds for master
            weights), for trainable parameters no optimizer holds yet; a load into such a
            parameter replaces its seed (:class:`mixprec.optim.follow.Seeds`).
        uncovered: trainable parameters no optimizer holds yet (their gradients are
            cleared with the optimizers').
        hooks: hook handles installed on the model (input casting, loads that masters follow).
        tracer: the overflow tracer, when asked for.
        parameters: the converted model's parameters (optimizers must hold only these).
        dtypes: a parameter of each dtype the conversion left (the first one met), to find a
            cast of the whole model after ``prepare`` cheaply (:meth:`check_dtypes`).
    """

    model: torch.nn.Module
    module: Any
    plan: Plan
    device: torch.device
    ddp: bool = False
    fp32_values: Seeds = field(default_factory=Seeds)
    uncovered: list[torch.Tensor] = field(default_factory=list)
    hooks: list[Any] = field(default_factory=list)
    tracer: OverflowTracer | None = None
    parameters: set[torch.Tensor] = field(default_factory=set)
    dtypes: tuple[tuple[torch.Tensor, torch.dtype], ...] = ()
    bound: bool = False  # check_bound() found every optimizer holding the model's parameters

    def check_bound(self, optimizers: Sequence[torch.optim.Optimizer], caller: str) -> None:
        """Refuse an optimizer holding parameters the model no longer has: built before the
        model's parameters were replaced (FSDP's ``fully_shard``, run by a framework's setup after
        the optimizer was made, or a tensor-parallel plan, swaps parameters for sharded ones), it
        would step tensors the model does not use, without a word. Every optimizer held only the
        model's parameters at ``prepare()`` (:func:`check_optimizers`). Checked at the first step,
        then no more."""
        if self.bound:
            return
        current = {id(p) for p in self.model.parameters()}
        for opt in optimizers:
            kind_params = getattr(opt, "kind_params", None)  # a wrapper: the model-side parameters
            held = list(kind_params()) if kind_params is not None else [
                p for g in opt.param_groups for p in g["params"]
            ]
            stale = [p for p in held if id(p) not in current]
            if not stale:
                continue
            if _tensor_parallel_since(self.model, stale):
                raise RuntimeError(
                    f"{caller}: optimizer {type(opt).__name__} holds {len(stale)} of its {len(held)} parameters that "
                    "the model no longer has: the model was tensor-parallelised (torch.distributed.tensor.parallel."
                    "parallelize_module, which replaces each parallelised parameter by a DTensor) after mixprec "
                    "prepared it, so the optimizer would step tensors the model does not use. Parallelise first, then "
                    "build the optimizer over the DTensor parameters and prepare: model = parallelize_module(model, "
                    "mesh, plan); optimizer = torch.optim.AdamW(model.parameters()); model, optimizer = "
                    "mp.prepare(model, optimizer) (with FSDP2 too: parallelize_module, then "
                    "mixprec.distributed.fully_shard_model(model, plan, mesh=mesh['dp']), then the optimizer and "
                    "prepare; see docs/distributed.md, 'Tensor parallelism')"
                )
            raise RuntimeError(
                f"{caller}: optimizer {type(opt).__name__} holds {len(stale)} of its {len(held)} parameters that the "
                "model no longer has: its steps would leave the model's parameters as they are. They were replaced "
                "after the optimizer was built over them: sharding (fully_shard, or a framework's setup of a "
                "ModelParallelStrategy) swaps parameters for sharded ones. Shard the model before mixprec converts "
                "it and build the optimizer over the sharded parameters: model = "
                "mixprec.distributed.fully_shard_model(model, plan); optimizer = "
                "torch.optim.AdamW(model.parameters()); then mp.prepare(model, optimizer), or with Fabric "
                "mixprec.integrations.lightning.setup(fabric, model, optimizer) under a strategy that does not "
                "shard again (a ModelParallelStrategy whose parallelize_fn returns the model as it is)"
            )
        self.bound = True

    def check_dtypes(self, caller: str) -> None:
        """Refuse to train on after the model was cast (``model.to(dtype)``, ``.half()``,
        ``.float()``) since :func:`prepare_model`: the optimizers' masters, compensation and
        state, the input cast and the fp32 islands describe the dtypes it prepared.
        A few dtype reads: the first parameter of each prepared dtype is checked."""
        for param, dtype in self.dtypes:
            if param.dtype != dtype:
                self._cast_error(param, dtype, caller)

    def _cast_error(self, param: torch.Tensor, dtype: torch.dtype, caller: str) -> None:
        name = next((n for n, p in self.model.named_parameters() if p is param), "?")
        raise RuntimeError(
            f"{caller}: parameter {name!r} was prepared as {dtype} for plan {self.plan.name!r} and is "
            f"{param.dtype} now: the model was cast after prepare() (model.to(dtype), .half(), .float() or "
            ".bfloat16()), and the optimizers' master weights, compensation and state, the input cast and the "
            "fp32 islands no longer match it. Cast the model before prepare(), or prepare it again for its "
            "new dtypes: a new MixedPrecision(...).prepare(model, optimizer) with an optimizer built over "
            "model.parameters() (carry training state over with state_dict()/load_state_dict())"
        )


def _tensor_parallel_since(model: torch.nn.Module, stale: list[torch.Tensor]) -> bool:
    """Whether the parameters that replaced ``stale`` ones are DTensors of tensor parallelism
    (``parallelize_module``), not FSDP2 shards: the model holds DTensor parameters, no FSDP2
    unit, and the stale ones were plain."""
    if has_fsdp(model) or any(has_dtensor([p]) for p in stale):
        return False
    return has_dtensor(list(model.parameters()))


def _sparse_modules(model: torch.nn.Module, plan: Plan) -> list[str]:
    """Trainable ``sparse=True`` embeddings the plan would cast down (outside fp32 islands)."""
    islands = fp32_island_names(model)
    if plan.policy is not None and plan.policy.fp32_modules:
        islands += match_fp32_modules(model, plan.policy)
    found = []
    for name, module in model.named_modules():
        if (
            isinstance(module, torch.nn.Embedding | torch.nn.EmbeddingBag)
            and module.sparse
            and module.weight.requires_grad
            and not any(name == i or name.startswith(f"{i}.") or i == "" for i in islands)
        ):
            found.append(f"{type(module).__name__} {name!r}")
    return found


def check_parameters(model: torch.nn.Module, plan: Plan) -> None:
    """Refuse, before anything is converted, parameters ``plan`` cannot train: sparse
    gradients where its optimizer wrapper expands them densely (pure, Kahan and
    stochastic-rounding plans: :attr:`Plan.supports_sparse_grads`)."""
    if plan.supports_sparse_grads:
        return
    sparse = _sparse_modules(model, plan)
    if sparse:
        raise ValueError(
            f"plan {plan.name!r} cannot train sparse gradients: {', '.join(sparse)} "
            "(nn.Embedding(sparse=True) / nn.EmbeddingBag(sparse=True)) would get a low-precision weight "
            "whose optimizer wrapper expands every gradient to fp32 densely. Build it with sparse=False, keep "
            "it in fp32 (get_plan(name, fp32_modules=[...])), or use a plan with fp32 weights or masters "
            "('bf16-mixed', 'bf16-master', 'fp32')"
        )


def _model_device(model: torch.nn.Module, device: torch.device | None) -> torch.device:
    first = next(iter(model.parameters()), None)
    if device is None:
        return first.device if first is not None else torch.device("cpu")
    if first is not None and first.device.type == "meta" and device.type != "meta":
        raise ValueError(
            f"MixedPrecision(device={str(device)!r}) but the model's parameters are on 'meta' (not materialized "
            f"yet). Prepare the meta model without device= (it is converted as it is; materialize it later with "
            f"model.to_empty(device={str(device)!r}) and initialise it), or materialize it first"
        )
    if first is not None and first.device.type != device.type:
        raise ValueError(
            f"MixedPrecision(device={str(device)!r}) but the model's parameters are on "
            f"{str(first.device)!r}: autocast would not apply to them. Move the model first "
            f"(model.to({str(device)!r})) or drop device="
        )
    return device


def prepare_model(
    model: torch.nn.Module,
    plan: Plan,
    *,
    device: torch.device | None = None,
    ddp: bool | Mapping[str, Any] = False,
    process_group: Any = None,
    compile: bool = False,
    trace_overflow: bool = False,
) -> PreparedModel:
    """Convert ``model`` in place for ``plan`` (see the module docs for the steps)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"prepare() expects an nn.Module first, got {type(model).__name__}")
    device = _model_device(model, device)
    ddp_kwargs = ddp_arguments(ddp, process_group) if ddp is not False else None
    plan = plan_for_model(plan, model, ddp=ddp_kwargs is not None)
    check_parameters(model, plan)
    fp32_values = plan.convert_model(model)
    if plan.policy is not None and plan.policy.fp32_modules:
        # After the conversion: islands turn their own parameters back to fp32.
        apply_fp32_islands(model, plan.policy)
        fp32_values = {p: v for p, v in fp32_values.items() if p.dtype != torch.float32}
    seeds = Seeds((p, v) for p, v in fp32_values.items() if p.requires_grad)  # frozen weights get no master
    register(seeds, seeds)
    prepared = PreparedModel(
        model=model,
        module=model,
        plan=plan,
        device=device,
        fp32_values=seeds,
        hooks=install_load_hooks(model),
        parameters=set(model.parameters()),
        # Parameters no optimizer holds (frozen ones, say): their gradients are cleared too.
        uncovered=[p for p in model.parameters() if p.requires_grad],
    )
    firsts: dict[torch.dtype, torch.Tensor] = {}
    for p in model.parameters():
        firsts.setdefault(p.dtype, p)
    prepared.dtypes = tuple((p, dtype) for dtype, p in firsts.items())
    if trace_overflow:  # on the inner model, before DDP/compile wrap it
        prepared.tracer = OverflowTracer(model)
    if plan.input_dtype is not None:
        prepared.hooks.extend(install_input_cast(model, plan.input_dtype))
    prepared.ddp = ddp_kwargs is not None or is_ddp(model)
    if ddp_kwargs is not None:  # after the conversion: DDP must see the final dtypes
        model = prepared.model = wrap_ddp(model, plan, **ddp_kwargs)
    if compile:
        check_compiler()  # an unusable TORCHINDUCTOR_CACHE_DIR: an error that names it and the fix
    prepared.module = torch.compile(model) if compile else model
    return prepared


def check_optimizers(
    prepared: PreparedModel, optimizers: Sequence[Any], existing: Sequence[torch.optim.Optimizer], caller: str
) -> None:
    """Refuse what is not a torch optimizer over ``prepared``'s parameters, is given twice, or
    holds a parameter another optimizer holds (its gradient would be unscaled, clipped and
    stepped once per optimizer, and a master plan would keep two diverging masters)."""
    seen = {id(o) for o in existing} | {id(getattr(o, "optimizer", o)) for o in existing}
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer):
            hint = "; pass scheduler= and criterion= by keyword" if caller == "prepare()" else ""
            raise TypeError(f"{caller} expects torch optimizers, got {type(opt).__name__}{hint}")
        if id(opt) in seen:
            raise ValueError(
                f"the same {type(opt).__name__} was passed twice to {caller}; it would step twice per "
                "iteration. Pass each optimizer once"
            )
        seen.add(id(opt))
        foreign = [p for g in opt.param_groups for p in g["params"] if p not in prepared.parameters]
        if foreign:
            raise ValueError(
                f"{len(foreign)} parameter(s) of the {type(opt).__name__} passed to {caller} are not "
                "parameters of the prepared model (was the optimizer built over another model or a copy?). "
                "Build the optimizer over model.parameters() of the model you pass to prepare()"
            )
    check_shared(prepared.model, optimizers, caller, _holders(prepared, existing), start=len(existing) + 1)


def _holders(prepared: PreparedModel, existing: Sequence[torch.optim.Optimizer]) -> dict[int, str]:
    """``id(param)`` -> which of the optimizers prepared so far holds it (groups added since
    included; a master-weight wrapper holds the parameters it keeps masters of)."""
    held: dict[int, str] = {}
    for index, opt in enumerate(existing, start=1):
        label = _owner_label(getattr(opt, "optimizer", opt), index)
        held.update(dict.fromkeys((id(p) for g in opt.param_groups for p in g["params"]), label))
        master_of = getattr(opt, "master_of", None)
        if callable(master_of):
            held.update({id(p): label for p in prepared.parameters if master_of(p) is not None})
    return held


def check_shared(
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    caller: str,
    owners: Mapping[int, str] | None = None,
    start: int = 1,
) -> None:
    """Refuse a parameter held by two of ``optimizers`` (numbered from ``start``), or by one of
    them and an optimizer already prepared (``owners``: ``id(param)`` -> which). Each step
    unscales, clips and steps every optimizer's gradients once, so a shared parameter would be
    unscaled twice (fp16 plans) or get two diverging fp32 masters (master plans). The front
    door checks before it converts anything."""
    held = dict(owners or {})
    unique = {id(opt): opt for opt in optimizers}  # one passed twice is refused as such
    for index, opt in enumerate(unique.values(), start=start):
        label = _owner_label(opt, index)
        for p in (p for g in opt.param_groups for p in g["params"]):
            if id(p) in held and held[id(p)] != label:
                name = next((n for n, q in model.named_parameters() if q is p), "?")
                raise ValueError(
                    f"parameter {name!r} is held by two optimizers ({held[id(p)]} and {label}, passed to "
                    f"{caller}): mixprec unscales, clips and steps each optimizer's gradients once per step, so a "
                    "shared parameter would be unscaled twice (fp16 plans) or get two diverging fp32 masters "
                    "(master plans). Give each parameter to one optimizer (param groups give parts of it "
                    "other settings)"
                )
            held[id(p)] = label


def _owner_label(opt: torch.optim.Optimizer, index: int) -> str:
    return f"the {type(opt).__name__} that is optimizer {index}"


def wrap_optimizers(
    prepared: PreparedModel,
    optimizers: Sequence[torch.optim.Optimizer],
    existing: Sequence[torch.optim.Optimizer] = (),
    caller: str = "prepare()",
) -> list[Any]:
    """The plan's wrappers around ``optimizers`` (checked first against ``existing``: :func:`check_optimizers`)."""
    check_optimizers(prepared, optimizers, existing, caller)
    covered = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
    prepared.uncovered = [p for p in prepared.uncovered if id(p) not in covered]
    wrapped = [prepared.plan.wrap_optimizer(opt, prepared.fp32_values) for opt in optimizers]
    for p in [p for p in prepared.fp32_values if id(p) in covered]:  # used: keep no second copy alive
        del prepared.fp32_values[p]
    return wrapped


class Fp32Criterion(torch.nn.Module):
    """Computes a loss in fp32 from low-precision outputs (autocast off, floating inputs upcast)."""

    def __init__(self, criterion: Any) -> None:
        super().__init__()
        self.criterion = criterion

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args = cast_floating(args, torch.float32)
        kwargs = cast_floating(kwargs, torch.float32)
        first = first_tensor(args)
        device_type = first.device.type if first is not None else "cpu"
        with torch.autocast(device_type, enabled=False):
            return self.criterion(*args, **kwargs)

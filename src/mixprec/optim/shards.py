"""FSDP2 shards under the low-precision wrappers: each rank steps its own part of each weight.

Under FSDP2 a parameter is a DTensor whose local tensor is this rank's shard; its gradient
and its optimizer state are DTensors sharded the same way. The low-precision wrappers
(:class:`~mixprec.optim.LowPrecisionOptimizer`, Kahan, stochastic rounding) update
elementwise, so a sharded step is the unsharded step of each local shard. :class:`ShardViews`
gives each sharded parameter a plain stand-in sharing its local storage (its ``.grad`` the
local gradient), moves the parameter's optimizer state to the stand-in as local tensors for
the step, and moves it back afterwards as DTensors with the parameter's placements, so a
state_dict, ``torch.distributed.checkpoint`` and torch's own optimizer code see what they
see without mixprec.

Only elementwise optimizers can step shards independently: torch's Adam, AdamW and SGD (the
fast path), and the other elementwise torch optimizers listed in :data:`ELEMENTWISE` on the
generic path. 8-bit optimizer states are not sharded (their blocks would straddle shards).

>>> import torch
>>> p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
>>> local_of(p) is p  # a plain tensor is its own shard
True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mixprec.dtypes import LOW_PRECISION_DTYPES
from mixprec.nested import shard_local
from mixprec.optim.fast import init_adam_state
from mixprec.optim.rule import scalar_value

__all__ = ["ELEMENTWISE", "ShardViews", "check_shardable", "is_dtensor", "is_zero_step", "local_of", "owner_of",
           "shard_index", "wrap_like", "zero_step"]

#: torch optimizers whose update of an element reads only that element's weight, gradient and state
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta,
)


def is_dtensor(t: Any) -> bool:
    """True for a DTensor (a sharded or replicated tensor of torch.distributed)."""
    return isinstance(getattr(t, "_local_tensor", None), torch.Tensor) and hasattr(t, "device_mesh")


def is_zero_step(param_groups: Sequence[dict[str, Any]]) -> bool:
    """True for the step ``torch.distributed.checkpoint`` takes to give an optimizer the state
    tensors to save or load into: every learning rate 0 (a group without one counts as 0) and
    every gradient present zero, at least one present. The learning rates are read first, so a
    real step is told apart without touching a gradient."""
    if not param_groups or any(scalar_value(g.get("lr", 0.0)) != 0.0 for g in param_groups):
        return False
    grads = [p.grad for g in param_groups for p in g["params"] if p.grad is not None]
    return bool(grads) and not any(bool(local_of(grad).any()) for grad in grads)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (sharing its storage), or ``t`` itself."""
    return shard_local(t)


def wrap_like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` (shaped like ``param``'s shard) as a DTensor sharded like ``param``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False,  # type: ignore[attr-defined]
        shape=param.shape, stride=param.stride(),
    )


def shard_index(param: torch.Tensor) -> int:
    """Which shard of ``param`` this rank holds, counting only the mesh dimensions ``param`` is
    sharded on (replicas of one shard, as under HSDP, get the same index); 0 for a plain tensor."""
    if not is_dtensor(param):
        return 0
    mesh = param.device_mesh  # type: ignore[attr-defined]
    coordinate = mesh.get_coordinate() or []
    index = 0
    for dim, placement in enumerate(param.placements):  # type: ignore[attr-defined]
        if placement.is_shard() and dim < len(coordinate):
            index = index * mesh.size(dim) + coordinate[dim]
    return index


def owner_of(param: torch.Tensor) -> torch.Tensor:
    """The sharded parameter a stand-in of :class:`ShardViews` stands for, else ``param``."""
    return getattr(param, "_mixprec_shard_of", param)


def check_shardable(optimizer: torch.optim.Optimizer, moments: torch.dtype | None, owner: str) -> None:
    """Refuse what cannot step FSDP2 shards independently (``moments``: the wrapper's state
    dtype), naming the fix."""
    if type(optimizer) not in ELEMENTWISE:
        names = ", ".join(c.__name__ for c in ELEMENTWISE)
        raise ValueError(
            f"{owner} over FSDP2-sharded weights steps each rank's shard on its own, which is only right for an "
            f"elementwise optimizer ({names}); {type(optimizer).__name__} is not one of them. Use one of those, or a "
            "'*-master' / '*-mixed' plan, whose fp32 shards torch's optimizers step as DTensors"
        )
    from mixprec.optim import states as qstates

    codec = qstates.block_codec(moments)
    if codec is not None:
        raise ValueError(
            f"{owner}: {codec.label} optimizer states are not supported "
            "on FSDP2 shards (their blocks would straddle shards); use state_dtype='bf16' there"
        )


class ShardViews:
    """Plain stand-ins for sharded parameters during one step of a low-precision wrapper.

    ``with ShardViews(optimizer, params, cache) as locals_:`` gives, for each parameter of
    ``params`` (all DTensors), a ``Parameter`` sharing its local storage whose ``.grad`` is the
    local gradient; ``optimizer.state`` holds their state as local tensors inside the block and
    under the real parameters, as DTensors, after it (also when the step raised). ``cache``
    (kept by the wrapper) reuses the stand-ins from step to step, so state the wrapper keys by
    parameter survives; :func:`owner_of` maps a stand-in back to its parameter.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                 cache: dict[int, tuple[torch.Tensor, torch.nn.Parameter]]) -> None:
        self.optimizer = optimizer
        self.params = list(params)
        self.cache = cache
        self.views: list[torch.nn.Parameter] = []
        self._before: list[dict[Any, Any] | None] = []

    @staticmethod
    def view_of(param: torch.Tensor, cache: dict[int, tuple[torch.Tensor, torch.nn.Parameter]]) -> torch.nn.Parameter:
        """The stand-in of ``param`` (made again when FSDP2 replaced its local storage)."""
        local = local_of(param)
        held = cache.get(id(param))
        if held is not None and held[1].data_ptr() == local.data_ptr() and held[1].shape == local.shape:
            return held[1]
        view = torch.nn.Parameter(local, requires_grad=False)  # aliases the shard: writes go through
        view._mixprec_shard_of = param  # type: ignore[attr-defined]  # (owner_of)
        cache[id(param)] = (param, view)
        return view

    def __enter__(self) -> list[torch.nn.Parameter]:
        state = self.optimizer.state
        for p in self.params:
            view = self.view_of(p, self.cache)
            grad = p.grad
            view.grad = None if grad is None else local_of(grad)
            before = state.pop(p, None)
            self._before.append(before)
            if before:
                state[view] = {k: local_of(v) if torch.is_tensor(v) else v for k, v in before.items()}
            self.views.append(view)
        return self.views

    def __exit__(self, *exc: object) -> None:
        state = self.optimizer.state
        for p, view, before in zip(self.params, self.views, self._before, strict=True):
            view.grad = None
            new = state.pop(view, None)
            if new is None:
                if before:
                    state[p] = before
                continue
            out: dict[Any, Any] = {}
            for key, value in new.items():
                old = before.get(key) if before else None
                if old is not None and is_dtensor(old) and local_of(old) is value:
                    out[key] = old  # updated in place: the same DTensor
                elif torch.is_tensor(value) and value.dim() > 0 and value.shape == view.shape:
                    out[key] = wrap_like(value, p)  # per-element state made by this step
                else:
                    out[key] = value  # step counts, scalars
            state[p] = out


def zero_step(opt: Any) -> bool:
    """Over FSDP2 shards, a step with every learning rate 0 and every gradient zero only
    creates state: torch.distributed.checkpoint's get/set_optimizer_state_dict take such a
    step to give an optimizer whose ``state`` is empty (SGD without momentum keeps none) the
    tensors to save or load into, every time. A real step would round weight + compensation
    again, draw rounding noise or change the moments of the weights just loaded. ``opt``: a
    :class:`~mixprec.optim.LowPrecisionOptimizer`; True when the step was such a step (taken here)."""
    groups = opt.optimizer.param_groups
    if "lr" in groups[0] and scalar_value(groups[0]["lr"]) != 0.0:
        return False  # (every real step: decided from the first group alone)
    low = [p for p in opt._low_params() if p.grad is not None]
    if not low or not any(is_dtensor(p) for p in low) or not is_zero_step(groups):
        return False
    dtype = torch.float32 if opt.state_dtype is None else opt.state_dtype
    generic: list[torch.Tensor] = []  # stepped on the generic path (fused, other optimizers): its own zero step
    for group in groups:
        mine = [p for p in group["params"] if p.dtype in LOW_PRECISION_DTYPES and p.grad is not None]
        kind = opt._fast_kind(group) if mine else None
        if mine and kind is None:
            generic.extend(mine)
        if kind == "adam":
            init_adam_state(opt.optimizer, group, mine, dtype)
        elif kind == "sgd" and group.get("momentum", 0) != 0:  # torch's SGD would keep zero buffers
            for p in mine:  # (8-bit state is refused on shards: a float dtype here)
                state = opt.optimizer.state[p]
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(p, dtype=dtype)
    # the fp32 parameters (norm layers): the inner optimizer's own zero step, as torch's would be
    saved = [group["params"] for group in groups]
    try:
        for group, params in zip(groups, saved, strict=True):
            group["params"] = [p for p in params if p.dtype not in LOW_PRECISION_DTYPES]
        if any(p.grad is not None for group in groups for p in group["params"]):
            opt._step_full_precision()
    finally:
        for group, params in zip(groups, saved, strict=True):
            group["params"] = params
    if generic:  # lr 0 and zero gradients: the weights (and compensation) come back as they were
        opt.step_selected(set(generic))
    opt._init_kinds(low)
    return True

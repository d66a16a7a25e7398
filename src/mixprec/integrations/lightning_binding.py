"""Optimizers built before Fabric shards the model, re-bound to its sharded parameters.

Under a strategy that shards the model inside ``fabric.setup`` (``ModelParallelStrategy``:
FSDP2's ``fully_shard`` swaps every parameter for a new ``DTensor`` one under the same
name), :func:`mixprec.integrations.lightning.setup` records with :class:`ParamBinding`
where each optimizer parameter sits in the model, then points the param groups at the
parameters that replaced them.
"""

from __future__ import annotations

import torch

__all__ = ["ParamBinding"]


# The names wrapper modules insert into parameter names (torch.compile, activation checkpointing, FSDP1).
_WRAPPER_NAMES = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})

_SEPARATE_ORDER = (
    "Set the model up alone, then the optimizer over its sharded parameters: model = setup(fabric, model); "
    "opt = torch.optim.AdamW(model.parameters()); opt = setup_optimizers(fabric, opt)"
)


def _plain_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)


def _named(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(_plain_name(name), param) for name, param in module.named_parameters()]


class ParamBinding:
    """Where each parameter of optimizers built before a strategy shards the model sits in it,
    to re-bind their param groups to the sharded parameters that replace them (FSDP2's
    ``fully_shard`` swaps every parameter for a new ``DTensor`` one under the same name).
    Refuses, before anything is sharded, what cannot be carried over."""

    def __init__(self, module: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], strategy: str) -> None:
        named = _named(module)
        self.names = [name for name, _ in named]
        self.shapes = [tuple(param.shape) for _, param in named]
        index = {id(param): i for i, (_, param) in enumerate(named)}
        self.optimizers = optimizers
        self.slots: list[list[list[int]]] = []  # per optimizer, per param group: indices into names
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"setup() expects torch optimizers, got {type(opt).__name__}")
            if opt.state:
                raise RuntimeError(
                    f"setup(): the optimizer {type(opt).__name__} already holds state ({len(opt.state)} parameters: "
                    f"momentum, moments, step counts) for the model's unsharded parameters, which "
                    f"{strategy} replaces with shards in fabric.setup; that state cannot follow "
                    f"them. {_SEPARATE_ORDER}, and load its state with fabric.load"
                )
            groups = [[index.get(id(p), -1) for p in group["params"]] for group in opt.param_groups]
            foreign = sum(i < 0 for g in groups for i in g)
            if foreign:
                raise RuntimeError(
                    f"setup(): {foreign} parameter(s) of the optimizer {type(opt).__name__} are not parameters of the "
                    "model being set up (an optimizer over another model or a copy?); build it over model.parameters()"
                )
            self.slots.append(groups)

    def rebind(self, sharded: torch.nn.Module) -> None:
        """Point the optimizers' param groups at ``sharded``'s parameters, in place."""
        named = _named(sharded)
        by_name = dict(named)
        wanted = {i for groups in self.slots for g in groups for i in g}
        missing = [self.names[i] for i in sorted(wanted) if self.names[i] not in by_name]
        if not missing and len(by_name) == len(named):
            new = {i: by_name[self.names[i]] for i in wanted}
        elif len(named) == len(self.names) and all(
            tuple(p.shape) == shape for (_, p), shape in zip(named, self.shapes, strict=True)
        ):  # renamed by the parallelize_fn (a wrapper around the model), in the same order and shapes
            new = {i: named[i][1] for i in wanted}
        else:
            shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
            raise RuntimeError(
                f"setup(): after the strategy's parallelize_fn, the model has no parameter named {shown} (it had "
                f"{len(self.names)} parameters, it has {len(named)}, not in the same order and shapes), so the "
                f"optimizer cannot be re-bound to the sharded parameters unambiguously. {_SEPARATE_ORDER}"
            )
        for i, param in new.items():
            if tuple(param.shape) != self.shapes[i]:  # a DTensor's shape is the global one
                raise RuntimeError(
                    f"setup(): the parallelize_fn changed the shape of {self.names[i]} from {self.shapes[i]} to "
                    f"{tuple(param.shape)}: the optimizer cannot be re-bound to it. {_SEPARATE_ORDER}"
                )
        for opt, groups in zip(self.optimizers, self.slots, strict=True):
            for group, indices in zip(opt.param_groups, groups, strict=True):
                group["params"] = [new[i] for i in indices]

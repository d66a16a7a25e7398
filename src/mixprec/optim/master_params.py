"""The masters of a :class:`~mixprec.optim.MasterWeightOptimizer`: made, adopted, found.

:class:`MasterParams` is the base class of :class:`~mixprec.optim.MasterWeightOptimizer`
that owns its bookkeeping of parameters: an fp32 master for each low-precision parameter
(started from prepare()'s fp32 seeds where it kept them, else from the weight), the masters
of parameter groups added later and of frozen parameters unfrozen since, and the mapping
between the inner optimizer's parameters and the model's. The gradients are
:mod:`mixprec.optim.master_grads`'s, the step is the subclass's.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from mixprec.dtypes import LOW_PRECISION_DTYPES
from mixprec.optim.base import WrappedOptimizer
from mixprec.optim.fast import prefer_fast_update
from mixprec.optim.follow import Seeds, WriteWatch, register, seed_master
from mixprec.optim.master_grads import MasterGrads
from mixprec.optim.shards import is_dtensor

__all__ = ["MasterParams"]


class MasterParams(WrappedOptimizer):
    """The parameter bookkeeping of :class:`~mixprec.optim.MasterWeightOptimizer` (its base:
    the attributes below are set by its ``__init__``)."""

    _seeds: weakref.ReferenceType[Seeds] | None  # prepare()'s seeds of parameters no optimizer holds yet
    _grads: MasterGrads
    _pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]]  # (model parameter, fp32 master)
    _master_by_param: dict[int, torch.nn.Parameter]
    _fast_path: bool
    _watch: WriteWatch
    _frozen: list[torch.nn.Parameter]  # frozen low-precision parameters, held without a master
    _layout: list[tuple[int, int]]

    def _masters_for(
        self, params: Iterable[torch.nn.Parameter], values: Mapping[torch.Tensor, torch.Tensor] | None = None
    ) -> list[torch.nn.Parameter]:
        """Masters for the low-precision ``params``, started from ``values``; by default (a
        group added later) from prepare()'s seeds where it kept them (each used once), else
        from the weights."""
        seeds = self._seeds() if values is None and self._seeds is not None else None
        out = []
        for p in params:
            if p.dtype not in LOW_PRECISION_DTYPES:
                out.append(p)
                continue
            if id(p) in self._master_by_param:
                raise ValueError("a parameter appears in more than one parameter group; list each parameter once")
            if not p.requires_grad:  # frozen: no master, no state (torch steps nothing without a gradient)
                self._frozen.append(p)
                out.append(p)
                continue
            source = seeds.pop(p, p) if seeds is not None else (values or {}).get(p, p)
            if source.shape != p.shape:
                raise ValueError(f"master value has shape {tuple(source.shape)} but the parameter {tuple(p.shape)}")
            master = torch.nn.Parameter(source.detach().to(torch.float32, copy=True), requires_grad=p.requires_grad)
            if source is not p:  # the weight may have been written since the value was taken
                seed_master(p, master)
            self._adopt_state(p, master)
            self._grads.add_pair(p, master)
            self._master_by_param[id(p)] = master
            out.append(master)
        self._follow([p for p in params if id(p) in self._master_by_param])
        return out

    def _group_layout(self) -> list[tuple[int, int]]:
        return [(id(g["params"]), len(g["params"])) for g in self.optimizer.param_groups]

    def _adopt_added(self) -> None:
        """Masters for the low-precision parameters put into the inner optimizer's groups
        since the last look (``opt.optimizer.add_param_group(...)``), as :meth:`add_param_group`
        gives them: from prepare's fp32 seed where it kept one, else from the weight; and for
        frozen parameters unfrozen since (``requires_grad_()``). While the groups are as they
        were, this is a few ``id`` reads."""
        if self._frozen and any(p.requires_grad for p in self._frozen):
            self._adopt_unfrozen()
        layout = self._group_layout()
        if layout == self._layout:
            return
        frozen = {id(p) for p in self._frozen}
        added = [p for g in self.optimizer.param_groups for p in g["params"]
                 if p.dtype in LOW_PRECISION_DTYPES and id(p) not in frozen]
        ids = [id(p) for p in added]
        if len(set(ids)) != len(ids) or any(i in self._master_by_param for i in ids):
            raise ValueError(
                "a parameter added to the inner optimizer's param groups is already in a group (it has a "
                "master, or was added twice); list each parameter once"
            )
        for group in self.optimizer.param_groups:
            fresh = [p for p in group["params"] if p.dtype in LOW_PRECISION_DTYPES and id(p) not in frozen]
            if fresh:
                made = iter(self._masters_for(fresh))
                group["params"] = [next(made) if p.dtype in LOW_PRECISION_DTYPES and id(p) not in frozen else p
                                   for p in group["params"]]
            self._choose_implementation(group)
        self._layout = self._group_layout()

    def _adopt_unfrozen(self) -> None:
        """Masters for the frozen parameters that now require a gradient, in their places (the
        masters stay in parameter order: a state_dict lists them so)."""
        woken = {id(p) for p in self._frozen if p.requires_grad}
        self._frozen = [p for p in self._frozen if not p.requires_grad]
        for group in self.optimizer.param_groups:
            params = group["params"]
            for j, p in enumerate(params):
                if id(p) in woken:
                    params[j] = self._masters_for([p])[0]
            self._choose_implementation(group)
        self._grads.reorder({id(q): i for i, q in enumerate(q for g in self.optimizer.param_groups for q in g["params"])})

    def _master_positions(self) -> list[int]:
        """Flat positions (over the param groups) of the parameters that have a master."""
        masters = {id(m) for _, m in self._pairs}
        return [i for i, q in enumerate(q for g in self.optimizer.param_groups for q in g["params"]) if id(q) in masters]

    def _follow(self, params: list[torch.nn.Parameter]) -> None:
        """From now on the masters of ``params`` follow writes into them (:mod:`mixprec.optim.follow`)."""
        register(self, params)
        self._watch.record(params)

    def _adopt_state(self, param: torch.Tensor, master: torch.Tensor) -> None:
        state = self.optimizer.state.pop(param, None)
        if state:
            self.optimizer.state[master] = {
                k: v.to(torch.float32) if _is_param_shaped(v, master) else v for k, v in state.items()
            }

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self._adopt_added()
        group["params"] = self._masters_for(params)
        self.optimizer.add_param_group(group)
        self._choose_implementation(self.optimizer.param_groups[-1])
        self._layout = self._group_layout()

    def _choose_implementation(self, group: dict[str, Any]) -> None:
        if self._fast_path and not _mixes_dtensors(group["params"]):
            prefer_fast_update(self.optimizer, group)

    def _model_params(self, inner: list[torch.Tensor]) -> list[torch.Tensor]:
        """The model parameter of each of ``inner`` (a master's weight; an fp32 parameter itself)."""
        model = {id(m): p for p, m in self._pairs}
        return [model.get(id(q), q) for q in inner]

    def kind_params(self) -> list[torch.Tensor]:
        return self._model_params(list(self.params()))


def _mixes_dtensors(params: list[torch.Tensor]) -> bool:
    """A group of DTensors (tensor parallelism) and plain tensors (a replicated norm layer's fp32
    weight, its own master): torch's fused and foreach kernels take one or the other, so the group
    keeps torch's default (one tensor at a time), as torch itself chooses for such a group."""
    kinds = {is_dtensor(q) for q in params}
    return len(kinds) > 1


def _is_param_shaped(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == param.shape

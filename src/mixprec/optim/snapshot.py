"""Snapshots of an optimizer before a step, so a refused step can be undone bit for bit, and
the check that decides a master-weight step must be refused (:func:`masters_nonfinite`).

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(2))
>>> sgd = torch.optim.SGD([w], lr=1.0, momentum=0.9)
>>> w.grad = torch.ones(2)
>>> snap = take_snapshot(sgd)
>>> sgd.step()
>>> restore_snapshot(sgd, snap)
>>> w.detach(), len(sgd.state)
(tensor([1., 1.]), 0)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "ParamSnapshot",
    "StepSnapshot",
    "became_nonfinite",
    "clone_all",
    "masters_nonfinite",
    "restore_params",
    "restore_snapshot",
    "snapshot_params",
    "take_snapshot",
]


@dataclass
class StepSnapshot:
    """Parameters, optimizer state and group settings before a step."""

    params: list[torch.Tensor]
    values: list[torch.Tensor]
    state: dict[torch.Tensor, dict[str, Any] | None]
    groups: list[dict[str, Any]] = field(default_factory=list)


def clone_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (one foreach copy per device and dtype)."""
    out = [torch.empty_like(t) for t in tensors]
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for t, c in zip(tensors, out, strict=True):
        dst, src = groups.setdefault((t.device, t.dtype), ([], []))
        dst.append(c)
        src.append(t)
    for dst, src in groups.values():
        torch._foreach_copy_(dst, src)
    return out


def take_snapshot(optimizer: torch.optim.Optimizer) -> StepSnapshot:
    """Copy every parameter of ``optimizer``, its state tensors and its group settings."""
    params = [q for g in optimizer.param_groups for q in g["params"]]
    state: dict[torch.Tensor, dict[str, Any] | None] = {}
    srcs: list[torch.Tensor] = list(params)
    for q in params:
        s = optimizer.state.get(q)
        state[q] = None if not s else dict(s)
        if s:
            srcs.extend(v for v in s.values() if isinstance(v, torch.Tensor))
    copies = clone_all(srcs)
    by_id = {id(t): c for t, c in zip(srcs, copies, strict=True)}
    for s in state.values():
        if s is not None:
            for k, v in s.items():
                if isinstance(v, torch.Tensor):
                    s[k] = by_id[id(v)]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return StepSnapshot(params=params, values=copies[: len(params)], state=state, groups=groups)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


@torch.no_grad()
def restore_snapshot(optimizer: torch.optim.Optimizer, snap: StepSnapshot) -> None:
    """Put ``optimizer``'s parameters, state (in place where the layout allows) and group
    settings back to ``snap``."""
    torch._foreach_copy_(snap.params, snap.values)
    for q, saved in snap.state.items():
        if saved is None:
            optimizer.state.pop(q, None)
            continue
        current = optimizer.state.setdefault(q, {})
        for k in [k for k in current if k not in saved]:
            del current[k]
        for k, v in saved.items():
            cur = current.get(k)
            if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor) and _same_layout(cur, v):
                cur.copy_(v)
            else:
                current[k] = v
    for group, saved_group in zip(optimizer.param_groups, snap.groups, strict=False):
        group.update(saved_group)


# -------------------------------------------- per-parameter snapshots (low-precision wrappers)
@dataclass
class ParamSnapshot:
    """Copies of parameters, their optimizer state (deep) and a wrapper's own state."""

    params: list[tuple[torch.Tensor, torch.Tensor]]
    state: dict[torch.Tensor, dict[Any, Any] | None]
    extra: dict[str, Any]
    restored: bool = False


def snapshot_params(
    optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor], extra: dict[str, Any]
) -> ParamSnapshot:
    """Copy ``params``, their state in ``optimizer`` and ``extra`` (a wrapper's own state)."""
    params = list(params)
    state: dict[torch.Tensor, dict[Any, Any] | None] = {}
    for p in params:
        live = optimizer.state.get(p)
        state[p] = None if live is None else {
            k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in live.items()
        }
    return ParamSnapshot([(p, p.detach().clone()) for p in params], state, copy.deepcopy(extra))


@torch.no_grad()
def became_nonfinite(snap: ParamSnapshot) -> torch.Tensor:
    """A bool tensor: an fp16 parameter finite in ``snap`` holds a non-finite value now."""
    flags = [(torch.isfinite(old) & ~torch.isfinite(p)).any() for p, old in snap.params if p.dtype == torch.float16]
    if not flags:
        return torch.zeros((), dtype=torch.bool)
    return torch.stack(flags).any()


@torch.no_grad()
def restore_params(optimizer: torch.optim.Optimizer, snap: ParamSnapshot) -> bool:
    """Put the parameters and their state back to ``snap`` (once: False when it was already
    restored); the caller restores ``snap.extra``."""
    if snap.restored:
        return False
    for p, old in snap.params:
        p.copy_(old)
    for p, saved_state in snap.state.items():
        if saved_state is None:
            optimizer.state.pop(p, None)
        else:
            optimizer.state[p] = saved_state
    snap.restored = True
    return True


# ------------------------------------------------- the master-weight step guard
def _inf_threshold(dtype: torch.dtype) -> float:
    """The smallest magnitude that rounds to inf when cast to ``dtype`` (round to nearest even)."""
    fmax = torch.finfo(dtype).max
    _, exp = math.frexp(fmax)
    return fmax + torch.finfo(dtype).eps * 2.0 ** (exp - 1) / 2


def masters_nonfinite(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], optimizer: torch.optim.Optimizer
) -> torch.Tensor:
    """After a master-weight step: True if a master (of ``(model parameter, master)`` ``pairs``)
    or an fp32 parameter ``optimizer`` updates is inf/NaN, or a master
    rounds to inf in its model parameter's dtype (one inf-norm read of each).

    The optimizer state is not read: from finite gradients, the usual optimizers' state
    stays finite (Adam's squared gradients overflow fp32 only beyond 1.8e19; fp16
    gradients end at 65504), and a non-finite state shows in the masters it updates.
    """
    by_threshold: dict[tuple[torch.device, float], list[torch.Tensor]] = {}
    for p, m in pairs:
        if m.numel():  # an empty tensor holds nothing non-finite (and has no inf-norm)
            by_threshold.setdefault((m.device, _inf_threshold(p.dtype)), []).append(m)
    direct = {id(m) for _, m in pairs}
    fp32_max = _inf_threshold(torch.float32)
    for group in optimizer.param_groups:
        for q in group["params"]:
            if id(q) not in direct and q.is_floating_point() and q.numel():
                by_threshold.setdefault((q.device, fp32_max), []).append(q)
    flags = []
    device = None
    for (dev, threshold), tensors in by_threshold.items():
        device = device or dev
        norms = torch._foreach_norm(tensors, float("inf"))
        flags.append((~(torch.stack(norms).float() < threshold)).any().to(device))
    if not flags:
        return torch.zeros((), dtype=torch.bool)
    return torch.stack(flags).any()

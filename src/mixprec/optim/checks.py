"""Validating optimizer state_dicts before anything is loaded (loading is all or nothing).

Each check raises ValueError/TypeError naming the entry, what it holds and what was
expected, and changes nothing.

>>> import torch
>>> w = torch.nn.Parameter(torch.zeros(2))
>>> check_inner_state_dict(torch.optim.SGD([w], lr=0.1), {"state": {}, "param_groups": []})
Traceback (most recent call last):
...
ValueError: the optimizer state_dict has 0 parameter group(s), this optimizer 1; was it saved from another optimizer?
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "check_group_keys",
    "check_inner_state_dict",
    "check_master_weights",
    "check_param_shaped_state",
    "check_state_shapes",
]

# torch's own optimizers whose per-parameter state tensors are either scalars (step
# counters) or shaped like the parameter; loading checks that shape.
_PARAM_SHAPED_STATE = (
    torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.SGD,
    torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop,
)


def check_inner_state_dict(optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
    """Raise ValueError/TypeError, naming the key, if torch's ``Optimizer.load_state_dict``
    would refuse ``state_dict`` for ``optimizer`` (or fail half-way with a KeyError)."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"an optimizer state_dict must be a dict, got {type(state_dict).__name__}")
    for key, kind in (("state", dict), ("param_groups", list)):
        if key not in state_dict:
            raise ValueError(
                f"the optimizer state_dict has no {key!r} entry; pass what optimizer.state_dict() returned"
            )
        if not isinstance(state_dict[key], kind):
            raise TypeError(
                f"the optimizer state_dict's {key!r} must be a {kind.__name__}, got {type(state_dict[key]).__name__}"
            )
    groups = state_dict["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the optimizer state_dict has {len(groups)} parameter group(s), this optimizer "
            f"{len(optimizer.param_groups)}; was it saved from another optimizer?"
        )
    for i, (saved, live) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
            raise ValueError(f"the optimizer state_dict's param_groups[{i}] has no 'params' list")
        if len(saved["params"]) != len(live["params"]):
            raise ValueError(
                f"the optimizer state_dict's param_groups[{i}] holds {len(saved['params'])} parameters, this "
                f"optimizer's {len(live['params'])}; was it saved from another model?"
            )
        if not all(isinstance(k, str) for k in saved):
            raise TypeError(f"the optimizer state_dict's param_groups[{i}] has non-string keys")
    check_group_keys(optimizer, groups)
    ids = {pid for g in groups for pid in g["params"]}
    for pid, value in state_dict["state"].items():
        if pid not in ids:
            raise ValueError(f"the optimizer state_dict's 'state' names parameter {pid!r}, which no group holds")
        if not isinstance(value, dict):
            raise TypeError(f"the optimizer state_dict's state[{pid!r}] must be a dict, got {type(value).__name__}")


# Group entries that choose the update rule itself, not a setting of it: torch loads them
# from the state_dict, so a state of torch.optim.Adam would turn an AdamW into Adam.
_RULE_KEYS = ("decoupled_weight_decay",)


def _groups_as_loaded(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> list[set[str]] | None:
    """The keys of ``groups`` once the optimizer's ``__setstate__`` has filled in the defaults
    of options newer than the state_dict (what torch's ``load_state_dict`` does); None when
    that cannot be told without loading (an optimizer whose ``__setstate__`` needs more)."""
    try:
        probe = object.__new__(type(optimizer))
        probe.__setstate__({
            "defaults": dict(optimizer.defaults),
            "state": {},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} | {"params": []} for g in groups],
        })
        return [set(g) for g in probe.param_groups]
    except Exception:
        return None


def check_group_keys(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Raise ValueError if the saved param ``groups`` lack a hyper-parameter of ``optimizer``
    (a key of its ``defaults``, which its step reads: ``betas`` of an SGD state loaded into
    AdamW would fail there with a KeyError, after the load replaced the optimizer's groups
    and state), or were saved by an optimizer with another update rule (Adam vs AdamW).
    Keys others add to a group (a scheduler's ``initial_lr``) are not required."""
    name = type(optimizer).__name__
    loaded = _groups_as_loaded(optimizer, groups)
    for i, (saved, live) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        keys = loaded[i] if loaded is not None else set(saved)
        missing = sorted(k for k in live if k in optimizer.defaults and k not in keys and k != "params")
        if missing:
            held = sorted(k for k in saved if k != "params")
            raise ValueError(
                f"the optimizer state_dict's param_groups[{i}] has no {', '.join(map(repr, missing))}, which this "
                f"{name} needs (the saved group holds {held}): it was saved from another kind of optimizer, and "
                f"its next step would fail. Load a state saved by a {name}, or start the optimizer fresh"
            )
        for key in _RULE_KEYS:
            if key in saved and key in live and saved[key] != live[key]:
                raise ValueError(
                    f"the optimizer state_dict's param_groups[{i}][{key!r}] is {saved[key]!r}, this {name}'s is "
                    f"{live[key]!r}: it was saved from an optimizer with another update rule (torch.optim.Adam "
                    f"has {key}=False, AdamW True). Load a state saved by a {name}, or start the optimizer fresh"
                )


def check_master_weights(saved: Any, masters: Sequence[torch.Tensor]) -> None:
    """``saved`` (a state_dict's master weights) matches ``masters`` in count, shapes and dtype (fp32)."""
    if not isinstance(saved, list | tuple) or len(saved) != len(masters):
        n = len(saved) if isinstance(saved, list | tuple) else type(saved).__name__
        raise ValueError(
            f"the state_dict holds {n} master weights but this optimizer has {len(masters)}; "
            "was it saved from a different model or plan?"
        )
    for i, (value, m) in enumerate(zip(saved, masters, strict=True)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"master weight {i} in the state_dict is a {type(value).__name__}, not a tensor")
        if value.shape != m.shape:
            raise ValueError(
                f"master weight {i} in the state_dict has shape {tuple(value.shape)}, expected {tuple(m.shape)}; "
                "was it saved from a different model?"
            )
        if value.dtype != torch.float32:
            raise ValueError(
                f"master weight {i} in the state_dict has dtype {value.dtype}, expected torch.float32; "
                "save it with MasterWeightOptimizer.state_dict()"
            )


def check_param_shaped_state(optimizer: torch.optim.Optimizer) -> None:
    """After a load: every non-scalar state tensor of torch's own optimizers is shaped like its parameter."""
    if type(optimizer) not in _PARAM_SHAPED_STATE:
        return
    for group in optimizer.param_groups:
        for q in group["params"]:
            for key, value in optimizer.state.get(q, {}).items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    continue
                if value.shape != q.shape:
                    raise ValueError(
                        f"optimizer state {key!r} in the state_dict has shape {tuple(value.shape)} but its "
                        f"parameter has shape {tuple(q.shape)}; the state_dict belongs to another model"
                    )


def check_state_shapes(params: Sequence[torch.Tensor], state_dict: dict[str, Any]) -> None:
    """Every non-scalar tensor of ``state_dict["state"]`` is shaped like the parameter it belongs to
    (``params`` in the order of the state_dict's groups); call after :func:`check_inner_state_dict`."""
    order = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    for pid, saved in state_dict["state"].items():
        param = params[order.index(pid)]
        for key, value in saved.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise ValueError(
                    f"the optimizer state_dict's state[{pid!r}][{key!r}] has shape {tuple(value.shape)}, but its "
                    f"parameter has shape {tuple(param.shape)}; was it saved from another model?"
                )

"""The one validator of optimizer state_dicts: everything is checked before anything is loaded.

Every wrapper's ``load_state_dict`` (and the front door's resume) calls these checks, then
loads inside :func:`mixprec.optim.snapshot.all_or_nothing`: the inner optimizer's state and
groups (:func:`check_inner_state_dict`, :func:`check_group_keys`, :func:`check_state_shapes`),
the wrapper's own entry (:func:`split_wrapper_state`), fp32 masters
(:func:`check_master_weights`) and the tensors of every state kind
(:func:`check_kind_state`, :mod:`mixprec.optim.kinds`). Each check raises
ValueError/TypeError naming the entry, what it holds and what was expected, and changes
nothing.

>>> import torch
>>> w = torch.nn.Parameter(torch.zeros(2))
>>> check_inner_state_dict(torch.optim.SGD([w], lr=0.1), {"state": {}, "param_groups": []})
Traceback (most recent call last):
...
ValueError: the optimizer state_dict has 0 parameter group(s), this optimizer 1; was it saved from another optimizer?
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mixprec.optim.kinds import MASTER, KindStore
from mixprec.optim.states import ABSMAX, BLOCK, BLOCKWISE, conform

__all__ = [
    "MASTER_INDEX_KEY",
    "check_group_keys",
    "check_inner_state_dict",
    "check_kind_state",
    "check_master_positions",
    "check_master_weights",
    "check_param_shaped_state",
    "check_rounding_state",
    "check_state_shapes",
    "conform_raw",
    "fits_raw",
    "raw_moments",
    "split_master_state",
    "split_wrapper_state",
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


def check_master_weights(saved: Any, masters: Sequence[torch.Tensor], key: str = "") -> None:
    """``saved`` (a state_dict's master weights, under ``key``) matches ``masters`` in count, shapes
    and dtype (:data:`~mixprec.optim.kinds.MASTER`'s: fp32)."""
    if saved is None:
        raise ValueError(
            f"this optimizer state_dict has no fp32 master weights (key {key!r}): it was saved without master "
            "weights. To start the masters from the current model weights instead, call "
            "opt.optimizer.load_state_dict(sd) and then opt.reset_masters_from_model()."
        )
    if not isinstance(saved, list | tuple) or len(saved) != len(masters):
        n = len(saved) if isinstance(saved, list | tuple) else type(saved).__name__
        raise ValueError(
            f"the state_dict holds {n} master weights but this optimizer has {len(masters)}; "
            "was it saved from a different model or plan, or with other parameters frozen (a parameter with "
            "requires_grad=False has no master)?"
        )
    for i, (value, m) in enumerate(zip(saved, masters, strict=True)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"master weight {i} in the state_dict is a {type(value).__name__}, not a tensor")
        if value.shape != m.shape:
            raise ValueError(
                f"master weight {i} in the state_dict has shape {tuple(value.shape)}, expected {tuple(m.shape)}; "
                "was it saved from a different model?"
            )
        if value.dtype != MASTER.dtype:
            raise ValueError(
                f"master weight {i} in the state_dict has dtype {value.dtype}, expected {MASTER.dtype}; "
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
            codes = saved.get(key[: -len(ABSMAX)]) if isinstance(key, str) and key.endswith(ABSMAX) else None
            if isinstance(codes, torch.Tensor) and codes.dtype in BLOCKWISE and isinstance(value, torch.Tensor):
                blocks = -(-param.numel() // BLOCK)  # a block-coded state's per-block scales
                if value.shape != (blocks,):
                    raise ValueError(
                        f"the optimizer state_dict's state[{pid!r}][{key!r}] has shape {tuple(value.shape)}, but "
                        f"its parameter's {BLOCKWISE[codes.dtype].label} state has {blocks} blocks; was it saved "
                        "from another model?"
                    )
                continue
            if isinstance(value, torch.Tensor) and value.dtype in BLOCKWISE and f"{key}{ABSMAX}" not in saved:
                raise ValueError(
                    f"the optimizer state_dict's state[{pid!r}][{key!r}] holds {BLOCKWISE[value.dtype].label} codes "
                    f"without their block scales ({key!r}_absmax): it cannot be read back; save it with the "
                    "optimizer's state_dict()"
                )
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise ValueError(
                    f"the optimizer state_dict's state[{pid!r}][{key!r}] has shape {tuple(value.shape)}, but its "
                    f"parameter has shape {tuple(param.shape)}; was it saved from another model?"
                )


# ------------------------------------------------------------ the wrappers' own entries
def lift_wrapper_state(state_dict: Any, key: str) -> Any:
    """``state_dict`` with a wrapper's entry ``key`` at the top level: a wrapper over FSDP2 shards
    keeps it in a param group (where torch.distributed.checkpoint keeps it); a shallow copy
    when it is moved, ``state_dict`` itself otherwise."""
    if not isinstance(state_dict, Mapping) or key in state_dict:
        return state_dict
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or not any(isinstance(g, Mapping) and key in g for g in groups):
        return state_dict
    lifted = dict(state_dict)
    lifted["param_groups"] = [{k: v for k, v in g.items() if k != key} if isinstance(g, Mapping) else g for g in groups]
    lifted[key] = next(g[key] for g in groups if isinstance(g, Mapping) and key in g)
    return lifted


def split_wrapper_state(state_dict: Any, key: str, owner: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``state_dict`` as (the inner optimizer's state_dict, the wrapper's own entry ``key``),
    refused (TypeError/ValueError naming ``owner``) when it is not a dict or lacks the entry."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a dict (from {owner}.state_dict()), got {type(state_dict).__name__}")
    sd = dict(state_dict)
    extra = sd.pop(key, None)
    if extra is None:
        state = sd.get("state")
        if isinstance(state, Mapping) and state and all(isinstance(k, str) for k in state):
            # parameters named by their qualified names: torch.distributed.checkpoint's
            # get_optimizer_state_dict, which keeps only "state" and "param_groups"
            raise ValueError(
                f"this optimizer state_dict names its parameters by qualified name and has no {key!r} entry: it went "
                "through torch.distributed.checkpoint's get_optimizer_state_dict, which keeps only 'state' and "
                f"'param_groups' and drops what a {owner} keeps beside them (Kahan compensation, rounding noise): "
                "from an optimizer over unsharded parameters, or over FSDP2 shards with "
                "StateDictOptions(flatten_optimizer_state_dict=True) (the entry travels in the first param group, "
                "which flattening keeps only for keys a fresh optimizer has). Save and load with "
                "mixprec.save_checkpoint / load_checkpoint, or, over shards, without flatten_optimizer_state_dict"
            )
        raise ValueError(
            f"this optimizer state_dict has no {key!r} entry: it was not saved by a "
            f"{owner}; load it into the optimizer that saved it"
        )
    if not isinstance(extra, dict):
        raise TypeError(f"the state_dict's {key!r} entry must be a dict, got {type(extra).__name__}")
    return sd, extra


def check_rounding_state(extra: Mapping[str, Any], rounding: str, owner: str) -> None:
    """Refuse to drop Kahan compensation: ``extra`` (a low-precision wrapper's own entry)
    holds compensation buffers, the bits rounding dropped from the weights, and the
    wrapper loading it (of ``rounding``) keeps none."""
    comp = extra.get("compensation")
    if rounding != "kahan" and comp:
        raise ValueError(
            f"this optimizer state_dict holds Kahan compensation for {len(comp)} low-precision weights (the bits "
            f"rounding dropped from them), which a {owner} (rounding {rounding!r}) cannot keep: loading it would "
            "drop them silently. Resume it under the plan that saved it ('bf16-kahan'), or, to change plans on "
            "purpose, load only the model weights and start the optimizer fresh"
        )


#: the entry of a wrapper's own state naming the state kinds it saved
KINDS_KEY = "state_kinds"


#: the key of a master wrapper's state_dict listing which parameters (flat positions over the
#: param groups) have a master: frozen ones have none
MASTER_INDEX_KEY = "mixprec_master_index"


def check_master_positions(saved: Any, positions: list[int]) -> None:
    """The parameters that had masters when the state_dict was saved (``saved``, positions over
    the param groups; None in checkpoints of earlier versions) are the ones that have them now."""
    if saved is None:
        return
    if not isinstance(saved, list | tuple) or not all(isinstance(i, int) and not isinstance(i, bool) for i in saved):
        raise TypeError(f"the state_dict's {MASTER_INDEX_KEY!r} entry must be a list of ints, got {saved!r}")
    if list(saved) != positions:
        only_saved = sorted(set(saved) - set(positions))[:5]
        only_here = sorted(set(positions) - set(saved))[:5]
        raise ValueError(
            "the state_dict has fp32 masters for other parameters than this optimizer: a frozen parameter "
            "(requires_grad=False) has none, and these were frozen differently when it was saved (parameters "
            f"{only_saved} had a master then and have none here; {only_here} have one here and had none then). "
            "Set requires_grad on the model's parameters as they were when it was saved, then load"
        )


def split_master_state(state_dict: Any, key: str, kinds_key: str) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """A master wrapper's ``state_dict`` as (the inner optimizer's state_dict, the masters
    saved under ``key``, its state kinds under ``kinds_key``: ``{}`` when it saved none);
    the masters are checked by :func:`check_master_weights`, their positions
    (:data:`MASTER_INDEX_KEY`, dropped from the inner state_dict) by :func:`check_master_positions`."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a dict (from MasterWeightOptimizer.state_dict()), got {type(state_dict).__name__}"
        )
    sd = dict(state_dict)
    sd.pop(MASTER_INDEX_KEY, None)
    masters = sd.pop(key, None)
    extra = sd.pop(kinds_key, None)
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"the state_dict's {kinds_key!r} entry must be a dict, got {type(extra).__name__}")
    return sd, masters, extra or {}


def check_kind_state(kinds: KindStore, extra: Mapping[str, Any], params: Sequence[torch.Tensor], owner: str) -> None:
    """The state-kind tensors in ``extra`` (a wrapper's own entry: ``{kind: {index: tensor}}``,
    and the names it saved under ``"state_kinds"``) fit this wrapper's ``kinds`` and ``params``:
    no saved kind this wrapper lacks (it would be dropped), every index a parameter the kind
    applies to, every tensor of the kind's shape, floating where the kind is (converted to its
    dtype on load) and of its very dtype where it is an integer kind."""
    saved_names = extra.get(KINDS_KEY, [])
    if not isinstance(saved_names, list | tuple) or not all(isinstance(n, str) for n in saved_names):
        raise TypeError(f"the state_dict's {KINDS_KEY!r} entry must be a list of names, got {saved_names!r}")
    missing = [n for n in saved_names if n not in kinds.kinds and extra.get(n)]
    if missing:
        raise ValueError(
            f"this optimizer state_dict holds state of kind {', '.join(map(repr, missing))}, which this {owner} "
            f"does not keep (it keeps {sorted(kinds.kinds) or 'none'}): loading it would drop it silently. Add the "
            "kind to the optimizer (opt.add_state_kind(...)) before loading, or resume under the setup that saved it"
        )
    for kind in kinds:
        entries = extra.get(kind.name)
        if entries is None:
            continue
        if not isinstance(entries, Mapping):
            raise TypeError(f"the state_dict's {kind.name!r} entry must be a dict of tensors, got {type(entries).__name__}")
        for index, value in entries.items():
            if isinstance(index, bool) or not isinstance(index, int | str) or not str(index).isdigit() \
                    or int(index) >= len(params):
                raise ValueError(
                    f"the state_dict's {kind.name!r} entry names parameter {index!r}; this {owner} has "
                    f"{len(params)} (was it saved from another model?)"
                )
            param = params[int(index)]
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"the state_dict's {kind.name}[{index}] is a {type(value).__name__}, not a tensor")
            if not kind.applies(param):
                raise ValueError(
                    f"the state_dict holds {kind.name} ({kind.describe}) for parameter {index}, a {param.dtype} "
                    f"parameter this {owner} keeps none for; was it saved under another plan?"
                )
            if kind.sparse:
                if value.dtype != torch.int64 or value.dim() != 1 or (
                    value.numel() and (int(value.min()) < 0 or int(value.max()) >= param.numel())
                ):
                    raise ValueError(
                        f"saved {kind.name} {index} must be a 1-D int64 list of element indices below "
                        f"{param.numel()}, got {value.dtype} of shape {tuple(value.shape)}; was it saved from another model?"
                    )
                continue
            shape = kind.shape_for(param)
            if value.shape != shape:
                raise ValueError(
                    f"saved {kind.name} {index} has shape {tuple(value.shape)}, expected {tuple(shape)}; "
                    "was it saved from another model?"
                )
            dtype = kind.dtype_for(param)
            if value.is_floating_point() != dtype.is_floating_point or (
                not dtype.is_floating_point and value.dtype != dtype
            ):
                raise ValueError(
                    f"saved {kind.name} {index} has dtype {value.dtype}, this {owner} keeps it in {dtype}; "
                    "was it saved under another plan?"
                )


def raw_moments(keys: Sequence[str], dtype: torch.dtype, numel: int) -> list[tuple[str, torch.dtype, int]]:
    """(key, dtype, numel) of each tensor of the moments ``keys`` of a weight of ``numel`` elements
    held in ``dtype``, as a kernel writes them through raw pointers (block codes: and their fp32
    block scales)."""
    scales = [(f"{k}{ABSMAX}", torch.float32, -(-numel // BLOCK)) for k in keys] if dtype in BLOCKWISE else []
    return [(k, dtype, numel) for k in keys] + scales


def fits_raw(state: Mapping[str, Any], keys: Sequence[str], dtype: torch.dtype, param: torch.Tensor) -> bool:
    """Whether ``param``'s moments are already what a kernel writes through raw pointers: plain
    contiguous tensors of ``dtype`` on its device, as :func:`raw_moments` lists them. The common
    case, checked without building anything."""
    for key, kind, n in raw_moments(keys, dtype, param.numel()):
        t = state.get(key)
        if (type(t) is not torch.Tensor or t.dtype != kind or t.numel() != n or t.device != param.device
                or not t.is_contiguous()):
            return False
    return True


def conform_raw(
    state: dict[str, Any], param: torch.Tensor, state_dtype: torch.dtype | None, keys: Sequence[str],
    *, refuse: str | None = None,
) -> bool:
    """Make ``param``'s moments what :func:`fits_raw` asks for where they are held otherwise
    (another dtype: converted as the other routes do; another layout: copied contiguous). False,
    nothing written, where a moment is left in another floating dtype (for the eager path, which
    reads and keeps it as it is); another size or device is False too, or, with ``refuse`` (the
    route's name), refused before a byte is written."""
    conform(state, param, state_dtype)
    dtype = torch.float32 if state_dtype is None else state_dtype
    held = [state.get(k) for k in keys]
    if dtype.is_floating_point and any(isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype for t in held):
        return False
    wanted = raw_moments(keys, dtype, param.numel())
    for name, kind, numel in wanted:
        t = state.get(name)
        if isinstance(t, torch.Tensor) and t.dtype == kind and t.numel() == numel and t.device == param.device:
            continue
        if refuse is None:
            return False
        got = f"{t.dtype} of {t.numel()} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        where = "CPU" if param.device.type == "cpu" else str(param.device)
        raise ValueError(
            f"optimizer state {name!r} of a {tuple(param.shape)} weight must be a {where} {kind} tensor of "
            f"{numel} elements for the {refuse} step, got {got}; load a state_dict saved for this model"
        )
    for name, _, _ in wanted:
        t = state[name]
        if type(t) is not torch.Tensor or not t.is_contiguous():
            state[name] = t.detach().contiguous().as_subclass(torch.Tensor)
    return True

"""A checkpoint's fp32 masters (or Kahan compensation) carried into this run's weights or masters.

A checkpoint of a master plan ("bf16-master", "fp16-master") holds the true value of each
low-precision weight in its optimizer's fp32 masters (``get_plan("bf16-master",
remainders=True)``: as a 16-bit remainder beside each bf16 weight); one of "bf16-kahan" holds
the bits rounding dropped from each weight as a compensation buffer. A run whose optimizer
keeps none of these ("bf16-mixed", "fp8-mixed", "fp32": fp32 weights, a plain optimizer)
would drop them and resume from the rounded weights. :func:`fp32_weights` gives the model
entries to load instead, exactly: each master (where it rounds to the saved weight, as
:func:`mixprec.resume.fp32_value`), rebuilt from its remainder, or weight + compensation, the
value a Kahan update starts from. Where this run's weight could not hold it (a low-precision
weight), or the masters cannot be matched to the model's weights, the load is refused.

:func:`carry_between_plans` converts between the optimizers that keep exact masters: fp32
masters, remainders and Kahan compensation become this run's fp32 masters or remainders,
exactly; a run whose optimizer could keep them only rounded (bf16-pure, bf16-sr; Kahan
compensation for a master) is refused with the reason and the ways that work.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import torch

from mixprec.dtypes import LOW_PRECISION_DTYPES
from mixprec.optim import (
    KahanOptimizer,
    LowPrecisionOptimizer,
    MasterWeightOptimizer,
    RemainderOptimizer,
)
from mixprec.optim import states as qstates
from mixprec.optim.checks import KINDS_KEY, MASTER_INDEX_KEY
from mixprec.optim.quant import join_master, split_master
from mixprec.optim.shards import is_dtensor
from mixprec.resume import fp32_value

__all__ = ["MASTER_KEY", "ROUNDING_KEY", "carry_between_plans", "fp32_weights"]

#: Where :class:`~mixprec.optim.MasterWeightOptimizer` keeps the masters in its state_dict.
MASTER_KEY = "mixprec_master_weights"
#: Where the low-precision wrappers keep their own state (Kahan compensation) in theirs.
ROUNDING_KEY = "mixprec_lowbit"


def _keys_by_param(module: torch.nn.Module) -> dict[int, list[str]]:
    keys: dict[int, list[str]] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            keys.setdefault(id(value), []).append(key)  # a tied weight under each of its keys
    return keys


def _target(where: str, n: int, param: torch.Tensor, keys: list[str] | None, what: str) -> list[str]:
    if not keys:
        raise ValueError(
            f"{where} holds {what}, but parameter {n} of this optimizer is not a parameter of the model, so they "
            "cannot be matched to the model's weights; resume under the plan that saved it"
        )
    if param.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"{where} holds {what}, which this run's {param.dtype} weight {keys[0]!r} cannot hold (loading would "
            "round them away); resume under the plan that saved it, or one with fp32 masters"
        )
    return keys


def _from_masters(
    where: str, params: list[torch.Tensor], masters: Any, saved_model: Mapping[str, Any], keys: dict[int, list[str]],
    positions: Any = None,
) -> dict[str, torch.Tensor]:
    if not isinstance(masters, list | tuple) or not all(isinstance(m, torch.Tensor) for m in masters):
        raise ValueError(f"{where}[{MASTER_KEY!r}] is not a list of tensors, as MasterWeightOptimizer saves it")
    if positions is not None:  # which parameters had masters (frozen ones have none): saved since 0.1
        if not isinstance(positions, list | tuple) or len(positions) != len(masters):
            raise ValueError(f"{where}[{MASTER_INDEX_KEY!r}] does not list one position per master weight")
        positions = {int(i) for i in positions}
    out: dict[str, torch.Tensor] = {}
    taken = 0
    for n, p in enumerate(params):
        names = keys.get(id(p))
        saved = saved_model.get(names[0]) if names else None
        if positions is not None and n not in positions:
            continue  # frozen when saved, or fp32 (a norm layer): it had no master
        if names and not (isinstance(saved, torch.Tensor) and saved.dtype in LOW_PRECISION_DTYPES):
            continue  # saved in fp32 (a norm layer): it had no master
        names = _target(where, n, p, names, "fp32 master weights")
        if taken == len(masters) or masters[taken].shape != p.shape:
            break
        value = fp32_value(saved, masters[taken])  # type: ignore[arg-type]
        taken += 1
        out.update(dict.fromkeys(names, value))
    if taken != len(masters):
        raise ValueError(
            f"{where} holds {len(masters)} fp32 master weights that do not match this optimizer's low-precision "
            "parameters in the checkpoint (count or shapes); it was saved from another model"
        )
    return out


def _from_compensation(
    where: str, params: list[torch.Tensor], comp: Any, saved_model: Mapping[str, Any], keys: dict[int, list[str]],
) -> dict[str, torch.Tensor]:
    if not isinstance(comp, Mapping):
        raise ValueError(f"{where}[{ROUNDING_KEY!r}]['compensation'] is not a dict, as KahanOptimizer saves it")
    out: dict[str, torch.Tensor] = {}
    for index, c in comp.items():
        n = int(index)
        if not 0 <= n < len(params) or not isinstance(c, torch.Tensor) or c.shape != params[n].shape:
            raise ValueError(f"{where} holds a compensation buffer {index!r} that matches no parameter of this optimizer")
        names = _target(where, n, params[n], keys.get(id(params[n])), "Kahan compensation")
        saved = saved_model[names[0]]
        value = saved.detach().to(torch.float32) + c.detach().to(device=saved.device, dtype=torch.float32)
        out.update(dict.fromkeys(names, value))
    return out


def _saved_remainders(rounding: Any) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]] | None:
    """(remainders, ties) by parameter position, as :class:`~mixprec.optim.RemainderOptimizer` saves
    them in its own entry; None when ``rounding`` holds none."""
    if not isinstance(rounding, Mapping) or not isinstance(rounding.get("remainder"), Mapping) or not rounding["remainder"]:
        return None
    ties = rounding.get("remainder_ties")
    ties = ties if isinstance(ties, Mapping) else {}
    return ({int(k): v for k, v in rounding["remainder"].items()}, {int(k): v for k, v in ties.items()})


def _rebuilt(weight: torch.Tensor, rem: torch.Tensor, ties: torch.Tensor | None) -> torch.Tensor:
    if not (isinstance(rem, torch.Tensor) and rem.dtype == torch.int16 and rem.shape == weight.shape
            and weight.dtype == torch.bfloat16):
        raise ValueError("a saved remainder that does not match its bf16 weight (shape or dtype)")
    tied = ties if isinstance(ties, torch.Tensor) else torch.empty(0, dtype=torch.int64)
    w = weight.detach().contiguous()
    return join_master(w, rem.to(w.device).contiguous(), tied.to(device=w.device, dtype=torch.int64).reshape(-1))


def _from_remainders(
    where: str, params: list[torch.Tensor], saved: tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]],
    saved_model: Mapping[str, Any], keys: dict[int, list[str]],
) -> dict[str, torch.Tensor]:
    rems, ties = saved
    out: dict[str, torch.Tensor] = {}
    for n, rem in rems.items():
        if not 0 <= n < len(params):
            raise ValueError(f"{where} holds a remainder {n!r} that matches no parameter of this optimizer")
        names = _target(where, n, params[n], keys.get(id(params[n])), "fp32 master weights (as remainders)")
        try:
            out.update(dict.fromkeys(names, _rebuilt(saved_model[names[0]], rem, ties.get(n))))
        except ValueError as exc:
            raise ValueError(f"{where}: parameter {n}: {exc}; it was saved from another model") from None
    return out


#: what a saved optimizer state keeps beside the low-precision weights, in words
_WHAT = {"masters": "fp32 master weights", "remainders": "fp32 master weights (as bf16 weight + remainder)",
         "compensation": "Kahan compensation (the bits rounding dropped from the weights)"}


def _truth(state: Mapping[str, Any]) -> str | None:
    """Which exact values beside its low-precision weights a saved optimizer state holds."""
    if state.get(MASTER_KEY) is not None:
        return "masters"
    rounding = state.get(ROUNDING_KEY)
    if _saved_remainders(rounding) is not None:
        return "remainders"
    if isinstance(rounding, Mapping) and rounding.get("compensation"):
        return "compensation"
    return None


def _keeps(opt: torch.optim.Optimizer) -> str | None:
    """Which of them this run's optimizer keeps: None for a plain optimizer (fp32 weights: see
    :func:`fp32_weights`), ``"rounded"`` for a low-precision wrapper that keeps none."""
    if isinstance(opt, MasterWeightOptimizer):
        return "masters"
    if isinstance(opt, RemainderOptimizer):
        return "remainders"
    if isinstance(opt, KahanOptimizer):
        return "compensation"
    return "rounded" if isinstance(opt, LowPrecisionOptimizer) else None


def _exact_values(kind: str, state: Mapping[str, Any], params: list[torch.Tensor],
                  saved_model: Mapping[str, Any], keys: dict[int, list[str]]) -> dict[int, torch.Tensor]:
    """The exact fp32 value of each saved low-precision weight, by parameter position."""
    out: dict[int, torch.Tensor] = {}
    pairs: Iterable[tuple[int, Any]]
    if kind == "masters":
        masters, positions = state[MASTER_KEY], state.get(MASTER_INDEX_KEY)
        if positions is None:
            positions = [n for n, p in enumerate(params) if (names := keys.get(id(p)))
                         and getattr(saved_model.get(names[0]), "dtype", None) in LOW_PRECISION_DTYPES]
        if not isinstance(masters, list | tuple) or len(masters) != len(positions):
            raise ValueError("its fp32 master weights do not match the parameters they are listed for")
        pairs = zip((int(n) for n in positions), masters, strict=True)
    elif kind == "remainders":
        rems, ties = _saved_remainders(state[ROUNDING_KEY]) or ({}, {})
        pairs = ((n, (rem, ties.get(n))) for n, rem in rems.items())
    else:
        pairs = ((int(n), c) for n, c in state[ROUNDING_KEY]["compensation"].items())
    for n, held in pairs:
        names = keys.get(id(params[n])) if 0 <= n < len(params) else None
        weight = saved_model.get(names[0]) if names else None
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"what it keeps for parameter {n} matches no weight of this model")
        if kind == "masters":
            value = fp32_value(weight, held.to(weight.device))
        elif kind == "remainders":
            value = _rebuilt(weight, *held)
        else:
            value = fp32_value(weight, weight.float() + held.to(device=weight.device, dtype=torch.float32))
        if value.shape != weight.shape:
            raise ValueError(f"what it keeps for parameter {n} has another shape than its weight")
        out[n] = value
    return out


def _fp32_moments(state: Mapping[Any, Any]) -> dict[Any, Any]:
    """A saved inner optimizer's per-parameter state with 8-bit moments expanded to fp32 (torch's
    load casts floating state to an fp32 master's dtype itself; codes it would keep as bytes)."""
    out: dict[Any, Any] = {}
    for index, entry in state.items():
        if not isinstance(entry, Mapping):
            out[index] = entry
            continue
        fixed = dict(entry)
        for key in [k for k in entry if qstates.is_scale_key(k)]:
            base = key[: -len(qstates.ABSMAX)]
            if base in fixed:
                fixed[base] = qstates.value(entry, base)
            del fixed[key]
        out[index] = fixed
    return out


def carry_between_plans(
    path: str, module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], payload: dict[str, Any],
) -> list[str]:
    """For a load with ``allow_plan_change=True``: each saved optimizer state whose exact values
    (fp32 masters, remainders, Kahan compensation) this run's optimizer keeps in another form is
    rewritten, in ``payload``, into that form, exactly (the model entries of a remainder run too:
    the weight is the master's rounding); returns one line per optimizer saying so.

    Refused (ValueError naming the optimizer, why and the ways that work) where this run's
    optimizer could keep them only rounded: a low-precision wrapper without masters (bf16-pure,
    bf16-sr), or Kahan compensation (bf16) for a master's 16 extra bits. Plain optimizers with fp32
    weights take them as weights (:func:`fp32_weights`); FSDP2 shards are left to the checks.
    """
    if any(is_dtensor(p) for p in module.parameters()):
        return []
    notes: list[str] = []
    states = payload.get("optimizers")
    keys: dict[int, list[str]] | None = None
    for i, (opt, state) in enumerate(zip(optimizers, states if isinstance(states, list) else [], strict=False)):
        if not isinstance(state, dict):
            continue
        kind, keeps = _truth(state), _keeps(opt)
        if kind is None or keeps is None or kind == keeps:
            continue
        where = f"checkpoint {path!r}: optimizers[{i}]"
        saved_plan = (payload.get("mixed_precision") or {}).get("plan", "another plan")
        if keeps in ("rounded", "compensation"):
            fix = ("resume under the plan that saved it, or one that keeps them exactly: get_plan('bf16-master'), "
                   "get_plan('bf16-master', remainders=True), or a plan with fp32 weights ('bf16-mixed', 'fp32'), "
                   "which takes them as its weights; to round them on purpose, load only the model "
                   "(model.load_state_dict(torch.load(path, weights_only=True)['model'])) and start the optimizer fresh")
            why = ("keeps the weights alone, rounded" if keeps == "rounded" else
                   "keeps the rounding error of each weight in bf16, which cannot hold a master's 16 extra bits")
            raise ValueError(
                f"{where} holds {_WHAT[kind]}, saved under plan {saved_plan!r}; this run's {type(opt).__name__} {why}: "
                f"loading would round them away. To go on, {fix}"
            )
        master_opt = opt if isinstance(opt, MasterWeightOptimizer) else None
        params: list[torch.Tensor] = (master_opt.kind_params() if master_opt is not None
                                      else list(cast(LowPrecisionOptimizer, opt).params()))
        saved_groups = state.get("param_groups")
        saved_count = sum(len(g.get("params", ())) for g in saved_groups) if isinstance(saved_groups, list) else -1
        if saved_count != len(params):
            continue  # another model or other groups: the checks say which
        keys = keys if keys is not None else _keys_by_param(module)
        try:
            values = _exact_values(kind, state, params, payload["model"], keys)
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise ValueError(f"{where} holds {_WHAT[kind]} that cannot be carried into this run ({exc}); resume "
                             "under the plan that saved it") from None
        own = {k: v for k, v in state.items() if k not in (MASTER_KEY, MASTER_INDEX_KEY, ROUNDING_KEY)}
        own["state"] = _fp32_moments(state.get("state", {}))
        if master_opt is not None:
            positions = [n for n, p in enumerate(params) if master_opt.master_of(p) is not None]
            own[MASTER_KEY] = [values[n] if n in values else _saved_weight(payload, keys, params[n]).float()
                               for n in positions]
            own[MASTER_INDEX_KEY] = positions
        else:  # remainders: each weight is its master's rounding, the low half kept beside it
            rem, ties, model = {}, {}, dict(payload["model"])
            for n, value in values.items():
                if params[n].dtype != torch.bfloat16:
                    continue
                weight, rem[n], ties[n] = split_master(value.contiguous())
                model.update(dict.fromkeys(keys[id(params[n])], weight))
            payload["model"] = model
            own[ROUNDING_KEY] = {"remainder": rem, "remainder_ties": ties, KINDS_KEY: ["remainder", "remainder_ties"],
                                 "compiled_layouts": []}
        states[i] = own  # type: ignore[index]
        notes.append(f"optimizers[{i}]: the {_WHAT[kind]} of {len(values)} weight(s) carried into its "
                     f"{_WHAT[keeps]}, exactly")
    return notes


def _saved_weight(payload: Mapping[str, Any], keys: dict[int, list[str]], param: torch.Tensor) -> torch.Tensor:
    return payload["model"][keys[id(param)][0]]


def fp32_weights(
    path: str, module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], payload: Mapping[str, Any],
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Model entries to load in place of the checkpoint's rounded weights, and one line per
    optimizer saying so; nothing when every optimizer keeps what it saved (the same plan).

    Raises ValueError naming the optimizer when its masters or compensation cannot be
    carried over exactly. Call after the parts were checked (same model, same groups).
    """
    keys: dict[int, list[str]] | None = None
    out: dict[str, torch.Tensor] = {}
    notes: list[str] = []
    saved_model = payload["model"]
    for i, (opt, state) in enumerate(zip(optimizers, payload["optimizers"], strict=True)):
        masters = state.get(MASTER_KEY)
        rounding = state.get(ROUNDING_KEY)
        comp = rounding.get("compensation") if isinstance(rounding, Mapping) else None
        remainders = _saved_remainders(rounding)
        found: dict[str, torch.Tensor] = {}
        where = f"checkpoint {path!r}: optimizers[{i}]"
        params = [p for group in opt.param_groups for p in group["params"]]
        if masters is not None and not isinstance(opt, MasterWeightOptimizer):
            keys = keys if keys is not None else _keys_by_param(module)
            found = _from_masters(where, params, masters, saved_model, keys, state.get(MASTER_INDEX_KEY))
            what = "loaded from their fp32 masters"
        elif remainders is not None and not isinstance(opt, LowPrecisionOptimizer | MasterWeightOptimizer):
            keys = keys if keys is not None else _keys_by_param(module)
            found = _from_remainders(where, params, remainders, saved_model, keys)
            what = "loaded from their fp32 masters (bf16 weight + remainder)"
        elif comp and not isinstance(opt, LowPrecisionOptimizer):
            keys = keys if keys is not None else _keys_by_param(module)
            found = _from_compensation(where, params, comp, saved_model, keys)
            what = "loaded as weight + Kahan compensation"
        if found:
            out.update(found)
            count = len({id(v) for v in found.values()})
            notes.append(f"optimizers[{i}]: {count} weight(s) {what}")
    return out, notes

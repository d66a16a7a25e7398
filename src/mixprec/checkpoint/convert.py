"""A checkpoint's fp32 masters (or Kahan compensation) carried into this run's fp32 weights.

A checkpoint of a master plan ("bf16-master", "fp16-master") holds the true value of each
low-precision weight in its optimizer's fp32 masters; one of "bf16-kahan" holds the bits
rounding dropped from each weight as a compensation buffer. A run whose optimizer keeps
neither ("bf16-mixed", "fp8-mixed", "fp32": fp32 weights, a plain optimizer) would drop
them and resume from the rounded weights. :func:`fp32_weights` gives the model entries to
load instead, exactly: each master (where it rounds to the saved weight, as
:func:`mixprec.resume.fp32_value`), or weight + compensation, the value a Kahan update starts
from. Where this run's weight could not hold it (a low-precision weight), or the masters
cannot be matched to the model's weights, the load is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mixprec.dtypes import LOW_PRECISION_DTYPES
from mixprec.optim import LowPrecisionOptimizer, MasterWeightOptimizer
from mixprec.optim.checks import MASTER_INDEX_KEY
from mixprec.resume import fp32_value

__all__ = ["MASTER_KEY", "ROUNDING_KEY", "fp32_weights"]

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
        found: dict[str, torch.Tensor] = {}
        where = f"checkpoint {path!r}: optimizers[{i}]"
        params = [p for group in opt.param_groups for p in group["params"]]
        if masters is not None and not isinstance(opt, MasterWeightOptimizer):
            keys = keys if keys is not None else _keys_by_param(module)
            found = _from_masters(where, params, masters, saved_model, keys, state.get(MASTER_INDEX_KEY))
            what = "loaded from their fp32 masters"
        elif comp and not isinstance(opt, LowPrecisionOptimizer):
            keys = keys if keys is not None else _keys_by_param(module)
            found = _from_compensation(where, params, comp, saved_model, keys)
            what = "loaded as weight + Kahan compensation"
        if found:
            out.update(found)
            count = len({id(v) for v in found.values()})
            notes.append(f"optimizers[{i}]: {count} weight(s) {what}")
    return out, notes

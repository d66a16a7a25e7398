"""A session's checkpoint state: its format, the checks a resumed run must pass, and the fp32 export.

Also what a resume from a checkpoint that mixprec did not write needs: loading a plain
torch optimizer's state into a prepared optimizer (:func:`load_plain_optimizer_state`),
and the model's weights with fp32 masters in place of low-precision ones
(:func:`fp32_state_dict`, behind :meth:`mixprec.MixedPrecision.export_fp32_state_dict`).

>>> import torch
>>> from mixprec import MixedPrecision
>>> from mixprec.resume import validated_scaler_state
>>> mp = MixedPrecision("fp16-mixed")
>>> sd = mp.state_dict()
>>> validated_scaler_state(sd, mp.plan, mp.scaler, None, False)["scale"]
65536.0
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mixprec.dtypes import LOW_PRECISION_DTYPES
from mixprec.optim import (
    LowPrecisionOptimizer,
    MasterWeightOptimizer,
    RemainderOptimizer,
    WrappedOptimizer,
)
from mixprec.optim import states as qstates
from mixprec.optim.checks import MASTER_INDEX_KEY, check_inner_state_dict, lift_wrapper_state
from mixprec.optim.follow import master_value
from mixprec.optim.loads import load_inner
from mixprec.plans import Plan
from mixprec.scaling import LossScaler
from mixprec.step import StepLedger

__all__ = [
    "SCALER_SETTINGS",
    "STATE_FORMAT",
    "fingerprint_diffs",
    "fp32_state_dict",
    "fp32_value",
    "load_plain_optimizer_state",
    "session_state",
    "validated_scaler_state",
]

STATE_FORMAT = "mixprec.MixedPrecision/1"
# Loss-scaler settings a resumed run must agree on (the counters are state, these are configuration).
SCALER_SETTINGS = (
    "growth_factor", "backoff_factor", "growth_interval", "hysteresis", "hysteresis_mode", "min_scale", "max_scale",
    "growth_delay", "raise_at_min_scale",
)


def session_state(plan: Plan, scaler: LossScaler, ledger: StepLedger, scheduler: Any) -> dict[str, Any]:
    """What :meth:`MixedPrecision.state_dict` saves: format, plan fingerprint, scaler, counters, scheduler."""
    sd: dict[str, Any] = {
        "format": STATE_FORMAT,
        "plan": plan.name,
        "fingerprint": plan.fingerprint(),
        "scaler": scaler.state_dict(),
        "optimizer_steps": ledger.optimizer_steps,
        "consecutive_skips": ledger.consecutive_skips,
        "zero_grad_steps": ledger.zero_grad_steps,
    }
    if scheduler is not None:
        sd["scheduler"] = scheduler.state_dict()
    return sd


def fingerprint_diffs(saved: Any, plan: Plan) -> str:
    """How a saved plan fingerprint differs from ``plan``'s ("weights: saved 'fp16' vs now 'bf16', ...")."""
    if not isinstance(saved, Mapping):
        return "no fingerprint"
    ours = plan.fingerprint()
    return ", ".join(f"{k}: saved {saved.get(k)!r} vs now {v!r}" for k, v in ours.items() if saved.get(k) != v)


def validated_scaler_state(
    state_dict: Any, plan: Plan, scaler: LossScaler, scheduler: Any, allow_plan_change: bool
) -> dict[str, Any] | None:
    """Check everything :meth:`MixedPrecision.load_state_dict` needs; return the scaler state to load (or None).

    Raises ValueError naming the problem and the fix; changes nothing.
    """
    if not isinstance(state_dict, Mapping) or state_dict.get("format") != STATE_FORMAT:
        raise ValueError(
            "not a MixedPrecision state_dict (missing or wrong 'format'); pass what MixedPrecision.state_dict() returned"
        )
    saved_fp, ours = state_dict.get("fingerprint"), plan.fingerprint()
    if saved_fp is not None and not isinstance(saved_fp, Mapping):
        raise ValueError(
            f"state_dict['fingerprint'] must be a dict (what Plan.fingerprint() returns), got {saved_fp!r:.80} "
            f"({type(saved_fp).__name__}): the checkpoint is corrupt or was not written by MixedPrecision.state_dict(); "
            "load an intact checkpoint"
        )
    if saved_fp != ours and not allow_plan_change:
        diffs = fingerprint_diffs(saved_fp, plan)
        auto = (
            f" This run's plan was chosen by precision='auto' on this hardware; to keep the checkpoint's plan, "
            f"name it: precision={state_dict.get('plan')!r}."
            if plan.auto_reason else ""
        )
        raise ValueError(
            f"this checkpoint was made under plan {state_dict.get('plan')!r}, but this run uses "
            f"{plan.name!r} ({diffs}). Resuming would silently change numerics; to convert on "
            "purpose, load the model weights, start the optimizer fresh, and call "
            f"load_state_dict(sd, allow_plan_change=True).{auto}"
        )
    for key in ("optimizer_steps", "consecutive_skips", "zero_grad_steps"):
        value = state_dict.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"state_dict[{key!r}] must be a non-negative integer, got {value!r}")
    has_saved = "scheduler" in state_dict
    if has_saved and scheduler is None:
        raise ValueError(
            "this checkpoint holds LR scheduler state, but no scheduler was given to prepare(): it would be "
            "dropped and the learning rate would restart. Pass scheduler= to prepare() (or set mp.scheduler) "
            "before loading"
        )
    if scheduler is not None and not has_saved:
        raise ValueError(
            "a scheduler was given to prepare(), but this checkpoint holds no scheduler state: the learning "
            "rate would restart from its first value. Load a checkpoint saved with the scheduler, or load "
            "without one"
        )
    if has_saved and not isinstance(state_dict["scheduler"], Mapping):
        raise ValueError(f"state_dict['scheduler'] must be a dict, got {type(state_dict['scheduler']).__name__}")
    saved = state_dict.get("scaler", {})
    if not isinstance(saved, Mapping):
        raise ValueError(f"state_dict['scaler'] must be a dict, got {type(saved).__name__}")
    if allow_plan_change and (saved_fp or {}).get("scaling") != ours["scaling"]:
        return None
    saved = dict(saved)
    current = scaler.state_dict()
    changed = {
        k: (saved[k], v) for k, v in current.items() if k in SCALER_SETTINGS and k in saved and saved[k] != v
    }
    if changed:
        if not allow_plan_change:
            diffs = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in changed.items())
            raise ValueError(
                f"this checkpoint's loss scaler was configured differently ({diffs}); resuming would "
                "silently replace this run's settings with the saved ones. Use the saved settings, or call "
                "load_state_dict(sd, allow_plan_change=True) to keep this run's settings and the saved counters"
            )
        saved.update({k: current[k] for k in changed})
        interval = saved.get("growth_interval")
        if isinstance(interval, int) and isinstance(saved.get("_growth_tracker"), int):
            saved["_growth_tracker"] = min(saved["_growth_tracker"], interval - 1)
    scaler.validate_state_dict(saved)
    return saved


# ------------------------------------------------------------------ fp32 export
def _plain_module(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DistributedDataParallel / DataParallel / ``torch.compile``."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while True:
        inner = model.module if isinstance(model, DistributedDataParallel | DataParallel) else getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


@torch.no_grad()
def fp32_value(tensor: torch.Tensor, master: torch.Tensor | None) -> torch.Tensor:
    """The fp32 value a weight stands for: its fp32 ``master`` where the master rounds to the
    weight, the weight upcast elsewhere (written after the last step); fp32/fp64 and
    non-floating tensors as they are."""
    value = tensor.detach()
    if not value.is_floating_point() or value.dtype in (torch.float32, torch.float64):
        return value
    if master is None:
        return value.to(torch.float32)
    # a weight written after the last step (and not by a load the master followed) is the truth
    if bool((master.to(value.dtype) == value).all()):
        return master.detach()  # shares storage with the master, as state_dict() shares the model's
    return master_value(value, master)


def fp32_state_dict(model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> dict[str, Any]:
    """``model.state_dict()`` (of the module inside DDP / ``torch.compile``) in fp32.

    Each low-precision parameter is replaced by its fp32 master where one of
    ``optimizers`` keeps one (:meth:`~mixprec.optim.MasterWeightOptimizer.master_of`; remainder
    masters rebuilt exactly, :meth:`~mixprec.optim.RemainderOptimizer.master_of`), and
    upcast to fp32 otherwise (pure, Kahan and stochastic-rounding plans, frozen weights:
    exactly the weight the model computes with). Elements of a weight written after the
    last optimizer step whose master no longer rounds to them are taken from the weight.
    Floating buffers are upcast to fp32 (exactly: BatchNorm statistics of a bf16 model);
    fp32/fp64 tensors, integer buffers and non-tensor extra state are returned as they are.

    Tensors that need no conversion (masters, fp32 weights) share storage with them, as
    ``state_dict()`` does; a weight tied under several keys is one tensor under all of them.

    >>> import torch
    >>> from mixprec import MixedPrecision
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> mp = MixedPrecision("bf16-master")
    >>> model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    >>> sd = fp32_state_dict(model, [opt])
    >>> model[0].weight.dtype, sd["0.weight"].dtype, torch.equal(sd["0.weight"], opt.master_of(model[0].weight))
    (torch.bfloat16, torch.float32, True)
    """
    module = _plain_module(model)
    # fp32 masters, whole (MasterWeightOptimizer) or as bf16 weight + remainder (RemainderOptimizer)
    masters = [opt for opt in optimizers if isinstance(opt, MasterWeightOptimizer | RemainderOptimizer)]
    out: dict[str, Any] = {}
    converted: dict[int, torch.Tensor] = {}  # id(tensor) -> its fp32 value (tied weights share it)
    for key, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            out[key] = value
            continue
        fp32 = converted.get(id(value))
        if fp32 is None:
            master = next((m for opt in masters if (m := opt.master_of(value)) is not None), None)
            fp32 = converted[id(value)] = fp32_value(value, master)
        out[key] = fp32
    return out


# --------------------------------------------- optimizer state saved without mixprec
LOWBIT_KEY = LowPrecisionOptimizer._STATE_KEY


def _own_entries(optimizer: WrappedOptimizer) -> dict[str, Any]:
    """What a wrapper's ``state_dict()`` holds besides the inner optimizer's (masters, compensation, noise)."""
    own = lift_wrapper_state(optimizer.state_dict(), LOWBIT_KEY)  # (over FSDP2 shards it sits in a param group)
    return {k: v for k, v in own.items() if k not in ("state", "param_groups")}


def _in_state_dtype(optimizer: LowPrecisionOptimizer, state_dict: Mapping[str, Any]) -> dict[Any, Any]:
    """The saved per-parameter state, each low-precision parameter's element-wise tensors in the
    wrapper's ``state_dtype`` (a plain optimizer saved them in fp32)."""
    params = list(optimizer.params())
    order = [pid for group in state_dict.get("param_groups", []) for pid in group.get("params", [])]
    state = dict(state_dict.get("state", {}))
    if len(order) != len(params):
        return state  # the load refuses it, naming the difference
    position = {pid: n for n, pid in enumerate(order)}
    dtype = optimizer.state_dtype or torch.float32
    if qstates.block_codec(dtype) is not None:
        return state  # block-coded (8-bit, fp8): the wrapper's load encodes the saved fp32 values
    for index, entry in state.items():
        param = params[position[index]] if index in position else None
        if param is None or param.dtype not in LOW_PRECISION_DTYPES or not isinstance(entry, Mapping):
            continue
        state[index] = {
            k: v.to(dtype) if (  # (block codes, fp8 ones too, are decoded by the wrapper's load)
                k != "step" and isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == param.shape
                and not qstates.is_coded(entry, k)
            ) else v
            for k, v in entry.items()
        }
    return state


def load_plain_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
    """Load the ``state_dict()`` of a plain torch optimizer into a prepared one.

    For a checkpoint that mixprec did not write (a plain loop, a framework without
    mixprec): the inner optimizer's state (Adam moments, step counts, param groups) is
    loaded, the low-precision parameters' element-wise state in the wrapper's
    ``state_dtype``; what the wrapper keeps of its own (fp32 masters, Kahan compensation,
    rounding noise) stays as it is. The masters follow the model's weights (load those
    first). Entries of the wrapper's own found in ``state_dict`` are loaded as saved; an
    entry of another kind of mixprec optimizer (a checkpoint of another plan) is refused.
    All or nothing, as the wrapper's ``load_state_dict``.
    """
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("not an optimizer state_dict (it needs 'state' and 'param_groups'); pass what optimizer.state_dict() returned")
    state_dict = lift_wrapper_state(state_dict, LOWBIT_KEY)
    if not isinstance(optimizer, WrappedOptimizer):
        kept = sorted(k for k in state_dict if isinstance(k, str) and k.startswith("mixprec_") and k != MASTER_INDEX_KEY)
        if kept:
            raise ValueError(
                f"this optimizer state_dict holds {', '.join(map(repr, kept))}, kept by a mixprec optimizer of another "
                f"plan (fp32 masters, Kahan compensation), which this run's plain {type(optimizer).__name__} cannot "
                "keep: loading it would drop them silently. Resume it under the plan that saved it"
            )
        check_inner_state_dict(optimizer, dict(state_dict))  # all or nothing: refused before anything changes
        load_inner(optimizer, dict(state_dict))
        return
    own = _own_entries(optimizer)
    foreign = sorted(k for k in state_dict if isinstance(k, str) and k.startswith("mixprec_") and k not in own)
    if foreign:
        raise ValueError(
            f"this optimizer state_dict holds {', '.join(map(repr, foreign))}, kept by another kind of mixprec "
            f"optimizer than the {type(optimizer).__name__} of this run: it was saved under another plan. Resume it "
            "under the plan that saved it"
        )
    sd = dict(state_dict)
    if isinstance(optimizer, LowPrecisionOptimizer) and not own.keys() & sd.keys():
        sd["state"] = _in_state_dtype(optimizer, sd)
    optimizer.load_state_dict({**own, **sd})

"""A session's checkpoint state: its format, and the checks a resumed run must pass.

>>> import torch
>>> from mixprec import MixedPrecision
>>> from mixprec.resume import validated_scaler_state
>>> mp = MixedPrecision("fp16-mixed")
>>> sd = mp.state_dict()
>>> validated_scaler_state(sd, mp.plan, mp.scaler, None, False)["scale"]
65536.0
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mixprec.plans import Plan
from mixprec.scaling import LossScaler
from mixprec.step import StepLedger

__all__ = ["SCALER_SETTINGS", "STATE_FORMAT", "session_state", "validated_scaler_state"]

STATE_FORMAT = "mixprec.MixedPrecision/1"
# Loss-scaler settings a resumed run must agree on (the counters are state, these are configuration).
SCALER_SETTINGS = (
    "growth_factor", "backoff_factor", "growth_interval", "hysteresis", "hysteresis_mode", "min_scale", "max_scale",
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
    }
    if scheduler is not None:
        sd["scheduler"] = scheduler.state_dict()
    return sd


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
    if saved_fp != ours and not allow_plan_change:
        if isinstance(saved_fp, dict):
            diffs = ", ".join(
                f"{k}: saved {saved_fp.get(k)!r} vs now {v!r}" for k, v in ours.items() if saved_fp.get(k) != v
            )
        else:
            diffs = "no fingerprint"
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
    for key in ("optimizer_steps", "consecutive_skips"):
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

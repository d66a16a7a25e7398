"""The one place where plan names become plans.

>>> from mixprec import get_plan
>>> get_plan("O2").name
'fp16-master'
>>> get_plan("fp16-mixed", loss_scale=128).scaling.kind
'constant'
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any

import torch

from mixprec.plans.base import Plan, ScalingConfig, ScalingKind
from mixprec.plans.fp8 import Fp8Plan
from mixprec.plans.full import FullPrecisionPlan
from mixprec.plans.lowbit import LowBitPlan
from mixprec.plans.master import MasterPlan
from mixprec.plans.mixed import MixedPlan
from mixprec.plans.pure import PurePlan

__all__ = ["ALIASES", "PLANS", "get_plan", "resolve_plan_name"]

_BF16, _FP16 = torch.bfloat16, torch.float16
_DYNAMIC = ScalingConfig(kind="dynamic")

_FACTORIES: dict[str, Callable[[], Plan]] = {
    "fp32": lambda: FullPrecisionPlan("fp32"),
    "tf32": lambda: FullPrecisionPlan("tf32", tf32=True),
    "bf16-mixed": lambda: MixedPlan("bf16-mixed", compute_dtype=_BF16),
    "fp16-mixed": lambda: MixedPlan("fp16-mixed", compute_dtype=_FP16, scaling=_DYNAMIC),
    "bf16-master": lambda: MasterPlan("bf16-master", compute_dtype=_BF16),
    "fp16-master": lambda: MasterPlan("fp16-master", compute_dtype=_FP16, scaling=_DYNAMIC),
    "bf16-pure": lambda: PurePlan("bf16-pure", compute_dtype=_BF16),
    "fp16-pure": lambda: PurePlan("fp16-pure", compute_dtype=_FP16, scaling=_DYNAMIC),
    "bf16-kahan": lambda: LowBitPlan("bf16-kahan", compute_dtype=_BF16, rounding="kahan"),
    "bf16-sr": lambda: LowBitPlan("bf16-sr", compute_dtype=_BF16, rounding="stochastic"),
    "fp8-mixed": lambda: Fp8Plan("fp8-mixed", compute_dtype=_BF16),
}

PLANS: tuple[str, ...] = tuple(_FACTORIES)

ALIASES: dict[str, str] = {
    # apex opt levels
    "O0": "fp32",
    "O1": "fp16-mixed",
    "O2": "fp16-master",
    "O3": "fp16-pure",
    # short names, Colossal-AI booster names, Lightning precision names
    "fp16": "fp16-mixed",
    "bf16": "bf16-mixed",
    "fp8": "fp8-mixed",
    "fp16_naive": "fp16-master",
    "fp16_apex": "fp16-mixed",
    "32": "fp32",
    "32-true": "fp32",
    "16-mixed": "fp16-mixed",
    "16-true": "fp16-pure",
    "bf16-true": "bf16-pure",
}

_SCALING_KEYS = {f.name for f in dataclasses.fields(ScalingConfig)} - {"kind"}
_POLICY_KEYS = {"lower_ops", "fp32_ops", "fp32_modules"}


def resolve_plan_name(name: str) -> str:
    """Canonical name for ``name`` (an alias or a canonical name); ValueError listing valid names."""
    if not isinstance(name, str):
        raise TypeError(f"a plan name must be a string, got {type(name).__name__}")
    key = name.strip()
    if key in _FACTORIES:
        return key
    if key in ALIASES:
        return ALIASES[key]
    lowered = {k.lower(): v for k, v in ALIASES.items()} | {k: k for k in _FACTORIES}
    if key.lower() in lowered:
        return lowered[key.lower()]
    close = difflib.get_close_matches(key, [*PLANS, *ALIASES], n=3)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(
        f"unknown precision plan {name!r}.{hint} Valid plans: {', '.join(PLANS)}; "
        f"aliases: {', '.join(f'{a}={c}' for a, c in ALIASES.items())}"
    )


def get_plan(name: str | Plan, **overrides: Any) -> Plan:
    """The plan called ``name`` (canonical name or alias), with ``overrides`` applied.

    Overrides are plan fields (``policy``, ``reduce_dtype``, ...), the op-list shortcuts
    ``lower_ops`` / ``fp32_ops`` / ``fp32_modules`` (an :class:`OpPolicy` is built),
    and loss-scaling settings as apex and Paddle take them: ``loss_scale`` ("dynamic",
    a number for a constant scale, or None), ``init_scale``, ``growth_factor``,
    ``backoff_factor``, ``growth_interval``, ``hysteresis``, ``hysteresis_mode``,
    ``min_scale``, ``max_scale``. Plans without loss scaling (bf16, fp32) refuse
    scaling settings unless ``loss_scale`` is given explicitly (the opt-in).
    """
    plan = name if isinstance(name, Plan) else _FACTORIES[resolve_plan_name(name)]()
    if not overrides:
        return plan
    changes: dict[str, Any] = {}
    scaling_changes = {k: overrides.pop(k) for k in list(overrides) if k in _SCALING_KEYS}
    has_loss_scale = "loss_scale" in overrides
    loss_scale = overrides.pop("loss_scale", None)
    policy_changes = {k: overrides.pop(k) for k in list(overrides) if k in _POLICY_KEYS}
    valid_fields = {f.name for f in dataclasses.fields(plan)} - {"name", "scaling"}
    unknown = sorted(set(overrides) - valid_fields)
    if unknown:
        valid = sorted(valid_fields | _SCALING_KEYS | _POLICY_KEYS | {"loss_scale"})
        raise ValueError(f"unknown override(s) {unknown} for plan {plan.name!r}; valid overrides: {', '.join(valid)}")
    changes.update(overrides)

    if has_loss_scale or scaling_changes:
        changes["scaling"] = _scaling_override(plan, has_loss_scale, loss_scale, scaling_changes)
    if policy_changes:
        from mixprec.policy import OpPolicy

        if "policy" in changes:
            raise ValueError("pass either policy= or lower_ops/fp32_ops/fp32_modules, not both")
        changes["policy"] = OpPolicy(dtype=plan.compute_dtype, **policy_changes)
    return dataclasses.replace(plan, **changes)


def _scaling_override(plan: Plan, has_loss_scale: bool, loss_scale: Any, settings: dict[str, Any]) -> ScalingConfig:
    base = plan.scaling
    kind: ScalingKind
    if has_loss_scale:
        if loss_scale is None or loss_scale == "none":
            if settings:
                raise ValueError(f"loss_scale=None disables scaling, but scaling settings were given: {sorted(settings)}")
            return ScalingConfig(kind="none")
        if loss_scale == "dynamic":
            kind = "dynamic"
        elif isinstance(loss_scale, int | float) and not isinstance(loss_scale, bool):
            if settings:
                raise ValueError(
                    f"loss_scale={loss_scale!r} is a constant scale; dynamic settings {sorted(settings)} do not apply"
                )
            return ScalingConfig(kind="constant", init_scale=float(loss_scale))
        else:
            raise ValueError(f"loss_scale must be 'dynamic', a number (constant scale) or None, got {loss_scale!r}")
    else:
        if base.kind == "none":
            raise ValueError(
                f"plan {plan.name!r} does not scale the loss ({plan.compute_dtype} has the range it needs), "
                f"so {sorted(settings)} would be ignored; pass loss_scale='dynamic' as well to opt in to loss scaling"
            )
        kind = base.kind
    return dataclasses.replace(base, kind=kind, **settings)

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
import math
import sys
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

import torch

from mixprec.dtypes import dtype_name, parse_dtype
from mixprec.optim.states import parse_state_dtype
from mixprec.plans.auto import AUTO, choose_plan, is_auto
from mixprec.plans.base import Plan, ScalingConfig, ScalingKind
from mixprec.plans.fp8 import Fp8Plan
from mixprec.plans.full import FullPrecisionPlan
from mixprec.plans.lowbit import LowBitPlan
from mixprec.plans.master import MasterPlan
from mixprec.plans.mixed import MixedPlan
from mixprec.plans.pure import PurePlan

__all__ = ["ALIASES", "NOT_ALIASES", "PLANS", "get_plan", "plan_names", "register_plan", "resolve_plan_name", "unregister_plan"]

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
    # Lightning's "bf16-true": the model in bf16, no autocast, no loss scaling (the optimizer
    # steps the bf16 parameters); bf16-pure is that, with fp32 arithmetic inside the step.
    "bf16-true": "bf16-pure",
}

NOT_ALIASES: dict[str, str] = {
    "16-true": (
        "Lightning's '16-true' (the model in fp16, no autocast, no loss scaling) has no mixprec plan: fp16 "
        "gradients underflow without loss scaling. The closest plan is 'fp16-pure' (fp16 model, no autocast, "
        "dynamic loss scaling); get_plan('fp16-pure', loss_scale=None) turns the scaling off, as '16-true' does"
    ),
}
"""Names other libraries use that no mixprec plan means: the error for each names the closest plan."""

_SCALING_KEYS = {f.name for f in dataclasses.fields(ScalingConfig)} - {"kind"}
_POLICY_KEYS = {"lower_ops", "fp32_ops", "fp32_modules"}


def register_plan(name: str, factory: Callable[[], Plan]) -> None:
    """Make ``get_plan(name)`` return ``factory()``: how a plan defined outside mixprec joins.

    A plan is a :class:`Plan` subclass (its dtypes and hooks) plus this one line; the
    session, DDP, FSDP2 and the diagnostics learn everything else from the plan's hooks.
    :data:`PLANS` lists the built-in plans, :func:`plan_names` every registered one.

    >>> from mixprec.plans import MixedPlan, get_plan, register_plan, unregister_plan
    >>> import torch
    >>> register_plan("bf16-mine", lambda: MixedPlan("bf16-mine", compute_dtype=torch.bfloat16))
    >>> get_plan("bf16-mine").compute_dtype
    torch.bfloat16
    >>> unregister_plan("bf16-mine")
    """
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(f"a plan name must be a non-empty string without surrounding spaces, got {name!r}")
    taken = {n.lower() for n in (*_FACTORIES, *ALIASES, *NOT_ALIASES, AUTO)}
    if name.lower() in taken:  # names resolve without regard to case
        raise ValueError(f"plan name {name!r} is taken; choose another name (registered: {', '.join(plan_names())})")
    if not callable(factory):
        raise TypeError(f"register_plan() needs a callable that returns a Plan, got {type(factory).__name__}")
    _FACTORIES[name] = factory


def unregister_plan(name: str) -> None:
    """Remove a plan added with :func:`register_plan` (built-in plans cannot be removed)."""
    if name in PLANS:
        raise ValueError(f"{name!r} is a built-in plan and cannot be unregistered")
    if name not in _FACTORIES:
        raise ValueError(f"no registered plan {name!r}; registered: {', '.join(plan_names())}")
    del _FACTORIES[name]


def plan_names() -> tuple[str, ...]:
    """Every registered plan name: the built-in :data:`PLANS`, then those from :func:`register_plan`."""
    return tuple(_FACTORIES)


def resolve_plan_name(name: str) -> str:
    """Canonical name for ``name`` (an alias or a canonical name); ValueError listing valid names."""
    if not isinstance(name, str):
        raise TypeError(f"a plan name must be a string, got {type(name).__name__}")
    key = name.strip()
    if key in _FACTORIES:
        return key
    if key in ALIASES:
        return ALIASES[key]
    if key.lower() in NOT_ALIASES:
        raise ValueError(f"plan {name!r}: {NOT_ALIASES[key.lower()]}")
    lowered = {k.lower(): v for k, v in ALIASES.items()} | {k: k for k in _FACTORIES}
    if key.lower() in lowered:
        return lowered[key.lower()]
    close = difflib.get_close_matches(key, [*_FACTORIES, *ALIASES], n=3)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(
        f"unknown precision plan {name!r}.{hint} Valid plans: {', '.join(_FACTORIES)}; "
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

    ``"auto"`` (any case) chooses a built-in plan from what the device measures and,
    with ``model=``, from the model's Linear widths (:mod:`mixprec.plans.auto`); ``device=``
    names the device to measure (default: CUDA where there is one, else the CPU). The plan
    returned is the chosen one, whose ``explain()`` ends with why.

    Every override is checked: an unknown name or a value of the wrong type raises
    ``TypeError``/``ValueError`` naming it. ``compute_dtype`` must be bf16 or fp16
    (fp32 for the fp32 plans); switching a plan without loss scaling to fp16 needs an
    explicit ``loss_scale`` ("dynamic", a number, or None to run fp16 unscaled on
    purpose), since fp16 gradients underflow without one.
    """
    if is_auto(name):
        plan: Plan = _auto_plan(overrides.pop("device", None), overrides.pop("model", None))
    else:
        if {"device", "model"} & set(overrides):
            raise ValueError(
                f"device= and model= are for get_plan('auto') (they tell it what to measure), not for plan {name!r}"
            )
        plan = name if isinstance(name, Plan) else _FACTORIES[resolve_plan_name(name)]()
    if not isinstance(plan, Plan):
        raise TypeError(f"the factory registered for plan {name!r} returned {type(plan).__name__}, not a Plan")
    if not overrides:
        return plan
    if is_auto(name):
        given = ", ".join(f"{k}=..." for k in overrides)
        try:
            return _overridden(plan, overrides)
        except (TypeError, ValueError) as exc:
            raise type(exc)(
                f"get_plan('auto', {given}): {(plan.auto_reason or 'auto chose ' + plan.name).split(':')[0]} on this "
                f"device, and there: {exc}. Name the plan the overrides are for instead of 'auto' "
                "(get_plan('bf16-kahan', state_dtype='8bit'), get_plan('fp16-mixed', init_scale=1024), ...), or "
                "drop them"
            ) from None
    return _overridden(plan, overrides)


def _overridden(plan: Plan, overrides: dict[str, Any]) -> Plan:
    """``plan`` with ``overrides`` applied, each checked (see :func:`get_plan`)."""
    changes: dict[str, Any] = {}
    scaling_changes = {k: overrides.pop(k) for k in list(overrides) if k in _SCALING_KEYS}
    has_loss_scale = "loss_scale" in overrides
    loss_scale = overrides.pop("loss_scale", None)
    policy_changes = {k: overrides.pop(k) for k in list(overrides) if k in _POLICY_KEYS}
    valid_fields = {f.name for f in dataclasses.fields(plan)} - {"name", "scaling", "auto_reason"}
    unknown = sorted(set(overrides) - valid_fields)
    if unknown:
        valid = sorted(valid_fields | _SCALING_KEYS | _POLICY_KEYS | {"loss_scale"})
        raise ValueError(f"unknown override(s) {unknown} for plan {plan.name!r}; valid overrides: {', '.join(valid)}")
    changes.update(_checked_fields(plan, overrides))
    compute = changes.get("compute_dtype", plan.compute_dtype)
    if (
        compute == torch.float16
        and plan.compute_dtype != torch.float16
        and plan.scaling.kind == "none"
        and not has_loss_scale
    ):
        raise ValueError(
            f"compute_dtype=torch.float16 on plan {plan.name!r}, which has no loss scaling: fp16 gradients "
            f"underflow without it. Use get_plan({_fp16_twin(plan)!r}), or pass loss_scale='dynamic' "
            "(or a constant, or loss_scale=None to run fp16 unscaled on purpose)"
        )

    if has_loss_scale or scaling_changes:
        changes["scaling"] = _scaling_override(plan, has_loss_scale, loss_scale, scaling_changes)
    if policy_changes:
        from mixprec.policy import OpPolicy

        if "policy" in changes:
            raise ValueError("pass either policy= or lower_ops/fp32_ops/fp32_modules, not both")
        if compute not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"{', '.join(sorted(policy_changes))} given for plan {plan.name!r}, which computes in "
                f"{dtype_name(compute)} without autocast, so op lists and fp32 islands would do nothing; "
                "use a low-precision plan such as 'bf16-mixed'"
            )
        changes["policy"] = OpPolicy(dtype=compute, **policy_changes)
    return dataclasses.replace(plan, **changes)


def _auto_plan(device: Any, model: Any) -> Plan:
    """The plan ``"auto"`` chooses for ``device`` (default: CUDA if present, else CPU) and ``model``."""
    from mixprec.hardware import device_facts

    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"get_plan('auto', model=...) needs an nn.Module, got {type(model).__name__}")
    try:
        facts = device_facts(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"get_plan('auto', device={device!r}): {exc}; pass a device such as 'cpu' or 'cuda'") from None
    choice = choose_plan(facts, model)
    return dataclasses.replace(_FACTORIES[choice.plan](), auto_reason=choice.text())


def _fp16_twin(plan: Plan) -> str:
    twin = plan.name.replace("bf16", "fp16")
    return twin if twin in _FACTORIES else "fp16-mixed"


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _checked_fields(plan: Plan, overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` (plan fields) with dtype names parsed; TypeError/ValueError naming a bad one."""
    hints = _field_hints(type(plan))
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        hint = hints.get(key)
        if key == "state_dtype" and hint is not None:
            try:  # "fp32", "bf16", "fp16" or "8bit" (8-bit blockwise): mixprec.optim.states
                value = parse_state_dtype(value)
            except ValueError as exc:
                shown = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else repr(value)
                raise ValueError(f"override state_dtype={shown} for plan {plan.name!r}: {exc}") from None
        elif key == "compute_dtype":
            value = _dtype_override(plan, key, value)
            allowed = (torch.float32,) if plan.family == "fp32" else (torch.bfloat16, torch.float16)
            if value not in allowed:
                fix = "use get_plan('bf16-mixed') or 'fp16-mixed' for low-precision compute" if plan.family == "fp32" else (
                    "use get_plan('fp32') for fp32 compute"
                )
                raise ValueError(
                    f"compute_dtype={value} is not a compute dtype for plan {plan.name!r} (expected "
                    f"{' or '.join(str(d) for d in allowed)}); {fix}"
                )
        elif hint is not None and _mentions_dtype(hint):
            if value is not None or not _allows_none(hint):
                value = _dtype_override(plan, key, value)
                if value not in _FLOAT_DTYPES:
                    raise ValueError(
                        f"{key}={value} for plan {plan.name!r}: expected torch.float32, torch.bfloat16 or torch.float16"
                    )
        elif hint is not None and _conforms(value, hint) is False:
            literal_values = [v for a in _args(hint) if typing.get_origin(a) is Literal for v in typing.get_args(a)]
            if any(type(v) is type(value) for v in literal_values):
                raise ValueError(
                    f"override {key}={value!r} for plan {plan.name!r} is not one of {_describe(hint)}"
                )
            raise TypeError(
                f"override {key}={value!r} for plan {plan.name!r} has the wrong type "
                f"{type(value).__name__}; expected {_describe(hint)}"
            )
        out[key] = value
    return out


def _dtype_override(plan: Plan, key: str, value: Any) -> torch.dtype:
    if not isinstance(value, torch.dtype | str):
        raise TypeError(
            f"override {key}={value!r} for plan {plan.name!r} must be a torch.dtype or a dtype name "
            f"('bf16', 'fp16', 'fp32'), got {type(value).__name__}"
        )
    try:
        dtype = parse_dtype(value)
    except ValueError as exc:
        raise ValueError(f"override {key}={value!r} for plan {plan.name!r}: {exc}") from None
    if not dtype.is_floating_point or dtype.itemsize < 2:
        raise ValueError(
            f"override {key}={dtype_name(dtype)} for plan {plan.name!r} is not a floating dtype mixprec computes "
            "in; expected torch.float32, torch.bfloat16 or torch.float16"
        )
    return dtype


def _field_hints(cls: type) -> dict[str, Any]:
    from mixprec.policy import OpPolicy

    hints: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        annotation: Any = f.type
        if isinstance(annotation, str):
            owner = next((c for c in cls.__mro__ if f.name in getattr(c, "__annotations__", {})), cls)
            namespace = {**vars(sys.modules[owner.__module__]), "OpPolicy": OpPolicy, "torch": torch}
            try:
                annotation = eval(annotation, namespace)  # the class's own annotation string
            except Exception:  # an annotation this check cannot resolve is not checked
                continue
        hints[f.name] = annotation
    return hints


def _args(hint: Any) -> tuple[Any, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _mentions_dtype(hint: Any) -> bool:
    return any(a is torch.dtype for a in _args(hint))


def _allows_none(hint: Any) -> bool:
    return any(a is type(None) for a in _args(hint))


def _conforms(value: Any, hint: Any) -> bool | None:
    """Whether ``value`` fits the annotation ``hint`` (None: this check cannot tell)."""
    results = []
    for arg in _args(hint):
        if typing.get_origin(arg) is Literal:
            results.append(value in typing.get_args(arg))
        elif arg is type(None):
            results.append(value is None)
        elif arg is bool:
            results.append(type(value) is bool)
        elif arg is int:
            results.append(isinstance(value, int) and not isinstance(value, bool))
        elif arg is float:
            results.append(isinstance(value, int | float) and not isinstance(value, bool))
        elif isinstance(arg, type) and typing.get_origin(arg) is None and arg is not Any:
            results.append(isinstance(value, arg))
        else:
            return None
    return any(results)


def _describe(hint: Any) -> str:
    parts = []
    for arg in _args(hint):
        if typing.get_origin(arg) is Literal:
            parts.append(" or ".join(repr(v) for v in typing.get_args(arg)))
        elif arg is type(None):
            parts.append("None")
        else:
            parts.append(getattr(arg, "__name__", str(arg)))
    return " or ".join(parts)


_FP32_MAX = torch.finfo(torch.float32).max
_MIN_SCALE = 2.0**-126


def _scaling_override(plan: Plan, has_loss_scale: bool, loss_scale: Any, settings: dict[str, Any]) -> ScalingConfig:
    for key in ("init_scale", "min_scale", "max_scale"):
        value = settings.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > _FP32_MAX:
            raise ValueError(f"{key}={value!r} does not fit in fp32 (the scale is an fp32 tensor); use at most {_FP32_MAX:g}")
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
            if not math.isfinite(loss_scale) or loss_scale < _MIN_SCALE or loss_scale > _FP32_MAX:
                raise ValueError(
                    f"loss_scale={loss_scale!r}: a constant loss scale must be a finite number in "
                    f"[2**-126, {_FP32_MAX:g}] (it and its inverse finite in fp32), e.g. 128 (or pass "
                    "'dynamic', or None for no scaling)"
                )
            if settings:
                raise ValueError(
                    f"loss_scale={loss_scale!r} is a constant scale; dynamic settings {sorted(settings)} do not apply"
                )
            return ScalingConfig(kind="constant", init_scale=float(loss_scale))
        else:
            error = ValueError if isinstance(loss_scale, str) else TypeError
            raise error(f"loss_scale must be 'dynamic', a number (constant scale) or None, got {loss_scale!r}")
    else:
        if base.kind == "none":
            raise ValueError(
                f"plan {plan.name!r} does not scale the loss ({plan.compute_dtype} has the range it needs), "
                f"so {sorted(settings)} would be ignored; pass loss_scale='dynamic' as well to opt in to loss scaling"
            )
        kind = base.kind
    return dataclasses.replace(base, kind=kind, **settings)

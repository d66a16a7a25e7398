"""Precision plans: one frozen dataclass per mode, and the registry that parses plan names."""

from mixprec.plans.base import NORM_LAYERS, Plan, ScalingConfig, cast_module_
from mixprec.plans.fp8 import Fp8Plan
from mixprec.plans.full import FullPrecisionPlan
from mixprec.plans.lowbit import LowBitPlan
from mixprec.plans.master import MasterPlan
from mixprec.plans.mixed import MixedPlan
from mixprec.plans.pure import PurePlan
from mixprec.plans.registry import (
    ALIASES,
    PLANS,
    get_plan,
    plan_names,
    register_plan,
    resolve_plan_name,
    unregister_plan,
)

__all__ = [
    "ALIASES",
    "NORM_LAYERS",
    "PLANS",
    "Fp8Plan",
    "FullPrecisionPlan",
    "LowBitPlan",
    "MasterPlan",
    "MixedPlan",
    "Plan",
    "PurePlan",
    "ScalingConfig",
    "cast_module_",
    "get_plan",
    "plan_names",
    "register_plan",
    "resolve_plan_name",
    "unregister_plan",
]

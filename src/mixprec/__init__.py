"""mixprec: automatic mixed precision for PyTorch training, done right."""

from mixprec import fp8
from mixprec.autocast import (
    autocast,
    autocast_backward,
    custom_op_precision,
    register_op,
    unregister_op,
)
from mixprec.checkpoint import load_checkpoint, save_checkpoint
from mixprec.dtypes import Format, parse_dtype
from mixprec.islands import apply_fp32_islands, remove_fp32_islands
from mixprec.plans import PLANS, Plan, get_plan
from mixprec.policy import OpPolicy, Precision, compare_with_torch
from mixprec.scaling import ConstantLossScaler, DynamicLossScaler, LossScaler, NoOpScaler
from mixprec.session import MixedPrecision, StepResult
from mixprec.stats import op_stats

__version__ = "0.1.0"

__all__ = [
    "PLANS",
    "ConstantLossScaler",
    "DynamicLossScaler",
    "Format",
    "LossScaler",
    "MixedPrecision",
    "NoOpScaler",
    "OpPolicy",
    "Plan",
    "Precision",
    "StepResult",
    "__version__",
    "apply_fp32_islands",
    "autocast",
    "autocast_backward",
    "compare_with_torch",
    "custom_op_precision",
    "fp8",
    "get_plan",
    "load_checkpoint",
    "op_stats",
    "parse_dtype",
    "register_op",
    "remove_fp32_islands",
    "save_checkpoint",
    "unregister_op",
]

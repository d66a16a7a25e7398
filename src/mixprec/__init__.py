"""mixprec: automatic mixed precision for PyTorch training, done right."""

from mixprec import fp8
from mixprec.checkpoint import load_checkpoint, save_checkpoint
from mixprec.dtypes import Format, parse_dtype
from mixprec.plans import PLANS, Plan, get_plan
from mixprec.scaling import ConstantLossScaler, DynamicLossScaler, LossScaler, NoOpScaler
from mixprec.session import MixedPrecision, StepResult

__version__ = "0.1.0"

__all__ = [
    "PLANS",
    "ConstantLossScaler",
    "DynamicLossScaler",
    "Format",
    "LossScaler",
    "MixedPrecision",
    "NoOpScaler",
    "Plan",
    "StepResult",
    "__version__",
    "fp8",
    "get_plan",
    "load_checkpoint",
    "parse_dtype",
    "save_checkpoint",
]

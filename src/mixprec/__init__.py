"""mixprec: automatic mixed precision for PyTorch training, done right."""

from mixprec.dtypes import Format, parse_dtype
from mixprec.plans import PLANS, Plan, get_plan
from mixprec.scaling import ConstantLossScaler, DynamicLossScaler, LossScaler, NoOpScaler

__version__ = "0.1.0"

__all__ = [
    "PLANS",
    "ConstantLossScaler",
    "DynamicLossScaler",
    "Format",
    "LossScaler",
    "NoOpScaler",
    "Plan",
    "__version__",
    "get_plan",
    "parse_dtype",
]

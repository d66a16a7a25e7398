"""mixprec: automatic mixed precision for PyTorch training, done right."""

from mixprec.dtypes import Format, parse_dtype
from mixprec.scaling import ConstantLossScaler, DynamicLossScaler, LossScaler, NoOpScaler

__version__ = "0.1.0"

__all__ = [
    # loss scaling
    "ConstantLossScaler",
    "DynamicLossScaler",
    # formats
    "Format",
    "LossScaler",
    "NoOpScaler",
    "__version__",
    "parse_dtype",
]

"""Loss scalers: dynamic (with hysteresis and bounds), constant, and the no-op identity."""

from mixprec.scaling._checks import SCALE_CEILING, SCALE_FLOOR
from mixprec.scaling.base import LossScaler, OptState, ScaleRefused
from mixprec.scaling.config import HYSTERESIS_MODES
from mixprec.scaling.constant import ConstantLossScaler, NoOpScaler
from mixprec.scaling.dynamic import DynamicLossScaler

__all__ = [
    "HYSTERESIS_MODES",
    "SCALE_CEILING",
    "SCALE_FLOOR",
    "ConstantLossScaler",
    "DynamicLossScaler",
    "LossScaler",
    "NoOpScaler",
    "OptState",
    "ScaleRefused",
]

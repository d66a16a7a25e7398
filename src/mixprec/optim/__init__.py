"""Optimizer wrappers for low-precision models: fp32 masters, Kahan and stochastic-rounding updates."""

from mixprec.optim.base import WrappedOptimizer
from mixprec.optim.in_backward import InBackwardOptimizer
from mixprec.optim.lowbit import (
    KahanOptimizer,
    LowPrecisionOptimizer,
    StochasticRoundingOptimizer,
    stochastic_round,
)
from mixprec.optim.master import MasterWeightOptimizer

__all__ = [
    "InBackwardOptimizer",
    "KahanOptimizer",
    "LowPrecisionOptimizer",
    "MasterWeightOptimizer",
    "StochasticRoundingOptimizer",
    "WrappedOptimizer",
    "stochastic_round",
]

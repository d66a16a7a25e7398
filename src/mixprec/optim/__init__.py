"""Optimizer wrappers for low-precision models: fp32 masters, Kahan and stochastic-rounding updates."""

from mixprec.optim.base import WrappedOptimizer
from mixprec.optim.in_backward import InBackwardOptimizer
from mixprec.optim.kahan import KahanOptimizer
from mixprec.optim.kinds import StateKind
from mixprec.optim.lowbit import LowPrecisionOptimizer
from mixprec.optim.master import MasterWeightOptimizer
from mixprec.optim.remainder import RemainderOptimizer
from mixprec.optim.stochastic import StochasticRoundingOptimizer, stochastic_round

__all__ = [
    "InBackwardOptimizer",
    "KahanOptimizer",
    "LowPrecisionOptimizer",
    "MasterWeightOptimizer",
    "RemainderOptimizer",
    "StateKind",
    "StochasticRoundingOptimizer",
    "WrappedOptimizer",
    "stochastic_round",
]

"""The dynamic loss scaler's settings: checked once, held in one frozen record.

Every check raises before anything changes (``TypeError`` for a value of the wrong kind,
``ValueError`` for one out of range), naming the setting, the value and the fix.

>>> from mixprec.scaling.config import dynamic_config
>>> dynamic_config(2.0, 0.5, 2000, 1, "consecutive", None, None).growth_interval
2000
>>> dynamic_config(2.0, 1.5, 2000, 1, "consecutive", None, None)
Traceback (most recent call last):
    ...
ValueError: backoff_factor must be in (0, 1), got 1.5; pass a factor in [2**-126, 1), e.g. backoff_factor=0.5
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Literal

from mixprec.scaling import _checks as checks
from mixprec.scaling._checks import SCALE_CEILING, SCALE_FLOOR, show

__all__ = [
    "HYSTERESIS_MODES",
    "DynamicConfig",
    "HysteresisMode",
    "check_backoff_factor",
    "check_growth_delay",
    "check_growth_factor",
    "check_growth_interval",
    "check_within",
    "dynamic_config",
]

HysteresisMode = Literal["consecutive", "since_growth", "deepspeed"]
HYSTERESIS_MODES: tuple[str, ...] = ("consecutive", "since_growth", "deepspeed")


@dataclass(frozen=True)
class DynamicConfig:
    """The settings of a :class:`~mixprec.DynamicLossScaler`, each already checked."""

    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    hysteresis_mode: str
    min_scale: float | None
    max_scale: float | None
    growth_delay: int = 0
    raise_at_min_scale: bool = False


def check_growth_factor(value: object) -> float:
    """``growth_factor`` as a float: finite, > 1 and at most the fp32 maximum."""
    fix = "pass e.g. growth_factor=2.0"
    x = checks.real("growth_factor", value, fix)
    if not math.isfinite(x) or not x > 1.0:
        raise ValueError(f"growth_factor must be a finite number > 1, got {show(value)}; {fix}")
    if x > SCALE_CEILING:
        raise ValueError(f"growth_factor={show(value)} is larger than the fp32 maximum; {fix}")
    return x


def check_backoff_factor(value: object) -> float:
    """``backoff_factor`` as a float in [2**-126, 1)."""
    fix = "pass a factor in [2**-126, 1), e.g. backoff_factor=0.5"
    x = checks.real("backoff_factor", value, fix)
    if not 0.0 < x < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1), got {show(value)}; {fix}")
    if x < SCALE_FLOOR:
        raise ValueError(
            f"backoff_factor={show(value)} is below 2**-126: a single backoff from scale 1.0 would leave "
            f"the usable range of scales; {fix} (min_scale bounds the scale from below)"
        )
    return x


def check_growth_interval(value: object) -> int:
    """``growth_interval`` as an int in [1, 2**31-1]."""
    return checks.positive_int("growth_interval", value, "pass e.g. growth_interval=2000")


def check_growth_delay(value: object) -> int:
    """``growth_delay`` as an int in [0, 2**31-1]: clean steps after the start and after each
    overflow that do not count towards growth (DeepSpeed: 1)."""
    fix = "pass growth_delay=0 (torch, Megatron, Paddle, apex) or 1 (DeepSpeed)"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"growth_delay must be an integer, got {show(value)} ({type(value).__name__}); {fix}")
    if not 0 <= int(value) <= checks.INT32_MAX:
        raise ValueError(f"growth_delay must be in [0, 2**31-1], got {show(value)}; {fix}")
    return int(value)


def dynamic_config(
    growth_factor: object,
    backoff_factor: object,
    growth_interval: object,
    hysteresis: object,
    hysteresis_mode: object,
    min_scale: object,
    max_scale: object,
    growth_delay: object = 0,
    raise_at_min_scale: object = False,
) -> DynamicConfig:
    """Every setting checked (nothing is changed here)."""
    gf = check_growth_factor(growth_factor)
    bf = check_backoff_factor(backoff_factor)
    gi = check_growth_interval(growth_interval)
    hy = checks.positive_int("hysteresis", hysteresis, "pass e.g. hysteresis=1 (back off on every overflow)")
    if not isinstance(hysteresis_mode, str) or hysteresis_mode not in HYSTERESIS_MODES:
        raise ValueError(
            f"hysteresis_mode must be one of {HYSTERESIS_MODES}, got {show(hysteresis_mode)}; "
            "pass hysteresis_mode='consecutive', 'since_growth' or 'deepspeed'"
        )
    bounds: list[float | None] = []
    for name, bound in (("min_scale", min_scale), ("max_scale", max_scale)):
        if bound is None:
            bounds.append(None)
        else:
            bounds.append(checks.scale_value(name, bound, f"pass {name}=None (no bound) or a scale such as 1.0"))
    lo, hi = bounds
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"min_scale={show(min_scale)} is larger than max_scale={show(max_scale)}; swap or fix them")
    delay = check_growth_delay(growth_delay)
    raising = checks.boolean("raise_at_min_scale", raise_at_min_scale, "pass raise_at_min_scale=True or False")
    return DynamicConfig(gf, bf, gi, hy, hysteresis_mode, lo, hi, delay, raising)


def check_within(name: str, value: float, shown: str, config: DynamicConfig) -> None:
    """ValueError if the scale ``value`` (shown to the user as ``shown``) lies outside ``config``'s bounds."""
    if config.min_scale is not None and value < config.min_scale:
        raise ValueError(f"{name}={shown} is below min_scale={config.min_scale!r}; raise {name} or lower min_scale")
    if config.max_scale is not None and value > config.max_scale:
        raise ValueError(f"{name}={shown} is above max_scale={config.max_scale!r}; lower {name} or raise max_scale")

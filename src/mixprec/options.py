"""Checks of :class:`mixprec.MixedPrecision`'s arguments: each refusal names the value and the fix.

>>> from mixprec.options import check_session_options
>>> check_session_options(0, None, 50, None, {})
Traceback (most recent call last):
...
ValueError: grad_accum_steps must be an integer >= 1, got 0
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from mixprec.plans import Plan
from mixprec.process_groups import is_distributed
from mixprec.scaling import LossScaler

__all__ = ["check_collapse_options", "check_in_backward", "check_ready", "check_session_options"]

SCALE_COLLAPSE_ACTIONS = ("raise", "reset")


def check_session_options(
    grad_accum_steps: Any, clip_grad_norm: Any, max_consecutive_skips: Any, scaler: Any, flags: Mapping[str, Any]
) -> None:
    """Refuse bad :class:`~mixprec.MixedPrecision` arguments, naming the value and the fix."""
    if not isinstance(grad_accum_steps, int) or isinstance(grad_accum_steps, bool) or grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be an integer >= 1, got {grad_accum_steps!r}")
    if clip_grad_norm is not None and (
        not isinstance(clip_grad_norm, int | float)
        or isinstance(clip_grad_norm, bool)
        or not clip_grad_norm > 0
        or not math.isfinite(clip_grad_norm)
    ):
        raise ValueError(f"clip_grad_norm must be a positive finite number or None, got {clip_grad_norm!r}")
    if not isinstance(max_consecutive_skips, int) or isinstance(max_consecutive_skips, bool) or max_consecutive_skips < 1:
        raise ValueError(f"max_consecutive_skips must be an integer >= 1, got {max_consecutive_skips!r}")
    if scaler is not None and not isinstance(scaler, LossScaler):
        raise TypeError(
            f"scaler must be a mixprec LossScaler (DynamicLossScaler, ConstantLossScaler, NoOpScaler), "
            f"got {type(scaler).__name__}"
        )
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name}= must be True or False, got {flag!r}")


def check_collapse_options(max_zero_grad_steps: Any, on_scale_collapse: Any) -> None:
    """Refuse bad scale-collapse settings of :class:`~mixprec.MixedPrecision`, naming the value and the fix."""
    if max_zero_grad_steps is not None and (
        not isinstance(max_zero_grad_steps, int) or isinstance(max_zero_grad_steps, bool) or max_zero_grad_steps < 1
    ):
        raise ValueError(
            f"max_zero_grad_steps must be an integer >= 1 or None (only warn), got {max_zero_grad_steps!r}"
        )
    if on_scale_collapse not in SCALE_COLLAPSE_ACTIONS:
        raise ValueError(
            f"on_scale_collapse must be one of {SCALE_COLLAPSE_ACTIONS}, got {on_scale_collapse!r}: 'raise' stops "
            "with the diagnosis, 'reset' warns and restarts the loss scale"
        )


def check_in_backward(plan: Plan, scaler: LossScaler, grad_accum_steps: int, clip_grad_norm: float | None) -> None:
    """Refuse ``optimizer_in_backward=True`` where it cannot be exact, naming each reason."""
    problems = []
    if grad_accum_steps != 1:
        problems.append(f"grad_accum_steps={grad_accum_steps} (each micro-batch would update the weights)")
    if clip_grad_norm is not None:
        problems.append(f"clip_grad_norm={clip_grad_norm} (the global norm needs every gradient first)")
    if scaler.is_enabled():
        problems.append(f"a loss scaler ({type(scaler).__name__}; use a bf16 plan)")
    if not plan.supports_optimizer_in_backward:
        problems.append(f"plan {plan.name!r} (use bf16-pure, bf16-kahan, bf16-sr or get_plan('bf16-master', remainders=True))")
    if is_distributed():
        problems.append("several ranks (each rank would update before the others' gradients arrive)")
    if problems:
        raise ValueError("optimizer_in_backward=True does not work with " + "; ".join(problems))


def check_ready(model: Any, optimizers: Sequence[Any], what: str) -> None:
    """Refuse a step-time call (``what``) before a model and an optimizer were prepared."""
    if model is None:
        raise RuntimeError(f"{what} called before prepare(); call mp.prepare(model, optimizer) first")
    if not optimizers:
        raise RuntimeError(
            f"{what} called with no optimizer: nothing would train. Pass the optimizer to "
            "mp.prepare(model, optimizer) or mp.prepare_optimizers(optimizer)"
        )

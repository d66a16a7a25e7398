"""Dynamic loss scaling with hysteresis and bounds; a drop-in for ``torch.amp.GradScaler``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch

from mixprec.scaling.base import LossScaler, _get_int, _get_number

__all__ = ["HYSTERESIS_MODES", "DynamicLossScaler"]

HysteresisMode = Literal["consecutive", "since_growth"]
HYSTERESIS_MODES: tuple[str, ...] = ("consecutive", "since_growth")
_STATE_FORMAT = "mixprec.DynamicLossScaler/1"


class DynamicLossScaler(LossScaler):
    """Grow the scale after ``growth_interval`` clean steps, back off after overflows.

    With the defaults (``hysteresis=1``, no bounds) the scale sequence is bit-for-bit
    that of ``torch.amp.GradScaler`` for the same gradients, and the methods are the
    same, so it is a drop-in replacement.

    Args:
        init_scale: starting scale.
        growth_factor: multiplier applied after ``growth_interval`` consecutive clean steps (> 1).
        backoff_factor: multiplier applied on overflow, in (0, 1).
        growth_interval: number of consecutive clean steps before growing (>= 1).
        hysteresis: number of overflow steps tolerated before backing off (>= 1).
        hysteresis_mode: ``"consecutive"`` (Paddle's ``decr_every_n_nan_or_inf``: back off
            after N consecutive overflows, then count again from zero; a clean step resets
            the count) or ``"since_growth"`` (Megatron / Colossal-AI: each overflow spends
            one of N; once spent every overflow backs off; refilled when a growth
            interval completes).
        min_scale, max_scale: bounds the scale is clamped to (None: unbounded).
        enabled: False makes the scaler the identity.
        process_group: group over which the found-inf flag is all-reduced (MAX); None
            means the default group when torch.distributed runs more than one rank.

    Example (an overflow at the second step halves the scale)::

        >>> import torch
        >>> from mixprec import DynamicLossScaler
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> scaler = DynamicLossScaler(init_scale=1024.0)
        >>> for bad in (False, True):
        ...     scaler.scale((w * (float("inf") if bad else 1.0)).sum()).backward()
        ...     _ = scaler.step(opt)
        ...     scaler.update()
        ...     opt.zero_grad()
        >>> scaler.get_scale()
        512.0
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        hysteresis_mode: HysteresisMode = "consecutive",
        min_scale: float | None = None,
        max_scale: float | None = None,
        enabled: bool = True,
        process_group: Any = None,
    ) -> None:
        super().__init__(init_scale, enabled=enabled, process_group=process_group)
        self._configure(
            growth_factor, backoff_factor, growth_interval, hysteresis, hysteresis_mode, min_scale, max_scale
        )
        if min_scale is not None and init_scale < min_scale:
            raise ValueError(f"init_scale={init_scale!r} is below min_scale={min_scale!r}; raise init_scale")
        if max_scale is not None and init_scale > max_scale:
            raise ValueError(f"init_scale={init_scale!r} is above max_scale={max_scale!r}; lower init_scale")
        self._growth_tracker = torch.zeros((), dtype=torch.int32)
        self._hysteresis_tracker = torch.full((), self._initial_hysteresis_tracker(), dtype=torch.int32)

    def _configure(
        self,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
        hysteresis_mode: str,
        min_scale: float | None,
        max_scale: float | None,
    ) -> None:
        if not _is_number(growth_factor) or not growth_factor > 1.0 or not math.isfinite(growth_factor):
            raise ValueError(f"growth_factor must be a finite number > 1, got {growth_factor!r}")
        if not _is_number(backoff_factor) or not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if not _is_int(growth_interval) or growth_interval < 1:
            raise ValueError(f"growth_interval must be an integer >= 1, got {growth_interval!r}")
        if not _is_int(hysteresis) or hysteresis < 1:
            raise ValueError(f"hysteresis must be an integer >= 1, got {hysteresis!r}")
        if hysteresis_mode not in HYSTERESIS_MODES:
            raise ValueError(f"hysteresis_mode must be one of {HYSTERESIS_MODES}, got {hysteresis_mode!r}")
        for name, bound in (("min_scale", min_scale), ("max_scale", max_scale)):
            if bound is not None and (not _is_number(bound) or not math.isfinite(bound) or bound <= 0):
                raise ValueError(f"{name} must be a finite positive number or None, got {bound!r}")
        if min_scale is not None and max_scale is not None and min_scale > max_scale:
            raise ValueError(f"min_scale={min_scale!r} is larger than max_scale={max_scale!r}; swap or fix them")
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._hysteresis = int(hysteresis)
        self._hysteresis_mode: str = hysteresis_mode
        self._min_scale = None if min_scale is None else float(min_scale)
        self._max_scale = None if max_scale is None else float(max_scale)

    def _initial_hysteresis_tracker(self) -> int:
        # "consecutive" counts overflows up to N; "since_growth" spends a budget of N.
        return 0 if self._hysteresis_mode == "consecutive" else self._hysteresis

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {
            "_scale": self._scale,
            "_growth_tracker": self._growth_tracker,
            "_hysteresis_tracker": self._hysteresis_tracker,
        }

    # torch.amp.GradScaler accessors, for drop-in use.
    def get_growth_factor(self) -> float:
        return self._growth_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    @property
    def hysteresis(self) -> int:
        return self._hysteresis

    @property
    def hysteresis_mode(self) -> str:
        return self._hysteresis_mode

    def _update_scale(self, found_inf: torch.Tensor, found_bool: torch.Tensor) -> None:
        if self._hysteresis == 1 and self._min_scale is None and self._max_scale is None:
            # torch's own fused update kernel: one op, and torch's sequence by construction.
            torch._amp_update_scale_(
                self._scale,
                self._growth_tracker,
                found_inf,
                self._growth_factor,
                self._backoff_factor,
                self._growth_interval,
            )
            return
        found_inf = found_bool
        scale = self._scale
        # Growth: the growth_interval-th consecutive clean step grows the scale (as torch).
        tracker = torch.where(found_inf, 0, self._growth_tracker + 1)
        grow = tracker >= self._growth_interval
        self._growth_tracker = torch.where(grow, 0, tracker).to(torch.int32)
        # Products in fp64, rounded once to fp32: exactly what torch's update kernel does.
        grown = (scale.double() * self._growth_factor).float()
        if self._max_scale is not None:
            grown = grown.clamp(max=self._max_scale)
        grow_ok = grow & torch.isfinite(grown)
        backed = (scale.double() * self._backoff_factor).float()
        if self._min_scale is not None:
            backed = backed.clamp(min=self._min_scale)

        hyst = self._hysteresis_tracker
        if self._hysteresis == 1:
            backoff = found_inf
        elif self._hysteresis_mode == "consecutive":
            count = torch.where(found_inf, hyst + 1, 0)
            backoff = found_inf & (count >= self._hysteresis)
            hyst = torch.where(backoff, 0, count)
        else:  # since_growth
            budget = torch.where(found_inf, hyst - 1, hyst)
            backoff = found_inf & (budget <= 0)
            hyst = torch.where(grow, self._hysteresis, budget.clamp(min=0))
        self._hysteresis_tracker = hyst.to(torch.int32)
        self._scale = torch.where(backoff, backed, torch.where(grow_ok, grown, scale))

    def _set_scale(self, new_scale: float | torch.Tensor) -> None:
        if not isinstance(new_scale, torch.Tensor):
            lo, hi = self._min_scale, self._max_scale
            if _is_number(new_scale) and (
                (lo is not None and new_scale < lo) or (hi is not None and new_scale > hi)
            ):
                raise ValueError(
                    f"new_scale={new_scale!r} is outside [min_scale, max_scale] = [{lo}, {hi}]"
                )
        super()._set_scale(new_scale)
        if isinstance(new_scale, torch.Tensor) and (self._min_scale is not None or self._max_scale is not None):
            self._scale = self._scale.clamp(min=self._min_scale, max=self._max_scale)

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Every setting and counter, as plain Python numbers (loadable with weights_only=True).

        The keys of ``torch.amp.GradScaler.state_dict()`` are included, so torch can load it too.
        """
        if not self._enabled:
            return {}
        return {
            "format": _STATE_FORMAT,
            "scale": float(self._scale.item()),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": int(self._growth_tracker.item()),
            "hysteresis": self._hysteresis,
            "hysteresis_mode": self._hysteresis_mode,
            "_hysteresis_tracker": int(self._hysteresis_tracker.item()),
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            **self._counter_state(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Replace every setting and counter. Accepts ``torch.amp.GradScaler`` state dicts too."""
        if not self._enabled:
            raise RuntimeError("load_state_dict() called on a disabled DynamicLossScaler; create it with enabled=True.")
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise RuntimeError(
                "The state_dict is empty: it was saved from a disabled scaler; nothing to load."
            )
        fmt = state_dict.get("format", _STATE_FORMAT)
        if fmt != _STATE_FORMAT:
            raise ValueError(f"scaler state_dict has format {fmt!r}; this DynamicLossScaler reads {_STATE_FORMAT!r}")
        scale = _get_number(state_dict, "scale")
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scaler state_dict['scale'] must be finite and positive, got {scale!r}")
        mode = state_dict.get("hysteresis_mode", "consecutive")
        min_scale = state_dict.get("min_scale")
        max_scale = state_dict.get("max_scale")
        self._configure(
            _get_number(state_dict, "growth_factor"),
            _get_number(state_dict, "backoff_factor"),
            _get_int(state_dict, "growth_interval"),
            _get_int(state_dict, "hysteresis", default=1),
            mode,
            min_scale,
            max_scale,
        )
        device = self._scale.device
        tracker = _get_int(state_dict, "_growth_tracker", minimum=0)
        hyst = _get_int(state_dict, "_hysteresis_tracker", default=self._initial_hysteresis_tracker(), minimum=0)
        self._scale = torch.tensor(scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.tensor(tracker, dtype=torch.int32, device=device)
        self._hysteresis_tracker = torch.tensor(hyst, dtype=torch.int32, device=device)
        self._load_counter_state(state_dict)
        self._records.clear()

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self.get_scale()}, growth_factor={self._growth_factor}, "
            f"backoff_factor={self._backoff_factor}, growth_interval={self._growth_interval}, "
            f"hysteresis={self._hysteresis}, hysteresis_mode={self._hysteresis_mode!r}, "
            f"min_scale={self._min_scale}, max_scale={self._max_scale}, enabled={self._enabled})"
        )


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)

"""Dynamic loss scaling with hysteresis and bounds; a drop-in for ``torch.amp.GradScaler``."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch

from mixprec.scaling import _checks as checks
from mixprec.scaling._checks import SCALE_FLOOR, show
from mixprec.scaling.base import LossScaler, ScaleRefused
from mixprec.scaling.config import (
    DynamicConfig,
    HysteresisMode,
    check_backoff_factor,
    check_growth_factor,
    check_growth_interval,
    check_within,
    dynamic_config,
)
from mixprec.scaling.presets import ScalerPresets

__all__ = ["DynamicLossScaler"]
_STATE_FORMAT = "mixprec.DynamicLossScaler/1"
_DEFAULT_INIT_SCALE = 2.0**16
_REQUIRED_KEYS = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
_ALLOWED_KEYS = _REQUIRED_KEYS | {
    "format",
    "hysteresis",
    "hysteresis_mode",
    "_hysteresis_tracker",
    "min_scale",
    "max_scale",
    "steps",
    "skipped_steps",
    "overflow_steps",
    "growth_delay",
    "raise_at_min_scale",
}


class DynamicLossScaler(LossScaler, ScalerPresets):
    """Grow the scale after ``growth_interval`` clean steps, back off after overflows.

    With the defaults (``hysteresis=1``, no bounds) the scale sequence is bit-for-bit
    that of ``torch.amp.GradScaler`` for the same gradients (above :data:`SCALE_FLOOR`,
    where torch's scale would become subnormal, then 0), and the methods are the same,
    so it is a drop-in replacement: torch's leading ``device`` argument is accepted
    (``DynamicLossScaler("cuda", init_scale=1024.0)``), and the first five positional
    arguments after it are torch's (``init_scale, growth_factor, backoff_factor,
    growth_interval, enabled``). A number as the only positional argument is ``init_scale``.

    Args:
        device: torch's device argument (``"cuda"``, ``"cpu"``...). The state moves to
            the loss's device on the first ``scale()`` whatever it says; unlike torch, a
            scaler asked for ``"cuda"`` on a machine without CUDA stays enabled.
        init_scale: starting scale, in [2**-126, fp32 max] (None: 2**16, torch's default).
        growth_factor: multiplier applied after ``growth_interval`` consecutive clean
            steps, in (1, fp32 max].
        backoff_factor: multiplier applied on overflow, in [2**-126, 1).
        growth_interval: number of consecutive clean steps before growing (1 .. 2**31-1).
        enabled: False makes the scaler the identity (a bool; anything else is a TypeError).
        hysteresis: number of overflow steps tolerated before backing off (1 .. 2**31-1).
        hysteresis_mode: ``"consecutive"`` (Paddle's ``decr_every_n_nan_or_inf``: back off
            after N consecutive overflows, then count again from zero; a clean step resets
            the count), ``"since_growth"`` (Megatron / Colossal-AI, and DeepSpeed's
            ``consecutive_hysteresis=False``: each overflow spends one of N; once spent every
            overflow backs off; refilled when a growth interval completes) or
            ``"deepspeed"`` (DeepSpeed's ``consecutive_hysteresis=True``: the same budget,
            refilled by every clean step).
        min_scale, max_scale: bounds the scale is clamped to (None: only the floor
            2**-126 and the fp32 maximum).
        growth_delay: clean steps, after the start and after every overflow, that do not
            count towards growth (0: torch; DeepSpeed grows one step later: 1).
        raise_at_min_scale: an overflow that would back off a scale already at its lower
            bound (``min_scale``, else the floor) raises RuntimeError in ``update()``, as
            DeepSpeed's ZeRO optimizers do; the check reads one flag from the device per update.
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
        >>> scaler.get_scale(), scaler.last_step_skipped
        (512.0, True)
    """

    def __init__(
        self,
        device: str | torch.device | float | None = None,
        init_scale: float | None = None,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        hysteresis_mode: HysteresisMode = "consecutive",
        min_scale: float | None = None,
        max_scale: float | None = None,
        growth_delay: int = 0,
        raise_at_min_scale: bool = False,
        process_group: Any = None,
    ) -> None:
        device_arg = device
        if isinstance(device, numbers.Real) and not isinstance(device, bool):
            # mixprec's positional init_scale: DynamicLossScaler(1024.0).
            if init_scale is not None:
                raise TypeError(
                    f"DynamicLossScaler got a number as its first argument ({show(device)}) and "
                    f"init_scale={show(init_scale)}; the first positional argument is torch's device "
                    "('cuda', 'cpu') or init_scale alone: pass the other settings by keyword"
                )
            try:
                checks.scale_value("init_scale", device, "pass e.g. init_scale=65536.0 (2**16, torch's default)")
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{exc} (a number as the first argument, device, is taken as init_scale)") from None
            device_arg, init_scale = None, device  # type: ignore[assignment]
        if init_scale is None:
            init_scale = _DEFAULT_INIT_SCALE
        config = dynamic_config(
            growth_factor, backoff_factor, growth_interval, hysteresis, hysteresis_mode, min_scale, max_scale,
            growth_delay, raise_at_min_scale,
        )
        super().__init__(init_scale, enabled=enabled, process_group=process_group, device=device_arg)  # type: ignore[arg-type]
        check_within("init_scale", self._scale.item(), show(init_scale), config)
        self._apply_config(config)
        self._growth_tracker = torch.full((), -self._growth_delay, dtype=torch.int32)
        self._hysteresis_tracker = torch.full((), self._initial_hysteresis_tracker(), dtype=torch.int32)

    def _apply_config(self, config: DynamicConfig) -> None:
        self._growth_factor = config.growth_factor
        self._backoff_factor = config.backoff_factor
        self._growth_interval = config.growth_interval
        self._hysteresis = config.hysteresis
        self._hysteresis_mode: str = config.hysteresis_mode
        self._min_scale = config.min_scale
        self._max_scale = config.max_scale
        self._growth_delay = config.growth_delay
        self._raise_at_min_scale = config.raise_at_min_scale

    def _initial_hysteresis_tracker(self) -> int:
        # "consecutive" counts overflows up to N; "since_growth" and "deepspeed" spend a budget of N.
        return 0 if self._hysteresis_mode == "consecutive" else self._hysteresis

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {
            "_scale": self._scale,
            "_growth_tracker": self._growth_tracker,
            "_hysteresis_tracker": self._hysteresis_tracker,
        }

    # torch.amp.GradScaler accessors and setters, for drop-in use (the setters check their value).
    def get_growth_factor(self) -> float:
        """The growth factor."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (a finite number > 1)."""
        self._growth_factor = check_growth_factor(new_factor)

    def get_backoff_factor(self) -> float:
        """The backoff factor."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in [2**-126, 1))."""
        self._backoff_factor = check_backoff_factor(new_factor)

    def get_growth_interval(self) -> int:
        """The growth interval."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval. Clean steps already counted are kept, capped at
        ``new_interval - 1`` (so the next clean step grows); no synchronisation."""
        interval = check_growth_interval(new_interval)
        self._growth_interval = interval
        self._growth_tracker.clamp_(max=interval - 1)

    def _get_growth_tracker(self) -> int:
        """Consecutive clean steps counted towards the next growth (torch's helper; synchronises)."""
        return int(self._growth_tracker.item()) if self._enabled else 0

    @property
    def _init_growth_tracker(self) -> int:
        """torch's ``GradScaler._init_growth_tracker``: the growth tracker (synchronises).

        Setting it sets the tracker, capped at ``growth_interval - 1``."""
        return int(self._growth_tracker.item())

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"_init_growth_tracker must be an integer, got {show(value)} ({type(value).__name__})")
        if not 0 <= int(value) <= checks.INT32_MAX:
            raise ValueError(f"_init_growth_tracker must be in [0, 2**31-1], got {show(value)}")
        # Capped at growth_interval - 1, as set_growth_interval() does.
        self._growth_tracker.fill_(min(int(value), self._growth_interval - 1))

    @property
    def hysteresis(self) -> int:
        return self._hysteresis

    @property
    def min_scale(self) -> float | None:
        """The lower bound the scale is clamped to (None: only :data:`SCALE_FLOOR`)."""
        return self._min_scale

    @property
    def hysteresis_mode(self) -> str:
        return self._hysteresis_mode

    @property
    def growth_delay(self) -> int:
        return self._growth_delay

    def _update_scale(self, found_inf: torch.Tensor, found_bool: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        plain = self._growth_delay == 0 and not self._raise_at_min_scale
        if plain and self._hysteresis == 1 and self._min_scale is None and self._max_scale is None:
            # torch's own fused update kernel: one op, and torch's sequence by construction;
            # then the floor, where torch would go subnormal and on to 0.
            torch._amp_update_scale_(
                self._scale,
                self._growth_tracker,
                found_inf,
                self._growth_factor,
                self._backoff_factor,
                self._growth_interval,
            )
            self._scale.clamp_(min=SCALE_FLOOR)
            return
        found_inf = found_bool
        scale = self._scale
        # Growth: the growth_interval-th counted consecutive clean step grows the scale (as torch).
        # An overflow (and the start) sets the tracker to -growth_delay: DeepSpeed does not count
        # the first clean step after one (stable_interval = cur_iter - last_overflow_iter - 1).
        tracker = torch.where(found_inf, -self._growth_delay, self._growth_tracker + 1)
        grow = tracker >= self._growth_interval
        # Products in fp64, rounded once to fp32: exactly what torch's update kernel does (and,
        # for fp32 factors, exactly an fp32 multiply: the fp64 product of two fp32 numbers is exact).
        grown = (scale.double() * self._growth_factor).float()
        if self._max_scale is not None:
            grown = grown.clamp(max=self._max_scale)
        grow_ok = grow & torch.isfinite(grown)
        lowest = SCALE_FLOOR if self._min_scale is None else max(self._min_scale, SCALE_FLOOR)
        backed = (scale.double() * self._backoff_factor).float().clamp(min=lowest)

        hyst = self._hysteresis_tracker
        if self._hysteresis == 1:
            backoff = found_inf
        elif self._hysteresis_mode == "consecutive":
            count = torch.where(found_inf, hyst + 1, 0)
            backoff = found_inf & (count >= self._hysteresis)
            hyst = torch.where(backoff, 0, count)
        else:  # a budget of N overflows: "since_growth" refills it on growth, "deepspeed" on every clean step
            budget = torch.where(found_inf, hyst - 1, hyst)
            backoff = found_inf & (budget <= 0)
            refill = grow if self._hysteresis_mode == "since_growth" else ~found_inf
            hyst = torch.where(refill, self._hysteresis, budget.clamp(min=0))
        refuse = backoff & (scale <= lowest)
        if self._raise_at_min_scale and bool((refuse if keep is None else refuse & ~keep).item()):
            raise ScaleRefused(
                f"update(): the loss scale is already at its minimum ({scale.item()!r}) and this overflow "
                "would back it off again (raise_at_min_scale=True, DeepSpeed's raise_error_at_min_scale); "
                "nothing was changed. The gradients overflow at the smallest allowed scale: find the inf/NaN "
                "source (mixprec.diagnostics), lower min_scale, or pass raise_at_min_scale=False to keep skipping"
            )
        self._growth_tracker = torch.where(grow, 0, tracker).to(torch.int32)
        self._hysteresis_tracker = hyst.to(torch.int32)
        self._scale = torch.where(backoff, backed, torch.where(grow_ok, grown, scale))

    def _clamped(self, value: float) -> float:
        lo, hi = self._min_scale, self._max_scale
        return min(max(value, lo if lo is not None else value), hi if hi is not None else value)

    def _set_scale(self, value: float, from_tensor: bool) -> None:
        lo, hi = self._min_scale, self._max_scale
        if from_tensor:  # tensors are clamped into the bounds (they may come from a computation)
            value = min(max(value, lo if lo is not None else value), hi if hi is not None else value)
        elif (lo is not None and value < lo) or (hi is not None and value > hi):
            raise ValueError(
                f"new_scale={value!r} is outside [min_scale, max_scale] = [{lo}, {hi}]; "
                "pass a scale within the bounds"
            )
        self._scale.fill_(value)

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Every setting and counter, as plain Python numbers (loadable with weights_only=True).

        The keys of ``torch.amp.GradScaler.state_dict()`` are included, so torch can load it too.
        A disabled scaler returns ``{}``, as torch does.
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
            "growth_delay": self._growth_delay,
            "raise_at_min_scale": self._raise_at_min_scale,
            **self._counter_state(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Replace every setting and counter. Accepts ``torch.amp.GradScaler`` state dicts too.

        All or nothing: the whole dict is checked first (keys, types, ranges, counters), and
        on any error (ValueError/TypeError naming the key) the scaler is unchanged. Loading
        into a disabled scaler does nothing, as in torch.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"state_dict must be a mapping, got {type(state_dict).__name__}; pass what state_dict() returned"
            )
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise ValueError(
                "The state_dict is empty: it was saved from a disabled scaler; nothing to load. "
                "Load a state_dict saved from an enabled scaler, or do not load one."
            )
        checks.check_keys(state_dict, _REQUIRED_KEYS, _ALLOWED_KEYS)
        fmt = state_dict.get("format", _STATE_FORMAT)
        if fmt != _STATE_FORMAT:
            raise ValueError(
                f"scaler state_dict has format {show(fmt)}; this DynamicLossScaler reads {_STATE_FORMAT!r} "
                "(or torch.amp.GradScaler's state_dict)"
            )
        scale = checks.state_scale(state_dict, "scale")
        bounds = []
        for key in ("min_scale", "max_scale"):
            bound = state_dict.get(key)
            bounds.append(None if bound is None else checks.state_number(state_dict, key))
        settings = (
            checks.state_number(state_dict, "growth_factor"),
            checks.state_number(state_dict, "backoff_factor"),
            checks.state_int(state_dict, "growth_interval", minimum=1, maximum=checks.INT32_MAX),
            checks.state_int(state_dict, "hysteresis", default=1, minimum=1, maximum=checks.INT32_MAX),
            checks.state_str(state_dict, "hysteresis_mode", default="consecutive"),
            bounds[0],
            bounds[1],
            checks.state_int(state_dict, "growth_delay", default=0, maximum=checks.INT32_MAX),
            _state_bool(state_dict, "raise_at_min_scale"),
        )
        try:
            config = dynamic_config(*settings)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"scaler state_dict: {exc}") from None
        check_within("state_dict['scale']", scale, show(scale), config)
        tracker = checks.state_int(
            state_dict, "_growth_tracker", minimum=-config.growth_delay, maximum=checks.INT32_MAX
        )
        if tracker >= config.growth_interval:
            raise ValueError(
                f"scaler state_dict['_growth_tracker']={tracker} must be < growth_interval={config.growth_interval} "
                "(it counts clean steps since the last growth, and the growth_interval-th grows and resets it)"
            )
        consecutive = config.hysteresis_mode == "consecutive"
        initial_hyst = 0 if consecutive else config.hysteresis
        hyst = checks.state_int(state_dict, "_hysteresis_tracker", default=initial_hyst, maximum=checks.INT32_MAX)
        hyst_max = config.hysteresis - 1 if consecutive else config.hysteresis
        if hyst > hyst_max:
            raise ValueError(
                f"scaler state_dict['_hysteresis_tracker']={hyst} must be <= {hyst_max} for "
                f"hysteresis={config.hysteresis}, hysteresis_mode={config.hysteresis_mode!r}"
            )
        counters = checks.parse_counters(state_dict)

        # Everything is valid: nothing below can fail.
        device = self._scale.device
        self._apply_config(config)
        self._scale = torch.tensor(scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.tensor(tracker, dtype=torch.int32, device=device)
        self._hysteresis_tracker = torch.tensor(hyst, dtype=torch.int32, device=device)
        self._apply_counters(counters)
        self._records.clear()
        self._last_skipped = False

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self.get_scale()}, growth_factor={self._growth_factor}, "
            f"backoff_factor={self._backoff_factor}, growth_interval={self._growth_interval}, "
            f"hysteresis={self._hysteresis}, hysteresis_mode={self._hysteresis_mode!r}, "
            f"min_scale={self._min_scale}, max_scale={self._max_scale}, "
            + (f"growth_delay={self._growth_delay}, " if self._growth_delay else "")
            + ("raise_at_min_scale=True, " if self._raise_at_min_scale else "")
            + f"enabled={self._enabled})"
        )


def _state_bool(state: Mapping[str, Any], key: str) -> bool:
    value = state.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"scaler state_dict[{key!r}] must be True or False, got {show(value)}")
    return value

"""Fixed-scale and no-op loss scalers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mixprec.scaling import _checks as checks
from mixprec.scaling._checks import show
from mixprec.scaling.base import LossScaler

__all__ = ["ConstantLossScaler", "NoOpScaler"]

_STATE_FORMAT = "mixprec.ConstantLossScaler/1"
_KEYS = {"format", "scale", "steps", "skipped_steps", "overflow_steps"}


class ConstantLossScaler(LossScaler):
    """A fixed scale (apex's ``loss_scale=128.0``): overflowing steps are skipped, the scale never changes.

    >>> import torch
    >>> from mixprec import ConstantLossScaler
    >>> scaler = ConstantLossScaler(128.0)
    >>> scaler.scale(torch.tensor(1.0))
    tensor(128.)
    """

    def __init__(self, scale: float, *, process_group: Any = None) -> None:
        try:
            super().__init__(scale, enabled=True, process_group=process_group)
        except (TypeError, ValueError) as exc:  # name the argument as the caller spelled it
            raise type(exc)(str(exc).replace("init_scale", "scale")) from None

    def _update_scale(self, found_inf: torch.Tensor, found_bool: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"format": _STATE_FORMAT, "scale": float(self._scale.item()), **self._counter_state()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Replace the scale and the counters; all or nothing (the scaler is unchanged on error)."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"state_dict must be a mapping, got {type(state_dict).__name__}; pass what state_dict() returned"
            )
        checks.check_keys(state_dict, {"format", "scale"}, _KEYS)
        fmt = state_dict.get("format")
        if fmt != _STATE_FORMAT:
            raise ValueError(
                f"scaler state_dict has format {show(fmt)}; ConstantLossScaler reads {_STATE_FORMAT!r}: "
                "load it into the scaler that saved it"
            )
        scale = checks.state_scale(state_dict, "scale")
        counters = checks.parse_counters(state_dict)
        self._scale = torch.tensor(scale, dtype=torch.float32, device=self._scale.device)
        self._apply_counters(counters)
        self._records.clear()
        self._last_skipped = False

    def __repr__(self) -> str:
        return f"ConstantLossScaler(scale={self.get_scale()})"


class NoOpScaler(LossScaler):
    """The identity scaler for bf16 and fp32 plans: ``scale`` returns its input, ``step`` always steps.

    ``is_enabled()`` is False. (The front door still checks gradients for inf/NaN.)

    >>> from mixprec import NoOpScaler
    >>> NoOpScaler().is_enabled(), NoOpScaler().get_scale()
    (False, 1.0)
    """

    def __init__(self) -> None:
        super().__init__(1.0, enabled=False)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"state_dict must be a mapping, got {type(state_dict).__name__}; pass what state_dict() returned"
            )
        if state_dict:
            keys = sorted(show(k) for k in state_dict)
            raise ValueError(
                f"NoOpScaler has no state, but the given state_dict has keys [{', '.join(keys[:10])}]; "
                "it was saved from a scaling (fp16) run: load it into that scaler"
            )

    def __repr__(self) -> str:
        return "NoOpScaler()"

"""The state every loss scaler keeps, and the arithmetic on it: the base of :class:`~mixprec.LossScaler`.

The scale and the overflow count are tensors (no host read per step) that move together to
the loss's device; the host's counters are Python ints. :class:`ScalerState` holds the
hooks a scaler subclass overrides (:meth:`ScalerState._update_scale`, ``_set_scale``,
``_clamped``, ``_tensors``), the unscale-and-check of one optimizer's gradients, and the
counters' checkpoint form; :class:`~mixprec.LossScaler` adds the per-optimizer state machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mixprec.process_groups import all_reduce_max
from mixprec.scaling.compat import GradScalerCompat
from mixprec.scaling.grads import unscale_and_check

__all__ = ["ScalerState"]

_FP64_RECIPROCAL_UNSUPPORTED = ("mps",)


class ScalerState(GradScalerCompat):
    """The scale, the counters and the hooks of a :class:`~mixprec.LossScaler` (its base class:
    ``LossScaler.__init__`` sets the attributes below)."""

    _enabled: bool
    _process_group: Any
    _scale: torch.Tensor
    _steps: int
    _forced_skips: int
    _overflow_steps: torch.Tensor

    def _tensors(self) -> dict[str, torch.Tensor]:
        """Every state tensor, by attribute name (moved together to the loss's device)."""
        return {"_scale": self._scale}

    def _to_device(self, device: torch.device) -> None:
        if device == self._scale.device:
            return
        for name, tensor in self._tensors().items():
            setattr(self, name, tensor.to(device))
        self._overflow_steps = self._overflow_steps.to(device)

    def _check_grads(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, sync: bool = True
    ) -> torch.Tensor:
        """Multiply every gradient by ``inv_scale`` in place; return a 0/1 found-inf flag.

        With ``sync`` the flag is all-reduced, so all ranks agree; without, the caller does.
        """
        found_inf = unscale_and_check(optimizer, inv_scale, self._scale.device)
        if sync:
            all_reduce_max(found_inf, self._process_group)
        return found_inf

    def _inv_scale(self) -> torch.Tensor:
        if self._scale.device.type in _FP64_RECIPROCAL_UNSUPPORTED:
            return self._scale.reciprocal()
        # fp32 division can be imprecise under some compile options: take the reciprocal in fp64.
        return self._scale.double().reciprocal().float()

    def _clamped(self, value: float) -> float:
        """``value`` within this scaler's bounds (a subclass with bounds clamps it)."""
        return value

    def _set_scale(self, value: float, from_tensor: bool) -> None:
        """Set the scale to an already checked value (subclasses add their bounds)."""
        self._scale.fill_(value)

    def _update_scale(self, found_inf: torch.Tensor, found_bool: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Evolve the scale given this iteration's found-inf count (fp32) and flag (bool); ``keep``
        (a bool tensor, from :meth:`~mixprec.LossScaler.settle`) where the caller puts the old state back afterwards
        (a check that would refuse the update ignores those iterations)."""

    def _counter_state(self) -> dict[str, int]:
        overflows = int(self._overflow_steps.item())
        return {"steps": self._steps, "skipped_steps": self._forced_skips + overflows, "overflow_steps": overflows}

    def _apply_counters(self, counters: tuple[int, int, int]) -> None:
        self._steps, self._forced_skips, overflows = counters
        self._overflow_steps = torch.tensor(overflows, dtype=torch.int64, device=self._scale.device)

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        raise NotImplementedError

"""``torch.amp.GradScaler``'s underscore helpers, for the optimizers and tools that call them.

Fused optimizers (``torch.optim.AdamW(fused=True)``), Accelerate and Lightning reach into
a ``GradScaler`` through ``_unscale_grads_``, ``_check_inf_per_device``,
``_found_inf_per_device``, ``_get_scale_async``, ``_device`` and
``_lazy_init_scale_growth_tracker``. :class:`GradScalerCompat` gives every
:class:`~mixprec.LossScaler` those names, with torch's signatures and meanings, on top
of the scaler's own state machine.

>>> import torch
>>> from mixprec import DynamicLossScaler
>>> w = torch.nn.Parameter(torch.ones(2))
>>> w.grad = torch.tensor([1.0, float("nan")])
>>> scaler = DynamicLossScaler(init_scale=2.0)
>>> scaler._check_inf_per_device(torch.optim.SGD([w], lr=0.1))
{device(type='cpu'): tensor(1.)}
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mixprec.scaling._checks import check_optimizer, parse_device
from mixprec.scaling.grads import grad_tensors

__all__ = ["GradScalerCompat"]


class GradScalerCompat:
    """Mixin of :class:`~mixprec.LossScaler`: torch's ``GradScaler`` helper methods."""

    # Provided by the scaler this is mixed into (LossScaler).
    _device_hint: torch.device | None

    if TYPE_CHECKING:

        @property
        def device(self) -> torch.device: ...

        def scale_tensor(self) -> torch.Tensor: ...

        def found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None: ...

        def _to_device(self, device: torch.device) -> None: ...

        def _check_grads(
            self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, sync: bool = True
        ) -> torch.Tensor: ...

        def _set_found_inf(self, optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None: ...

    @property
    def _device(self) -> str:
        """torch's ``GradScaler._device``: the device type the scale lives (or will live) on."""
        if self._device_hint is not None and self.device.type == "cpu":
            return self._device_hint.type
        return self.device.type

    def _lazy_init_scale_growth_tracker(self, dev: str | torch.device) -> None:
        """torch's hook for creating the state on ``dev`` (Accelerate calls it after loading): move it there."""
        parsed = parse_device(dev)
        if parsed is None:
            raise TypeError("_lazy_init_scale_growth_tracker() needs a device, got None; pass e.g. 'cuda'")
        self._to_device(parsed)

    def _get_scale_async(self) -> torch.Tensor:
        """torch's name for :meth:`scale_tensor` (used by optimizers that unscale themselves)."""
        return self.scale_tensor()

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """Multiply ``optimizer``'s gradients by ``inv_scale``; return {device: found_inf} (torch's helper).

        The returned flag is the maximum of ``found_inf`` and this check. With
        ``allow_fp16=False`` fp16 gradients are refused, as torch does.
        """
        check_optimizer(optimizer, "_unscale_grads_")
        if not allow_fp16:
            for grad in grad_tensors(optimizer):
                if grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
        flag = self._check_grads(optimizer, inv_scale.reshape(()).float())
        merged = torch.maximum(found_inf.to(flag.device), flag.to(found_inf.dtype))
        return {merged.device: merged}

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """Check ``optimizer``'s gradients for inf/NaN without unscaling, and record the flag (torch's helper)."""
        check_optimizer(optimizer, "_check_inf_per_device")
        ones = torch.ones((), dtype=torch.float32, device=self.device)
        flag = self._check_grads(optimizer, ones)
        self._set_found_inf(optimizer, flag)
        return {flag.device: flag}

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """The recorded found-inf flag of ``optimizer`` as {device: flag} (torch's helper)."""
        flag = self.found_inf(optimizer)
        return {} if flag is None else {flag.device: flag}

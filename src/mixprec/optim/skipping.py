"""Steps of the low-precision wrappers skipped on the device, and the host's count of them one step late.

The front door decides each step on the device (a 0-dim 0/1 fp32 ``skip`` flag) and hands it to
:meth:`~mixprec.optim.LowPrecisionOptimizer.step_skipping`. Where every executor of the step can
mask its writes with the flag (:func:`skips_on_device`), nothing is read on the host:

- torch's fused kernel takes it as ``found_inf`` and writes nothing where it is 1: the fp32
  parameters (the inner optimizer, fused) and the eager fast path's fused chunks, whose
  round-to-nearest and stochastic-rounding stores give back the very bits they loaded when the
  kernel changed nothing (a Kahan compensation in bf16 would not: those go compiled or native);
- the compiled loop keeps every stored tensor as it was (:func:`~mixprec.optim.compiled.compiled_adam_step`);
- the native kernel returns before writing (:mod:`mixprec.optim.native`).

What the host keeps, the step counts of the low-precision weights and the rounding noise's
position, advances as for a taken step; :class:`Unsettled` puts it back one step late, when the
flag's host copy is read for free (before the next step, a ``state_dict()``, :meth:`settle`).
Whatever part of a step no executor can mask (a parameter left to the generic path, a group
whose compilation failed) reads the flag on the host, once.

>>> import torch
>>> from mixprec.optim import LowPrecisionOptimizer
>>> w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
>>> opt = LowPrecisionOptimizer(torch.optim.AdamW([w], lr=0.1, fused=True))
>>> w.grad = torch.ones_like(w); opt.step()  # the first step creates the state (host-decided)
>>> w.grad = torch.ones_like(w); opt.skips_on_device()
True
>>> opt.step_skipping(torch.ones(()))  # skipped on the device: nothing written
>>> w.tolist(), float(opt.optimizer.state[w]["step"])  # the count is put back at the next settle
([0.8984375, 0.8984375, 0.8984375, 0.8984375], 2.0)
>>> opt.settle()  # (the flag's host copy says: skipped)
True
>>> float(opt.optimizer.state[w]["step"])
1.0
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.dtypes import LOW_PRECISION_DTYPES
from mixprec.lagged import HostCopy
from mixprec.optim import routing, shards
from mixprec.optim.compiled import uniform_steps
from mixprec.optim.fast import fused_everywhere

__all__ = ["SKIPPING_ROUNDINGS", "DeviceSkipping", "Unsettled", "skips_on_device"]

#: the stores whose every executor can mask a step (remainders keep a host list of ties)
SKIPPING_ROUNDINGS = ("nearest", "kahan", "stochastic")


def skips_on_device(opt: Any) -> bool:
    """Whether a step of ``opt`` now can skip from the device flag with no host read (see the module):
    bf16 weights (fp16 ones are guarded on the host) of Adam/AdamW groups stored by one of
    :data:`SKIPPING_ROUNDINGS`, each going native, compiled (with one step count) or eager where
    :func:`~mixprec.optim.routing.eager_masks` says so (:func:`mixprec.optim.routing.plan`, predicting); unsharded; an inner
    optimizer fused in every group with state for every parameter to update (a first step, which
    creates it, is decided on the host); no state kind with an ``after_step`` rule."""
    if opt.rounding not in SKIPPING_ROUNDINGS or opt.refuses_nonfinite() or not fused_everywhere(opt.optimizer):
        return False
    if any(kind.after_step is not None for kind in opt.kinds):
        return False
    for group in opt.optimizer.param_groups:
        low = [p for p in group["params"] if p.grad is not None and p.dtype in LOW_PRECISION_DTYPES]
        if not low:
            continue
        if opt._fast_kind(group) != "adam" or any(shards.is_dtensor(p) for p in low):
            return False
        routes = routing.plan(opt.rounding, opt.state_dtype, opt.compile, low, predict=True)
        left = routes.eager if routes.compiled else routes.rest
        if routes.compiled and not uniform_steps(opt.optimizer, routes.compiled):
            left = routes.rest
        if any(not routing.eager_masks(opt, p.device) for p in left):
            return False
    return True


class Unsettled:
    """A step stepped with a device flag, not yet counted on the host: the step counts it advanced
    (of every low-precision weight it stepped) and the rounding noise before it (``noise``:
    ``rounding_state()``), put back by :meth:`settle` if the flag's host copy says it was skipped."""

    __slots__ = ("_copy", "_noise", "_steps")

    def __init__(self, opt: Any, skip: torch.Tensor, stepped: list[torch.Tensor],
                 noise: dict[str, Any]) -> None:
        state = opt.optimizer.state
        self._steps = [state[p]["step"] for p in stepped if p in state]
        self._noise = noise
        self._copy = HostCopy(skip.reshape(1))

    def settle(self, opt: Any) -> bool:
        """Put back what a skipped step advanced; returns whether it was skipped."""
        if not self._copy.values()[0]:
            return False
        steps = [s for s in self._steps if isinstance(s, torch.Tensor)]
        if steps:
            torch._foreach_sub_(steps, 1.0)
        if self._noise:
            opt.load_rounding_state(self._noise)
        return True


class DeviceSkipping:
    """The device-decided step of :class:`~mixprec.optim.LowPrecisionOptimizer` (mixed in)."""

    #: step counts and bias corrections are host numbers (a CUDA graph would capture them as constants)
    host_step_counts = True
    _skip: torch.Tensor | None = None  # the flag of the step running now
    _skip_read: bool | None = None  # ... once read on the host
    _unsettled: Unsettled | None = None

    def skips_on_device(self: Any) -> bool:
        """Whether :meth:`step_skipping` runs without a host read (:func:`skips_on_device`)."""
        return skips_on_device(self)

    def step_skipping(self: Any, skip: torch.Tensor) -> None:
        """``step()`` that changes nothing where ``skip`` (a 0-dim 0/1 fp32 tensor) is 1, masked on
        the device where :meth:`skips_on_device` says so (else the flag is read on the host); the
        step counts and the rounding noise of a skipped step are put back at the next :meth:`settle`."""
        if not self.skips_on_device():
            if not bool(skip):
                self.step()
            return
        self.settle()
        noise = self.rounding_state()
        stepped = [p for p in self._low_params() if p.grad is not None]
        self._skip, self._skip_read = skip, None
        try:
            self.step()
        finally:
            self._skip = self._skip_read = None
        self._unsettled = Unsettled(self, skip, stepped, noise)

    def skip_on_host(self: Any) -> bool:
        """Inside :meth:`step_skipping`: the flag, read on the host once, for the part of the step no
        executor masks (False outside a device-decided step)."""
        if self._skip is None:
            return False
        if self._skip_read is None:
            self._skip_read = bool(self._skip)
        return bool(self._skip_read)

    def settle(self: Any) -> bool | None:
        """Count the last step decided on the device: if it was skipped, put back its step counts
        and rounding noise (reads the flag's host copy: free one step later). Returns whether it
        was skipped, None when no such step is waiting. ``step()``, ``state_dict()`` and the
        front door's checkpoints call it; read ``optimizer.state`` after it."""
        pending, self._unsettled = self._unsettled, None
        return None if pending is None else pending.settle(self)

    def _step_full_precision(self: Any) -> Any:
        """The inner optimizer's step of the fp32 parameters (norm layers), unexpanded; inside
        :meth:`step_skipping` torch's fused kernel skips it from the flag."""
        if self._skip is None:
            return self.optimizer.step()
        self.optimizer.found_inf, self.optimizer.grad_scale = self._skip, None
        try:
            return self.optimizer.step()
        finally:
            del self.optimizer.found_inf, self.optimizer.grad_scale

"""The halves of a training step, for frameworks that own the loop.

:class:`ComposableSteps` is the part of :class:`mixprec.MixedPrecision` a framework's
loop calls instead of ``mp.backward`` and friends: :meth:`~ComposableSteps.scale_loss`,
:meth:`~ComposableSteps.backward_context`, :meth:`~ComposableSteps.micro_batch_done`,
:meth:`~ComposableSteps.unscale_`, :meth:`~ComposableSteps.grad_norm`,
:meth:`~ComposableSteps.clip_grad_norm_`. ``MixedPrecision`` builds on it (the one-line
path calls these too); the state it reads is set up by ``MixedPrecision.__init__`` and
``prepare``.

>>> import torch
>>> from mixprec import MixedPrecision
>>> _ = torch.manual_seed(0)
>>> model = torch.nn.Linear(4, 2)
>>> mp = MixedPrecision("fp16-mixed")
>>> model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
>>> with mp.autocast():
...     loss = model(torch.randn(3, 4)).float().mean()
>>> with mp.backward_context():
...     mp.scale_loss(loss).backward()   # the framework runs backward itself
>>> mp.micro_batch_done()
>>> norm = mp.clip_grad_norm_(1.0)      # true gradients: unscaled first
>>> mp.step().stepped
True
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from mixprec.nested import by_device_dtype
from mixprec.options import check_ready
from mixprec.plans import Plan
from mixprec.process_groups import world_size
from mixprec.scaling import LossScaler
from mixprec.scaling.grads import grad_tensors
from mixprec.step import (
    NormMemo,
    SkipDecision,
    StepResult,
    call_hook,
    check_loss,
    clip_,
    total_norm,
    unscale_all,
)

__all__ = ["ComposableSteps"]


def _first_parameter(module: torch.nn.Module) -> list[tuple[dict[str, Any], str, Any]] | None:
    """Where ``next(iter(module.parameters()), None)`` sits: the (dict, key, value) links from
    ``module`` down to it (``_modules`` entries, then one ``_parameters`` entry), or None."""
    for name, p in module._parameters.items():
        if p is not None:
            return [(module._parameters, name, p)]
    for name, child in module._modules.items():
        if child is not None and (below := _first_parameter(child)) is not None:
            return [(module._modules, name, child), *below]
    return None


class FirstParameter:
    """The model's first parameter, found once and then checked with a few dict lookups.

    The device is read a few times a step, and a walk down the module tree costs ~30 us
    once a backward has left the caches cold. The parameter found stays the answer while
    every link from the model down to it still holds (``model.to()`` keeps the parameter
    objects); a framework that replaces it or a module above it makes the next read walk again.
    A parameter added after it was found, earlier in ``parameters()`` order, is not seen: it
    matters only if it sits on another device than the rest of the model.
    """

    def __init__(self) -> None:
        self._model: torch.nn.Module | None = None
        self._links: list[tuple[dict[str, Any], str, Any]] | None = None

    def of(self, model: torch.nn.Module) -> torch.nn.Parameter | None:
        links = self._links
        if model is self._model and links is not None:
            for d, k, v in links:
                if d.get(k) is not v:
                    break
            else:
                return links[-1][2]
        self._model, self._links = model, _first_parameter(model)
        return None if self._links is None else self._links[-1][2]


class ComposableSteps:
    """Loss scaling, backward bookkeeping, unscaling and clipping: one step's halves.

    A base of :class:`mixprec.MixedPrecision`, not used alone: the attributes below are
    set up by ``MixedPrecision.__init__`` and ``prepare``.
    """

    plan: Plan
    scaler: LossScaler
    model: torch.nn.Module | None
    optimizers: list[torch.optim.Optimizer]
    _device: torch.device | None  # the device= argument, if any
    process_group: Any
    grad_accum_steps: int
    last_result: StepResult | None
    _decision: SkipDecision
    _norm_memo: NormMemo
    _micro: int
    _loose: bool  # a finished backward's gradients sit in .grad, not yet in fp32 accumulators
    _unscaled: bool
    _published: bool
    _ddp: bool
    _first: FirstParameter

    @property
    def device(self) -> torch.device | None:
        """``device=`` if given, else where the model's parameters are now: a framework may
        move the model after :meth:`~mixprec.MixedPrecision.prepare` (Lightning, Accelerate)."""
        if self._device is not None or self.model is None:
            return self._device
        first = self._first.of(self.model)
        return None if first is None else first.device

    @property
    def device_type(self) -> str:
        device = self.device
        return "cpu" if device is None else device.type

    def is_accumulating(self) -> bool:
        """True when the next backward() is not at an accumulation boundary."""
        return (self._micro + 1) % self.grad_accum_steps != 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``.backward()`` on, for frameworks that run backward themselves.

        Keeps the loss for the skip decision and multiplies it by the loss scale (fp16
        plans); it does not divide by ``grad_accum_steps``. Run the backward inside
        :meth:`backward_context`, then call :meth:`micro_batch_done` (:meth:`backward` does all three).
        """
        return self._scale_loss(loss, "scale_loss()")

    def _scale_loss(self, loss: torch.Tensor, caller: str) -> torch.Tensor:
        check_loss(loss, caller)
        if self._unscaled:
            raise RuntimeError(
                "a backward after unscale_() in the same step would mix scaled and unscaled gradients; "
                "call step() first"
            )
        self._decision.record_loss(loss)
        if self._loose and not self.is_ddp and world_size() == 1:
            # another backward in this step (manual accumulation: Lightning's manual optimisation,
            # Fabric, two backward() calls): move the last one's gradients into the wrappers' wide
            # accumulators first, so micro-batches add up in fp32 however the loop marks boundaries.
            # Not across ranks: a DDP / FSDP wrapper a framework put around the model reduces .grad.
            call_hook(self.optimizers, "accumulate_grads")
        self._loose = False
        return self.scaler.scale(loss)

    def backward_context(self) -> contextlib.AbstractContextManager[Any]:
        """The context a backward runs in (the plan's): a custom op policy also holds where
        backward recomputes the forward (activation checkpointing); tf32 stays on."""
        return self.plan.backward_context(self.device_type)

    def micro_batch_done(self, boundary: bool | None = None) -> None:
        """Count one finished backward; between accumulation boundaries, let the optimizer
        wrappers move low-precision gradients into wider accumulators (not under DDP).

        ``boundary`` says whether this backward ends the accumulation window; by default
        ``grad_accum_steps`` decides. A framework that decides the boundary itself passes it.
        """
        self._micro += 1
        if boundary is None:
            boundary = self._micro % self.grad_accum_steps == 0
        if not boundary and not self.is_ddp:
            call_hook(self.optimizers, "accumulate_grads")
        else:
            self._loose = True

    @property
    def is_ddp(self) -> bool:
        """Whether DDP reduces the model's gradients (its reducer owns ``.grad``): after
        ``prepare(..., ddp=True)``, for a DDP-wrapped model, or set by a framework that wraps it."""
        return self._ddp

    @is_ddp.setter
    def is_ddp(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"is_ddp must be True or False, got {value!r}")
        self._ddp = value

    def _grads(self) -> list[torch.Tensor]:
        return [g for opt in self.optimizers for g in grad_tensors(opt)]

    def unscale_(self) -> None:
        """Gather and unscale every optimizer's gradients once for this step (idempotent).

        Afterwards the optimizers' and the model's parameters hold true gradients (a
        master-weight wrapper copies them back), for a framework's clipping, logging and
        hooks; :meth:`step` does not unscale again and gathers in-place changes.
        """
        self._unscale()
        if not self._published:
            call_hook(self.optimizers, "publish_grads")
            self._published = True

    def _unscale(self) -> None:
        if self._unscaled:  # (checked when it was set)
            return
        check_ready(self.model, self.optimizers, "unscale_()")
        if self._micro == 0:
            raise RuntimeError("unscale_() called before any backward(); call mp.backward(loss) first")
        unscale_all(self.plan, self.model, self.optimizers, self.scaler, self.process_group)  # type: ignore[arg-type]
        self._unscaled = True

    def grad_norm(self) -> torch.Tensor:
        """The true (unscaled) total 2-norm of every optimizer's gradients (unscales first)."""
        self._unscale()
        return self._norm(self._grads(), remember=True)

    def _norm(self, grads: list[torch.Tensor], *, remember: bool) -> torch.Tensor:
        """The total norm of ``grads``, measured once a step while they stay unchanged
        (clipping, logging and the skip decision then read the gradients once).
        ``remember``: keep it for a later reader this step (the skip decision is the last)."""
        norm = self._norm_memo.get(grads)
        if norm is None:
            norm = total_norm(grads, None if grads else self.device)  # the device only places an empty total
            if remember:
                self._norm_memo.remember(grads, norm)
        return norm

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Unscale, then clip the true gradients to a total norm of ``max_norm``; returns the norm
        before clipping (as ``torch.nn.utils.clip_grad_norm_``). A non-finite norm clips nothing:
        the step will be skipped."""
        if not isinstance(max_norm, int | float) or isinstance(max_norm, bool) or not max_norm > 0:
            raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
        self._unscale()
        grads = self._grads()
        norm = self._norm(grads, remember=False)
        clip_(grads, norm, float(max_norm))
        self._norm_memo.remember(grads, norm)  # the clipped gradients are finite exactly when the norm is
        return norm

    def clip_grad_value_(self, clip_value: float) -> None:
        """Unscale, then clamp every true gradient to ``[-clip_value, clip_value]`` (as
        ``torch.nn.utils.clip_grad_value_``; inf/NaN gradients still skip the step)."""
        if (
            not isinstance(clip_value, int | float)
            or isinstance(clip_value, bool)
            or not 0 < clip_value < math.inf
        ):
            raise ValueError(f"clip_value must be a positive finite number, got {clip_value!r}")
        self._unscale()
        for gs in by_device_dtype(self._grads()).values():
            torch._foreach_clamp_min_(gs, -float(clip_value))
            torch._foreach_clamp_max_(gs, float(clip_value))

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last :meth:`step` at an accumulation boundary skipped the update."""
        return self.last_result is not None and self.last_result.skipped

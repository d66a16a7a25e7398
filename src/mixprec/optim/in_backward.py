"""Optimizer in backward (gradient release) for the pure, Kahan and stochastic-rounding wrappers.

Each parameter is updated as soon as autograd has accumulated its gradient (a
post-accumulate-grad hook) and its gradient is freed at once, so a training step never
holds the gradients of the whole model: peak memory drops by the gradient bytes.

Skipping a step stays exact: a non-finite gradient in *any* parameter must leave *every*
parameter untouched, but by the time the last gradient is known most parameters are
updated. So each hook, before updating its parameter, copies what the update will
change (the parameter, its optimizer state and Kahan compensation; the rounding noise
state once per backward) and ORs "this gradient, or the weight it produced, is not
finite" into one device flag, without a host sync. :meth:`InBackwardOptimizer.finish`,
called after ``backward()``, reads the flag once: if set, every parameter updated in this
backward is restored from its copy, bit for bit, and the step counts with it. The copies
cost the state's bytes while backward runs (freed by ``finish``). A cheaper variant for
large models (not implemented): copy asynchronously into pinned host memory, which the
rare restore reads back.

Usage (what the front door needs; not wired into ``MixedPrecision`` yet)::

    opt = KahanOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    in_bwd = InBackwardOptimizer(opt)
    for x, y in batches:
        loss = criterion(model(x), y)
        in_bwd.set_grad_scale(1 / scale)     # fp16 with loss scaling; unscaled in the hooks
        (loss * scale).backward()            # parameters update during backward
        stepped = in_bwd.finish()            # one host read: False -> every update undone

Not supported: DDP (the reducer must all-reduce a gradient before it is used),
gradient accumulation over micro-batches, and clipping by the global gradient norm
(needs every gradient first): each raises or is the caller's to avoid.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from mixprec.optim import footprint
from mixprec.optim.lowbit import LowPrecisionOptimizer

__all__ = ["InBackwardOptimizer"]


class InBackwardOptimizer:
    """Run ``optimizer``'s update of each parameter inside backward, then free its gradient.

    Args:
        optimizer: a :class:`~mixprec.optim.LowPrecisionOptimizer` (or its Kahan /
            stochastic-rounding subclass) over the model's parameters.

    During backward each hook keeps a copy of what its update changes, so that
    :meth:`finish` can undo every update when any gradient was non-finite (exact skip).
    """

    def __init__(self, optimizer: LowPrecisionOptimizer) -> None:
        if not isinstance(optimizer, LowPrecisionOptimizer):
            raise TypeError(
                f"InBackwardOptimizer needs a mixprec LowPrecisionOptimizer (pure, Kahan or stochastic "
                f"rounding), got {type(optimizer).__name__}; wrap your optimizer first"
            )
        self.optimizer = optimizer
        self._inv_scale: torch.Tensor | None = None
        self._found: torch.Tensor | None = None
        self._records: list[tuple[torch.Tensor, torch.Tensor, dict[Any, Any] | None, torch.Tensor | None]] = []
        self._extra: dict[str, Any] | None = None
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook) for p in optimizer.params() if p.requires_grad
        ]

    def set_grad_scale(self, inv_scale: torch.Tensor | float | None) -> None:
        """Multiply each gradient by ``inv_scale`` before its update (loss scaling); None: as is."""
        self._inv_scale = None if inv_scale is None else torch.as_tensor(inv_scale, dtype=torch.float32)

    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:
            return
        if self._inv_scale is not None:
            grad.mul_(self._inv_scale.to(grad.device))
        bad = ~torch.isfinite(grad).all()
        if self._found is not None:
            bad = bad.to(self._found.device) | self._found
        self._found = bad
        if self._extra is None:
            self._extra = copy.deepcopy(self.optimizer.rounding_state())  # rounding-noise state: small
        state = self.optimizer.state.get(p)
        saved_state = None if state is None else {
            k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in state.items()
        }
        comp = self.optimizer.compensation(p)
        self._records.append((p, p.detach().clone(), saved_state, None if comp is None else comp.clone()))
        self.optimizer.step_selected({p})
        # a finite weight that the update made non-finite (fp16 range) refuses the step too
        overflow = (torch.isfinite(self._records[-1][1]) & ~torch.isfinite(p)).any()
        self._found = self._found | overflow.to(self._found.device)
        p.grad = None

    @torch.no_grad()
    def finish(self) -> bool:
        """After ``backward()``: True when every update of this backward stands.

        False when a gradient (or an updated weight) was non-finite: every
        parameter, its state, compensation and the rounding-noise state are restored to
        before this backward. One host read.
        """
        found, self._found = self._found, None
        records, self._records = self._records, []
        extra, self._extra = self._extra, None
        if found is None or not bool(found):
            return True
        for p, value, state, comp in reversed(records):
            p.copy_(value)
            if state is None:
                self.optimizer.state.pop(p, None)
            else:
                self.optimizer.state[p] = state
            if comp is not None:
                self.optimizer.set_compensation(p, comp)
            else:
                self.optimizer.drop_compensation(p)
        if extra is not None:
            self.optimizer.load_rounding_state(extra)
        self.optimizer.note_written([p for p, _, _, _ in records])
        return False

    # ------------------------------------------------------------------ memory facts
    def state_bytes(self) -> dict[str, int]:
        """What the wrapped optimizer keeps between steps (see
        :meth:`mixprec.optim.WrappedOptimizer.state_bytes`)."""
        return self.optimizer.state_bytes()

    def step_transient_bytes(self) -> int:
        """Peak temporaries of the updates run inside backward: one parameter at a time, plus
        the copies of every updated parameter, its state and compensation, kept until
        :meth:`finish` (the whole training state, when every parameter has a gradient)."""
        copies = sum(footprint.nbytes(p) for p in footprint.unique_tensors(self.optimizer.params()))
        held = self.optimizer.state_bytes()
        return copies + held.get("optimizer_state", 0) + held.get("compensation", 0)

    def remove(self) -> None:
        """Remove the hooks: the wrapper steps in ``step()`` again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

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
cost the state's bytes while backward runs and are freed by ``finish`` (or by the undo
of an interrupted backward): they never outlive the backward that made them
(:meth:`~InBackwardOptimizer.undo_bytes` is 0 between backwards). A cheaper variant for
large models (not implemented): copy asynchronously into pinned host memory, which the
rare restore reads back.

One backward goes through these phases, in this order:

1. *idle*: :meth:`~InBackwardOptimizer.begin` (optional; the front door calls it before each
   backward) hooks parameters added or unfrozen since the hooks were installed.
2. *running*: the first update of a backward queues an autograd callback that runs when
   autograd completes that backward (it does not run when an exception stops it).
3. *complete*: the callback ran. :meth:`~InBackwardOptimizer.finish` first updates any
   parameter that got a gradient without a hook, then reads the flag (kept or undone).
4. *finished*: with ``finish(hold=True)`` (the front door) a further backward is refused
   until :meth:`~InBackwardOptimizer.release` (the front door's ``step()``): each backward
   is one step, so two backwards cannot share one.

A backward that does not complete (an exception or KeyboardInterrupt in a hook, an op or
the loss) is undone at once inside :meth:`~InBackwardOptimizer.guard`, else at the next
``begin``, ``finish`` or ``settle``, so a save and a retry start from the weights before
it; if something wrote those weights or their optimizer state in between (a checkpoint
load), what it wrote stands and the copies are dropped.

Usage (what :class:`mixprec.MixedPrecision` does with ``optimizer_in_backward=True``)::

    opt = KahanOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    in_bwd = InBackwardOptimizer(opt)
    for x, y in batches:
        loss = criterion(model(x), y)
        in_bwd.set_grad_scale(1 / scale)     # fp16 with loss scaling; unscaled in the hooks
        with in_bwd.guard():                 # an interrupted backward is undone
            (loss * scale).backward()        # parameters update during backward
        stepped = in_bwd.finish()            # one host read: False -> every update undone

Not supported: DDP (the reducer must all-reduce a gradient before it is used),
gradient accumulation over micro-batches, clipping by the global gradient norm (needs
every gradient first), and a parameter whose gradient arrives in two parts within one
backward (reentrant activation checkpointing over a shared parameter): the last raises,
the others are refused by the front door.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mixprec.optim import footprint
from mixprec.optim.lowbit import LowPrecisionOptimizer
from mixprec.optim.snapshot import Snapshot

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
        self._undo: Snapshot | None = None  # what this backward's updates changed, as it was before
        self._updated: set[int] = set()  # ids of the parameters updated in this backward
        self._pending: set[int] = set()  # autograd graph tasks with updates whose end has not been seen
        self._held = False
        self._stood = True
        self._hooked: dict[int, tuple[torch.Tensor, Any]] = {}
        self._removed = False
        self._sync_hooks()

    def set_grad_scale(self, inv_scale: torch.Tensor | float | None) -> None:
        """Multiply each gradient by ``inv_scale`` before its update (loss scaling); None: as is."""
        self._inv_scale = None if inv_scale is None else torch.as_tensor(inv_scale, dtype=torch.float32)

    def _sync_hooks(self) -> None:
        """Hook every parameter of the optimizer that can get a gradient and has no hook yet
        (a frozen parameter cannot be hooked: it is, once unfrozen, at the next call)."""
        if self._removed:
            return
        for p in self.optimizer.params():
            if p.requires_grad and id(p) not in self._hooked:
                self._hooked[id(p)] = (p, p.register_post_accumulate_grad_hook(self._hook))

    # ------------------------------------------------------------------ the phases
    def begin(self, caller: str = "begin()") -> None:
        """Before a backward: undo an earlier one that an exception stopped outside
        :meth:`guard` (this is its retry), refuse one while the last is held or not yet
        finished, and hook parameters added or unfrozen since."""
        if self._held:
            raise RuntimeError(_again(f"{caller} called again"))
        if self._pending:
            self._rollback()
        elif self._undo:
            raise RuntimeError(
                f"{caller} called before the last backward was counted: under optimizer_in_backward=True call "
                "mp.micro_batch_done() after each backward (mp.backward() does), then mp.step()"
            )
        self._sync_hooks()

    @contextlib.contextmanager
    def guard(self, on_undo: Callable[[], None] | None = None) -> Iterator[None]:
        """The context a backward runs in: if an exception (KeyboardInterrupt included) leaves it,
        every update made inside it is undone (then ``on_undo`` runs) before the exception
        propagates, whether autograd had finished the backward or not."""
        start = len(self._undo or ())
        try:
            yield
        except BaseException:
            if self._pending or len(self._undo or ()) > start:
                self._rollback()
                if on_undo is not None:
                    on_undo()
            raise

    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        if self._held:  # a backward run directly, with no begin(), while the last one awaits its step
            p.grad = None
            raise RuntimeError(_again("a second backward ran"))
        task = torch._C._current_graph_task_id()
        if task not in self._pending:  # the first update of this backward (or of a nested, reentrant one)
            self._pending.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._pending.discard, task))
        self._update(p)

    @torch.no_grad()
    def _update(self, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:
            return
        if id(p) in self._updated:
            p.grad = None
            raise RuntimeError(
                f"a parameter of shape {tuple(p.shape)} got its gradient in two parts within one backward "
                "(reentrant activation checkpointing over a parameter also used outside it): under "
                "optimizer_in_backward=True it would be updated twice; use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) or optimizer_in_backward=False"
            )
        if self._inv_scale is not None:
            grad.mul_(self._inv_scale.to(grad.device))
        bad = ~torch.isfinite(grad).all()
        self._found = bad if self._found is None else self._found | bad.to(self._found.device)
        opt = self.optimizer
        if self._undo is None:  # the rounding-noise state is copied once per backward (small)
            self._undo = Snapshot(opt.optimizer, opt.kinds, extra=opt.rounding_state())
        opt.follow_writes([p])  # before the copy: an undo must not bring back a stale residual
        self._undo.add([p])
        undo = self._undo.entries[-1]
        self._updated.add(id(p))
        self.optimizer.step_selected({p})
        # a finite weight that the update made non-finite (fp16 range) refuses the step too
        overflow = (torch.isfinite(undo.value) & ~torch.isfinite(p)).any()
        self._found = self._found | overflow.to(self._found.device)
        undo.version, undo.state_after = p._version, self.optimizer.state.get(p)
        p.grad = None

    @torch.no_grad()
    def finish(self, *, hold: bool = False, caller: str = "finish()") -> bool:
        """After ``backward()``: True when every update of this backward stands.

        False when a gradient (or an updated weight) was non-finite: every
        parameter, its state, compensation and the rounding-noise state are restored to
        before this backward. One host read. A parameter that got a gradient without a
        hook is updated first, in the same way. ``hold=True``: refuse another backward
        until :meth:`release`. A backward that did not complete is undone, then refused.
        """
        if self._held:
            raise RuntimeError(_again(f"{caller} called again"))
        if self._pending:
            self._rollback()
            raise RuntimeError(
                f"{caller} called after a backward that did not complete (an exception or KeyboardInterrupt "
                "stopped it): its updates were undone; run the backward again"
            )
        missed = [p for p in self.optimizer.params() if p.grad is not None]
        if missed:
            for p in missed:
                self._update(p)
            self._sync_hooks()
        found, undo = self._take()
        self._held, self._stood = hold, found is None or not bool(found)
        if not self._stood and undo is not None:
            self._restore(undo)
        return self._stood

    def release(self) -> bool:
        """The outcome of the held backward (True: its updates stand, or there was none);
        a new backward is accepted again."""
        stood, self._held, self._stood = self._stood, False, True
        return stood

    def settle(self) -> bool:
        """Undo a backward that did not complete; True when there was one."""
        if not self._pending:
            return False
        self._rollback()
        return True

    def reset(self) -> None:
        """Forget this step: undo an incomplete backward, drop the copies of a complete but
        unfinished one (its updates stand) and release a held one."""
        self.settle()
        self._take()
        self.release()

    def refuse_gradients(self, what: str) -> None:
        """Raise: ``what`` (a clip, a norm, an unscale) needs gradients that this mode freed."""
        raise RuntimeError(
            f"{what} does not work with optimizer_in_backward=True: each parameter is updated inside "
            "backward and its gradient freed at once, so no gradient is left to unscale, measure or clip "
            "(a global-norm clip needs every gradient before the first update); use "
            "MixedPrecision(optimizer_in_backward=False) to clip or read gradients"
        )

    # ------------------------------------------------------------------ undo
    def _take(self) -> tuple[torch.Tensor | None, Snapshot | None]:
        found, undo = self._found, self._undo
        self._found, self._undo = None, None
        self._updated = set()
        self._pending.clear()
        return found, undo

    def _rollback(self) -> None:
        """Undo an incomplete backward, unless the weights or state it wrote were written since
        (then the copies are stale and what was written stands); clear partial gradients."""
        _, undo = self._take()
        untouched = undo is None or all(
            u.version is None or (u.param._version == u.version and self.optimizer.state.get(u.param) is u.state_after)
            for u in undo
        )
        if undo is not None and untouched:
            self._restore(undo)
        for p in self.optimizer.params():
            p.grad = None

    def _restore(self, undo: Snapshot) -> None:
        if undo.restore():
            self.optimizer.load_rounding_state(undo.extra)
        self.optimizer.note_written([u.param for u in undo])

    # ------------------------------------------------------------------ memory facts
    def undo_bytes(self) -> int:
        """Bytes of the undo copies held now: those of the backward running, 0 between backwards."""
        return 0 if self._undo is None else self._undo.nbytes()

    def state_bytes(self) -> dict[str, int]:
        """What the wrapped optimizer keeps between steps (see
        :meth:`mixprec.optim.WrappedOptimizer.state_bytes`)."""
        return self.optimizer.state_bytes()

    def step_transient_bytes(self) -> int:
        """Peak temporaries of the updates run inside backward: one parameter at a time, plus
        the copies of every updated parameter, its state and compensation, kept until
        :meth:`finish` (the whole training state, when every parameter has a gradient)."""
        copies = sum(footprint.nbytes(p) for p in footprint.unique_tensors(self.optimizer.params()))
        return copies + sum(self.optimizer.state_bytes().values())  # optimizer state and every state kind

    def remove(self) -> None:
        """Remove the hooks: the wrapper steps in ``step()`` again."""
        for _, handle in self._hooked.values():
            handle.remove()
        self._hooked = {}
        self._removed = True


def _again(what: str) -> str:
    return (
        f"{what} before step(): under optimizer_in_backward=True the last backward already updated the "
        "weights and counts as one step, so another backward cannot join it (no gradient accumulation); "
        "call mp.step() after each backward"
    )

"""A torch.optim.Optimizer that wraps another one and shares its param groups and state.

LR schedulers, ``optimizer.param_groups[0]["lr"]`` and ``add_param_group`` keep
working on the wrapper because it *is* an ``Optimizer`` whose ``param_groups`` and
``state`` are the inner optimizer's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

from mixprec.optim import footprint
from mixprec.optim.kinds import KindStore, StateKind

__all__ = ["WrappedOptimizer"]


class WrappedOptimizer(torch.optim.Optimizer):
    """Base of the precision wrappers: delegate everything to ``self.optimizer``.

    Per-parameter state a wrapper keeps beside the inner optimizer's is described by its
    :class:`~mixprec.optim.kinds.StateKind` entries (the class's ``state_kinds`` and those
    added by :meth:`add_state_kind`), held in :attr:`kinds`.
    """

    #: the state kinds every instance of this wrapper keeps (:mod:`mixprec.optim.kinds`)
    state_kinds: ClassVar[tuple[StateKind, ...]] = ()

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, WrappedOptimizer):
            raise TypeError(
                f"{type(optimizer).__name__} is already a mixprec optimizer wrapper; pass the plain optimizer"
            )
        self.optimizer = optimizer
        self.kinds = KindStore(type(self).state_kinds)

    def add_state_kind(self, kind: StateKind) -> None:
        """Keep ``kind`` for this optimizer's parameters from now on: checkpointed in
        :meth:`state_dict`, checked by :meth:`load_state_dict`, put back with a step that is
        undone, counted by :meth:`state_bytes`, and updated by its ``after_step`` rule after
        each step that stands (wrappers that support kinds: the master, low-precision, Kahan
        and stochastic-rounding wrappers)."""
        self.kinds.add(kind)

    def kind_params(self) -> list[torch.Tensor]:
        """The parameters state kinds are kept for, in checkpoint order (the model's)."""
        return list(self.params())

    # The Optimizer attributes, shared with the inner optimizer.
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def params(self) -> Iterator[torch.nn.Parameter]:
        """Every parameter the inner optimizer updates."""
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        return self.optimizer.step(closure)

    def skips_on_device(self) -> bool:
        """Whether :meth:`step_skipping` skips from a device flag without reading it on the host
        (the front door then steps this optimizer without waiting for its decision)."""
        return False

    def step_skipping(self, skip: torch.Tensor) -> None:
        """``step()``, changing nothing where ``skip`` (a 0-dim fp32 0/1 tensor on the device) is 1;
        only where :meth:`skips_on_device` says so (this default reads the flag on the host)."""
        if not bool(skip):
            self.step()

    # Hooks the front door (and framework integrations) call around a step. The
    # defaults do nothing, so a wrapper implements only what its plan needs.
    def prepare_grads(self) -> None:
        """Make this step's gradients visible as ``.grad`` of the parameters in ``param_groups``.

        Called once per optimizer step, before unscaling, clipping and the skip decision
        (a wrapper that keeps its own parameters, such as fp32 masters, gathers the model's
        gradients into them here, replacing what they held). Calling it again before
        ``step()`` changes nothing unless the model's gradients changed in between (then
        those are gathered again). ``step()`` calls it itself, so a loop that only calls
        ``opt.step()`` is correct. Gradients of ``param_groups`` are the ones to unscale
        and clip after this call.
        """

    def publish_grads(self) -> None:
        """After ``prepare_grads()`` and unscaling: show the ``param_groups`` gradients in the
        model's own ``.grad`` too, for a framework that clips or logs ``model.parameters()``.

        A later in-place change of the model's gradients (clipping) is then gathered again
        by ``step()``. A no-op where ``param_groups`` hold the model's parameters.
        """

    def accumulate_grads(self) -> None:
        """Called after the backward of a micro-batch that is not an accumulation boundary.

        A wrapper may move the model's low-precision gradients into a wider buffer here, so
        micro-batches add up in fp32; ``zero_grad()`` and ``step()`` drop that buffer. Never
        called under DDP (whose reducer reads ``.grad`` at the boundary and must see the sum).
        """

    def refuses_nonfinite(self) -> bool:
        """Whether this wrapper's steps can refuse (and undo) an update that writes a non-finite
        value: a fact of its parameters' dtypes, the same on every rank (by default: whether the
        wrapper implements :meth:`step_nonfinite`)."""
        return type(self).step_nonfinite is not WrappedOptimizer.step_nonfinite

    def step_nonfinite(self) -> torch.Tensor | None:
        """After ``step()``: a bool tensor, True when the update would have written a
        non-finite value (a low-precision weight, a master or optimizer state); the step was
        then undone and changed nothing, and ``step()`` returned None.

        None when this wrapper does not check its steps (it cannot produce non-finite
        weights from a finite update, or the check is off).
        """
        return None

    def undo_step(self) -> None:
        """Restore parameters and optimizer state (step counters included) to what they were
        before the last ``step()``.

        Used when another optimizer of the same step refused its update (see
        :meth:`step_nonfinite`). Only wrappers that return a flag from ``step_nonfinite``
        support it, until the next ``zero_grad()``, ``prepare_grads()`` or ``step()``.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot undo a step")

    # Memory facts, read by the memory diagnostics (which know no wrapper class by name).
    def state_bytes(self) -> dict[str, int]:
        """Bytes of training state this optimizer keeps between steps, by tensor class.

        Keys (any subset): ``"master_weights"`` (fp32 copies of the model's parameters),
        ``"optimizer_state"`` (moments, momentum buffers, step counters),
        ``"compensation"`` (Kahan residuals), ``"grad_accumulation"`` (gradient buffers
        that outlive a step). State not created yet (before the first step) is predicted.
        The model's own parameters and gradients are not included. A wrapper that reports
        ``"master_weights"`` accounts for every parameter of ``param_groups`` the model
        lacks; without that key the memory diagnostics count those as master weights.

        The default: the inner optimizer's state (see :mod:`mixprec.optim.footprint`) and the
        state kinds' tensors (:meth:`kind_bytes`).
        """
        return self.kind_bytes({"optimizer_state": footprint.optimizer_state_bytes(self.optimizer)})

    def kind_bytes(self, out: dict[str, int]) -> dict[str, int]:
        """``out`` plus the bytes of every state kind's tensors (predicted where not created yet)."""
        for category, n in self.kinds.bytes_by_category(self.kind_params()).items():
            out[category] = out.get(category, 0) + n
        return out

    def state_tensors(self) -> Iterator[torch.Tensor]:
        """The tensors :meth:`state_bytes` counts that exist now (the parameters of
        ``param_groups`` and their gradients excluded). The default: the inner optimizer's state
        and the state kinds' tensors."""
        yield from footprint.state_tensors(self.optimizer)
        yield from self.kinds.tensors()

    def step_transient_bytes(self) -> int:
        """Peak bytes of the temporaries one ``step()`` allocates besides the persistent state
        and the gradients (update scratch, snapshots of a guarded step, gathered fp32
        gradients). The default: the inner optimizer's update (see
        :func:`mixprec.optim.footprint.update_transient_bytes`)."""
        return footprint.update_transient_bytes(self.optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if "kinds" not in self.__dict__:  # pickled before state kinds existed
            self.kinds = KindStore(type(self).state_kinds)
            comp = self.__dict__.pop("_comp", None)  # Kahan's compensation buffers then
            if comp is not None and "compensation" in self.kinds.kinds:
                self.kinds.values["compensation"] = dict(comp)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"

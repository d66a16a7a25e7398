"""fp32 master weights and fp32 gradient accumulation for a low-precision model.

The model keeps bf16/fp16 weights (fast compute, half the weight memory); the inner
optimizer updates fp32 copies ("masters") so small updates are not rounded away,
and every step copies the masters back into the model.

Gradients stay where autograd puts them, in the model parameters' own low-precision
``.grad``: DDP (also one a framework wraps around the model later) reduces them there,
``model.zero_grad()`` clears them, and a framework that clips or logs the gradient norm
of ``model.parameters()`` sees them. At step time :meth:`MasterWeightOptimizer.prepare_grads`
gathers them into the masters' fp32 ``.grad`` (one foreach copy); :meth:`~MasterWeightOptimizer.step`
calls it itself, so a loop that only calls ``opt.step()`` is correct. Micro-batches add up
in fp32 when :meth:`~MasterWeightOptimizer.accumulate_grads` is called after each backward that
is not an accumulation boundary (the front door does). The fp32 gradients exist only
during a step.

>>> import torch
>>> from mixprec.optim import MasterWeightOptimizer
>>> model = torch.nn.Linear(4, 2)
>>> sgd = torch.optim.SGD(model.parameters(), lr=1e-4)
>>> fp32_values = {p: p.detach().clone() for p in model.parameters()}
>>> _ = model.to(torch.bfloat16)  # parameters keep their identity, sgd still holds them
>>> opt = MasterWeightOptimizer(sgd, master_values=fp32_values)
>>> model(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum().backward()
>>> opt.step(); opt.zero_grad()
>>> opt.param_groups[0]["params"][0].dtype, model.weight.dtype
(torch.float32, torch.bfloat16)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from mixprec.optim import footprint
from mixprec.optim.checks import (
    KINDS_KEY,
    MASTER_INDEX_KEY,
    check_inner_state_dict,
    check_kind_state,
    check_master_positions,
    check_master_weights,
    check_param_shaped_state,
    split_master_state,
)
from mixprec.optim.fast import fused_everywhere
from mixprec.optim.follow import Seeds, WriteWatch, follow_masters, register, seed_master
from mixprec.optim.kinds import MASTER, StateKind
from mixprec.optim.master_grads import MasterGrads
from mixprec.optim.master_params import MasterParams
from mixprec.optim.shards import is_dtensor, local_of
from mixprec.optim.snapshot import DeviceSnapshot, Snapshot, all_or_nothing, masters_nonfinite

__all__ = ["MasterWeightOptimizer"]

_MASTER_KEY = "mixprec_master_weights"
_KINDS_KEY = "mixprec_state_kinds"  # the state kinds added to this wrapper (absent when none)


class MasterWeightOptimizer(MasterParams):
    """Keep fp32 master copies of the low-precision parameters of ``optimizer``.

    Args:
        optimizer: any torch optimizer over the model's parameters.
        master_values: optional fp32 values to start the masters from, by parameter
            (pass the fp32 weights captured before the model was cast down, so the
            masters lose nothing). Parameters not in it start from their own values.
        guard_nonfinite: snapshot the masters and the optimizer state before each step,
            and undo the step when copying the masters back would write a non-finite
            low-precision weight (see :meth:`step_nonfinite`). ``None`` (default): only when
            a parameter is fp16, whose range is small (60000 + 8000 is inf in fp16).
            bf16 has fp32's exponent range: a bf16 weight becomes inf only if its fp32
            master is non-finite or within 0.2% of fp32's largest value, where fp32
            training itself overflows; pass True to guard bf16 as well (costs a copy of
            the masters and the optimizer state per step).
        fast_path: where a parameter group leaves both ``foreach`` and ``fused`` at torch's
            default (``None``), update the fp32 masters with torch's fused kernel (plain
            ``torch.optim.Adam``/``AdamW``, on a device that has it) or
            else its multi-tensor (foreach) implementation. Same update rule, a few times
            faster than torch's default on CPU; False keeps the optimizer's settings as given.

    ``param_groups`` hold the masters (fp32 parameters are used directly, without a
    copy). The masters are part of :meth:`state_dict`. Parameters added later get masters
    too, through :meth:`add_param_group` or the inner optimizer's own ``add_param_group``
    (found at the next :meth:`prepare_grads`, :meth:`accumulate_grads` or :meth:`step`).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        master_values: Mapping[torch.Tensor, torch.Tensor] | None = None,
        guard_nonfinite: bool | None = None,
        fast_path: bool = True,
    ) -> None:
        super().__init__(optimizer)
        if guard_nonfinite is not None and not isinstance(guard_nonfinite, bool):
            raise TypeError(f"guard_nonfinite must be True, False or None, got {guard_nonfinite!r}")
        # prepare()'s seeds of the parameters no optimizer holds yet, for groups added later
        self._seeds = weakref.ref(master_values) if isinstance(master_values, Seeds) else None
        self._guard_arg = guard_nonfinite
        self._grads = MasterGrads()
        self._pairs = self._grads.pairs  # (model parameter, fp32 master), shared with the gradient half
        self._master_by_param: dict[int, torch.nn.Parameter] = {}
        self._snapshot: Snapshot | None = None
        self._device_snapshot: DeviceSnapshot | None = None
        self._nonfinite: torch.Tensor | None = None
        self._fast_path = bool(fast_path)
        self._watch = WriteWatch()  # the model weights as this optimizer last wrote them
        # frozen low-precision parameters (a LoRA base) held as they are, without a master,
        # until they get requires_grad (then _adopt_added gives them one)
        self._frozen: list[torch.nn.Parameter] = []
        for group in optimizer.param_groups:
            group["params"] = self._masters_for(group["params"], master_values or {})
            self._choose_implementation(group)
        self._layout = self._group_layout()

    # the copies a device-decided guarded step keeps, made once (defaults: wrappers pickled before them)
    _device_copies: DeviceSnapshot | None = None
    _device_snapshot: DeviceSnapshot | None = None  # the copies of the last step, until undo_step_if

    #: what the masters are, as data (:mod:`mixprec.optim.kinds`); kept as the inner optimizer's parameters
    master_kind: ClassVar[StateKind] = MASTER

    # ----------------------------------------------------------------- masters
    def loaded(self, param: torch.Tensor, value: torch.Tensor | None, kept: torch.Tensor) -> None:
        """``param`` was loaded (``model.load_state_dict``): its master takes the loaded value
        (exactly, where it was wider than the parameter); elements the load left unchanged
        keep their master."""
        master = self.master_of(param)
        if master is None:
            return
        seed_master(param, master, loaded=value)
        self._watch.record([param])

    @property
    def masters(self) -> list[torch.nn.Parameter]:
        """The fp32 master parameters, in parameter order."""
        return [m for _, m in self._pairs]

    def master_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """The master of a model parameter (None if it has none, e.g. an fp32 norm weight)."""
        return self._master_by_param.get(id(param))

    @property
    def guard_nonfinite(self) -> bool:
        """Whether steps are checked for non-finite low-precision weights and undone (see the class docs)."""
        if self._guard_arg is not None:
            return self._guard_arg
        return any(p.dtype == torch.float16 for p, _ in self._pairs)

    # --------------------------------------------------------------- gradients
    def prepare_grads(self) -> None:
        """Gather the model's low-precision gradients into the masters' fp32 ``.grad``.

        Each master gradient is *replaced* by the fp32 sum of what :meth:`accumulate_grads`
        collected and the model parameter's current ``.grad`` (None when both are absent).
        Calling it again before :meth:`step` keeps the master gradients (which the front
        door may have unscaled and clipped in fp32) unless a model gradient changed since
        (a framework clipped ``model.parameters()`` in place, zeroed them, or ran another
        backward): those are gathered again. A gradient changed on both sides is an error.
        """
        self._snapshot = None  # a new step begins: the last one can no longer be undone
        self._device_snapshot = None
        self._nonfinite = None
        self._adopt_added()
        self._grads.prepare()

    def publish_grads(self) -> None:
        """Copy the masters' fp32 gradients back into the model's ``.grad`` (rounded to its dtype).

        For a framework that clips or logs ``model.parameters()`` after the loss scaler
        unscaled the master gradients: the model then shows the true gradients, and a
        later in-place change of them (clipping) is gathered again by :meth:`step`.
        """
        if not self._grads.gathered:
            self.prepare_grads()
        self._grads.publish()

    def accumulate_grads(self) -> None:
        """Add the model's low-precision gradients into fp32 buffers and free them.

        Call it after the backward of each micro-batch that is not an accumulation
        boundary, so micro-batches add up in fp32; the next :meth:`prepare_grads` (or
        :meth:`step`) adds the last micro-batch and makes the sum the master gradient.
        :meth:`zero_grad` and :meth:`step` drop the buffers. Not under DDP: its reducer
        reads ``.grad`` at the boundary and must see the sum there.
        """
        self._adopt_added()
        self._grads.accumulate()

    # -------------------------------------------------------------------- step
    @torch.no_grad()
    def sync_model(self) -> None:
        """Copy the masters into the model's low-precision parameters (one foreach copy)."""
        if self._pairs:
            params: list[torch.Tensor] = [p for p, _ in self._pairs]
            # (DTensors of tensor parallelism: their local shards, which DTensor's foreach rules need)
            torch._foreach_copy_([local_of(p) for p in params], [local_of(m) for _, m in self._pairs])
            self._watch.record(params)

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        """Gather gradients (:meth:`prepare_grads`), step the inner optimizer on the masters,
        copy them into the model; the fp32 gradients are freed afterwards.

        With :attr:`guard_nonfinite`, a step whose masters would round to a non-finite
        low-precision weight is undone instead (:meth:`step_nonfinite` then returns True).
        """
        if closure is not None:
            raise ValueError("MasterWeightOptimizer.step() does not take a closure; compute the loss before step()")
        self.prepare_grads()
        follow_masters(self._pairs, self._watch)  # weights written since the last step: masters follow them
        inner = [q for g in self.optimizer.param_groups for q in g["params"]]
        stepped = [p for q, p in zip(inner, self._model_params(inner), strict=True) if q.grad is not None]
        self.kinds.before_step(stepped)
        guard = self.guard_nonfinite
        if guard:  # what the step can change: parameters with a gradient (not a frozen base)
            active = [q for q in inner if q.grad is not None]
            self._snapshot = Snapshot(self.optimizer, self.kinds, groups=True)
            self._snapshot.add(active, self._model_params(active))
        result = self.optimizer.step()
        self._grads.release()
        if guard:
            bad = _whole(masters_nonfinite(self._pairs, self.optimizer))
            self._nonfinite = bad
            if bool(bad):  # one host read, on guarded (fp16) steps only
                self._restore()
                return None
        self.sync_model()
        self.kinds.after_step(stepped)  # the state kinds' own rules (the masters have none)
        return result

    def skips_on_device(self) -> bool:
        """Whether :meth:`step_skipping` runs without a host read: the inner optimizer skips on
        the device (torch's fused kernel in every group: Adam/AdamW where the groups leave the
        choice to torch, or ``fused=True``; every parameter to update has its state already, so
        a first step, which creates it, reads the decision on the host) and no added state kind
        has an ``after_step`` rule."""
        return fused_everywhere(self.optimizer) and not any(k.after_step is not None for k in self.kinds)

    def step_skipping(self, skip: torch.Tensor) -> None:
        """:meth:`step` that changes nothing where ``skip`` (a 0-dim 0/1 fp32 tensor) is 1, read by
        torch's fused kernel on the device, not by the host (see :meth:`skips_on_device`). Under
        :attr:`guard_nonfinite` the masters, their state and step counts are copied first
        (:class:`~mixprec.optim.snapshot.DeviceSnapshot`) and :meth:`undo_step_if` puts them back
        where the decision of every optimizer and rank says so."""
        if not self.skips_on_device():
            super().step_skipping(skip)
            return
        self.prepare_grads()
        follow_masters(self._pairs, self._watch)
        inner = [q for g in self.optimizer.param_groups for q in g["params"]]
        stepped = [p for q, p in zip(inner, self._model_params(inner), strict=True) if q.grad is not None]
        self.kinds.before_step(stepped)
        guard = self.guard_nonfinite
        if guard:
            active = [q for q in inner if q.grad is not None]
            held = [v for q in active for v in self.optimizer.state[q].values() if isinstance(v, torch.Tensor)]
            if self._device_copies is None:
                self._device_copies = DeviceSnapshot()
            self._device_copies.take(active + held)
            self._device_snapshot = self._device_copies
        self.optimizer.found_inf = skip  # type: ignore[attr-defined]
        self.optimizer.grad_scale = None  # type: ignore[attr-defined]
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf  # type: ignore[attr-defined]
            del self.optimizer.grad_scale  # type: ignore[attr-defined]
        self._grads.release()
        self._nonfinite = _whole(masters_nonfinite(self._pairs, self.optimizer)) if guard else None
        self.sync_model()  # a skipped step leaves the masters as they were: the same weights again

    @torch.no_grad()
    def undo_step_if(self, flag: torch.Tensor) -> None:
        """After :meth:`step_skipping`: undo the step where ``flag`` (every optimizer's and rank's
        refusal, a 0-dim tensor) is 1, on the device; nothing without a guarded step to undo."""
        snap = self._device_snapshot
        if snap is None:  # the host stepped this one (its Snapshot) or refused its own update (restored already)
            if self._snapshot is not None and bool(flag):  # (a host read: that step was decided on the host)
                self._restore()
            return
        self._device_snapshot = None
        snap.restore_where(flag)
        snap.release()
        self.sync_model()

    def refuses_nonfinite(self) -> bool:
        """Whether this optimizer's steps are checked for non-finite low-precision weights (a fact of
        the plan, the same on every rank: the front door's agreement on refusals depends on it)."""
        return self.guard_nonfinite

    def step_nonfinite(self) -> torch.Tensor | None:
        """After :meth:`step`: a bool tensor, True when the update would have written a
        non-finite low-precision weight (the step was then undone and changed nothing).

        None when the last step was not guarded (:attr:`guard_nonfinite` is False) or
        before the first step.
        """
        return self._nonfinite

    @torch.no_grad()
    def undo_step(self) -> None:
        """Restore masters, optimizer state (step counters included) and model weights to
        what they were before the last :meth:`step` (possible until the next
        :meth:`zero_grad`, :meth:`prepare_grads` or :meth:`step`; guarded steps only). After a
        step that undid itself (:meth:`step_nonfinite` True) it does nothing."""
        if self._device_snapshot is not None:  # a step decided on the device: undone there, unconditionally
            self.undo_step_if(torch.ones((), device=self._device_snapshot.device))
            return
        if self._snapshot is None and self._nonfinite is not None and bool(self._nonfinite):
            return  # the last step refused its own update: nothing to undo
        if self._snapshot is None:
            raise RuntimeError(
                "undo_step() has no step to undo: it works only after a guarded step() "
                "(guard_nonfinite, fp16 by default) and before the next zero_grad(), prepare_grads() or step()"
            )
        self._restore()

    def _restore(self) -> None:
        with torch.no_grad():
            if self._snapshot is not None:  # callers check
                self._snapshot.restore()
            self.sync_model()
        self._snapshot = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the master gradients, the fp32 accumulation buffers and the model's gradients."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._grads.release()
        self._snapshot = None
        for p, _ in self._pairs:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    # -------------------------------------------------------------- state dict
    def state_dict(self) -> dict[str, Any]:
        self._adopt_added()
        if follow_masters(self._pairs, self._watch):  # weights written since the last step: save what they are
            self._watch.record([p for p, _ in self._pairs])
        sd = self.optimizer.state_dict()
        sd[_MASTER_KEY] = [m.detach().clone() for m in self.masters]
        sd[MASTER_INDEX_KEY] = self._master_positions()
        if self.kinds:
            sd[_KINDS_KEY] = {**self.kinds.state(self.kind_params()), KINDS_KEY: sorted(self.kinds.kinds)}
        return sd

    def check_state_dict(self, state_dict: Any) -> tuple[dict[str, Any], Any, dict[str, Any]]:
        """Everything :meth:`load_state_dict` checks before anything changes; returns (the inner
        optimizer's state_dict, the masters, the state kinds' entry)."""
        self._adopt_added()  # groups added to the inner optimizer since: their masters are counted too
        sd, masters, kinds = split_master_state(state_dict, _MASTER_KEY, _KINDS_KEY)
        if isinstance(state_dict, Mapping):
            check_master_positions(state_dict.get(MASTER_INDEX_KEY), self._master_positions())
        check_master_weights(masters, self.masters, _MASTER_KEY)
        check_kind_state(self.kinds, kinds, self.kind_params(), type(self).__name__)
        check_inner_state_dict(self.optimizer, sd)
        return sd, masters, kinds

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load masters and inner optimizer state, all or nothing: everything is checked
        (master count, shapes and dtypes; the inner state's groups and shapes) before
        anything changes, and a failure leaves this optimizer and the model as they were."""
        sd, masters, kinds = self.check_state_dict(state_dict)
        with all_or_nothing(self.optimizer, self):
            self.optimizer.load_state_dict(sd)
            check_param_shaped_state(self.optimizer)
            self.kinds.load(kinds, self.kind_params())
        for group in self.optimizer.param_groups:  # a loaded group may name torch's defaults again
            self._choose_implementation(group)
        self._grads.release()
        self._snapshot = None
        self._nonfinite = None
        with torch.no_grad():
            targets: list[torch.Tensor] = list(self.masters)
            # (DTensor masters of tensor parallelism by their local shards: no foreach rule mixes them with plain ones)
            torch._foreach_copy_([local_of(m) for m in targets],
                                 [local_of(t).to(m.device) for t, m in zip(masters, targets, strict=True)])
        self.sync_model()

    def __getstate__(self) -> dict[str, Any]:
        # a weak reference to prepare()'s seeds; scratch copies (made again by a copy's first step)
        return {**super().__getstate__(), "_seeds": None, "_device_copies": None, "_device_snapshot": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = {"_seeds": None, "_layout": [], "_frozen": [], **state}  # (pickles of earlier versions lack some)
        super().__setstate__(state)
        self._master_by_param = {id(p): m for p, m in self._pairs}  # a copy has new parameters
        register(self, [p for p, _ in self._pairs])

    # ------------------------------------------------------------ memory facts
    def state_bytes(self) -> dict[str, int]:
        """The fp32 masters, the inner optimizer's state (kept for the masters, in fp32;
        predicted before the first step) and the fp32 buffers of micro-batches accumulated
        since the last step."""
        return self.kind_bytes({
            "master_weights": sum(self.master_kind.nbytes_for(p) for p, _ in self._pairs),
            "optimizer_state": footprint.optimizer_state_bytes(self.optimizer),
            "grad_accumulation": self._grads.accumulation_bytes(),
        })

    def step_transient_bytes(self) -> int:
        """The update's temporaries, the fp32 gradients gathered at step time and, on guarded
        steps, the copy of every parameter and state tensor kept to undo the update."""
        transient = footprint.update_transient_bytes(self.optimizer) + sum(footprint.nbytes(m) for m in self.masters)
        if self.guard_nonfinite:  # the snapshot: every parameter, its state and state kinds
            transient += sum(self.kinds.bytes_by_category(self.kind_params()).values())
            layouts = footprint.state_layout(self.optimizer)
            for group in self.optimizer.param_groups:
                for q in group["params"]:
                    if q.requires_grad:  # (a frozen parameter is not stepped, so not copied)
                        transient += q.numel() * 4 * (1 + footprint.param_shaped(layouts.get(id(q), {}), q))
        return transient

    @torch.no_grad()
    def follow_model(self) -> None:
        """Bring every master in line with its weight now (:func:`~mixprec.optim.follow.seed_master`):
        after writes through ``param.data``, which the version counter does not see."""
        for p, m in self._pairs:
            seed_master(p, m)
        self._watch.record([p for p, _ in self._pairs])

    @torch.no_grad()
    def reset_masters_from_model(self) -> None:
        """Set every master to the current (low-precision) value of its model parameter."""
        for p, m in self._pairs:
            m.copy_(p)
        self._watch.record([p for p, _ in self._pairs])


def _whole(flag: torch.Tensor) -> torch.Tensor:
    """A flag measured over DTensor masters (tensor parallelism) as a plain tensor every rank of
    their mesh agrees on (a device collective, no host read); a plain flag as it is."""
    if not is_dtensor(flag):
        return flag
    return flag.full_tensor()  # type: ignore[attr-defined,no-any-return]

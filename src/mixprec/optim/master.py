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

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec.dtypes import LOW_PRECISION_DTYPES
from mixprec.optim.base import WrappedOptimizer, check_inner_state_dict

__all__ = ["MasterWeightOptimizer"]

_MASTER_KEY = "mixprec_master_weights"

# torch's own optimizers whose per-parameter state tensors are either scalars (step
# counters) or shaped like the parameter; loading checks that shape.
_PARAM_SHAPED_STATE = frozenset(
    {"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "SGD", "RMSprop", "Adagrad", "Adadelta", "ASGD", "Rprop"}
)


_FUSED_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps"})


def _inf_threshold(dtype: torch.dtype) -> float:
    """The smallest magnitude that rounds to inf when cast to ``dtype`` (round to nearest even)."""
    fmax = torch.finfo(dtype).max
    _, exp = math.frexp(fmax)
    return fmax + torch.finfo(dtype).eps * 2.0 ** (exp - 1) / 2


@dataclass
class _Gathered:
    """What :meth:`MasterWeightOptimizer.prepare_grads` read for one parameter."""

    grad: torch.Tensor | None  # the model gradient it read (None: there was none)
    grad_version: int
    master_version: int  # version of the master's .grad right after the gather
    accumulated: bool  # the master grad includes fp32-accumulated micro-batches


@dataclass
class _Snapshot:
    """Parameters, optimizer state and group settings before a step (for :meth:`undo_step`)."""

    params: list[torch.Tensor]
    values: list[torch.Tensor]
    state: dict[torch.Tensor, dict[str, Any] | None]
    groups: list[dict[str, Any]] = field(default_factory=list)


class MasterWeightOptimizer(WrappedOptimizer):
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
    copy). The masters are part of :meth:`state_dict`.
    """

    # The model's gradients stay in the model until the step (read by the memory estimator).
    _hook_mode = False

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
        self._values = master_values or {}
        self._guard_arg = guard_nonfinite
        self._pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        self._master_by_param: dict[int, torch.nn.Parameter] = {}
        self._acc: list[torch.Tensor | None] = []
        self._gathered: list[_Gathered | None] | None = None
        self._snapshot: _Snapshot | None = None
        self._nonfinite: torch.Tensor | None = None
        self._fast_path = bool(fast_path)
        for group in optimizer.param_groups:
            group["params"] = self._masters_for(group["params"])
            self._choose_implementation(group)
        self._values = {}

    # ----------------------------------------------------------------- masters
    def _masters_for(self, params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        out = []
        for p in params:
            if p.dtype not in LOW_PRECISION_DTYPES:
                out.append(p)
                continue
            if id(p) in self._master_by_param:
                raise ValueError("a parameter appears in more than one parameter group; list each parameter once")
            source = self._values.get(p, p)
            if source.shape != p.shape:
                raise ValueError(f"master value has shape {tuple(source.shape)} but the parameter {tuple(p.shape)}")
            master = torch.nn.Parameter(source.detach().to(torch.float32, copy=True), requires_grad=p.requires_grad)
            self._adopt_state(p, master)
            self._pairs.append((p, master))
            self._master_by_param[id(p)] = master
            self._acc.append(None)
            out.append(master)
        return out

    def _adopt_state(self, param: torch.Tensor, master: torch.Tensor) -> None:
        state = self.optimizer.state.pop(param, None)
        if state:
            self.optimizer.state[master] = {
                k: v.to(torch.float32) if _is_param_shaped(v, master) else v for k, v in state.items()
            }

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

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        group["params"] = self._masters_for(params)
        self.optimizer.add_param_group(group)
        self._choose_implementation(self.optimizer.param_groups[-1])

    def _choose_implementation(self, group: dict[str, Any]) -> None:
        """Fused, else foreach, where the group leaves both to torch's default (see ``fast_path``)."""
        if not self._fast_path or "foreach" not in group or group["foreach"] is not None or group.get("fused"):
            return
        fusable = (
            type(self.optimizer) in (torch.optim.Adam, torch.optim.AdamW)
            and "fused" in group
            and not group.get("differentiable", False)
            and all(q.is_floating_point() and q.device.type in _FUSED_DEVICES for q in group["params"])
        )
        if not fusable:
            group["foreach"] = True
            return
        group["fused"] = True
        for q in group["params"]:  # the fused kernel keeps step counters beside the parameter, in fp32
            state = self.optimizer.state.get(q)
            step = None if not state else state.get("step")
            if isinstance(step, torch.Tensor):
                state["step"] = step.to(device=q.device, dtype=torch.float32)  # type: ignore[index]

    # --------------------------------------------------------------- gradients
    @torch.no_grad()
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
        self._nonfinite = None
        if self._gathered is not None:
            self._regather_changed()
            return
        read: list[tuple[torch.Tensor | None, bool]] = []
        dense_src: list[torch.Tensor] = []
        dense_dst: list[torch.Tensor] = []
        acc_dst: list[torch.Tensor] = []
        acc_src: list[torch.Tensor] = []
        for i, (p, m) in enumerate(self._pairs):
            g, acc = p.grad, self._acc[i]
            self._acc[i] = None
            if g is None:
                m.grad = acc
            elif acc is not None:
                m.grad = acc
                if g.is_sparse:
                    acc.add_(g.to(torch.float32))
                else:
                    acc_dst.append(acc)
                    acc_src.append(g)
            elif g.is_sparse:
                m.grad = g.to(torch.float32)
            else:
                m.grad = torch.empty_like(m, memory_format=torch.preserve_format)
                dense_dst.append(m.grad)
                dense_src.append(g)
            read.append((g, acc is not None))
        if dense_dst:
            torch._foreach_copy_(dense_dst, dense_src)
        if acc_dst:
            torch._foreach_add_(acc_dst, acc_src)
        self._gathered = [self._record(i, g, accumulated) for i, (g, accumulated) in enumerate(read)]

    def _record(self, i: int, grad: torch.Tensor | None, accumulated: bool) -> _Gathered:
        master_grad = self._pairs[i][1].grad
        return _Gathered(
            grad=grad,
            grad_version=-1 if grad is None else grad._version,
            master_version=-1 if master_grad is None else master_grad._version,
            accumulated=accumulated,
        )

    def _regather_changed(self) -> None:
        assert self._gathered is not None
        for i, (p, m) in enumerate(self._pairs):
            rec = self._gathered[i]
            assert rec is not None
            g = p.grad
            if g is rec.grad and (g is None or g._version == rec.grad_version):
                continue  # unchanged since the gather: the master gradient is the truth
            master_version = -1 if m.grad is None else m.grad._version
            if rec.accumulated or master_version != rec.master_version:
                where = "fp32-accumulated micro-batches" if rec.accumulated else "the master gradient was modified"
                raise RuntimeError(
                    f"the model gradient of a {tuple(p.shape)} parameter changed after prepare_grads() although "
                    f"{where} since: the two disagree. Modify gradients on one side only: either "
                    "before prepare_grads() in the model's .grad, or after it in the optimizer's "
                    "param_groups (the fp32 masters); or call publish_grads() after changing the masters"
                )
            m.grad = None if g is None else g.to(torch.float32, copy=True)
            self._gathered[i] = self._record(i, g, False)

    @torch.no_grad()
    def publish_grads(self) -> None:
        """Copy the masters' fp32 gradients back into the model's ``.grad`` (rounded to its dtype).

        For a framework that clips or logs ``model.parameters()`` after the loss scaler
        unscaled the master gradients: the model then shows the true gradients, and a
        later in-place change of them (clipping) is gathered again by :meth:`step`.
        """
        if self._gathered is None:
            self.prepare_grads()
        assert self._gathered is not None
        dst, src, idx = [], [], []
        for i, (p, m) in enumerate(self._pairs):
            if m.grad is None:
                p.grad = None
            elif m.grad.is_sparse or p.grad is None or p.grad.is_sparse or p.grad.shape != p.shape:
                p.grad = m.grad.to(p.dtype)
            else:
                dst.append(p.grad)
                src.append(m.grad)
            idx.append(i)
        if dst:
            torch._foreach_copy_(dst, src)
        for i in idx:
            self._gathered[i] = self._record(i, self._pairs[i][0].grad, False)

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Add the model's low-precision gradients into fp32 buffers and free them.

        Call it after the backward of each micro-batch that is not an accumulation
        boundary, so micro-batches add up in fp32; the next :meth:`prepare_grads` (or
        :meth:`step`) adds the last micro-batch and makes the sum the master gradient.
        :meth:`zero_grad` and :meth:`step` drop the buffers. Not under DDP: its reducer
        reads ``.grad`` at the boundary and must see the sum there.
        """
        if self._gathered is not None:
            raise RuntimeError(
                "accumulate_grads() called after prepare_grads() in the same step; accumulate every "
                "micro-batch first, then prepare_grads() / step() once at the accumulation boundary"
            )
        add_dst, add_src = [], []
        for i, (p, _) in enumerate(self._pairs):
            g = p.grad
            if g is None:
                continue
            acc = self._acc[i]
            if acc is None:
                self._acc[i] = g.to(torch.float32, copy=True)
            elif g.is_sparse or acc.is_sparse:
                self._acc[i] = acc + g.to(torch.float32)
            else:
                add_dst.append(acc)
                add_src.append(g)
            p.grad = None
        if add_dst:
            torch._foreach_add_(add_dst, add_src)

    def gather_grads(self) -> None:
        """Alias of :meth:`prepare_grads` (the name earlier front doors call)."""
        self.prepare_grads()

    # -------------------------------------------------------------------- step
    @torch.no_grad()
    def sync_model(self) -> None:
        """Copy the masters into the model's low-precision parameters (one foreach copy)."""
        if self._pairs:
            torch._foreach_copy_([p for p, _ in self._pairs], [m for _, m in self._pairs])

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        """Gather gradients (:meth:`prepare_grads`), step the inner optimizer on the masters,
        copy them into the model; the fp32 gradients are freed afterwards.

        With :attr:`guard_nonfinite`, a step whose masters would round to a non-finite
        low-precision weight is undone instead (:meth:`step_nonfinite` then returns True).
        """
        if closure is not None:
            raise ValueError("MasterWeightOptimizer.step() does not take a closure; compute the loss before step()")
        self.prepare_grads()
        guard = self.guard_nonfinite
        if guard:
            self._snapshot = self._take_snapshot()
        result = self.optimizer.step()
        self._release_grads()
        if guard:
            bad = self._would_be_nonfinite()
            self._nonfinite = bad
            if bool(bad):  # one host read, on guarded (fp16) steps only
                self._restore()
                return None
        self.sync_model()
        return result

    def _release_grads(self) -> None:
        for _, m in self._pairs:
            m.grad = None
        self._acc = [None] * len(self._pairs)
        self._gathered = None

    def _would_be_nonfinite(self) -> torch.Tensor:
        """True if a master or an fp32 parameter the optimizer updates is inf/NaN, or a master
        rounds to inf in its model parameter's dtype (one inf-norm read of each).

        The optimizer state is not read: from finite gradients, the usual optimizers' state
        stays finite (Adam's squared gradients overflow fp32 only beyond 1.8e19; fp16
        gradients end at 65504), and a non-finite state shows in the masters it updates.
        """
        by_threshold: dict[tuple[torch.device, float], list[torch.Tensor]] = {}
        for p, m in self._pairs:
            by_threshold.setdefault((m.device, _inf_threshold(p.dtype)), []).append(m)
        direct = {id(m) for _, m in self._pairs}
        fp32_max = _inf_threshold(torch.float32)
        for group in self.optimizer.param_groups:
            for q in group["params"]:
                if id(q) not in direct and q.is_floating_point():
                    by_threshold.setdefault((q.device, fp32_max), []).append(q)
        flags = []
        device = None
        for (dev, threshold), tensors in by_threshold.items():
            device = device or dev
            norms = torch._foreach_norm(tensors, float("inf"))
            flags.append((~(torch.stack(norms).float() < threshold)).any().to(device))
        if not flags:
            return torch.zeros((), dtype=torch.bool)
        return torch.stack(flags).any()

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
        if self._snapshot is None and self._nonfinite is not None and bool(self._nonfinite):
            return  # the last step refused its own update: nothing to undo
        if self._snapshot is None:
            raise RuntimeError(
                "undo_step() has no step to undo: it works only after a guarded step() "
                "(guard_nonfinite, fp16 by default) and before the next zero_grad(), prepare_grads() or step()"
            )
        self._restore()

    def _take_snapshot(self) -> _Snapshot:
        params = [q for g in self.optimizer.param_groups for q in g["params"]]
        state: dict[torch.Tensor, dict[str, Any] | None] = {}
        srcs: list[torch.Tensor] = list(params)
        for q in params:
            s = self.optimizer.state.get(q)
            state[q] = None if not s else dict(s)
            if s:
                srcs.extend(v for v in s.values() if isinstance(v, torch.Tensor))
        copies = _clone_all(srcs)
        by_id = {id(t): c for t, c in zip(srcs, copies, strict=True)}
        for s in state.values():
            if s is not None:
                for k, v in s.items():
                    if isinstance(v, torch.Tensor):
                        s[k] = by_id[id(v)]
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return _Snapshot(params=params, values=copies[: len(params)], state=state, groups=groups)

    def _restore(self) -> None:
        snap = self._snapshot
        assert snap is not None
        with torch.no_grad():
            torch._foreach_copy_(snap.params, snap.values)
            for q, saved in snap.state.items():
                if saved is None:
                    self.optimizer.state.pop(q, None)
                    continue
                current = self.optimizer.state.setdefault(q, {})
                for k in [k for k in current if k not in saved]:
                    del current[k]
                for k, v in saved.items():
                    cur = current.get(k)
                    if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor) and _same_layout(cur, v):
                        cur.copy_(v)
                    else:
                        current[k] = v
            for group, saved_group in zip(self.optimizer.param_groups, snap.groups, strict=False):
                group.update(saved_group)
            self.sync_model()
        self._snapshot = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the master gradients, the fp32 accumulation buffers and the model's gradients."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._release_grads()
        self._snapshot = None
        for p, _ in self._pairs:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    # -------------------------------------------------------------- state dict
    def state_dict(self) -> dict[str, Any]:
        sd = self.optimizer.state_dict()
        sd[_MASTER_KEY] = [m.detach().clone() for m in self.masters]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load masters and inner optimizer state, all or nothing: everything is checked
        (master count, shapes and dtypes; the inner state's groups and shapes) before
        anything changes, and a failure leaves this optimizer and the model as they were."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a dict (from MasterWeightOptimizer.state_dict()), got {type(state_dict).__name__}")
        sd = dict(state_dict)
        masters = sd.pop(_MASTER_KEY, None)
        if masters is None:
            raise ValueError(
                "this optimizer state_dict has no fp32 master weights (key "
                f"{_MASTER_KEY!r}): it was saved without master weights. To start the masters from "
                "the current model weights instead, call opt.optimizer.load_state_dict(sd) and then "
                "opt.reset_masters_from_model()."
            )
        if not isinstance(masters, list | tuple) or len(masters) != len(self._pairs):
            n = len(masters) if isinstance(masters, list | tuple) else type(masters).__name__
            raise ValueError(
                f"the state_dict holds {n} master weights but this optimizer has {len(self._pairs)}; "
                "was it saved from a different model or plan?"
            )
        for i, (saved, (_, m)) in enumerate(zip(masters, self._pairs, strict=True)):
            if not isinstance(saved, torch.Tensor):
                raise TypeError(f"master weight {i} in the state_dict is a {type(saved).__name__}, not a tensor")
            if saved.shape != m.shape:
                raise ValueError(
                    f"master weight {i} in the state_dict has shape {tuple(saved.shape)}, expected {tuple(m.shape)}; "
                    "was it saved from a different model?"
                )
            if saved.dtype != torch.float32:
                raise ValueError(
                    f"master weight {i} in the state_dict has dtype {saved.dtype}, expected torch.float32; "
                    "save it with MasterWeightOptimizer.state_dict()"
                )
        check_inner_state_dict(self.optimizer, sd)
        old_state, old_groups = self.optimizer.state, self.optimizer.param_groups
        self.optimizer.load_state_dict(sd)  # builds new state and groups; raises before replacing them
        try:
            self._check_loaded_state()
        except (ValueError, TypeError):
            self.optimizer.state, self.optimizer.param_groups = old_state, old_groups
            raise
        for group in self.optimizer.param_groups:  # a loaded group may name torch's defaults again
            self._choose_implementation(group)
        self._release_grads()
        self._snapshot = None
        self._nonfinite = None
        with torch.no_grad():
            targets: list[torch.Tensor] = list(self.masters)
            torch._foreach_copy_(targets, [t.to(m.device) for t, m in zip(masters, targets, strict=True)])
        self.sync_model()

    def _check_loaded_state(self) -> None:
        name = type(self.optimizer).__name__
        shaped = name in _PARAM_SHAPED_STATE and type(self.optimizer).__module__.startswith("torch.optim")
        for group in self.optimizer.param_groups:
            for q in group["params"]:
                for key, value in self.optimizer.state.get(q, {}).items():
                    if not isinstance(value, torch.Tensor) or value.dim() == 0:
                        continue
                    if shaped and value.shape != q.shape:
                        raise ValueError(
                            f"optimizer state {key!r} in the state_dict has shape {tuple(value.shape)} but its "
                            f"parameter has shape {tuple(q.shape)}; the state_dict belongs to another model"
                        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._master_by_param = {id(p): m for p, m in self._pairs}  # a copy has new parameters

    @torch.no_grad()
    def reset_masters_from_model(self) -> None:
        """Set every master to the current (low-precision) value of its model parameter."""
        for p, m in self._pairs:
            m.copy_(p)


def _clone_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (one foreach copy per device and dtype)."""
    out = [torch.empty_like(t) for t in tensors]
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for t, c in zip(tensors, out, strict=True):
        dst, src = groups.setdefault((t.device, t.dtype), ([], []))
        dst.append(c)
        src.append(t)
    for dst, src in groups.values():
        torch._foreach_copy_(dst, src)
    return out


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def _is_param_shaped(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == param.shape

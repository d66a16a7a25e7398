"""The phases of one optimizer step: gradient norm and clipping, the skip decision, the update.

:class:`mixprec.MixedPrecision.step` runs them in order. :class:`SkipDecision` is the one
owner of the decision to skip: whatever the number of optimizers, it decides with one
host read, after one all-reduce when several ranks run (a plan whose update can refuse a
non-finite low-precision weight checks once more, after the update).

>>> import torch
>>> from mixprec.step import SkipDecision, total_norm
>>> decision = SkipDecision()
>>> decision.record_loss(torch.tensor(float("inf")))
>>> decision.decide(total_norm([torch.ones(3)], torch.device("cpu")))
'nonfinite_loss'
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch

from mixprec.distributed.fsdp import has_dtensor, total_grad_norm
from mixprec.ledger import StepLedger, StepResult, skip_error, warn_zero_grads
from mixprec.nested import by_device_dtype, shard_local
from mixprec.plans import Plan
from mixprec.process_groups import all_reduce_max, resolve_group
from mixprec.scaling import LossScaler

__all__ = [
    "NormMemo", "SkipDecision", "StepLedger", "StepResult", "apply_update", "call_hook", "check_loss", "clip_",
    "skip_error", "total_norm", "unscale_all", "warn_zero_grads",
]


# ------------------------------------------------------------------ gradients
def call_hook(optimizers: Sequence[torch.optim.Optimizer], name: str) -> None:
    """Call the optional wrapper hook ``name`` on each optimizer that has it.

    The hooks of :class:`mixprec.optim.WrappedOptimizer` (``publish_grads``,
    ``accumulate_grads``; the scaler calls ``prepare_grads``) move gradients between the
    model and a wrapper's own storage; a plain torch optimizer has none of them.
    """
    for opt in optimizers:
        hook = getattr(opt, name, None)
        if hook is not None:
            hook()


def check_loss(loss: Any, caller: str) -> None:
    """Refuse what cannot be backpropagated as one micro-batch's loss."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"{caller} expects the loss tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(
            f"{caller} expects a scalar loss, got shape {tuple(loss.shape)}; reduce it (e.g. loss.mean()) first"
        )


def unscale_all(
    plan: Plan,
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    scaler: LossScaler,
    process_group: Any = None,
    *,
    again: bool = False,
) -> None:
    """Bring every optimizer's gradients to their true values, once per step.

    The plan acts first (fp8: every rank computes the next scales from the same amaxes),
    then the scaler has each wrapper gather its gradients (masters: the model's gradients
    into the fp32 masters) and unscales them without a collective: :class:`SkipDecision`
    makes the only one. ``again``: an earlier call was interrupted; optimizers the scaler
    already unscaled are left as they are (gathering again changes nothing).
    """
    plan.before_unscale(model, process_group)  # an all-reduce of maxima: the same when repeated
    for opt in optimizers:
        if again and scaler.found_inf(opt) is not None:
            continue
        scaler.unscale_(opt, sync=False)


_DEVICE_INDEX = torch.Tensor.get_device  # -1 on the CPU, the index elsewhere
_DTYPE = operator.attrgetter("dtype")


def total_norm(grads: Sequence[torch.Tensor], device: torch.device | None) -> torch.Tensor:
    """The total 2-norm of ``grads`` in fp32: one foreach norm per (device, dtype) group.

    DTensor gradients (FSDP2 shards, tensor parallelism) sum their squared norms across
    their mesh.
    """
    if not grads:
        return torch.zeros((), device=device)
    # the common case, plain tensors of one dtype on one device: one foreach kernel (CUDA's fused
    # norm needs one dtype). The checks loop in C; devices of one index but two types (cuda:0
    # and xpu:0) would fail loudly in the kernel.
    if (
        len(set(map(type, grads))) == 1
        and type(grads[0]) is torch.Tensor
        and len(set(map(_DTYPE, grads))) == 1
        and len(set(map(_DEVICE_INDEX, grads))) == 1
    ):
        return _norm_of(list(grads))
    if has_dtensor(grads):
        return total_grad_norm(list(grads))
    # one foreach kernel per (device, dtype), then one norm over every tensor's norm in the order
    # given: the result does not depend on how the dtypes group (bf16 gradients measure exactly
    # as their fp32 copies do, so remainder masters clip as fp32 masters do, bit for bit)
    target = grads[0].device
    places: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(grads):
        places.setdefault((g.device, g.dtype), []).append(i)
    norms: list[torch.Tensor] = [torch.empty(0)] * len(grads)
    for (_, dtype), where in places.items():
        group = [grads[i] for i in where]
        if dtype in _FP32_NORM:
            measured = list(torch._foreach_norm(group, 2.0, dtype=torch.float32))
        else:
            measured = [n.to(torch.float32) for n in torch._foreach_norm(group, 2.0)]
        for i, n in zip(where, measured, strict=True):
            norms[i] = n.to(target)
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def _norm_of(grads: list[torch.Tensor]) -> torch.Tensor:
    """The fp32 2-norm of tensors of one device and dtype (one foreach kernel); fp64 and
    complex gradients are measured in their own precision, then the norm is cast to fp32."""
    if grads[0].dtype not in _FP32_NORM:
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0).to(torch.float32)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)), 2.0)


_FP32_NORM = (torch.float32, torch.bfloat16, torch.float16)


class NormMemo:
    """The total gradient norm measured in this step, for as long as those gradients are unchanged.

    A framework's clipping (``clip_grad_norm_``) or logging (``grad_norm``) measures the
    gradients; the skip decision then needs the same norm. "Unchanged" means the same
    tensors with the same version counters: every in-place change bumps a tensor's
    counter (``torch._foreach_mul_`` of the clipping included, which is why the memo is
    taken again after clipping); a change made through ``tensor.data`` bypasses the counter
    and is not seen. The memo holds the gradients until :meth:`forget` (each step's end).

    >>> import torch
    >>> memo, g = NormMemo(), [torch.full((4,), 2.0)]
    >>> memo.remember(g, total_norm(g, None)); memo.get(g)
    tensor(4.)
    >>> _ = g[0].mul_(0.5)  # an in-place change: the memo no longer holds
    >>> memo.get(g) is None
    True
    """

    _grads: list[torch.Tensor]
    _versions: list[int]
    _norm: torch.Tensor | None
    clipped_to: float | None  # the max_norm these gradients were clipped to (valid while get() holds)

    def __init__(self) -> None:
        self.forget()

    def remember(self, grads: Sequence[torch.Tensor], norm: torch.Tensor, clipped_to: float | None = None) -> None:
        self._grads = list(grads)
        self._versions = [g._version for g in self._grads]
        self._norm = norm
        self.clipped_to = clipped_to

    def get(self, grads: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The remembered norm if ``grads`` are the very tensors measured, unchanged; else None."""
        if self._norm is None or len(grads) != len(self._grads):
            return None
        for g, seen, version in zip(grads, self._grads, self._versions, strict=True):
            if g is not seen or g._version != version:
                return None
        return self._norm

    def forget(self) -> None:
        self._grads, self._versions, self._norm, self.clipped_to = [], [], None, None


def clip_(
    grads: Sequence[torch.Tensor], norm: torch.Tensor, max_norm: float,
    optimizers: Sequence[torch.optim.Optimizer] = (),
) -> None:
    """Scale ``grads`` in place so their total norm ``norm`` becomes at most ``max_norm``.

    A non-finite norm clips nothing (the step will be skipped). An optimizer of
    ``optimizers`` with ``scale_grads_later`` (remainder masters) takes the factor for the
    gradients it names and applies it in fp32 inside its step; those are left as they are.
    """
    if not grads:
        return
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    coef = torch.where(torch.isfinite(coef), coef, torch.ones_like(coef))
    taken: set[int] = set()
    for opt in optimizers:
        later = getattr(opt, "scale_grads_later", None)
        if later is not None:
            taken.update(map(id, later(coef)))
    if taken:
        grads = [g for g in grads if id(g) not in taken]
    for (device, _), gs in by_device_dtype([shard_local(g) for g in grads]).items():  # FSDP2: local shards
        torch._foreach_mul_(gs, coef.to(device))


# ------------------------------------------------------------------ decision
class SkipDecision:
    """Decides, once per step and for every optimizer and rank, whether the update happens.

    Reasons, first match wins: ``"nonfinite_loss"`` (the forward overflowed; the scale is
    kept), ``"overflow"`` (inf/NaN gradients; a dynamic scale backs off),
    ``"nonfinite_plan"`` (the plan saw a non-finite value the gradients do not show, e.g.
    an inf input or output gradient of an fp8 layer; the scale is kept).
    """

    def __init__(self, process_group: Any = None) -> None:
        self.process_group = process_group
        self._losses: list[torch.Tensor] = []
        self.norm: float | None = None  # the gradient norm the last decision read

    def record_loss(self, loss: torch.Tensor) -> None:
        """Keep a micro-batch's loss value to check it at the decision (an fp32 copy of its one
        element, so the caller's tensor is neither kept alive nor read after it changes; no host read)."""
        self._losses.append(loss.detach().to(torch.float32, copy=True).reshape(()))

    def loss_was_nonfinite(self) -> bool:
        """Whether a loss of this step was inf/NaN (a host read)."""
        return bool(self._losses) and not bool(torch.isfinite(torch.stack(self._losses)).all())

    def decide(
        self,
        norm: torch.Tensor,
        plan_flag: torch.Tensor | None = None,
        scaler: LossScaler | None = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> str | None:
        """The skip reason (None: step). ``scaler`` has unscaled ``optimizers`` without syncing;
        it learns the decision, so its ``update()`` needs no further synchronisation."""
        device = norm.device
        norm = _fp32_scalar(norm.detach() if norm.requires_grad else norm, device)
        losses = [_fp32_scalar(t, device) for t in self._losses]
        plan = None if plan_flag is None else _fp32_scalar(plan_flag, device)
        scaling = scaler is not None and scaler.is_enabled()
        found = scaler.sync_found_inf(optimizers).to(device, torch.float32) if scaling else None  # type: ignore[union-attr]
        single = resolve_group(self.process_group) is None
        if single:
            # One process: read the values there are (bf16 and fp32 plans: the losses and the
            # norm) with one stack and one host read, and judge them on the host.
            values = torch.stack([*losses, norm, *(f for f in (plan, found) if f is not None)]).tolist()
            n = len(losses)
            self.norm, rest = values[n], iter(values[n + 1:])
            plan_bad = next(rest) if plan is not None else 0.0
            found_inf = next(rest) if found is not None else 0.0
            nonfinite_loss = not all(math.isfinite(v) for v in values[:n])
            grads_bad = found_inf > 0
            overflow = grads_bad or not math.isfinite(self.norm)
        else:
            # Several ranks: one MAX all-reduce of the flags, then one read of them and this rank's norm.
            zero = torch.zeros((), device=device)
            flags = torch.stack([
                (~torch.isfinite(torch.stack(losses or [zero]))).any().float(), (~torch.isfinite(norm)).float(),
                zero if plan is None else plan, zero if found is None else found,
            ])
            all_reduce_max(flags, self.process_group)
            nonfinite_loss, norm_bad, plan_bad, found_inf, self.norm = torch.cat([flags, norm.reshape(1)]).tolist()
            grads_bad = found_inf > 0
            overflow = grads_bad or norm_bad > 0
        if found is not None:  # a scaling scaler: it unscaled the optimizers
            # the scaler counts inf/NaN gradients (its backoff); a norm that overflows fp32 on finite
            # gradients skips the step but is not the scale's doing
            # what every optimizer (one process: the scaler's own combined flag) and rank agreed
            scaler.decided(optimizers, found if single else flags[3], grads_bad)  # type: ignore[union-attr]
        if nonfinite_loss:
            return "nonfinite_loss"
        if overflow:
            return "overflow"
        return "nonfinite_plan" if plan_bad else None

    def reset(self) -> None:
        self._losses = []


def _fp32_scalar(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` as a 0-dim fp32 tensor on ``device`` (no kernel where it already is one)."""
    if t.dtype != torch.float32 or t.device != device:
        t = t.to(device, torch.float32)
    return t if t.dim() == 0 else t.reshape(())


def _step_nonfinite(opt: torch.optim.Optimizer) -> torch.Tensor | None:
    check = getattr(opt, "step_nonfinite", None)  # wrappers whose update can refuse inf weights
    return check() if check is not None else None


def apply_update(optimizers: Sequence[torch.optim.Optimizer], process_group: Any = None, progress: Any = None) -> str | None:
    """Step every optimizer; undo them all if one refused a non-finite low-precision weight.

    The decision is made and gradients are unscaled, so each optimizer steps directly.
    Returns ``"nonfinite_weights"`` when the update was undone, else None. ``progress``
    (an object with an int ``updated``, e.g. :class:`mixprec.phases.StepPhases`) counts the
    optimizers whose ``step()`` returned: after an interruption a second call steps only
    the others.
    """
    start = 0 if progress is None else progress.updated
    for opt in optimizers[start:] if start else optimizers:
        opt.step()
        if progress is not None:
            progress.updated += 1
    refusals = [flag for opt in optimizers if (flag := _step_nonfinite(opt)) is not None]
    if not refusals:
        return None
    refused = torch.stack([_fp32_scalar(f, refusals[0].device) for f in refusals]).amax()
    if not bool(all_reduce_max(refused, process_group)):
        return None
    for opt in optimizers:
        flag = _step_nonfinite(opt)
        if flag is None or not bool(flag):
            opt.undo_step()  # type: ignore[attr-defined]
    return "nonfinite_weights"

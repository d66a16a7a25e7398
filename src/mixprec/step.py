"""The phases of one optimizer step: gradient norm and clipping, the skip decision, the update.

:class:`mixprec.MixedPrecision.step` runs them in order. :class:`SkipDecision` is the one
owner of the decision to skip: whatever the number of optimizers, it decides on the device
(:class:`Decision`), after one all-reduce when several ranks run, and no host read; the
update is masked on the device for optimizers that skip from a device flag (torch's fused
ones, mixprec's wrappers that can), and reads the decision once for any other. A plan whose
update can refuse a non-finite low-precision weight decides once more, after the update.

>>> import torch
>>> from mixprec.step import SkipDecision, total_norm
>>> decider = SkipDecision()
>>> decider.record_loss(torch.tensor(float("inf")))
>>> decision = decider.decide(total_norm([torch.ones(3)], torch.device("cpu")))
>>> decision.code, decision.read()
(tensor(1.), ('nonfinite_loss', 1.7320507764816284))
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
from mixprec.optim.fast import fused_everywhere
from mixprec.plans import Plan
from mixprec.process_groups import all_reduce_max, resolve_group
from mixprec.scaling import LossScaler

__all__ = [
    "NONFINITE_LOSS", "NONFINITE_PLAN", "NONFINITE_WEIGHTS", "OVERFLOW", "REASONS", "STEP",
    "Decision", "NormMemo", "SkipDecision", "StepLedger", "StepResult", "apply_update", "call_hook", "check_loss",
    "clip_", "skip_error", "skips_on_device", "step_masked", "total_norm", "unscale_all", "warn_zero_grads",
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
    optimizers: Sequence[torch.optim.Optimizer] = (), skip: torch.Tensor | None = None,
) -> None:
    """Scale ``grads`` in place so their total norm ``norm`` becomes at most ``max_norm``.

    A non-finite norm clips nothing (the step will be skipped), nor does a step ``skip`` (a
    0-dim 0/1 tensor, decided on the device) says is skipped: a clamp of the factor, no branch.
    An optimizer of ``optimizers`` with ``scale_grads_later`` (remainder masters) takes the
    factor for the gradients it names and applies it in fp32 inside its step; those are left as
    they are.
    """
    if not grads:
        return
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    keep = torch.isfinite(coef) if skip is None else torch.isfinite(coef) & (skip.to(coef.device) == 0)
    coef = torch.where(keep, coef, torch.ones_like(coef))
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
#: the skip decision as a number on the device (first match wins; 0: the update happens)
STEP, NONFINITE_LOSS, OVERFLOW, NONFINITE_PLAN, NONFINITE_WEIGHTS = 0, 1, 2, 3, 4
#: ``StepResult.skip_reason`` of each code
REASONS: tuple[str | None, ...] = (None, "nonfinite_loss", "overflow", "nonfinite_plan", "nonfinite_weights")


class Decision:
    """One step's skip decision, as device tensors: nothing here waits for the device.

    Attributes:
        code: a 0-dim fp32 tensor, one of :data:`STEP`, :data:`NONFINITE_LOSS`,
            :data:`OVERFLOW`, :data:`NONFINITE_PLAN`, :data:`NONFINITE_WEIGHTS` (the same on
            every rank: decided after one MAX all-reduce).
        norm: this rank's total gradient norm (fp32; over the mesh for sharded gradients).
        found: the loss scaler's found-inf flag every rank agreed on (None without scaling).
        host: ``(reason, norm)`` once read on the host (:meth:`read`), else None.
    """

    __slots__ = ("code", "finished", "found", "host", "measured", "norm", "outcome")

    def __init__(self, code: torch.Tensor, norm: torch.Tensor, found: torch.Tensor | None = None) -> None:
        self.code, self.norm, self.found = code, norm, found
        self.host: tuple[str | None, float] | None = None
        self.measured = True  # the norm was measured (not under the optimizer in backward)
        self.finished = False  # buffers, plan and loss scale settled for it (once)
        self.outcome: torch.Tensor | None = None  # what the host's bookkeeping reads of it, on the device

    @classmethod
    def known(cls, reason: str | None, norm: float | None, device: torch.device | None = None) -> Decision:
        """A decision the host already made (the optimizer in backward)."""
        out = cls(torch.tensor(float(REASONS.index(reason)), device=device),
                  torch.tensor(math.nan if norm is None else norm, device=device))
        out.host = (reason, math.nan if norm is None else norm)
        out.measured = norm is not None
        return out

    def skip_flag(self) -> torch.Tensor:
        """1.0 where the update is skipped, else 0.0 (fp32, as torch's fused optimizers take ``found_inf``)."""
        return (self.code > 0).to(torch.float32)

    def read(self) -> tuple[str | None, float]:
        """``(reason, norm)`` on the host: one host read (it waits for the device), once."""
        if self.host is None:
            code, norm = torch.stack([self.code, self.norm.to(self.code.device)]).tolist()
            self.host = (REASONS[int(code)], norm)
        return self.host

    def refused(self, flag: torch.Tensor) -> None:
        """An update already made wrote a non-finite low-precision weight (``flag``: every rank's,
        agreed): the step becomes a :data:`NONFINITE_WEIGHTS` skip where it was one to take."""
        self.code = torch.where((self.code == STEP) & flag.to(self.code.device, torch.bool),
                                torch.full_like(self.code, NONFINITE_WEIGHTS), self.code)
        self.host = None


class SkipDecision:
    """Decides, once per step and for every optimizer and rank, whether the update happens.

    Reasons, first match wins: ``"nonfinite_loss"`` (the forward overflowed; the scale is
    kept), ``"overflow"`` (inf/NaN gradients; a dynamic scale backs off),
    ``"nonfinite_plan"`` (the plan saw a non-finite value the gradients do not show, e.g.
    an inf input or output gradient of an fp8 layer; the scale is kept). The decision is
    made on the device (:class:`Decision`): one stack of the flags, one MAX all-reduce when
    several ranks run, and no host read.
    """

    def __init__(self, process_group: Any = None) -> None:
        self.process_group = process_group
        self._losses: list[torch.Tensor] = []

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
    ) -> Decision:
        """The decision on the device. ``scaler`` has unscaled ``optimizers`` without syncing; it
        learns the agreed found-inf flag, so its update needs no further synchronisation."""
        device = norm.device
        norm = _fp32_scalar(norm.detach() if norm.requires_grad else norm, device)
        scaling = scaler is not None and scaler.is_enabled()
        found = scaler.sync_found_inf(optimizers).to(device, torch.float32) if scaling else None  # type: ignore[union-attr]
        parts = [torch.stack([_fp32_scalar(t, device) for t in self._losses]).isfinite().all().logical_not()
                 if self._losses else None,
                 norm.isfinite().logical_not(),
                 None if plan_flag is None else _fp32_scalar(plan_flag, device) > 0,
                 None if found is None else found > 0]
        zero = torch.zeros((), dtype=torch.bool, device=device)
        flags = torch.stack([zero if f is None else f for f in parts]).to(torch.float32)
        if resolve_group(self.process_group) is not None:
            all_reduce_max(flags, self.process_group)  # every rank: the same flags, no host read
        loss_bad, norm_bad, plan_bad, grads_bad = flags.unbind()
        code = torch.where(loss_bad > 0, float(NONFINITE_LOSS), torch.where(
            (grads_bad > 0) | (norm_bad > 0), float(OVERFLOW), torch.where(plan_bad > 0, float(NONFINITE_PLAN), 0.0)))
        agreed = None
        if found is not None:  # a scaling scaler: it unscaled the optimizers
            # the scaler counts inf/NaN gradients (its backoff); a norm that overflows fp32 on finite
            # gradients skips the step but is not the scale's doing
            agreed = grads_bad
            scaler.decided(optimizers, agreed, None)  # type: ignore[union-attr]
        return Decision(code, norm, agreed)

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


def skips_on_device(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` skips a step from a device flag (``found_inf``) without the host reading it:
    torch's fused optimizers (``fused=True``: Adam, AdamW, SGD) and the mixprec wrappers that say
    so (``skips_on_device()``); any other optimizer needs the decision on the host."""
    own = getattr(opt, "skips_on_device", None)
    if callable(own):
        return bool(own())
    return fused_everywhere(opt)


def step_masked(opt: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """``opt.step()`` that changes nothing where ``skip`` (fp32 0/1 on the device) is 1: the flag
    goes to the optimizer as torch's GradScaler gives it to fused optimizers (``found_inf``; the
    gradients are unscaled already, so no ``grad_scale``)."""
    own = getattr(opt, "step_skipping", None)
    if callable(own):
        own(skip)
        return
    opt.found_inf = skip  # type: ignore[attr-defined]
    opt.grad_scale = None  # type: ignore[attr-defined]
    try:
        opt.step()
    finally:
        del opt.found_inf  # type: ignore[attr-defined]
        del opt.grad_scale  # type: ignore[attr-defined]


def apply_update(
    optimizers: Sequence[torch.optim.Optimizer], decision: Decision, process_group: Any = None, progress: Any = None,
) -> None:
    """Step every optimizer as ``decision`` says; undo them all if one refused a non-finite
    low-precision weight (the decision then says :data:`NONFINITE_WEIGHTS`).

    Optimizers that skip on the device (:func:`skips_on_device`) step with the decision's flag
    and no host read; for any other the decision is read on the host once (it is then known).
    The gradients are unscaled and clipped already. ``progress`` (an object with an int
    ``updated``, e.g. :class:`mixprec.phases.StepPhases`) counts the optimizers whose
    ``step()`` returned: after an interruption a second call steps only the others.
    """
    start = 0 if progress is None else progress.updated
    skip: torch.Tensor | None = None
    for opt in optimizers[start:] if start else optimizers:
        if skips_on_device(opt):
            skip = decision.skip_flag() if skip is None else skip
            step_masked(opt, skip)
        elif decision.read()[0] is None:
            opt.step()
        if progress is not None:
            progress.updated += 1
    guarded = [opt for opt in optimizers if _refuses(opt)]
    if not guarded:
        return
    # every rank takes part (whether it refuses is a fact of the plan, not of this step): one flag each
    device = decision.code.device
    flags = [flag if (flag := _step_nonfinite(opt)) is not None else torch.zeros((), device=device) for opt in guarded]
    refused = torch.stack([_fp32_scalar(f, device) for f in flags]).amax()
    all_reduce_max(refused, process_group)  # every rank undoes, or none
    for opt in guarded:
        undo = getattr(opt, "undo_step_if", None)
        if callable(undo):
            undo(refused)
        elif decision.host is not None and decision.host[0] is not None:
            continue  # nothing stepped
        elif bool(refused):  # an optimizer that can undo only on the host's word (one read)
            flag = _step_nonfinite(opt)
            if flag is None or not bool(flag):
                opt.undo_step()  # type: ignore[attr-defined]
    decision.refused(refused)


def _refuses(opt: torch.optim.Optimizer) -> bool:
    check = getattr(opt, "refuses_nonfinite", None)
    return bool(check()) if callable(check) else _step_nonfinite(opt) is not None

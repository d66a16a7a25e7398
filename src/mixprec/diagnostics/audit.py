"""Audit a training loop that does not use mixprec yet: the plan it effectively runs, its risks, the fix.

:func:`audit` reads what a loop is made of (the trainable parameters' dtypes, the
optimizer and its state, the loss scaler, the autocast dtype the loop uses) and names:

- the precision plan the setup effectively runs, in words and as the closest mixprec plan;
- its risks: fp16 compute without a loss scaler (small gradients flush to zero); pure
  bf16 / fp16 weights without fp32 masters or compensation (updates below 2**-8 of a
  weight, bf16, or 2**-11, fp16, are lost); optimizer state kept in bf16 / fp16 by a
  torch optimizer (its update math runs in that dtype too); gradients accumulated in
  bf16 / fp16; and, given a ``batch``, under fp16 compute: activations within 2**4 of
  fp16's largest value, and gradients that underflow at the current loss scale
  (measured by :func:`~mixprec.diagnostics.headroom` on a copy of the model);
- the mixprec plan (with fp32 islands for the modules near fp16's range) that removes
  them, and the one line to switch.

A loop with no risk gets an empty :attr:`AuditReport.risks`. A loop mixprec already runs is
recognised: a model a :class:`~mixprec.MixedPrecision` prepared (:func:`mixprec.session.session_of`,
while the session lives and steps the optimizer audited) is judged with the session's own loss
scaler when no ``scaler`` is given, and its plan is the proposal; without its session, a mixprec
optimizer wrapper names the plan, whose own loss scaling a MixedPrecision applies.

>>> import torch
>>> from mixprec.diagnostics import audit
>>> model = torch.nn.Linear(8, 8).to(torch.bfloat16)         # a pure-bf16 loop
>>> report = audit(model, torch.optim.AdamW(model.parameters()))
>>> [r.code for r in report.risks]
['pure_low_precision', 'low_precision_state', 'low_precision_accumulation']
>>> report.proposed_plan.name
'bf16-kahan'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics import _args as check
from mixprec.diagnostics.headroom import FP16_MAX, headroom
from mixprec.dtypes import LOW_PRECISION_DTYPES, dtype_name, parse_dtype
from mixprec.formatting import display_name
from mixprec.plans import Plan, get_plan, plan_names
from mixprec.scaling import LossScaler

__all__ = ["AuditReport", "Risk", "audit"]

#: activations within 2**HEADROOM_BITS of fp16's largest value are a risk under fp16 compute
HEADROOM_BITS = 4
#: a module whose output gradients flush to zero in fp16 above this fraction is a risk
UNDERFLOW_FRACTION = 0.01

_SIGNIFICANT_BITS = {torch.bfloat16: 8, torch.float16: 11}


@dataclass(frozen=True)
class Risk:
    """One precision risk of the audited setup.

    Attributes:
        code: ``"fp16_without_scaler"``, ``"pure_low_precision"``, ``"low_precision_state"``,
            ``"low_precision_accumulation"``, ``"activation_headroom"`` or ``"gradient_underflow"``.
        message: what goes wrong, in numbers.
        modules: the modules concerned (measured risks), else empty.
    """

    code: str
    message: str
    modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class AuditReport:
    """What :func:`audit` found; ``str()`` is the report a person reads.

    Attributes:
        effective: the precision the setup runs, in words.
        effective_plan: the name of the mixprec plan that runs the same precision (its risks included).
        risks: the risks found (empty: nothing to fix).
        proposed_plan: the mixprec plan that removes them (with fp32 islands where measured;
            with no risk, :attr:`effective_plan` itself).
        switch: the line that switches the loop to :attr:`proposed_plan`.
    """

    effective: str
    effective_plan: str
    risks: tuple[Risk, ...]
    proposed_plan: Plan
    switch: str

    @property
    def ok(self) -> bool:
        """No risk found."""
        return not self.risks

    def __str__(self) -> str:
        lines = [f"effective precision: {self.effective} (as mixprec's {self.effective_plan!r})"]
        if not self.risks:
            lines.append("no precision risk found")
        for risk in self.risks:
            lines.append(f"risk [{risk.code}]: {risk.message}")
        lines.append(f"proposal: {self.proposed_plan.name}" + (
            f" with fp32 islands {list(self.proposed_plan.policy.fp32_modules)}"
            if self.proposed_plan.policy is not None and self.proposed_plan.policy.fp32_modules else ""))
        lines.append(f"switch: {self.switch}")
        return "\n".join(lines)


def _wrapped(optimizer: Any) -> bool:
    """A mixprec optimizer wrapper (fp32 masters, Kahan, stochastic rounding, remainders)."""
    from mixprec.optim import WrappedOptimizer

    return isinstance(optimizer, WrappedOptimizer)


def _session(model: nn.Module, optimizer: Any) -> Any:
    """The MixedPrecision that prepared ``model`` and steps ``optimizer`` (None: not found, or the
    loop steps another optimizer than the session's, so the session does not scale its losses)."""
    from mixprec.session import session_of

    session = session_of(model)
    if session is None or optimizer is None:
        return session
    held = {id(x) for o in session.optimizers for x in (o, getattr(o, "optimizer", None)) if x is not None}
    for _ in range(4):  # the optimizer audited, or a framework's wrapper around the session's (its .optimizer)
        if id(optimizer) in held:
            return session
        optimizer = getattr(optimizer, "optimizer", None)
        if optimizer is None:
            break
    return None


def _scale(scaler: Any) -> float | None:
    """The loss scale a scaler applies now; None when there is none (or it is disabled)."""
    if scaler is None:
        return None
    if isinstance(scaler, LossScaler):
        return float(scaler.get_scale()) if scaler.is_enabled() else None
    if isinstance(scaler, torch.amp.GradScaler):
        return float(scaler.get_scale()) if scaler.is_enabled() else None
    raise TypeError(
        f"audit(): scaler must be a torch.amp.GradScaler, a mixprec LossScaler or None, got {type(scaler).__name__}"
    )


def _state_dtypes(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> set[torch.dtype]:
    """The dtypes of ``optimizer``'s per-element state: what it holds, else what torch's
    optimizers create (state in the parameter's dtype)."""
    found: set[torch.dtype] = set()
    for p in params:
        state = optimizer.state.get(p)
        shaped = [v for v in state.values() if isinstance(v, torch.Tensor) and v.shape == p.shape] if state else []
        if shaped:
            found.update(v.dtype for v in shaped)
        else:
            found.add(p.dtype)
    return found


def audit(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    batch: Any = None,
    *,
    autocast: str | torch.dtype | None = None,
    criterion: Any = None,
) -> AuditReport:
    """Name the precision plan ``model`` + ``optimizer`` (+ ``scaler``) effectively run, its risks and the fix.

    Args:
        model: the model as the loop trains it.
        optimizer: its optimizer (None: judged from the parameters alone).
        scaler: the loop's ``torch.amp.GradScaler`` (or a mixprec loss scaler); None for none.
        batch: one batch (as for :func:`~mixprec.diagnostics.compare`); with it, a copy of
            the model runs once to measure activation headroom and gradient underflow.
        autocast: the dtype of the loop's ``torch.autocast`` ("bf16", "fp16"), None without.
        criterion: the loss function, with ``batch``.
    """
    check.model(model, "audit()")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"audit(): optimizer must be a torch optimizer or None, got {type(optimizer).__name__}")
    try:
        compute = None if autocast is None else parse_dtype(autocast)
    except (TypeError, ValueError):
        compute = torch.float64  # refused below, by name
    if compute is not None and compute not in (*LOW_PRECISION_DTYPES, torch.float32):
        raise ValueError(f"audit(): autocast must be 'bf16', 'fp16' or None (the loop's torch.autocast dtype), got {autocast!r}")
    session = _session(model, optimizer)
    scale = _scale(scaler if scaler is not None or session is None else session.scaler)
    floating = [p for p in model.parameters() if p.is_floating_point()]
    trainable = [p for p in floating if p.requires_grad]
    low = [p for p in trainable if p.dtype in LOW_PRECISION_DTYPES]
    wrapped = _wrapped(optimizer)
    risks: list[Risk] = []
    plan: Plan | None = None  # the mixprec plan the loop already runs: its session's, or the one its wrapper names

    # the weights' dtype as the forward computes with them: frozen ones too (a LoRA base in fp16)
    weights = {p.dtype for p in floating}
    weight_dtype = next((d for d in (torch.float16, torch.bfloat16) if d in weights), torch.float32)
    fp16_compute = compute == torch.float16 or weight_dtype == torch.float16
    if low and not wrapped:
        effective = f"pure {dtype_name(weight_dtype)}: {dtype_name(weight_dtype)} weights updated in place, no fp32 master"
        closest = f"{dtype_name(weight_dtype)}-pure"
        bits = _SIGNIFICANT_BITS[weight_dtype]
        risks.append(Risk("pure_low_precision", (
            f"{len(low)} trainable parameter(s) are {dtype_name(weight_dtype)} with no fp32 master or compensation: "
            f"an update smaller than 2**-{bits} of its weight rounds away (a weight of 1.0 ignores updates below "
            f"{2.0 ** -bits:.2g})")))
        if optimizer is not None:
            state = _state_dtypes(optimizer, low) & set(LOW_PRECISION_DTYPES)
            if state:
                risks.append(Risk("low_precision_state", (
                    f"{type(optimizer).__name__} keeps its state in {', '.join(sorted(map(dtype_name, state)))} and "
                    "computes its update in that dtype: Adam's second moment loses small gradients' squares, "
                    "its eps=1e-8 " + ("flushes to zero in fp16" if torch.float16 in state else "is rounded"))))
        risks.append(Risk("low_precision_accumulation", (
            f"gradients accumulate in {dtype_name(weight_dtype)} (the weights' dtype): over micro-batches, or over "
            "the many terms of one backward, small contributions round away")))
    elif compute in LOW_PRECISION_DTYPES:
        effective = f"{dtype_name(compute)} autocast over {dtype_name(weight_dtype)} weights"
        closest = f"{dtype_name(compute)}-mixed"
    elif weight_dtype != torch.float32:  # fp32 trainable parameters on a frozen half-precision base
        effective = f"a frozen {dtype_name(weight_dtype)} base with fp32 trainable parameters (as LoRA)"
        closest = f"{dtype_name(weight_dtype)}-mixed"
    else:
        effective = "fp32 throughout" if not wrapped else f"mixprec's {type(optimizer).__name__}"
        closest = "fp32"
    if wrapped:
        named = {"MasterWeightOptimizer": f"{dtype_name(weight_dtype)}-master", "KahanOptimizer": "bf16-kahan",
                 "StochasticRoundingOptimizer": "bf16-sr", "RemainderOptimizer": "bf16-master",
                 "LowPrecisionOptimizer": f"{dtype_name(weight_dtype)}-pure"}.get(type(optimizer).__name__, closest)
        closest = named if named in plan_names() else closest  # (a wrapper over fp32 weights: no such plan)
        effective = f"{dtype_name(weight_dtype)} weights with mixprec's {type(optimizer).__name__}"
        if named in plan_names():
            plan = get_plan(named)
    if session is not None:
        plan = session.plan
        closest = plan.name
        effective += f", run by mixprec.MixedPrecision({plan.name!r})"
    # Without its session, a wrapper's plan scales fp16 losses as a MixedPrecision stepping it does.
    scaled_by_plan = session is None and scaler is None and plan is not None and plan.scaling.kind != "none"
    if fp16_compute and scale is None and not scaled_by_plan:
        risks.append(Risk("fp16_without_scaler", (
            "fp16 compute without a loss scaler: gradients below 2**-24 (6e-8) flush to zero and those below "
            "2**-14 lose precision; a dynamic loss scale keeps them in range")))

    islands: tuple[str, ...] = ()
    # measured on a copy; not for a loop mixprec runs (it explains overflows itself, and its prepared
    # model may cast inputs the copy would not), nor a model with nothing to train
    if batch is not None and fp16_compute and trainable and not wrapped and session is None:
        devices = sorted({p.device.index or 0 for p in floating if p.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices):  # the copy's forward (dropout) leaves the loop's RNG alone
            report = headroom(model, batch, criterion=criterion, loss_scale=scale if scale is not None else 1.0)
        near = tuple(m.module for m in report.values()
                     if m.module and m.act_amax == m.act_amax and m.act_amax > FP16_MAX / 2**HEADROOM_BITS)
        if near:
            islands = near
            risks.append(Risk("activation_headroom", (
                f"activations within 2**{HEADROOM_BITS} of fp16's largest value (65504) in "
                f"{', '.join(map(display_name, near[:5]))}: an input a little larger overflows to inf"), near))
        under = tuple(m.module for m in report.values() if m.grad_values and m.grad_underflow_fp16 > UNDERFLOW_FRACTION)
        if under:
            worst = max(report[m].grad_underflow_fp16 for m in under)
            risks.append(Risk("gradient_underflow", (
                f"at loss scale {scale if scale is not None else 1.0:g}, up to {worst:.0%} of the output gradients of "
                f"{', '.join(map(display_name, under[:5]))} flush to zero in fp16"), under))

    if session is not None:  # its plan, with its islands (its own scaler, the plan's, fixes an unscaled one)
        proposal = session.plan
        islands = tuple(r for r in (proposal.policy.fp32_modules if proposal.policy is not None else ())
                        if isinstance(r, str))
    elif plan is not None and not risks:
        proposal = plan
    else:
        proposal = _proposal(weight_dtype, compute, risks, islands) if risks else get_plan(closest)
    switch = (f"mp = mixprec.MixedPrecision(mixprec.get_plan({proposal.name!r}"
              + (f", fp32_modules={list(islands)}" if islands else "") + ")); model, optimizer = mp.prepare(model, "
              "optimizer)  # then: with mp.autocast(): loss = ...; mp.backward(loss); mp.step()")
    return AuditReport(effective, closest, tuple(risks), proposal, switch)


def _proposal(weight: torch.dtype, compute: torch.dtype | None, risks: list[Risk], islands: tuple[str, ...]) -> Plan:
    """The mixprec plan that removes ``risks`` and keeps what the loop chose (its dtype, its memory)."""
    codes = {r.code for r in risks}
    if "pure_low_precision" in codes:
        # a loop that stores bf16 weights wants the memory: Kahan keeps it (10 B/param with AdamW);
        # fp16 weights need fp32 masters (fp16's range is too narrow for a compensation scheme)
        name = "bf16-kahan" if weight == torch.bfloat16 else "fp16-master"
    elif compute == torch.float16 or weight == torch.float16:
        name = "fp16-mixed"
    elif compute == torch.bfloat16:
        name = "bf16-mixed"
    else:
        name = "fp32" if weight == torch.float32 else "bf16-mixed"
    plan = get_plan(name)
    if islands and plan.compute_dtype in LOW_PRECISION_DTYPES:
        plan = get_plan(name, fp32_modules=list(islands))
    return plan

"""Compare a precision plan against an fp32 shadow, module by module, forward and backward.

:func:`compare` deep-copies the model twice: an fp32 reference and a copy prepared
by the plan (exactly as :class:`~mixprec.MixedPrecision` prepares it). Both run the
same batch with the same random state; every module's outputs, every parameter's
gradient and the loss are compared. Two errors are reported per module:

- **end-to-end**: the module's output in the plan's run against the fp32 run. Errors
  accumulate along the network, so modules late in it look worst.
- **introduced** (``local``): the module alone, run in the plan's precision on the
  *fp32 reference inputs* rounded to the dtypes the plan's run gave it, against the
  fp32 module on the same rounded values, and in backward fed the fp32 reference
  output gradient. This isolates what the module and its children add (the rounding
  of its inputs is charged to the module that produced them).
- **own**: the same, but every child module answers exactly (the fp32 child on fp32
  inputs), so only the module's own code runs in the plan's precision. A leaf's own
  error is its introduced error; a block whose children are sensitive has a small own
  error, while a module whose own code is sensitive (an attention softmax between two
  Linear children) has a large one.

Modules are ranked by own error (the larger of forward and backward). Errors are
relative (``||plan - fp32|| / ||fp32||``) and SQNR in dB
(``10 log10(||fp32||² / ||plan - fp32||²)``).

>>> import torch
>>> from torch import nn
>>> from mixprec.diagnostics import compare
>>> class Cancel(nn.Module):  # (x + 1000) - 1000: exact in fp32, ruins bf16
...     def forward(self, x):
...         return (x + 1000) - 1000
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> net = nn.Sequential(nn.Linear(8, 16), Cancel(), nn.Linear(16, 4))
>>> batch = (torch.randn(32, 8), torch.randint(0, 4, (32,)))
>>> report = compare(net, batch, "bf16-mixed", criterion=nn.CrossEntropyLoss())
>>> report.ranked()[0].module
'1'
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics import _args as check
from mixprec.diagnostics.compare_capture import Capture, run_isolated, seeded
from mixprec.diagnostics.compare_report import (
    ComparisonReport,
    ErrorSum,
    ModuleError,
    ParamError,
    rel_of,
    sqnr_of,
)
from mixprec.diagnostics.shadow import prepare_copy, run_loss
from mixprec.plans import Plan, get_plan

__all__ = ["ComparisonReport", "ModuleError", "ParamError", "compare"]


# ------------------------------------------------------------------ compare
def _flops_by_module(model: nn.Module, run: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
    try:
        from torch.utils.flop_counter import FlopCounterMode
    except ImportError:  # pragma: no cover - old torch
        return run(), {}
    counter = FlopCounterMode(display=False)
    with counter:
        result = run()
    root = type(model).__name__
    flops: dict[str, float] = {}
    for key, ops in counter.get_flop_counts().items():
        if key == "Global":
            continue
        name = "" if key == root else key.removeprefix(root + ".")
        flops[name] = float(sum(ops.values()))
    return result, flops


def _children_of(names: list[str]) -> dict[str, list[str]]:
    known = set(names)
    children: dict[str, list[str]] = {n: [] for n in names}
    for n in names:
        if n == "":
            continue
        parent = n.rsplit(".", 1)[0] if "." in n else ""
        while parent not in known and parent != "":
            parent = parent.rsplit(".", 1)[0] if "." in parent else ""
        children.setdefault(parent, []).append(n)
    return children


def check_inputs(call: str, model: Any, batch: Any, criterion: Any, seed: Any) -> None:
    """The arguments :func:`compare` and :func:`~mixprec.diagnostics.advise` share, refused
    before any copy is made or any step runs."""
    check.model(model, call)
    check.batch(batch, call)
    check.criterion(criterion, call)
    check.integer(seed, "seed", call)


def compare(
    model: nn.Module,
    batch: Any,
    plan: str | Plan,
    *,
    criterion: Any = None,
    local: bool = True,
    seed: int = 0,
) -> ComparisonReport:
    """Run ``plan`` and an fp32 shadow of ``model`` on ``batch`` and rank modules by error.

    Args:
        model: the model (not modified: both runs use deep copies).
        batch: ``(inputs, targets)`` with a criterion, else the inputs; inputs are a
            tensor, a tuple of positional arguments or a dict of keyword arguments.
        plan: a plan name or :class:`~mixprec.Plan`.
        criterion: ``criterion(output, targets)`` gives the loss (computed in fp32, as the
            front door does). Without it the loss is a fixed random projection of the
            outputs.
        local: also measure the introduced and own errors of each module (two or three
            extra forward-and-backward runs of the module per call).
        seed: the random state both runs start from (dropout masks match).

    Returns:
        a :class:`ComparisonReport`.
    """
    check_inputs("compare()", model, batch, criterion, seed)
    check.flag(local, "local", "compare()")
    plan = get_plan(plan)
    gpus = sorted({t.device.index or 0 for t in (*model.parameters(), *model.buffers()) if t.device.type == "cuda"})
    reference = prepare_copy(model, "fp32", criterion)
    low = prepare_copy(model, plan, criterion)

    ref_cap = Capture(reference.model, inputs=local, grads=local)
    try:
        with seeded(seed, gpus):
            ref_loss, flops = _flops_by_module(reference.model, lambda: run_loss(reference, batch, criterion))
            ref_loss.backward()
    finally:
        ref_cap.remove()

    scale = low.initial_scale
    low_params = dict(low.model.named_parameters())
    while True:
        low_cap = Capture(low.model, inputs=False, grads=False)
        try:
            low.model.zero_grad(set_to_none=True)
            with seeded(seed, gpus):
                low_loss = run_loss(low, batch, criterion)
                if torch.isfinite(low_loss):
                    (low_loss * scale).backward()
        finally:
            low_cap.remove()
        grads_finite = all(
            p.grad is None or bool(torch.isfinite(p.grad).all()) for p in low_params.values()
        )
        if grads_finite or scale <= 1.0 or not torch.isfinite(low_loss):
            break
        scale /= 2.0  # what a dynamic loss scaler does after an overflow

    # ---------------------------------------------------------- parameters
    grad_total = ErrorSum()
    if not torch.isfinite(low_loss):
        grad_total.finite = False  # no backward: the plan's step would be skipped
    params: dict[str, ParamError] = {}
    ref_params = dict(reference.model.named_parameters())
    per_module_grad: dict[str, ErrorSum] = {}
    for name, rp in ref_params.items():
        lp = low_params.get(name)
        if lp is None:
            continue
        lg = None if lp.grad is None else lp.grad.to(torch.float64) / scale
        e = ErrorSum()
        e.add(lg, rp.grad)
        grad_total.add(lg, rp.grad)
        params[name] = ParamError(name, lp.dtype, e.rel, e.sqnr)
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        per_module_grad.setdefault(owner, ErrorSum()).add(lg, rp.grad)

    # ---------------------------------------------------------- modules
    ref_modules = dict(reference.model.named_modules())
    low_modules = dict(low.model.named_modules())
    names = [n for n in ref_modules if n in ref_cap.calls]
    children = _children_of(names)
    local_fwd: dict[str, ErrorSum] = {}
    local_bwd: dict[str, ErrorSum] = {}
    own_fwd: dict[str, ErrorSum] = {}
    own_bwd: dict[str, ErrorSum] = {}
    fwd: dict[str, ErrorSum] = {}
    for name in names:
        ref_calls = ref_cap.calls[name]
        low_calls = low_cap.calls.get(name, [])
        e = ErrorSum()
        for rc, lc in zip(ref_calls, low_calls, strict=False):
            for ro, lo in zip(rc.outputs, lc.outputs, strict=False):
                e.add(lo, ro)
        fwd[name] = e
        if not local or name not in low_modules:
            continue
        exact = {low_modules[c]: ref_modules[c] for c in children.get(name, []) if c in low_modules}
        lf, lb, of, ob = ErrorSum(), ErrorSum(), ErrorSum(), ErrorSum()
        for k, rc in enumerate(ref_calls):
            dtypes = low_calls[k].in_dtypes if k < len(low_calls) else None
            ref_run = run_isolated(
                ref_modules[name], rc, dtypes, contextlib.nullcontext, 1.0, seed + k, upcast=True, cuda_devices=gpus
            )
            if ref_run is None:
                continue
            low_run = run_isolated(low_modules[name], rc, dtypes, low.autocast, scale, seed + k, cuda_devices=gpus)
            own_run = (
                run_isolated(low_modules[name], rc, dtypes, low.autocast, scale, seed + k, exact, cuda_devices=gpus)
                if exact else low_run
            )
            for run, ef, eb in ((low_run, lf, lb), (own_run, of, ob)):
                if run is None:
                    continue
                for ro, lo in zip(ref_run[0], run[0], strict=False):
                    ef.add(lo, ro)
                for rg, lg in zip(ref_run[1], run[1], strict=False):
                    eb.add(lg, rg)
        local_fwd[name], local_bwd[name], own_fwd[name], own_bwd[name] = lf, lb, of, ob

    param_counts = {n: sum(p.numel() for p in m.parameters()) for n, m in ref_modules.items()}
    modules: dict[str, ModuleError] = {}

    for name in names:
        g = per_module_grad.get(name)
        lf_e, lb_e, of_e, ob_e = (d.get(name) for d in (local_fwd, local_bwd, own_fwd, own_bwd))
        modules[name] = ModuleError(
            module=name,
            module_type=type(ref_modules[name]).__name__,
            calls=len(ref_cap.calls[name]),
            fwd_rel_err=fwd[name].rel,
            fwd_sqnr_db=fwd[name].sqnr,
            local_fwd_rel_err=rel_of(lf_e),
            local_fwd_sqnr_db=sqnr_of(lf_e),
            own_fwd_err=rel_of(of_e),
            grad_rel_err=g.rel if g is not None else None,
            grad_sqnr_db=g.sqnr if g is not None else None,
            local_bwd_rel_err=rel_of(lb_e),
            local_bwd_sqnr_db=sqnr_of(lb_e),
            own_bwd_err=rel_of(ob_e),
            params=param_counts.get(name, 0),
            flops=flops.get(name, 0.0),
        )

    loss_ref, loss_low = float(ref_loss.detach()), float(low_loss.detach())
    if not math.isfinite(loss_low):
        loss_err = math.inf
    elif loss_ref == 0.0:
        loss_err = 0.0 if loss_low == 0.0 else math.inf
    else:
        loss_err = abs(loss_low - loss_ref) / abs(loss_ref)
    return ComparisonReport(
        plan=plan,
        loss_ref=loss_ref,
        loss=loss_low,
        loss_rel_err=loss_err,
        grad_rel_err=grad_total.rel,
        grad_sqnr_db=grad_total.sqnr,
        loss_scale=scale,
        modules=modules,
        params=params,
    )

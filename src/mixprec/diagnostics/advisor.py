"""Precision advisor: the fewest fp32 islands that bring a plan within tolerance of fp32.

:func:`advise` starts from :func:`~mixprec.diagnostics.compare`: while the loss or
the gradients are further from fp32 than ``tolerance``, it keeps the module with the
largest *own* error (what its own code adds, see :mod:`mixprec.diagnostics.compare`)
in fp32 as an island, and compares again. It stops when the plan is within
tolerance or a budget (number of islands, fraction of parameters in fp32) is spent.
The result is an :class:`~mixprec.policy.OpPolicy` with ``fp32_modules`` set, and a
plan carrying it, ready for ``MixedPrecision(advice.plan)``.

>>> import torch
>>> from torch import nn
>>> from mixprec.diagnostics import advise
>>> class Cancel(nn.Module):  # (x + 1000) - 1000: exact in fp32, ruins bf16
...     def forward(self, x):
...         return (x + 1000) - 1000
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> net = nn.Sequential(nn.Linear(8, 16), Cancel(), nn.Linear(16, 4))
>>> batch = (torch.randn(32, 8), torch.randint(0, 4, (32,)))
>>> advice = advise(net, batch, "bf16-mixed", criterion=nn.CrossEntropyLoss())
>>> advice.fp32_modules, advice.within_tolerance
(('1',), True)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics.compare import ComparisonReport, check_inputs, compare
from mixprec.formatting import display_name, format_number
from mixprec.plans import Plan, get_plan

__all__ = ["Advice", "advise"]


@dataclass(frozen=True)
class Advice:
    """What :func:`advise` proposes.

    Attributes:
        plan: the plan with the proposed islands (``plan.policy.fp32_modules``).
        policy: the :class:`~mixprec.policy.OpPolicy` carrying them (None when no island
            is needed, or the plan computes in fp32).
        fp32_modules: qualified names of the proposed islands, in the order chosen.
        within_tolerance: the plan with the islands is within ``tolerance`` of fp32.
        tolerance: the relative error allowed on the loss and on the gradients.
        baseline: the comparison of the plan as given.
        final: the comparison of the plan with the islands.
        param_fraction: fraction of the model's parameters inside the islands.
        flop_fraction: fraction of the forward FLOPs (matmuls, convolutions) inside them.
        steps: ``(module, loss_rel_err, grad_rel_err)`` after each island was added.
    """

    plan: Plan
    policy: Any
    fp32_modules: tuple[str, ...]
    within_tolerance: bool
    tolerance: float
    baseline: ComparisonReport
    final: ComparisonReport
    param_fraction: float
    flop_fraction: float
    steps: tuple[tuple[str, float, float], ...] = ()

    def __str__(self) -> str:
        lines = [
            f"advice for plan {self.baseline.plan.name} (tolerance {self.tolerance:g} on loss and gradients):",
            f"  before: loss rel err {format_number(self.baseline.loss_rel_err)}, "
            f"gradients rel err {format_number(self.baseline.grad_rel_err)}",
        ]
        if not self.fp32_modules:
            lines.append("  no fp32 island needed" if self.within_tolerance else "  no island helps")
        for name, loss_err, grad_err in self.steps:
            lines.append(
                f"  + fp32 island {display_name(name)!r}: loss rel err {format_number(loss_err)}, "
                f"gradients rel err {format_number(grad_err)}"
            )
        verdict = "within tolerance" if self.within_tolerance else "NOT within tolerance (no further island helped within the budget)"
        lines.append(
            f"  result: {verdict}; cost: {self.param_fraction:.1%} of parameters and "
            f"{self.flop_fraction:.1%} of forward FLOPs in fp32"
        )
        if self.fp32_modules:
            lines.append(f"  use: get_plan({self.baseline.plan.name!r}, fp32_modules={list(self.fp32_modules)!r})")
        return "\n".join(lines)


def _with_islands(plan: Plan, names: list[str]) -> tuple[Plan, Any]:
    from mixprec.policy import OpPolicy

    base = plan.policy
    if base is None:
        policy = OpPolicy(dtype=plan.compute_dtype, fp32_modules=tuple(names))
    else:
        policy = dataclasses.replace(base, fp32_modules=(*base.fp32_modules, *names))
    return plan.replace(policy=policy), policy


def _inside(name: str, islands: list[str]) -> bool:
    """``name`` is one of ``islands`` or nested in one of them."""
    return any(name == i or i == "" or name.startswith(i + ".") for i in islands)


def _cost(model: nn.Module, report: ComparisonReport, islands: list[str]) -> tuple[float, float]:
    """Fractions of parameters and of forward FLOPs inside ``islands`` (nesting counted once)."""
    top = [n for n in islands if not _inside(n, [i for i in islands if i != n])]
    modules = dict(model.named_modules())
    seen: set[int] = set()
    in_fp32 = 0
    for name in top:
        if name not in modules:
            continue
        for p in modules[name].parameters():
            if id(p) not in seen:
                seen.add(id(p))
                in_fp32 += p.numel()
    total = sum(p.numel() for p in model.parameters())
    root = report.modules.get("")
    total_flops = root.flops if root is not None else 0.0
    flops = sum(report.modules[n].flops for n in top if n in report.modules)
    return (in_fp32 / total if total else 0.0), (flops / total_flops if total_flops else 0.0)


_IMPROVEMENT = 0.9  # an island must cut the error by at least 10% to be kept


def _badness(report: ComparisonReport) -> float:
    return max(report.loss_rel_err, report.grad_rel_err)


def _next_candidate(
    model: nn.Module,
    baseline: ComparisonReport,
    report: ComparisonReport,
    existing: list[str],
    chosen: list[str],
    rejected: set[str],
    max_param_fraction: float,
) -> str | None:
    """The module with the largest own error that may still become an island."""
    for m in report.ranked():
        if m.module == "" or m.module in rejected or not m.score > 0:
            continue
        if _inside(m.module, existing + chosen):
            continue
        # A parent replaces the children already chosen inside it.
        trial = [c for c in chosen if not _inside(c, [m.module])] + [m.module]
        if _cost(model, baseline, existing + trial)[0] > max_param_fraction:
            rejected.add(m.module)
            continue
        return m.module
    return None


def advise(
    model: nn.Module,
    batch: Any,
    plan: str | Plan,
    *,
    criterion: Any = None,
    tolerance: float = 0.1,
    max_islands: int = 8,
    max_param_fraction: float = 0.5,
    seed: int = 0,
) -> Advice:
    """Propose fp32 islands that keep ``plan`` within ``tolerance`` of fp32.

    Args:
        model, batch, criterion, seed: as for :func:`~mixprec.diagnostics.compare`.
        plan: the plan to improve (a name or a :class:`~mixprec.Plan`); islands it
            already has are kept.
        tolerance: allowed relative error of the loss and of all gradients together
            (L2 norm of the difference over the L2 norm of fp32; bf16 alone typically
            gives 0.5-10% on gradients, more when the loss is near its floor).
        max_islands: at most this many islands are added (and at most twice as many
            tried: an island that does not cut the error by 10% is not kept).
        max_param_fraction: islands holding more than this fraction of the parameters
            are not proposed.

    Greedy: the module with the largest own error (forward or backward) that is not
    already in fp32 becomes an island, then the plan is compared again; an island that
    does not reduce the error is dropped and the next module is tried. The model's
    root is never proposed (that is the fp32 plan).
    """
    check_inputs("advise()", model, batch, criterion, seed)
    if isinstance(tolerance, bool) or not (isinstance(tolerance, int | float) and tolerance > 0 and math.isfinite(tolerance)):
        raise ValueError(f"tolerance must be a positive number, got {tolerance!r}")
    if isinstance(max_islands, bool) or not isinstance(max_islands, int) or max_islands < 0:
        raise ValueError(f"max_islands must be an integer >= 0, got {max_islands!r}")
    if isinstance(max_param_fraction, bool) or not isinstance(max_param_fraction, int | float):
        raise TypeError(f"max_param_fraction must be a number in (0, 1], got {max_param_fraction!r}; pass e.g. 0.5")
    if not 0 < max_param_fraction <= 1:
        raise ValueError(f"max_param_fraction must be in (0, 1], got {max_param_fraction!r}")
    plan = get_plan(plan)
    baseline = compare(model, batch, plan, criterion=criterion, seed=seed)
    if plan.compute_dtype == torch.float32 or plan.compute_dtype not in (torch.float16, torch.bfloat16):
        return Advice(plan, plan.policy, (), baseline.within(tolerance), float(tolerance),
                      baseline, baseline, 0.0, 0.0)

    from mixprec.islands import match_fp32_modules

    existing = match_fp32_modules(model, plan.policy) if plan.policy is not None else []
    chosen: list[str] = []
    rejected: set[str] = set()
    report = baseline
    steps: list[tuple[str, float, float]] = []
    current_plan, policy = plan, plan.policy
    trials = 0
    while not report.within(tolerance) and len(chosen) < max_islands and trials < 2 * max_islands:
        candidate = _next_candidate(model, baseline, report, existing, chosen, rejected, max_param_fraction)
        if candidate is None:
            break
        trials += 1
        trial = [c for c in chosen if not _inside(c, [candidate])] + [candidate]
        trial_plan, trial_policy = _with_islands(plan, trial)
        trial_report = compare(model, batch, trial_plan, criterion=criterion, seed=seed)
        if _badness(trial_report) > _IMPROVEMENT * _badness(report):
            rejected.add(candidate)  # keeping it in fp32 does not help: do not pay for it
            continue
        chosen, current_plan, policy, report = trial, trial_plan, trial_policy, trial_report
        steps.append((candidate, report.loss_rel_err, report.grad_rel_err))

    param_fraction, flop_fraction = _cost(model, baseline, existing + chosen)
    return Advice(
        plan=current_plan,
        policy=policy,
        fp32_modules=tuple(chosen),
        within_tolerance=report.within(tolerance),
        tolerance=float(tolerance),
        baseline=baseline,
        final=report,
        param_fraction=param_fraction,
        flop_fraction=flop_fraction,
        steps=tuple(steps),
    )

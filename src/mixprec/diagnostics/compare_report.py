"""What :func:`~mixprec.diagnostics.compare` reports: errors against fp32 per module and parameter.

Errors are relative (``||plan - fp32|| / ||fp32||``) and SQNR in dB
(``10 log10(||fp32||² / ||plan - fp32||²)``), summed in fp64 by :class:`ErrorSum`.

>>> import torch
>>> err = ErrorSum()
>>> err.add(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
>>> round(err.rel, 3), round(err.sqnr, 1)
(0.186, 14.6)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mixprec.formatting import display_name, format_number, format_table
from mixprec.plans import Plan

__all__ = ["ComparisonReport", "ErrorSum", "ModuleError", "ParamError", "rel_of", "sqnr_of"]


# ------------------------------------------------------------------ error algebra
class ErrorSum:
    """Sum of squared differences and squared references, in fp64."""

    __slots__ = ("diff", "empty", "finite", "ref")

    def __init__(self) -> None:
        self.diff = 0.0
        self.ref = 0.0
        self.finite = True
        self.empty = True

    def add(self, low: torch.Tensor | None, ref: torch.Tensor | None) -> None:
        if low is None:
            if ref is None:
                return
            low = torch.zeros_like(ref, dtype=torch.float64)
        elif ref is None:
            ref = torch.zeros_like(low, dtype=torch.float64)
        if low.shape != ref.shape:
            return
        self.empty = False
        lo, re = low.detach().to(torch.float64), ref.detach().to(torch.float64)
        if not bool(torch.isfinite(lo).all()):
            self.finite = False
            return
        self.diff += float((lo - re).square().sum())
        self.ref += float(re.square().sum())

    @property
    def rel(self) -> float:
        if not self.finite:
            return math.inf
        if self.ref == 0.0:
            return 0.0 if self.diff == 0.0 else math.inf
        return math.sqrt(self.diff / self.ref)

    @property
    def sqnr(self) -> float:
        if not self.finite:
            return -math.inf
        if self.diff == 0.0:
            return math.inf
        if self.ref == 0.0:
            return -math.inf
        return 10.0 * math.log10(self.ref / self.diff)


# ------------------------------------------------------------------ report types
@dataclass(frozen=True)
class ModuleError:
    """How far one module of the plan's run is from fp32.

    Attributes:
        module: qualified name (``""`` is the model itself).
        module_type: class name.
        calls: forward calls compared.
        fwd_rel_err, fwd_sqnr_db: end-to-end error of its outputs.
        local_fwd_rel_err, local_fwd_sqnr_db: error it introduces itself (run alone in
            the plan's precision on the fp32 reference inputs); None when not measured.
        own_fwd_err: error of its own code alone (children answered exactly in fp32).
        grad_rel_err, grad_sqnr_db: end-to-end error of the gradients of its own
            parameters (None if it has none).
        local_bwd_rel_err, local_bwd_sqnr_db: error of the input and parameter gradients
            it computes alone from the fp32 reference output gradient.
        own_bwd_err: the same for the gradients of its inputs and own parameters.
        params: parameters in it (children included).
        flops: forward FLOPs in it (children included; matmuls and convolutions).
    """

    module: str
    module_type: str
    calls: int
    fwd_rel_err: float
    fwd_sqnr_db: float
    local_fwd_rel_err: float | None = None
    local_fwd_sqnr_db: float | None = None
    own_fwd_err: float | None = None
    grad_rel_err: float | None = None
    grad_sqnr_db: float | None = None
    local_bwd_rel_err: float | None = None
    local_bwd_sqnr_db: float | None = None
    own_bwd_err: float | None = None
    params: int = 0
    flops: float = 0.0

    @property
    def score(self) -> float:
        """What ranks modules: the larger own error (forward or backward); end-to-end
        error when introduced errors were not measured."""
        own = [e for e in (self.own_fwd_err, self.own_bwd_err) if e is not None]
        if own:
            return max(own)
        return max(e for e in (self.fwd_rel_err, self.grad_rel_err or 0.0))


@dataclass(frozen=True)
class ParamError:
    """End-to-end gradient error of one parameter."""

    name: str
    dtype: torch.dtype
    rel_err: float
    sqnr_db: float


@dataclass(frozen=True)
class ComparisonReport:
    """What :func:`compare` found; ``str()`` is a table of the modules, worst first.

    Attributes:
        plan: the plan compared.
        loss_ref, loss: the fp32 and the plan's loss.
        loss_rel_err: ``|loss - loss_ref| / |loss_ref|``.
        grad_rel_err, grad_sqnr_db: over all parameter gradients together.
        loss_scale: the loss scale the plan's backward used (halved from the plan's
            initial scale until the gradients were finite, as a dynamic scaler would).
        modules: :class:`ModuleError` per module, in module order.
        params: :class:`ParamError` per parameter.
    """

    plan: Plan
    loss_ref: float
    loss: float
    loss_rel_err: float
    grad_rel_err: float
    grad_sqnr_db: float
    loss_scale: float
    modules: dict[str, ModuleError] = field(default_factory=dict)
    params: dict[str, ParamError] = field(default_factory=dict)

    def ranked(self, by: str = "score") -> list[ModuleError]:
        """Modules worst first. ``by``: ``"score"`` (own error, forward or backward),
        ``"forward"`` / ``"backward"`` (own error in that direction), ``"end_to_end"``."""
        keys: dict[str, Callable[[ModuleError], float]] = {
            "score": lambda m: m.score,
            "forward": lambda m: m.own_fwd_err if m.own_fwd_err is not None else m.fwd_rel_err,
            "backward": lambda m: (
                m.own_bwd_err if m.own_bwd_err is not None else (m.grad_rel_err or 0.0)
            ),
            "end_to_end": lambda m: m.fwd_rel_err,
        }
        if by not in keys:
            raise ValueError(f"ranked(by={by!r}): expected one of {', '.join(keys)}")
        key = keys[by]
        # Ties (a container and its only child): the deeper module first.
        return sorted(self.modules.values(), key=lambda m: (-_nan_low(key(m)), -m.module.count(".")))

    def within(self, tolerance: float) -> bool:
        """Loss and gradients are within ``tolerance`` (relative) of fp32."""
        return self.loss_rel_err <= tolerance and self.grad_rel_err <= tolerance

    def summary(self) -> str:
        return (
            f"plan {self.plan.name} vs fp32: loss {format_number(self.loss, '.6g')} vs "
            f"{format_number(self.loss_ref, '.6g')} (rel err {format_number(self.loss_rel_err)}), "
            f"gradients rel err {format_number(self.grad_rel_err)} "
            f"(SQNR {format_number(self.grad_sqnr_db, '.1f')} dB), loss scale {self.loss_scale:g}"
        )

    def table(self, n: int | None = None) -> str:
        """The ``n`` worst modules (all by default) as a table."""
        header = ["module", "type", "own fwd err", "fwd err", "fwd SQNR dB",
                  "own bwd err", "grad err", "grad SQNR dB"]
        rows = []
        for m in self.ranked()[:n]:
            rows.append([
                display_name(m.module),
                m.module_type,
                format_number(m.own_fwd_err),
                format_number(m.fwd_rel_err),
                format_number(m.fwd_sqnr_db, ".1f"),
                format_number(m.own_bwd_err),
                format_number(m.grad_rel_err),
                format_number(m.grad_sqnr_db, ".1f"),
            ])
        return format_table(header, rows, align_left=2)

    def __str__(self) -> str:
        return self.summary() + "\n" + self.table()


def rel_of(err: ErrorSum | None) -> float | None:
    """Relative error, or None when nothing was measured."""
    return None if err is None or err.empty else err.rel


def sqnr_of(err: ErrorSum | None) -> float | None:
    return None if err is None or err.empty else err.sqnr


def _nan_low(x: float) -> float:
    return -math.inf if math.isnan(x) else x

"""Headroom: how close each module's activations run to the dtype's range, how many of its
gradients would underflow in fp16 at a given loss scale, and the loss-scale history of a run.

:class:`HeadroomMonitor` hooks a model and accumulates, per module, the largest
activation magnitude (amax) and the fraction of its output gradients that fp16
would flush to zero (``|g * loss_scale| < 2**-25``) or keep only as subnormals
(``< 2**-14``). Statistics stay tensors until :meth:`HeadroomMonitor.report`.
Run it on an fp32 (or bf16) model to ask "what would fp16 do here?": gradients
seen in an fp16 run have already underflowed.

:class:`ScaleHistory` records :class:`~mixprec.StepResult` objects: the loss scale,
skips and gradient norms as a time series, with :meth:`ScaleHistory.to_dict` for
plotting.

>>> import torch
>>> from torch import nn
>>> from mixprec.diagnostics import HeadroomMonitor
>>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
>>> with HeadroomMonitor(model, loss_scale=1.0) as monitor:
...     model(torch.randn(16, 4) * 1e4).sum().mul(1e-9).backward()
>>> report = monitor.report()
>>> report["0"].fp16_headroom < 10  # activations of ~1e4: less than 10x below fp16's 65504
True
>>> report["2"].grad_underflow_fp16 > 0.5  # gradients of 1e-9 flush to zero in fp16
True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics import _args as check
from mixprec.diagnostics.shadow import prepare_copy, run_loss
from mixprec.dtypes import dtype_name
from mixprec.formatting import display_name, format_number, format_table
from mixprec.nested import floating_tensors

__all__ = ["HeadroomMonitor", "HeadroomReport", "ModuleHeadroom", "ScaleHistory", "headroom"]

FP16_MAX = float(torch.finfo(torch.float16).max)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
FP32_MAX = float(torch.finfo(torch.float32).max)
FP16_UNDERFLOW = 2.0**-25  # below half the smallest fp16 subnormal: rounds to zero
FP16_SUBNORMAL = float(torch.finfo(torch.float16).tiny)  # 2**-14: below it precision is lost


@dataclass(frozen=True)
class ModuleHeadroom:
    """Headroom of one module.

    Attributes:
        module: qualified name.
        module_type: class name.
        dtype: dtype of its outputs (the last one seen).
        calls: forward calls seen.
        act_amax: largest finite |activation| of its outputs (nan if none was finite).
        nonfinite_outputs: forward calls whose output held inf/NaN.
        grad_values: output-gradient values seen (elements).
        grad_underflow_fp16: fraction of the non-zero output-gradient values that fp16
            would round to zero at the monitor's loss scale.
        grad_subnormal_fp16: fraction that would be fp16 subnormals (lost precision),
            including those that underflow.
    """

    module: str
    module_type: str
    dtype: torch.dtype | None
    calls: int
    act_amax: float
    nonfinite_outputs: int
    grad_values: int
    grad_underflow_fp16: float
    grad_subnormal_fp16: float

    def headroom(self, dtype: torch.dtype) -> float:
        """``dtype``'s largest value over this module's amax (inf when the amax is 0)."""
        if not self.act_amax > 0:
            return math.inf
        return float(torch.finfo(dtype).max) / self.act_amax

    @property
    def fp16_headroom(self) -> float:
        """65504 / amax: how many times larger activations could grow before fp16 overflows."""
        return self.headroom(torch.float16)

    @property
    def bf16_headroom(self) -> float:
        """bf16's max / amax."""
        return self.headroom(torch.bfloat16)


@dataclass(frozen=True)
class HeadroomReport(Mapping[str, ModuleHeadroom]):
    """Per-module :class:`ModuleHeadroom`, in module order; ``str()`` is a table."""

    modules: dict[str, ModuleHeadroom] = field(default_factory=dict)
    loss_scale: float = 1.0

    def __getitem__(self, name: str) -> ModuleHeadroom:
        return self.modules[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.modules)

    def __len__(self) -> int:
        return len(self.modules)

    def tightest(self, n: int = 5) -> list[ModuleHeadroom]:
        """The ``n`` modules with the least fp16 headroom."""
        return sorted(self.modules.values(), key=lambda m: m.fp16_headroom)[:n]

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain data, one dict per module."""
        out: dict[str, dict[str, Any]] = {}
        for name, m in self.modules.items():
            out[name] = {
                "module_type": m.module_type,
                "dtype": dtype_name(m.dtype) if m.dtype is not None else None,
                "calls": m.calls,
                "act_amax": m.act_amax,
                "fp16_headroom": m.fp16_headroom,
                "bf16_headroom": m.bf16_headroom,
                "nonfinite_outputs": m.nonfinite_outputs,
                "grad_underflow_fp16": m.grad_underflow_fp16,
                "grad_subnormal_fp16": m.grad_subnormal_fp16,
            }
        return out

    def __str__(self) -> str:
        header = ["module", "type", "dtype", "act amax", "fp16 headroom", "bf16 headroom",
                  "non-finite", f"fp16 grad underflow @{self.loss_scale:g}", "fp16 subnormal"]
        rows = []
        for m in self.modules.values():
            rows.append([
                display_name(m.module),
                m.module_type,
                dtype_name(m.dtype) if m.dtype is not None else "-",
                format_number(m.act_amax),
                format_number(m.fp16_headroom, ".3g") + "x",
                format_number(m.bf16_headroom, ".3g") + "x",
                str(m.nonfinite_outputs),
                f"{m.grad_underflow_fp16:.2%}" if m.grad_values else "-",
                f"{m.grad_subnormal_fp16:.2%}" if m.grad_values else "-",
            ])
        return format_table(header, rows, align_left=3)


class _Stats:
    """Running per-module statistics, kept as tensors (no sync while recording)."""

    __slots__ = ("amax", "calls", "dtype", "grad_n", "nonfinite", "subnormal", "underflow")

    def __init__(self) -> None:
        self.calls = 0
        self.dtype: torch.dtype | None = None
        self.amax: torch.Tensor | None = None
        self.nonfinite: torch.Tensor | None = None
        self.grad_n: torch.Tensor | None = None
        self.underflow: torch.Tensor | None = None
        self.subnormal: torch.Tensor | None = None


def _add(acc: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value if acc is None else acc + value.to(acc.device)


def _check_loss_scale(loss_scale: object) -> None:
    if callable(loss_scale):
        return
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, int | float) or not (
        math.isfinite(loss_scale) and loss_scale > 0
    ):
        raise ValueError(
            f"loss_scale must be a finite positive number or a callable returning one, got {loss_scale!r}; "
            "pass e.g. loss_scale=65536.0 (fp16's usual starting scale) or loss_scale=scaler.get_scale"
        )


class HeadroomMonitor:
    """Accumulate activation amax and fp16 gradient-underflow fractions per module.

    Args:
        model: the module to watch (all submodules).
        loss_scale: the scale the observed gradients would be multiplied by in an fp16
            run (a number, or a callable returning the current one). Use 1.0 when the
            gradients you observe are already scaled.
        gradients: also watch output gradients (tensor hooks).

    Use it as a context manager or call :meth:`remove` when done; :meth:`report`
    synchronises once and returns a :class:`HeadroomReport`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        loss_scale: float | Callable[[], float] = 1.0,
        gradients: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"HeadroomMonitor expects an nn.Module, got {type(model).__name__}")
        _check_loss_scale(loss_scale)
        check.flag(gradients, "gradients", "HeadroomMonitor()")
        self.model = model
        self.loss_scale = loss_scale
        self.gradients = gradients
        self._names: list[str] = []
        self._types: list[str] = []
        self._stats: list[_Stats] = []
        self._handles: list[Any] = []
        self._entered = False
        for index, (name, module) in enumerate(model.named_modules()):
            self._names.append(name)
            self._types.append(type(module).__name__)
            self._stats.append(_Stats())
            self._handles.append(module.register_forward_hook(self._hook(index)))

    def _scale(self) -> float:
        return float(self.loss_scale()) if callable(self.loss_scale) else float(self.loss_scale)

    def _hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            stats = self._stats[index]
            stats.calls += 1
            for t in floating_tensors(output):
                if t.numel() == 0:
                    continue
                d = t.detach()
                finite = torch.isfinite(d)
                amax = torch.where(finite, d.abs(), 0).amax().float()
                stats.amax = amax if stats.amax is None else torch.maximum(stats.amax, amax)
                stats.nonfinite = _add(stats.nonfinite, (~finite.all()).to(torch.int64))
                stats.dtype = t.dtype
                if self.gradients and t.requires_grad:
                    t.register_hook(self._grad_hook(index))

        return hook

    def _grad_hook(self, index: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if grad is None or not grad.is_floating_point() or grad.numel() == 0:
                return
            stats = self._stats[index]
            g = grad.detach().abs().float() * self._scale()
            nonzero = g != 0
            stats.grad_n = _add(stats.grad_n, nonzero.sum())
            stats.underflow = _add(stats.underflow, (nonzero & (g < FP16_UNDERFLOW)).sum())
            stats.subnormal = _add(stats.subnormal, (nonzero & (g < FP16_SUBNORMAL)).sum())

        return hook

    def report(self) -> HeadroomReport:
        """Read the statistics back (one sync) as a :class:`HeadroomReport`."""
        modules: dict[str, ModuleHeadroom] = {}
        for name, type_name, s in zip(self._names, self._types, self._stats, strict=True):
            if s.calls == 0:
                continue
            n = int(s.grad_n) if s.grad_n is not None else 0
            modules[name] = ModuleHeadroom(
                module=name,
                module_type=type_name,
                dtype=s.dtype,
                calls=s.calls,
                act_amax=float(s.amax) if s.amax is not None else math.nan,
                nonfinite_outputs=int(s.nonfinite) if s.nonfinite is not None else 0,
                grad_values=n,
                grad_underflow_fp16=int(s.underflow) / n if n and s.underflow is not None else 0.0,
                grad_subnormal_fp16=int(s.subnormal) / n if n and s.subnormal is not None else 0.0,
            )
        return HeadroomReport(modules=modules, loss_scale=self._scale())

    def reset(self) -> None:
        """Forget the statistics gathered so far."""
        self._stats = [_Stats() for _ in self._stats]

    def remove(self) -> None:
        """Remove the hooks; :meth:`report` still works on what was gathered."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> HeadroomMonitor:
        if self._entered:
            raise RuntimeError("this HeadroomMonitor is already in use as a context manager")
        self._entered = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._entered = False
        self.remove()


def headroom(
    model: nn.Module,
    batch: Any,
    *,
    criterion: Any = None,
    loss_scale: float = 2.0**16,
    plan: Any = "fp32",
) -> HeadroomReport:
    """One forward and backward of a copy of ``model`` under ``plan`` (fp32 by default),
    reporting each module's activation headroom and the fraction of its output gradients
    that fp16 would lose at ``loss_scale``.

    ``batch`` and ``criterion`` are as for :func:`mixprec.diagnostics.compare`.

    >>> import torch
    >>> from torch import nn
    >>> from mixprec.diagnostics import headroom
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    >>> report = headroom(net, (torch.randn(8, 4), torch.tensor([0, 1] * 4)), criterion=nn.CrossEntropyLoss())
    >>> sorted(report)[:2]
    ['', '0']
    """
    check.model(model, "headroom()")
    check.batch(batch, "headroom()")
    check.criterion(criterion, "headroom()")
    _check_loss_scale(loss_scale)
    prepared = prepare_copy(model, plan)
    with HeadroomMonitor(prepared.model, loss_scale=loss_scale) as monitor:
        loss = run_loss(prepared, batch, criterion)
        loss.backward()
    return monitor.report()


class ScaleHistory:
    """The loss scale, skips and gradient norms of a run, step by step.

    Feed it every :class:`~mixprec.StepResult` (results of accumulation micro-steps are
    ignored); ``to_dict()`` gives columns ready for plotting.

    Args:
        window: number of recent steps the rolling skip rate is taken over.

    >>> from mixprec import StepResult
    >>> from mixprec.diagnostics import ScaleHistory
    >>> history = ScaleHistory(window=2)
    >>> history.record(StepResult(stepped=False, skipped=True, scale=32768.0, grad_norm=float("inf"), skip_reason="overflow"))
    >>> history.record(StepResult(stepped=True, skipped=False, scale=32768.0, grad_norm=1.5, optimizer_steps=1))
    >>> history.skip_rate(), history.to_dict()["rolling_skip_rate"]
    (0.5, [1.0, 0.5])
    """

    def __init__(self, window: int = 100) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        self.window = window
        self.scale: list[float] = []
        self.skipped: list[bool] = []
        self.skip_reason: list[str | None] = []
        self.grad_norm: list[float | None] = []
        self.optimizer_steps: list[int] = []

    def record(self, result: Any) -> None:
        """Append one step's result (an accumulation micro-step is ignored)."""
        if getattr(result, "accumulating", False):
            return
        for attr in ("skipped", "scale", "grad_norm"):
            if not hasattr(result, attr):
                raise TypeError(f"ScaleHistory.record() expects a StepResult, got {type(result).__name__}")
        self.scale.append(float(result.scale))
        self.skipped.append(bool(result.skipped))
        self.skip_reason.append(getattr(result, "skip_reason", None))
        self.grad_norm.append(None if result.grad_norm is None else float(result.grad_norm))
        self.optimizer_steps.append(int(getattr(result, "optimizer_steps", 0)))

    def __len__(self) -> int:
        return len(self.scale)

    def skip_rate(self, last: int | None = None) -> float:
        """Fraction of the recorded steps (or of the ``last`` ones) that were skipped."""
        steps = self.skipped if last is None else self.skipped[-last:]
        return sum(steps) / len(steps) if steps else 0.0

    def rolling_skip_rate(self) -> list[float]:
        """Skip rate over the preceding ``window`` steps, at each step."""
        out, running = [], 0
        for i, s in enumerate(self.skipped):
            running += s
            if i >= self.window:
                running -= self.skipped[i - self.window]
            out.append(running / min(i + 1, self.window))
        return out

    def to_dict(self) -> dict[str, list[Any]]:
        """Columns: ``step``, ``scale``, ``skipped``, ``skip_reason``, ``grad_norm``,
        ``optimizer_steps``, ``rolling_skip_rate``."""
        return {
            "step": list(range(len(self))),
            "scale": list(self.scale),
            "skipped": list(self.skipped),
            "skip_reason": list(self.skip_reason),
            "grad_norm": list(self.grad_norm),
            "optimizer_steps": list(self.optimizer_steps),
            "rolling_skip_rate": self.rolling_skip_rate(),
        }

    def __str__(self) -> str:
        if not self.scale:
            return "ScaleHistory: no steps recorded"
        reasons: dict[str, int] = {}
        for r in self.skip_reason:
            if r is not None:
                reasons[r] = reasons.get(r, 0) + 1
        why = ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items())) or "none"
        return (
            f"ScaleHistory: {len(self)} steps, {sum(self.skipped)} skipped ({self.skip_rate():.1%}; {why}); "
            f"scale {self.scale[0]:g} -> {self.scale[-1]:g} (min {min(self.scale):g}, max {max(self.scale):g})"
        )

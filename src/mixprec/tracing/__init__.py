"""Overflow tracing (also :mod:`mixprec.diagnostics`): name the first module whose activations or gradients become inf/NaN.

A skipped step says *that* something overflowed; :class:`OverflowTracer` says
*where*. It hooks every module of a model and, for each call, records the largest
magnitude of

- the module's forward outputs (direction ``"forward"``), and
- in backward, the gradient arriving at the module's outputs, the gradient it
  produces for its inputs, and its parameters' gradients (direction ``"backward"``).

Recording is cheap and never synchronises: each check is one fused ``aminmax``
reduction whose result stays a tensor on the device. Nothing is read back until
:meth:`OverflowTracer.first_overflow` is asked, which resolves the records with
a single host transfer and returns the *first* non-finite event in time order:

- forward: the first module (in execution order) whose output is inf/NaN. Later
  modules that merely propagate the inf come after it and are not named.
- backward: the first module that *produces* a non-finite gradient: its inputs' or
  parameters' gradient is inf/NaN while the gradient arriving at its outputs was
  finite. Modules upstream that receive the inf are not named.

A traced model stays an ordinary module. A tracer belongs to the run that reads it, so
copies are not traced: ``copy.deepcopy(model)`` and a model pickled with ``torch.save``
carry no-op hooks in place of the tracer's (trace a copy with a tracer of its own).

>>> import torch
>>> from torch import nn
>>> from mixprec.diagnostics import trace_overflow
>>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
>>> with torch.no_grad():
...     _ = model[1].weight.mul_(1e5)
>>> with trace_overflow(model) as tracer:
...     out = model(torch.full((2, 4), 1e3))
>>> tracer.first_overflow() is None  # fp32 has the range: nothing overflows
True
>>> with trace_overflow(model) as tracer:
...     with torch.autocast("cpu", dtype=torch.float16):
...         out = model(torch.full((2, 4), 1e3))
>>> finding = tracer.first_overflow()
>>> finding.module, finding.direction, finding.dtype
('1', 'forward', torch.float16)
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from mixprec.dtypes import dtype_name
from mixprec.formatting import display_name, format_number
from mixprec.tracing.records import (
    BWD_OUT,
    BWD_PARAM,
    FWD_IN,
    FWD_OUT,
    MODEL_INPUT,
    WHAT,
    Record,
    read_records,
    tensor_amax,
)
from mixprec.tracing.sites import UNTRACED, Site, Untraced, untraced_site

__all__ = ["OverflowFinding", "OverflowTracer", "trace_overflow"]

# Pickled models name _Site and _untraced_site (see mixprec.tracing.sites): keep the names.
_Site, _Untraced, _UNTRACED, _untraced_site = Site, Untraced, UNTRACED, untraced_site

Direction = Literal["forward", "backward"]


@dataclass(frozen=True)
class OverflowFinding:
    """The first non-finite value a traced step produced, and where.

    Attributes:
        module: qualified name of the module (``""`` is the model itself).
        module_type: its class name.
        direction: ``"forward"`` (an output became inf/NaN) or ``"backward"`` (a gradient
            it produced became inf/NaN).
        what: which tensor: ``"output"``, ``"gradient of its input"``, ``"gradient of its
            parameters"`` or ``"gradient of its output"`` (the last only when no module
            produced the non-finite gradient, e.g. the loss itself); :data:`MODEL_INPUT`
            when a floating tensor passed to the model itself was already inf/NaN (the
            data; ``module`` is then ``""``, the model).
        step: the tracer's step counter (advanced by :meth:`OverflowTracer.reset`, which
            the front door calls after each real step, and by the first forward after a
            finding was handed out).
        call: which call of the module within the step (0 for the first).
        dtype: dtype of the non-finite tensor.
        kind: ``"inf"`` or ``"nan"``.
        max_abs: largest finite magnitude this module produced in this direction during
            this step and the previous one before the overflow (None if there was none):
            how close to the dtype's range it ran.
    """

    module: str
    module_type: str
    direction: Direction
    what: str
    step: int
    call: int
    dtype: torch.dtype
    kind: Literal["inf", "nan"]
    max_abs: float | None

    @property
    def dtype_max(self) -> float:
        """Largest finite value of :attr:`dtype`."""
        return float(torch.finfo(self.dtype).max)

    @property
    def in_input(self) -> bool:
        """True when the model's own input already held the inf/NaN: no precision produced it."""
        return self.what == MODEL_INPUT

    def __str__(self) -> str:
        if self.in_input:
            return (f"non-finite input at step {self.step}: {MODEL_INPUT} already held {self.kind} "
                    f"({dtype_name(self.dtype)} tensor) before any module ran")
        seen = (
            f"largest finite |value| seen there {format_number(self.max_abs)}"
            if self.max_abs is not None
            else "no finite value seen there before"
        )
        name = dtype_name(self.dtype)
        return (
            f"{self.direction} overflow at step {self.step}: module {display_name(self.module)!r} "
            f"({self.module_type}): {self.what} became {self.kind} "
            f"({name} tensor, {name} max {format_number(self.dtype_max)}; {seen})"
        )


class OverflowTracer:
    """Hooks ``model`` and finds the first module whose activations or gradients overflow.

    Use as a context manager (``with OverflowTracer(model) as tracer``), through
    :func:`trace_overflow`, or attach it to a front door (``mp.tracer =
    OverflowTracer(model)``): a skipped step's ``StepResult.overflow`` then carries
    the :class:`OverflowFinding`.

    Args:
        model: the module to trace (every submodule is hooked).
        backward: also trace gradients (tensor hooks on module outputs, inputs and
            parameters). Forward-only tracing is cheaper.
        max_records: unresolved records kept before the tracer resolves them itself
            (bounds memory when nobody calls :meth:`reset`).

    Records accumulate from the last :meth:`reset` (the front door resets after each
    real optimizer step). :meth:`first_overflow` syncs once and keeps its answer until
    the next reset; once an overflow is known, the hooks stop measuring. Once a finding
    has been handed out, the next forward of ``model`` starts a new step by itself, so
    a skipped step's finding never carries over to the next one.
    """

    def __init__(self, model: nn.Module, *, backward: bool = True, max_records: int = 65536) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"OverflowTracer expects an nn.Module, got {type(model).__name__}")
        if isinstance(max_records, bool) or not isinstance(max_records, int) or max_records < 1:
            raise ValueError(f"max_records must be an integer >= 1, got {max_records!r}")
        self.model = model
        self.backward = backward
        self.max_records = max_records
        self.step = 0
        self._names: list[str] = []
        self._types: list[str] = []
        self._calls: list[int] = []
        self._records: list[Record] = []
        self._previous: list[Record] = []
        self._finding: OverflowFinding | None = None
        self._found = False
        self._removed = False
        self._reported = False
        self._peaks: dict[tuple[int, int], float] = {}
        self._out_bad: set[tuple[int, int]] = set()
        self._fallback: tuple[Record, float] | None = None
        self._handles: list[Any] = []
        self._last: tuple[weakref.ref[torch.Tensor], int, torch.Tensor | None] | None = None
        self._entered = False
        self._install()

    # ---------------------------------------------------------------- hooks
    def _install(self) -> None:
        for index, (name, module) in enumerate(self.model.named_modules()):
            self._names.append(name)
            self._types.append(type(module).__name__)
            self._calls.append(0)
            if index == 0:  # the model's own inputs, as the caller passed them (before any input cast)
                self._handles.append(module.register_forward_pre_hook(Site(self, 0).inputs, with_kwargs=True,
                                                                      prepend=True))
            if self.backward or index == 0:
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(index)))
            if self.backward:
                for p in module.parameters(recurse=False):
                    if p.requires_grad:
                        self._handles.append(p.register_hook(self._grad_hook(index, BWD_PARAM, 0)))
            self._handles.append(module.register_forward_hook(self._post_hook(index)))

    @property
    def _idle(self) -> bool:
        return self._found or self._removed

    def _measure(self, t: torch.Tensor) -> torch.Tensor | None:
        # A container returns its last child's output, and neighbouring modules see the
        # same gradient: measure each tensor once (unless it was modified in place since).
        last = self._last
        if last is not None and last[0]() is t and last[1] == t._version:
            return last[2]
        amax = tensor_amax(t)
        self._last = (weakref.ref(t), t._version, amax)
        return amax

    def _record(self, module: int, code: int, call: int, t: torch.Tensor) -> None:
        amax = self._measure(t)
        if amax is None:
            return
        self._records.append((module, code, call, t.dtype, amax))
        if len(self._records) >= self.max_records:
            self._resolve()

    def _pre_hook(self, index: int) -> Any:
        return Site(self, index).pre

    def _post_hook(self, index: int) -> Any:
        return Site(self, index).post

    def _grad_hook(self, index: int, code: int, call: int) -> Any:
        # A tensor hook: torch copies and pickles no tensor hooks, so a closure is fine here.
        def hook(grad: torch.Tensor) -> None:
            if self._idle or grad is None or not grad.is_floating_point():
                return
            self._record(index, code, call, grad)

        return hook

    # ------------------------------------------------------------ resolving
    def _resolve(self) -> None:
        """Read the pending records back (one sync) and keep the first overflow found."""
        records, self._records = self._records, []
        self._last = None
        if self._found or not records:
            return
        values = read_records(records)
        culprit = self._scan(records, values)
        if culprit is not None:
            self._finding = self._make_finding(records[culprit], values[culprit])
            self._found = True

    def _scan(self, records: list[Record], values: list[float]) -> int | None:
        """Position of the first culprit record; remembers peaks and fallbacks on the way."""
        for pos, (module, code, call, _, _) in enumerate(records):
            value = values[pos]
            if code == FWD_IN:  # the model's input: its largest element NaN or +inf (-inf: a mask)
                if math.isnan(value) or value == math.inf:
                    return pos
                continue
            if math.isfinite(value):
                key = (module, 0 if code == FWD_OUT else 1)
                if value > self._peaks.get(key, -1.0):
                    self._peaks[key] = value
                continue
            if code == FWD_OUT:
                return pos
            if code == BWD_OUT:
                self._out_bad.add((module, call))
            elif code == BWD_PARAM:
                # Parameter gradients are per module: produced here unless an output
                # gradient of this module was already non-finite.
                if not any(m == module for m, _ in self._out_bad):
                    return pos
            elif (module, call) not in self._out_bad:
                return pos
            if self._fallback is None:
                self._fallback = (records[pos], value)
        return None

    def _make_finding(self, record: Record, value: float) -> OverflowFinding:
        module, code, call, dtype, _ = record
        direction: Direction = "forward" if code in (FWD_OUT, FWD_IN) else "backward"
        return OverflowFinding(
            module=self._names[module],
            module_type=self._types[module],
            direction=direction,
            what=WHAT[code],
            step=self.step,
            call=call,
            dtype=dtype,
            kind="nan" if math.isnan(value) else "inf",
            max_abs=None if code == FWD_IN else self._peaks.get((module, 0 if code == FWD_OUT else 1)),
        )

    # --------------------------------------------------------------- public
    def first_overflow(self) -> OverflowFinding | None:
        """The first non-finite activation or gradient since the last :meth:`reset`, or None.

        Synchronises once (reads the pending records back); the answer is kept until
        :meth:`reset`, so asking again is free. When no module produced the non-finite
        value (the loss itself, or code between modules), the first module that saw
        it is named, with ``what="gradient of its output"``.
        """
        if not self._found:
            if self._previous:  # the previous step's peaks, so max_abs covers it too
                previous, self._previous = self._previous, []
                values = read_records(previous)
                for pos, (module, code, _, _, _) in enumerate(previous):
                    if code != FWD_IN and math.isfinite(values[pos]):
                        key = (module, 0 if code == FWD_OUT else 1)
                        self._peaks[key] = max(self._peaks.get(key, -1.0), values[pos])
            self._resolve()
        if not self._found and self._fallback is not None:
            record, value = self._fallback
            self._finding = self._make_finding(record, value)
            self._found = True
        self._reported = self._finding is not None
        return self._finding

    def reset(self) -> None:
        """Start a new step: forget the records and any finding; ``step`` advances by one."""
        self._previous = [] if self._found else self._records
        self._records = []
        self._last = None
        self._finding = None
        self._found = False
        self._peaks = {}
        self._out_bad = set()
        self._fallback = None
        self._reported = False
        self._calls = [0] * len(self._calls)
        self.step += 1

    def remove(self) -> None:
        """Remove every hook from the model. What was recorded can still be resolved."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._removed = True

    @property
    def active(self) -> bool:
        """True while the tracer's hooks are installed."""
        return not self._removed

    def __enter__(self) -> OverflowTracer:
        if self._entered:
            raise RuntimeError("this OverflowTracer is already in use as a context manager; create another one")
        if self._removed:
            raise RuntimeError("this OverflowTracer was removed; create a new one to trace again")
        self._entered = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._entered = False
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"OverflowTracer({type(self.model).__name__}, {len(self._names)} modules, step {self.step}, {state})"


class _TraceContext:
    def __init__(self, tracer: OverflowTracer) -> None:
        self.tracer = tracer

    def __enter__(self) -> OverflowTracer:
        return self.tracer.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.tracer.__exit__(*exc)


def trace_overflow(model: nn.Module, *, backward: bool = True) -> _TraceContext:
    """Trace ``model`` for overflows inside a ``with`` block; yields the :class:`OverflowTracer`.

    The hooks are removed when the block ends; the tracer's :meth:`~OverflowTracer.first_overflow`
    keeps working on what was recorded.
    """
    return _TraceContext(OverflowTracer(model, backward=backward))

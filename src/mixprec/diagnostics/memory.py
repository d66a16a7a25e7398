"""Training memory by tensor class, estimated and measured, for a model under each plan.

Tensor classes (:data:`MEMORY_CLASSES`):

- ``weights``, ``buffers``: the model's parameters and buffers, in the plan's dtypes;
- ``grads``: the model's ``.grad`` tensors held until the optimizer step (the
  master-weight plans keep them in the model's low-precision ``.grad`` too);
- ``master_weights``: fp32 copies kept by the optimizer (master-weight plans);
- ``grad_accumulation``: fp32 gradient buffers of the masters that outlive a step (none:
  master-weight plans gather the fp32 gradients at step time and free them after it,
  so they count among the step's temporaries);
- ``optimizer_state``: moments etc. (AdamW: two per parameter plus a step counter);
- ``compensation``: Kahan compensation buffers (``bf16-kahan``);
- ``activations``: what one forward keeps alive for backward (saved tensors, the
  autocast copies of the weights, the output and the loss).

:func:`estimate_memory` computes them without running the model: the model is
copied with *fake* tensors (shapes and dtypes only, no storage), prepared by the
plan through :class:`~mixprec.MixedPrecision` (so the dtypes are the plan's own),
the optimizer is wrapped the same way, and one forward is traced to collect the
tensors autograd saves, then a fake backward is traced too. The peak of a step is
then modelled as the persistent state plus the largest of (activations + the first
gradients of backward), the traced backward's own peak, and (gradients + the
optimizer step's temporaries: the low-precision optimizers' bounded fp32 scratch and
fp16 snapshot, the master plans' fp32 gradients).

:func:`measure_memory` runs real training steps through
:class:`~mixprec.MixedPrecision` and accounts every live tensor storage: the
persistent state present at the start of the measured step, plus every storage
created during it (a ``TorchDispatchMode`` sees each op's outputs; a finaliser on the
storage notices when it is freed). It works on any device, including CPUs, which
have no allocator high-water mark. :func:`memory_report` puts both side by side.

>>> import torch
>>> from mixprec.diagnostics import estimate_memory
>>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256))
>>> est = estimate_memory(model, "bf16-master", optimizer="adamw")
>>> est.bytes["master_weights"] == 256 * 256 * 4 + 256 * 4  # the Linear's masters; the LayerNorm stays fp32
True
>>> {k: round(v, 2) for k, v in est.per_param().items() if v}
{'weights': 2.02, 'grads': 2.02, 'master_weights': 3.97, 'optimizer_state': 8.0, 'total': 16.0}
"""

from __future__ import annotations

import contextlib
import copy
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics._tensors import format_table, human_bytes
from mixprec.dtypes import LOW_PRECISION_DTYPES
from mixprec.plans import Plan, get_plan

__all__ = [
    "MEMORY_CLASSES",
    "MemoryEstimate",
    "MemoryReport",
    "estimate_memory",
    "measure_memory",
    "memory_report",
    "training_state_bytes_per_param",
]

MEMORY_CLASSES: tuple[str, ...] = (
    "weights",
    "buffers",
    "grads",
    "master_weights",
    "grad_accumulation",
    "optimizer_state",
    "compensation",
    "activations",
)
_STATE_CLASSES = MEMORY_CLASSES[:-1]

OptimizerSpec = str | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

_OPTIMIZERS: dict[str, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}


def _optimizer_factory(optimizer: OptimizerSpec) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    if callable(optimizer):
        return optimizer
    if isinstance(optimizer, str):
        key = optimizer.strip().lower().replace("_", "-")
        if key in _OPTIMIZERS:
            return _OPTIMIZERS[key]
    raise ValueError(
        f"unknown optimizer {optimizer!r}; expected one of {', '.join(repr(k) for k in _OPTIMIZERS)} "
        "or a callable params -> torch.optim.Optimizer"
    )


# ---------------------------------------------------------------- result types
@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes by tensor class for one training step of a model under a plan.

    Attributes:
        plan: the plan's name.
        method: ``"estimated"`` or ``"measured"``.
        bytes: bytes per class (keys: :data:`MEMORY_CLASSES`).
        peak: peak bytes during one step (forward, backward, optimizer step).
        params: number of model parameters.
        notes: caveats (e.g. no batch given, so no activations).
    """

    plan: str
    method: str
    bytes: dict[str, int]
    peak: int
    params: int
    notes: tuple[str, ...] = ()

    @property
    def persistent(self) -> int:
        """Bytes that live across steps: weights, buffers, masters, optimizer state, compensation."""
        return sum(self.bytes[k] for k in ("weights", "buffers", "master_weights", "optimizer_state", "compensation"))

    @property
    def total(self) -> int:
        """Sum of all classes (an upper bound of what coexists; :attr:`peak` is what does)."""
        return sum(self.bytes.values())

    def per_param(self) -> dict[str, float]:
        """Bytes per model parameter by class (activations excluded), with ``total``."""
        n = max(self.params, 1)
        out = {k: self.bytes[k] / n for k in _STATE_CLASSES}
        out["total"] = sum(out.values())
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan,
            "method": self.method,
            **{k: self.bytes[k] for k in MEMORY_CLASSES},
            "peak": self.peak,
            "params": self.params,
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        rows = [[k, human_bytes(self.bytes[k]), f"{self.bytes[k] / max(self.params, 1):.2f}"] for k in MEMORY_CLASSES]
        rows.append(["peak", human_bytes(self.peak), f"{self.peak / max(self.params, 1):.2f}"])
        title = f"{self.method} memory of plan {self.plan} ({self.params:,} parameters)"
        notes = "".join(f"\nnote: {n}" for n in self.notes)
        return title + "\n" + format_table(["class", "bytes", "bytes/param"], rows) + notes


@dataclass(frozen=True)
class MemoryReport:
    """Estimated and measured memory side by side, one pair per plan; ``str()`` is a table."""

    estimates: dict[str, MemoryEstimate] = field(default_factory=dict)
    measurements: dict[str, MemoryEstimate] = field(default_factory=dict)

    def ratio(self, plan: str, key: str = "peak") -> float:
        """Estimated over measured for ``key`` (a class or ``"peak"``) of ``plan``."""
        est, meas = self.estimates[plan], self.measurements[plan]
        e = est.peak if key == "peak" else est.bytes[key]
        m = meas.peak if key == "peak" else meas.bytes[key]
        if m == 0:
            return 1.0 if e == 0 else math.inf
        return e / m

    def to_dict(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for plan, est in self.estimates.items():
            out[plan] = {"estimated": est.to_dict()}
            if plan in self.measurements:
                out[plan]["measured"] = self.measurements[plan].to_dict()
        return out

    def __str__(self) -> str:
        plans = list(self.estimates)
        header = ["class"]
        for p in plans:
            header += [f"{p} est", f"{p} meas"] if p in self.measurements else [f"{p} est"]
        rows = []
        for key in (*MEMORY_CLASSES, "peak"):
            row = [key]
            for p in plans:
                est = self.estimates[p]
                row.append(human_bytes(est.peak if key == "peak" else est.bytes[key]))
                if p in self.measurements:
                    meas = self.measurements[p]
                    row.append(human_bytes(meas.peak if key == "peak" else meas.bytes[key]))
            rows.append(row)
        return format_table(header, rows)


# ------------------------------------------------------ persistent state by class
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _unique(tensors: Iterable[torch.Tensor | None]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        out.append(t)
    return out


def _state_tensors_per_param(inner: torch.optim.Optimizer, group: dict[str, Any]) -> tuple[int, int]:
    """(param-shaped state tensors, scalar step-counter bytes) the optimizer will create."""
    name = type(inner).__name__
    if name in ("Adam", "AdamW", "NAdam", "RAdam", "Adamax"):
        return (3 if group.get("amsgrad") else 2), 4
    if name == "SGD":
        return (1 if group.get("momentum", 0) else 0), 0
    if name in ("RMSprop",):
        return 1 + (1 if group.get("momentum", 0) else 0) + (1 if group.get("centered") else 0), 4
    if name in ("Adagrad", "Adadelta"):
        return (1 if name == "Adagrad" else 2), 4
    return 0, 0


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Persistent bytes by class of a prepared model and its (wrapped) optimizer.

    Gradients are counted as the step holds them (whether or not ``.grad`` is set now);
    optimizer state is counted where it exists, and predicted (from the optimizer's
    type and the plan's state dtype) where it is not created yet.
    """
    from mixprec.optim import (
        KahanOptimizer,
        LowPrecisionOptimizer,
        MasterWeightOptimizer,
        WrappedOptimizer,
    )

    out = dict.fromkeys(_STATE_CLASSES, 0)
    params = _unique(model.parameters())
    model_ids = {id(p) for p in params}
    out["weights"] = sum(_nbytes(p) for p in params)
    out["buffers"] = sum(_nbytes(b) for b in _unique(model.buffers()))

    masters: dict[int, torch.Tensor] = {}
    if isinstance(optimizer, MasterWeightOptimizer):
        for p in params:
            m = optimizer.master_of(p)
            if m is not None and m is not p:
                masters[id(p)] = m
    for p in params:
        if p.requires_grad:  # the fp32 master gradients exist only during a step
            out["grads"] += _nbytes(p)
    out["master_weights"] = sum(_nbytes(m) for m in _unique(masters.values()))
    if optimizer is None:
        return out

    inner = optimizer.optimizer if isinstance(optimizer, WrappedOptimizer) else optimizer
    low_state = optimizer.state_dtype if isinstance(optimizer, LowPrecisionOptimizer) else None
    counted: set[int] = set()
    for group in inner.param_groups:
        n_state, step_bytes = _state_tensors_per_param(inner, group)
        for q in group["params"]:
            if id(q) in counted:
                continue
            counted.add(id(q))
            if id(q) not in model_ids and not any(m is q for m in masters.values()):
                out["master_weights"] += _nbytes(q)  # a parameter only the optimizer has
            state = inner.state.get(q)
            if state:
                out["optimizer_state"] += sum(
                    _nbytes(v) for v in _unique(v for v in state.values() if isinstance(v, torch.Tensor))
                )
                continue
            dtype = q.dtype
            if isinstance(optimizer, LowPrecisionOptimizer) and q.dtype in LOW_PRECISION_DTYPES:
                dtype = low_state or torch.float32
            size = torch.empty((), dtype=dtype).element_size()
            out["optimizer_state"] += n_state * q.numel() * size + (step_bytes if n_state else 0)
    if isinstance(optimizer, KahanOptimizer):
        comp = getattr(optimizer, "_comp", {})
        for p in params:
            if p.dtype in LOW_PRECISION_DTYPES:
                c = comp.get(p)
                out["compensation"] += _nbytes(c) if c is not None else _nbytes(p)
    return out


def training_state_bytes_per_param(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, float]:
    """Persistent training-state bytes per model parameter, by class, for a prepared
    ``model`` and the (wrapped) ``optimizer`` :meth:`MixedPrecision.prepare` returned.

    Keys: ``weights``, ``buffers``, ``grads``, ``master_weights``, ``grad_accumulation``,
    ``optimizer_state``, ``compensation`` and ``total``. Gradients count as the step
    holds them; optimizer state not created yet is predicted from the optimizer's type.

    >>> import torch
    >>> from mixprec import MixedPrecision
    >>> from mixprec.diagnostics import training_state_bytes_per_param
    >>> model = torch.nn.Linear(64, 64, bias=False)
    >>> mp = MixedPrecision("fp32")
    >>> model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters()))
    >>> training_state_bytes_per_param(model, opt)["total"]  # 4 weight + 4 grad + 8 AdamW state
    16.0009765625
    """
    state = _state_bytes(model, optimizer)
    n = max(sum(p.numel() for p in _unique(model.parameters())), 1)
    out = {k: v / n for k, v in state.items()}
    out["total"] = sum(out.values())
    return out


# ------------------------------------------------------------------ estimating
def _fake_copy(model: nn.Module, mode: Any) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are fake (no storage)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(mode.from_tensor(p.detach()), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = mode.from_tensor(b)
    return copy.deepcopy(model, memo)


def _storage_key(t: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def _split(batch: Any, criterion: Any) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    from mixprec.diagnostics.compare import _split_batch

    return _split_batch(batch, criterion)


def _to_fake(value: Any, mode: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return mode.from_tensor(value)
    if isinstance(value, list | tuple):
        return type(value)(_to_fake(v, mode) for v in value)
    if isinstance(value, dict):
        return {k: _to_fake(v, mode) for k, v in value.items()}
    return value


def _flat_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _flat_tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flat_tensors(v)


def _traced_activations(
    model: nn.Module,
    run: Callable[[], torch.Tensor],
    persistent: Iterable[torch.Tensor],
) -> tuple[int, int]:
    """Bytes of the distinct storages one forward keeps for backward (plus the loss and
    what it saved), excluding ``persistent`` tensors (the state and the batch itself);
    and the largest of them."""
    exclude = {_storage_key(t) for t in persistent}
    saved: dict[Any, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in exclude:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    key = _storage_key(loss)
    if key not in exclude:
        saved[key] = loss.untyped_storage().nbytes()
    return sum(saved.values()), max(saved.values(), default=0)


def _traced_backward_peak(model: nn.Module, run: Callable[[], torch.Tensor], persistent: Iterable[torch.Tensor]) -> int:
    """The largest sum of bytes alive during one (fake) forward and backward, besides ``persistent``:
    activations, gradients as backward makes them, and every temporary of both passes."""
    live = _LiveStorages()
    for t in persistent:
        live.add(t, dynamic=False)
    base = live.live
    live.peak = base
    with live.tracking():
        loss = run()
        loss.backward()
        del loss
    for p in model.parameters():
        p.grad = None
    return live.peak - base


def _persistent_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = [*model.parameters(), *model.buffers()]
    if optimizer is not None:
        for group in optimizer.param_groups:
            tensors.extend(group["params"])
    return tensors


def _update_temporaries(inner: torch.optim.Optimizer, group: dict[str, Any]) -> tuple[int, int]:
    """(temporaries of the largest parameter, temporaries per parameter of the group) an
    update allocates, in fp32-parameter units: Adam-style single-tensor updates build
    ``sqrt(v) / c`` (two temporaries of one parameter at a time); foreach updates build
    one for every parameter at once; fused updates and SGD update in place."""
    if type(inner).__name__ not in ("Adam", "AdamW", "NAdam", "RAdam", "Adamax") or group.get("fused"):
        return 0, 0
    foreach = group.get("foreach")
    if foreach is None:  # torch's default: foreach where every parameter is on a GPU
        foreach = all(q.device.type == "cuda" for q in group["params"])
    return (0, 1) if foreach else (2, 0)


def _step_transient(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Temporaries of one optimizer step: the update's own (see :func:`_update_temporaries`);
    in the low-precision wrappers, their bounded fp32 scratch and fp16 snapshot (see
    :func:`_low_precision_transient`); in the master-weight wrappers, the fp32 gradients
    gathered at step time and, for fp16, the snapshot of a guarded step."""
    from mixprec.optim import LowPrecisionOptimizer, MasterWeightOptimizer, WrappedOptimizer

    if optimizer is None:
        return 0
    inner = optimizer.optimizer if isinstance(optimizer, WrappedOptimizer) else optimizer
    if isinstance(optimizer, LowPrecisionOptimizer):
        return _low_precision_transient(optimizer, inner)
    largest = 0
    transient = 0
    for group in inner.param_groups:
        of_largest, per_param = _update_temporaries(inner, group)
        for q in group["params"]:
            largest = max(largest, of_largest * q.numel() * 4)
            transient += per_param * q.numel() * 4
    if isinstance(optimizer, MasterWeightOptimizer):
        # The fp32 gradients gathered at step time; a guarded (fp16) step also copies every
        # parameter and state tensor of the optimizer so it can undo the update.
        transient += sum(_nbytes(m) for m in optimizer.masters)
        if optimizer.guard_nonfinite:
            for group in inner.param_groups:
                n_state, _ = _state_tensors_per_param(inner, group)
                transient += sum(q.numel() * 4 * (1 + n_state) for q in group["params"])
    return largest + transient


def _low_precision_transient(optimizer: Any, inner: torch.optim.Optimizer) -> int:
    """Peak temporaries of a :class:`~mixprec.optim.LowPrecisionOptimizer` step, as its step runs them.

    - fp32 parameters (norm layers) are stepped by the inner optimizer as usual;
    - low-precision ones on the fast path (:func:`mixprec.optim.fast.fast_step`) are
      expanded chunk by chunk (at most ``chunk_numel`` elements, or one larger
      parameter): fp32 values and gradients, fp32 copies of low-precision state, the
      foreach path's denominator, stochastic rounding's noise. Round-to-nearest stores
      with everything in the parameters' dtype run torch's fused kernel in place (no
      scratch); the compiled route materialises nothing in fp32;
    - on the generic path, one parameter at a time on reused fp32 scratch;
    - with fp16 parameters, the step first snapshots every parameter and state tensor
      (kept for the whole step, so a non-finite update can be undone).
    """
    from mixprec.optim import StochasticRoundingOptimizer
    from mixprec.optim.fast import chunks, fast_kind, fused_available

    low_dtypes = LOW_PRECISION_DTYPES
    state_dtype = optimizer.state_dtype or torch.float32
    state_low = state_dtype != torch.float32
    guarded = False
    snapshot = 0
    fp32_largest = fp32_all = 0
    scratch = 0
    for group in inner.param_groups:
        n_state, step_bytes = _state_tensors_per_param(inner, group)
        of_largest, per_param = _update_temporaries(inner, group)
        params = group["params"]
        for q in params:
            size = state_dtype.itemsize if q.dtype in low_dtypes else q.dtype.itemsize
            snapshot += _nbytes(q) + n_state * q.numel() * size + (step_bytes if n_state else 0)
            guarded = guarded or q.dtype == torch.float16
            if q.dtype not in low_dtypes:
                fp32_largest = max(fp32_largest, of_largest * q.numel() * 4)
                fp32_all += per_param * q.numel() * 4
        low = [q for q in params if q.dtype in low_dtypes and q.requires_grad]
        if not low:
            continue
        kind = fast_kind(inner, group) if optimizer.fast else None
        n_low_state = n_state if state_low else 0
        if kind == "adam" and optimizer.compile:
            continue
        if kind is not None:
            fused = kind == "adam" and optimizer.fused and fused_available(low[0].device)
            for chunk in chunks(low, lambda q: (q.device, q.dtype), optimizer.chunk_numel):
                n = sum(q.numel() for q in chunk)
                if fused and optimizer._PLAIN_STORE and state_dtype == chunk[0].dtype:
                    continue  # torch's fused kernel on the low-precision tensors, in place
                per_element = 8 + 4 * n_low_state  # values, gradients, low-precision state
                if kind == "adam" and not fused:
                    per_element += 4  # the denominator
                if isinstance(optimizer, StochasticRoundingOptimizer):
                    per_element += 4  # int32 noise
                scratch = max(scratch, n * per_element)
        else:
            largest = max(q.numel() for q in low)
            scratch = max(scratch, largest * 4 * (2 + n_low_state + of_largest) + per_param * largest * 4)
    return (snapshot if guarded else 0) + max(scratch, fp32_largest + fp32_all)


def estimate_memory(
    model: nn.Module,
    plan: str | Plan,
    *,
    optimizer: OptimizerSpec = "adamw",
    batch: Any = None,
    criterion: Any = None,
) -> MemoryEstimate:
    """Estimate training memory of ``model`` under ``plan`` without running it.

    Args:
        model: the model as built (fp32 usually); it is not modified.
        plan: a plan name or :class:`~mixprec.Plan`.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"``, ``"sgd-momentum"``, or a callable
            ``params -> torch.optim.Optimizer``.
        batch: one batch, to estimate activations (``(inputs, targets)`` with a
            criterion, else the inputs, as for :func:`~mixprec.diagnostics.compare`).
            Without it, activations are 0 and the peak covers the training state only.
        criterion: the loss function (its saved tensors count as activations).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mixprec.session import MixedPrecision

    # A private copy: the fake model must leave nothing in the caller's plan (an fp8
    # recipe keeps scaling state that would then hold fake tensors).
    plan = copy.deepcopy(get_plan(plan))
    make_opt = _optimizer_factory(optimizer)
    notes: list[str] = []
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = _fake_copy(model, mode)
    activations = largest = backward_peak = 0
    mp = MixedPrecision(plan)  # outside the fake mode: the loss scaler reads its real scale
    with mode:
        opt = make_opt(fake.parameters())
        if criterion is not None:
            prepared, opt, crit = mp.prepare(fake, opt, criterion=criterion)
        else:
            (prepared, opt), crit = mp.prepare(fake, opt), None
        _islands_to_fp32(prepared)
        state = _state_bytes(prepared, opt)
        if batch is not None:
            args, kwargs, targets = _split(batch, criterion)
            args, kwargs, targets = _to_fake(args, mode), _to_fake(kwargs, mode), _to_fake(targets, mode)

            def run() -> torch.Tensor:
                with mp.autocast():
                    output = prepared(*args, **kwargs)
                if crit is None:
                    from mixprec.diagnostics.compare import _projection_loss

                    return _projection_loss(output)
                return crit(output, targets)

            inputs = [t for t in (args, kwargs, targets) for t in _flat_tensors(t)]
            activations, largest = _traced_activations(
                prepared, run, [*_persistent_tensors(prepared, opt), *inputs]
            )
            backward_peak = _traced_backward_peak(prepared, run, [*_persistent_tensors(prepared, opt), *inputs])
        else:
            notes.append("no batch given: activations not estimated")
        transient = _step_transient(prepared, opt)
    by_class = {**state, "activations": activations}
    persistent = sum(state[k] for k in ("weights", "buffers", "master_weights", "optimizer_state", "compensation"))
    grads = state["grads"] + state["grad_accumulation"]
    # Backward starts with every activation alive and makes gradients as large as the
    # activations (the largest one bounds what coexists); the step holds every gradient
    # and its temporaries once the activations are gone.
    # The traced (fake) backward covers what the rule misses: temporaries of custom
    # backward passes, such as fp8 layers widening their operands for an emulated GEMM.
    peak = persistent + max(activations + largest, backward_peak, grads + transient)
    n = sum(p.numel() for p in _unique(model.parameters()))
    return MemoryEstimate(plan.name, "estimated", by_class, int(peak), n, tuple(notes))


def _islands_to_fp32(model: nn.Module) -> None:
    from mixprec.diagnostics.compare import _fp32_islands

    _fp32_islands(model)


# ------------------------------------------------------------------ measuring
class _LiveStorages:
    """Counts the bytes of live tensor storages: registered ones plus every storage an
    op creates while the dispatch mode is active; freed ones are noticed by finalisers."""

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self.dynamic: set[int] = set()

    def _free(self, key: int) -> None:
        size = self.sizes.pop(key, 0)
        self.live -= size
        self.dynamic.discard(key)

    def add(self, t: torch.Tensor, *, dynamic: bool) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        size = storage.nbytes()
        old = self.sizes.get(key)
        if old is None:
            self.sizes[key] = size
            self.live += size
            if dynamic:
                self.dynamic.add(key)
            weakref.finalize(storage, self._free, key)
        elif size > old:  # resized in place
            self.sizes[key] = size
            self.live += size - old
        if self.live > self.peak:
            self.peak = self.live

    def dynamic_bytes(self) -> int:
        return sum(self.sizes[k] for k in self.dynamic if k in self.sizes)

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.device.type != "meta":
                        tracker.add(t, dynamic=True)
                return out

        with _Mode():
            yield


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    from mixprec.optim import KahanOptimizer, WrappedOptimizer

    inner = optimizer.optimizer if isinstance(optimizer, WrappedOptimizer) else optimizer
    for group in inner.param_groups:
        for q in group["params"]:
            yield q
            if q.grad is not None:
                yield q.grad
    for state in inner.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v
    if isinstance(optimizer, KahanOptimizer):
        yield from getattr(optimizer, "_comp", {}).values()


def _grad_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(_nbytes(t.grad) for t in _unique(tensors) if t.grad is not None)


def measure_memory(
    model_factory: Callable[[], nn.Module],
    plan: str | Plan,
    batch_fn: Callable[[], Any],
    *,
    optimizer: OptimizerSpec = "adamw",
    criterion: Any = None,
    warmup_steps: int = 1,
) -> MemoryEstimate:
    """Measure the memory of one training step through :class:`~mixprec.MixedPrecision`.

    Args:
        model_factory: builds a fresh model (as for :func:`estimate_memory`).
        plan: a plan name or :class:`~mixprec.Plan`.
        batch_fn: returns one batch (``(inputs, targets)`` with a criterion, else the inputs).
        optimizer: as for :func:`estimate_memory`.
        criterion: the loss function (without one, a fixed projection of the outputs).
        warmup_steps: steps run before the measured one (optimizers create their state
            on the first step).

    Storages are accounted live (see the module docs): ``peak`` is the largest sum of
    live bytes during the measured step; ``activations`` is what the forward left
    alive when it ended; gradients are read when backward ended; the persistent classes
    after the step.
    """
    from mixprec.session import MixedPrecision

    plan = get_plan(plan)
    make_opt = _optimizer_factory(optimizer)
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    model = model_factory()
    opt = make_opt(model.parameters())
    mp = MixedPrecision(plan)
    if criterion is not None:
        model, opt, crit = mp.prepare(model, opt, criterion=criterion)
    else:
        (model, opt), crit = mp.prepare(model, opt), None

    def loss_of(batch: Any) -> torch.Tensor:
        args, kwargs, targets = _split(batch, criterion)
        with mp.autocast():
            output = model(*args, **kwargs)
        if crit is None:
            from mixprec.diagnostics.compare import _projection_loss

            return _projection_loss(output)
        return crit(output, targets)

    for _ in range(warmup_steps):
        mp.backward(loss_of(batch_fn()))
        mp.step()

    batch = batch_fn()
    live = _LiveStorages()
    for t in [*model.parameters(), *model.buffers(), *_optimizer_tensors(opt)]:
        live.add(t, dynamic=False)
    for p in model.parameters():
        if p.grad is not None:
            live.add(p.grad, dynamic=False)
    live.peak = live.live
    with live.tracking():
        loss = loss_of(batch)
        activations = live.dynamic_bytes()
        mp.backward(loss)
        grads = _grad_bytes(model.parameters())
        model_ids = {id(p) for p in model.parameters()}
        masters = [q for g in opt.param_groups for q in g["params"] if id(q) not in model_ids]
        grad_accumulation = _grad_bytes(masters)
        mp.step()
    del loss
    state = _state_bytes(model, opt)
    by_class = {**state, "grads": grads, "grad_accumulation": grad_accumulation, "activations": activations}
    n = sum(p.numel() for p in _unique(model.parameters()))
    return MemoryEstimate(plan.name, "measured", by_class, int(live.peak), n)


def memory_report(
    model_factory: Callable[[], nn.Module],
    plans: Sequence[str | Plan] = ("fp32", "bf16-mixed", "bf16-master"),
    batch_fn: Callable[[], Any] | None = None,
    *,
    optimizer: OptimizerSpec = "adamw",
    criterion: Any = None,
    measure: bool = True,
) -> MemoryReport:
    """Estimated (and, with ``measure=True`` and a ``batch_fn``, measured) memory of
    ``model_factory()`` under each plan, side by side.

    >>> import torch
    >>> from mixprec.diagnostics import memory_report
    >>> report = memory_report(lambda: torch.nn.Linear(32, 32), ("fp32", "bf16-master"),
    ...                        lambda: torch.randn(8, 32))
    >>> print(str(report).splitlines()[0])
    class               fp32 est  fp32 meas  bf16-master est  bf16-master meas
    """
    estimates: dict[str, MemoryEstimate] = {}
    measurements: dict[str, MemoryEstimate] = {}
    model = model_factory()
    batch = batch_fn() if batch_fn is not None else None
    for p in plans:
        plan = get_plan(p)
        estimates[plan.name] = estimate_memory(model, plan, optimizer=optimizer, batch=batch, criterion=criterion)
        if measure and batch_fn is not None:
            measurements[plan.name] = measure_memory(
                model_factory, plan, batch_fn, optimizer=optimizer, criterion=criterion
            )
    return MemoryReport(estimates, measurements)

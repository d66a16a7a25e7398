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
import copy
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics._tensors import (
    display_name,
    floating_tensors,
    format_number,
    format_table,
    map_floating,
)
from mixprec.plans import Plan, get_plan

__all__ = ["ComparisonReport", "ModuleError", "ParamError", "compare", "prepare_copy", "run_loss"]


# ------------------------------------------------------------------ error algebra
class _Err:
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


def _rel(err: _Err | None) -> float | None:
    """Relative error, or None when nothing was measured."""
    return None if err is None or err.empty else err.rel


def _sqnr(err: _Err | None) -> float | None:
    return None if err is None or err.empty else err.sqnr


def _nan_low(x: float) -> float:
    return -math.inf if math.isnan(x) else x


# ------------------------------------------------------------ preparing and running
@dataclass
class PreparedCopy:
    """A deep copy of a model prepared by a plan, with the context its forward runs in."""

    model: nn.Module
    plan: Plan
    device_type: str
    criterion: Any
    initial_scale: float

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return self.plan.autocast(self.device_type)


def _device_type(model: nn.Module) -> str:
    for t in (*model.parameters(), *model.buffers()):
        return t.device.type
    return "cpu"


def prepare_copy(model: nn.Module, plan: str | Plan, criterion: Any = None) -> PreparedCopy:
    """A deep copy of ``model`` prepared by ``plan`` through :class:`~mixprec.MixedPrecision`
    (islands, conversion, input casting), without an optimizer."""
    from mixprec.session import MixedPrecision

    plan = get_plan(plan)
    mp = MixedPrecision(plan)
    shadow = copy.deepcopy(model)
    if criterion is not None:
        shadow, wrapped = mp.prepare(shadow, criterion=criterion)
    else:
        shadow, wrapped = mp.prepare(shadow), None
    _fp32_islands(shadow)
    scale = float(mp.scaler.get_scale()) if mp.scaler.is_enabled() else 1.0
    return PreparedCopy(shadow, plan, mp.device_type, wrapped, scale)


def _fp32_islands(model: nn.Module) -> None:
    """Keep fp32 islands in fp32 after a plan cast the whole model down."""
    from mixprec.islands import is_fp32_island

    for module in model.modules():
        if is_fp32_island(module):
            for t in [*module.parameters(), *module.buffers()]:
                if t.is_floating_point() and t.dtype in (torch.float16, torch.bfloat16):
                    t.data = t.data.to(torch.float32)


def _split_batch(batch: Any, criterion: Any) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    if criterion is not None:
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            raise ValueError(
                "with a criterion, batch must be (inputs, targets); got "
                f"{type(batch).__name__}{f' of length {len(batch)}' if isinstance(batch, tuple | list) else ''}"
            )
        inputs, targets = batch
    else:
        inputs, targets = batch, None
    if isinstance(inputs, dict):
        return (), dict(inputs), targets
    if isinstance(inputs, tuple):
        return inputs, {}, targets
    return (inputs,), {}, targets


def _projection_loss(output: Any) -> torch.Tensor:
    """A fixed random projection of the outputs: the same gradient direction for every run."""
    total: torch.Tensor | None = None
    generator = torch.Generator().manual_seed(0)
    for t in floating_tensors(output):
        probe = torch.randn(t.shape, generator=generator).to(t.device) / max(t.numel(), 1) ** 0.5
        term = (t.float() * probe).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("the model returned no floating-point tensor; pass a criterion to compute a loss")
    return total


def run_loss(prepared: PreparedCopy, batch: Any, criterion: Any = None) -> torch.Tensor:
    """Forward ``batch`` through a prepared copy under its plan and return the fp32 loss."""
    args, kwargs, targets = _split_batch(batch, criterion)
    with prepared.autocast():
        output = prepared.model(*args, **kwargs)
    if criterion is None:
        return _projection_loss(output)
    crit = prepared.criterion if prepared.criterion is not None else criterion
    return crit(output, targets).float()


# ------------------------------------------------------------------ capturing
@dataclass
class _Call:
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    in_dtypes: list[torch.dtype] = field(default_factory=list)
    in_grad: list[bool] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    out_grads: dict[int, torch.Tensor] = field(default_factory=dict)


class _Capture:
    """Hooks every module and keeps its inputs, outputs and output gradients per call."""

    def __init__(self, model: nn.Module, *, inputs: bool, grads: bool) -> None:
        self.calls: dict[str, list[_Call]] = {}
        self._stack: dict[str, list[_Call]] = {}
        self._handles: list[Any] = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._pre(name, inputs), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(name, grads)))

    def _pre(self, name: str, keep_inputs: bool) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            call = _Call()
            floats = list(floating_tensors((args, kwargs)))
            call.in_dtypes = [t.dtype for t in floats]
            call.in_grad = [t.requires_grad for t in floats]
            if keep_inputs:
                clone: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.detach().clone()  # noqa: E731
                call.args = map_floating(args, clone)
                call.kwargs = map_floating(kwargs, clone)
            self.calls.setdefault(name, []).append(call)
            self._stack.setdefault(name, []).append(call)

        return hook

    def _post(self, name: str, keep_grads: bool) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            stack = self._stack.get(name)
            if not stack:
                return
            call = stack.pop()
            for i, t in enumerate(floating_tensors(output)):
                call.outputs.append(t.detach().clone())
                if keep_grads and t.requires_grad:
                    t.register_hook(_grad_saver(call, i))

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _grad_saver(call: _Call, index: int) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        call.out_grads[index] = grad.detach().clone()

    return hook


@contextlib.contextmanager
def _seeded(seed: int, cuda_devices: Sequence[int] = ()) -> Iterator[None]:
    """Both precisions draw the same random numbers (dropout masks) on CPU and the model's GPUs."""
    with torch.random.fork_rng(devices=list(cuda_devices)):
        torch.manual_seed(seed)
        yield


# --------------------------------------------------------------- isolated runs
def _isolated(
    module: nn.Module,
    call: _Call,
    dtypes: list[torch.dtype] | None,
    context: Callable[[], contextlib.AbstractContextManager[Any]],
    grad_scale: float,
    seed: int,
    exact_children: dict[nn.Module, nn.Module] | None = None,
    *,
    upcast: bool = False,
    cuda_devices: Sequence[int] = (),
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]] | None:
    """Run ``module`` alone on the captured reference inputs, rounded to ``dtypes`` (the
    dtypes the plan's run gave it); return its floating outputs and the (unscaled)
    gradients of its differentiable inputs and parameters.

    ``upcast`` turns the rounded inputs back into their reference dtype: the fp32 module
    then computes exactly on the very values the plan's module received, so the
    comparison measures what the module's computation adds, not the rounding of its
    inputs (which the module that produced them is charged with).

    With ``exact_children`` (low child -> fp32 reference child), every call of a child
    is answered by the fp32 child on fp32 inputs with autocast off, so only the module's
    own code runs in the plan's precision.
    """
    leaves: list[torch.Tensor] = []
    counter = iter(range(1 << 30))

    def prepare(t: torch.Tensor) -> torch.Tensor:
        i = next(counter)
        dtype = dtypes[i] if dtypes is not None and i < len(dtypes) else t.dtype
        wants_grad = i < len(call.in_grad) and call.in_grad[i]
        source = t.detach().clone().requires_grad_(True) if wants_grad else t
        if wants_grad:
            leaves.append(source)
        rounded = source.to(dtype, copy=True)
        return rounded.to(t.dtype) if upcast else rounded

    # Own parameters first, so the gradients of a run with exact children (own
    # parameters only) line up with a prefix of a full run's.
    own = [p for p in module.parameters(recurse=False) if p.requires_grad]
    seen = {id(p) for p in own}
    params = own if exact_children else own + [
        p for p in module.parameters() if p.requires_grad and id(p) not in seen
    ]
    try:
        with _seeded(seed, cuda_devices), _exact(exact_children or {}), context():
            args = map_floating(call.args, prepare)
            kwargs = map_floating(call.kwargs, prepare)
            output = module(*args, **kwargs)
    except (RuntimeError, TypeError, ValueError):
        return None
    outs = list(floating_tensors(output))
    pairs = [(o, call.out_grads[i]) for i, o in enumerate(outs) if i in call.out_grads and o.requires_grad]
    targets = leaves + params
    if not pairs or not targets:
        return [o.detach() for o in outs], []
    try:
        grads = torch.autograd.grad(
            [o for o, _ in pairs],
            targets,
            [(g.to(torch.float32) * grad_scale).to(o.dtype) for o, g in pairs],
            allow_unused=True,
        )
    except RuntimeError:
        return [o.detach() for o in outs], []
    return [o.detach() for o in outs], [None if g is None else g.to(torch.float32) / grad_scale for g in grads]


@contextlib.contextmanager
def _exact(children: dict[nn.Module, nn.Module]) -> Iterator[None]:
    """Make each low-precision child answer with its fp32 reference (fp32 inputs, autocast off)."""
    saved = {child: child.__dict__.get("forward") for child in children}
    try:
        for child, reference in children.items():
            child.forward = _fp32_forward(reference)  # type: ignore[method-assign]
        yield
    finally:
        for child, previous in saved.items():
            if previous is None:
                child.__dict__.pop("forward", None)
            else:
                child.forward = previous  # type: ignore[method-assign]


def _fp32_forward(reference: nn.Module) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        device_type = next((t.device.type for t in floating_tensors((args, kwargs))), "cpu")
        up: Callable[[torch.Tensor], torch.Tensor] = lambda t: t if t.dtype == torch.float64 else t.float()  # noqa: E731
        with torch.autocast(device_type, enabled=False):
            return reference(*map_floating(args, up), **map_floating(kwargs, up))

    return forward


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
    plan = get_plan(plan)
    gpus = sorted({t.device.index or 0 for t in (*model.parameters(), *model.buffers()) if t.device.type == "cuda"})
    reference = prepare_copy(model, "fp32", criterion)
    low = prepare_copy(model, plan, criterion)

    ref_cap = _Capture(reference.model, inputs=local, grads=local)
    try:
        with _seeded(seed, gpus):
            ref_loss, flops = _flops_by_module(reference.model, lambda: run_loss(reference, batch, criterion))
            ref_loss.backward()
    finally:
        ref_cap.remove()

    scale = low.initial_scale
    low_params = dict(low.model.named_parameters())
    while True:
        low_cap = _Capture(low.model, inputs=False, grads=False)
        try:
            low.model.zero_grad(set_to_none=True)
            with _seeded(seed, gpus):
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
    grad_total = _Err()
    if not torch.isfinite(low_loss):
        grad_total.finite = False  # no backward: the plan's step would be skipped
    params: dict[str, ParamError] = {}
    ref_params = dict(reference.model.named_parameters())
    per_module_grad: dict[str, _Err] = {}
    for name, rp in ref_params.items():
        lp = low_params.get(name)
        if lp is None:
            continue
        lg = None if lp.grad is None else lp.grad.to(torch.float64) / scale
        e = _Err()
        e.add(lg, rp.grad)
        grad_total.add(lg, rp.grad)
        params[name] = ParamError(name, lp.dtype, e.rel, e.sqnr)
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        per_module_grad.setdefault(owner, _Err()).add(lg, rp.grad)

    # ---------------------------------------------------------- modules
    ref_modules = dict(reference.model.named_modules())
    low_modules = dict(low.model.named_modules())
    names = [n for n in ref_modules if n in ref_cap.calls]
    children = _children_of(names)
    local_fwd: dict[str, _Err] = {}
    local_bwd: dict[str, _Err] = {}
    own_fwd: dict[str, _Err] = {}
    own_bwd: dict[str, _Err] = {}
    fwd: dict[str, _Err] = {}
    for name in names:
        ref_calls = ref_cap.calls[name]
        low_calls = low_cap.calls.get(name, [])
        e = _Err()
        for rc, lc in zip(ref_calls, low_calls, strict=False):
            for ro, lo in zip(rc.outputs, lc.outputs, strict=False):
                e.add(lo, ro)
        fwd[name] = e
        if not local or name not in low_modules:
            continue
        exact = {low_modules[c]: ref_modules[c] for c in children.get(name, []) if c in low_modules}
        lf, lb, of, ob = _Err(), _Err(), _Err(), _Err()
        for k, rc in enumerate(ref_calls):
            dtypes = low_calls[k].in_dtypes if k < len(low_calls) else None
            ref_run = _isolated(
                ref_modules[name], rc, dtypes, contextlib.nullcontext, 1.0, seed + k, upcast=True, cuda_devices=gpus
            )
            if ref_run is None:
                continue
            low_run = _isolated(low_modules[name], rc, dtypes, low.autocast, scale, seed + k, cuda_devices=gpus)
            own_run = (
                _isolated(low_modules[name], rc, dtypes, low.autocast, scale, seed + k, exact, cuda_devices=gpus)
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
            local_fwd_rel_err=_rel(lf_e),
            local_fwd_sqnr_db=_sqnr(lf_e),
            own_fwd_err=_rel(of_e),
            grad_rel_err=g.rel if g is not None else None,
            grad_sqnr_db=g.sqnr if g is not None else None,
            local_bwd_rel_err=_rel(lb_e),
            local_bwd_sqnr_db=_sqnr(lb_e),
            own_bwd_err=_rel(ob_e),
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

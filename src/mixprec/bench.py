"""Side-by-side training harness: the benchmark matrix and the demo runs.

Every variant trains its own copy of the same model (same initial weights, same
batches) with the same training step users write::

    with mp.autocast():
        loss = criterion(model(x), y)
    mp.backward(loss)
    mp.step()

next to ``fp32`` (the same loop under the "fp32" plan) and the plain
``torch.autocast`` loop (model fp32, ``torch.autocast("cpu", dtype=torch.bfloat16)``,
``loss.backward()``, ``opt.step()``, ``opt.zero_grad()``). Variants run in one process
and their steps are interleaved (A B C, C B A, A B C, ...), so a machine whose speed
drifts slows them all alike; step times are medians, and every comparison is a ratio
measured in the same run. Nothing here passes or fails on time.

Benchmarks are data: :class:`Row` ``(model, plan, batch)``; :func:`run_bench` runs a
list of rows, :func:`train_side_by_side` trains several plans for the demo.

>>> rows = plan_rows(["mlp"], ["bf16-mixed"])
>>> [(r.model, r.plan) for r in rows]
[('mlp', 'fp32'), ('mlp', 'torch-autocast'), ('mlp', 'bf16-mixed')]
"""

from __future__ import annotations

import math
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from mixprec.plans import PLANS, Plan, get_plan, resolve_plan_name
from mixprec.session import MixedPrecision

__all__ = [
    "FP32",
    "TORCH_AUTOCAST",
    "BenchResult",
    "DemoResult",
    "PlanHistory",
    "Row",
    "RowResult",
    "Runner",
    "TaskLike",
    "Workload",
    "builtin_workload",
    "default_plans",
    "estimate_peaks",
    "format_bytes",
    "is_fp16_plan",
    "max_batch_for",
    "measure_peak",
    "parse_bytes",
    "plan_label",
    "plan_rows",
    "run_bench",
    "train_side_by_side",
]

FP32 = "fp32"
TORCH_AUTOCAST = "torch-autocast"
"""Row name of the plain ``torch.autocast`` bf16 loop (not a mixprec plan)."""

_BF16_AUTOCAST_LABEL = "torch.autocast (bf16)"


# ---------------------------------------------------------------- workloads
class TaskLike(Protocol):
    """What the harness trains: :class:`mixprec.cli.models.Task` is one; so are adapted user models."""

    @property
    def model(self) -> nn.Module: ...

    @property
    def criterion(self) -> Callable[..., Tensor]: ...

    @property
    def default_batch_size(self) -> int: ...

    @property
    def eval_batch_size(self) -> int: ...

    @property
    def chance(self) -> float | None: ...

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[Any, Any]:
        """A training batch ``(inputs, targets)`` drawn with ``generator``."""
        ...

    def eval_batch(self, batch_size: int = 256) -> tuple[Any, Any]:
        """A fixed held-out batch."""
        ...

    def accuracy(self, outputs: Any, targets: Any) -> float | None:
        """Accuracy of ``outputs`` against ``targets`` (None where it has no meaning)."""
        ...


@dataclass(frozen=True)
class Workload:
    """A named recipe for a fresh task: ``make(seed)`` returns a new model with its data.

    Every variant calls ``make`` with the same seed, so all start from identical weights.
    """

    name: str
    make: Callable[[int], TaskLike]
    lr: float = 3e-3
    description: str = ""


def builtin_workload(name: str, size: str = "tiny") -> Workload:
    """A built-in task of :mod:`mixprec.cli.models` (``"gpt"``, ``"cnn"``, ``"vit"``, ``"mlp"``) at ``size``."""
    from mixprec.cli.models import SIZES, TASKS, build_task

    if name not in TASKS:
        raise ValueError(f"unknown model {name!r}; built-in models are {', '.join(TASKS)}, or pass module:factory")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {', '.join(SIZES)}")
    return Workload(
        name=f"{name}-{size}",
        make=lambda seed: build_task(name, size=size, seed=seed),
        lr=3e-3 if size == "tiny" else 1e-3,
        description=f"built-in {name} ({size})",
    )


# -------------------------------------------------------------------- plans
def is_fp16_plan(plan: str) -> bool:
    """True for plans that compute in fp16 (no fast path on most CPUs)."""
    if plan == TORCH_AUTOCAST:
        return False
    return get_plan(plan).compute_dtype == torch.float16


def default_plans(device_type: str = "cpu", *, include_fp16: bool = False) -> list[str]:
    """Every canonical plan; fp16 plans are left out on CPU unless ``include_fp16``."""
    skip_fp16 = device_type == "cpu" and not include_fp16
    return [p for p in PLANS if not (skip_fp16 and is_fp16_plan(p))]


def plan_label(plan: str) -> str:
    """How a row is named in tables."""
    return _BF16_AUTOCAST_LABEL if plan == TORCH_AUTOCAST else plan


@dataclass(frozen=True)
class Row:
    """One benchmark row: a model (workload name), a plan (or ``"torch-autocast"``), a batch size."""

    model: str
    plan: str
    batch: int | None = None


def plan_rows(
    models: Sequence[str], plans: Sequence[str], *, batch: int | None = None, baselines: bool = True
) -> list[Row]:
    """Rows for every model x plan, with the fp32 and plain torch.autocast baselines first."""
    names = [resolve_plan_name(p) if p != TORCH_AUTOCAST else p for p in plans]
    if baselines:
        names = [FP32, TORCH_AUTOCAST, *(p for p in names if p not in (FP32, TORCH_AUTOCAST))]
    names = list(dict.fromkeys(names))
    return [Row(model, plan, batch) for model in models for plan in names]


# ----------------------------------------------------------------- sizes
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"512 MiB"``, ``"1.5GB"``, ``"1000000"`` -> bytes.

    >>> parse_bytes("2GiB"), parse_bytes("1.5 GB")
    (2147483648, 1500000000)
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a memory size; write it like 2GiB, 512MiB or 1.5GB")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return int(value)


def format_bytes(n: float | None) -> str:
    """Bytes in binary units (``"1.50 GiB"``); ``"n/a"`` for None.

    >>> format_bytes(3 * 2**20), format_bytes(None)
    ('3.00 MiB', 'n/a')
    """
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# ------------------------------------------------------------------ memory
def measure_peak(workload: Workload, plan: str | Plan, batch: int, seed: int) -> int | None:
    """Peak bytes of one training step of ``workload`` under ``plan``, measured by
    :func:`mixprec.diagnostics.memory.measure_memory` (every live storage accounted, so it
    works on CPUs too). None for the plain torch.autocast loop, which it does not run."""
    if plan == TORCH_AUTOCAST:
        return None
    from mixprec.diagnostics.memory import measure_memory

    task = workload.make(seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return measure_memory(lambda: workload.make(seed).model, plan, lambda: task.batch(batch, generator),
                              criterion=task.criterion, warmup_steps=1).peak


def estimate_peaks(workload: Workload, plan: str, batches: Sequence[int], seed: int) -> list[int] | None:
    """Estimated peak bytes of a step at each batch size (:func:`mixprec.diagnostics.memory.estimate_memory`:
    fake tensors, nothing computed). None for the plain torch.autocast loop."""
    if plan == TORCH_AUTOCAST:
        return None
    from mixprec.diagnostics.memory import estimate_memory

    task = workload.make(seed)
    generator = torch.Generator().manual_seed(seed)
    return [
        estimate_memory(task.model, plan, batch=task.batch(b, generator), criterion=task.criterion).peak
        for b in batches
    ]


def max_batch_for(budget: int, batches: Sequence[int], peaks: Sequence[int]) -> tuple[int, float, float]:
    """The largest batch whose peak fits ``budget``, from a line through two (batch, peak) points.

    Returns (max batch, fixed bytes, bytes per sample); the max batch is 0 when not even
    the fixed part fits.

    >>> max_batch_for(1000, [2, 4], [300, 500])
    (9, 100.0, 100.0)
    """
    (b1, b2), (p1, p2) = batches, peaks
    per_sample = max((p2 - p1) / (b2 - b1), 1.0)
    fixed = p1 - per_sample * b1
    return max(math.floor((budget - fixed) / per_sample), 0), float(fixed), float(per_sample)


# ------------------------------------------------------------------ runner
@dataclass(frozen=True)
class StepOutcome:
    """What one training step of a :class:`Runner` did."""

    seconds: float
    loss: float
    skipped: bool
    scale: float


class Runner:
    """A fresh model and AdamW optimizer trained under one plan, or under the plain torch.autocast loop."""

    def __init__(self, plan: str | Plan, task: TaskLike, *, lr: float) -> None:
        """Prepare ``task.model`` for ``plan`` (a plan name, a :class:`Plan`, or :data:`TORCH_AUTOCAST`)."""
        self.plan = plan
        self.task = task
        first = next(iter(task.model.parameters()), None)
        if first is None:
            raise ValueError("the model has no parameters to train")
        self.device_type = first.device.type
        optimizer = torch.optim.AdamW(task.model.parameters(), lr=lr)
        self.mp: MixedPrecision | None = None
        self.model: nn.Module
        self.optimizer: torch.optim.Optimizer
        self.criterion: Callable[..., Tensor]
        if plan == TORCH_AUTOCAST:
            self.model, self.optimizer, self.criterion = task.model, optimizer, task.criterion
        else:
            self.mp = MixedPrecision(plan)
            self.model, self.optimizer, self.criterion = self.mp.prepare(
                task.model, optimizer, criterion=task.criterion
            )
        self.params = sum(p.numel() for p in {id(p): p for p in self.model.parameters()}.values())

    def _context(self) -> Any:
        if self.mp is None:
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return self.mp.autocast()

    def loss(self, inputs: Any, targets: Any) -> Tensor:
        """The loss of one forward pass, in the plan's autocast context (graph kept)."""
        with self._context():
            return self.criterion(self.model(inputs), targets)

    def step(self, inputs: Any, targets: Any) -> StepOutcome:
        """One timed training step: forward and loss, backward, optimizer step."""
        start = time.perf_counter()
        loss = self.loss(inputs, targets)
        if self.mp is None:
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            skipped, scale = False, 1.0
        else:
            self.mp.backward(loss)
            result = self.mp.step()
            skipped, scale = result.skipped, result.scale
        seconds = time.perf_counter() - start
        return StepOutcome(seconds=seconds, loss=float(loss.detach().float()), skipped=skipped, scale=scale)

    def state_bytes_per_param(self) -> dict[str, float]:
        """Training-state bytes per parameter by class (weights, buffers, grads, master weights,
        grad accumulation, optimizer state, compensation) and their ``total``, counted on the
        live model and optimizer by :func:`mixprec.diagnostics.memory.training_state_bytes_per_param`."""
        from mixprec.diagnostics.memory import training_state_bytes_per_param

        return training_state_bytes_per_param(self.model, self.optimizer)

    @torch.no_grad()
    def evaluate(self, inputs: Any, targets: Any) -> tuple[float, float | None]:
        """Held-out (loss, accuracy) in eval mode, under the plan's autocast."""
        self.model.eval()
        try:
            with self._context():
                outputs = self.model(inputs)
                loss = self.criterion(outputs, targets)
            return float(loss.float()), self.task.accuracy(outputs.float(), targets)
        finally:
            self.model.train()


def progress_bars_wanted(enabled: bool, stream: Any = None) -> bool:
    """Progress bars only on a terminal: piped to a file, a bar's redraws are a wall of
    carriage returns, so callers print one line per finished plan instead."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return enabled and callable(isatty) and bool(isatty())


def _progress_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _progress(total: int, desc: str, enabled: bool, position: int = 0) -> Any:
    if not progress_bars_wanted(enabled):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the cli extra is not installed: no bars
        return None
    return tqdm(total=total, desc=desc, position=position, leave=True, dynamic_ncols=True)


def _interleaved(indices: Sequence[int], repeat: int) -> Iterator[int]:
    """A B C on even repeats, C B A on odd ones: slow drift costs every variant alike."""
    return iter(indices if repeat % 2 == 0 else list(reversed(indices)))


def environment() -> dict[str, Any]:
    """Versions and machine facts that go into every report."""
    import mixprec

    return {
        "mixprec": mixprec.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": _cpu_name(),
        "cpu_capability": _cpu_capability(),
        "threads": torch.get_num_threads(),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_capability() -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


# ------------------------------------------------------------------- bench
@dataclass
class RowResult:
    """The measurements of one :class:`Row`.

    Memory: ``peak_memory_bytes`` is measured for one training step; ``estimated_peak_bytes``
    (at ``batch``) and ``peak_bytes_per_sample`` come from the estimate at two batch sizes
    that gives ``max_batch`` for the budget. All are None for the plain torch.autocast row,
    which the memory tools (built on :class:`~mixprec.MixedPrecision`) do not run.
    """

    model: str
    plan: str
    batch: int
    params: int
    step_time_s: float
    min_step_time_s: float
    times_s: list[float]
    final_loss: float
    skipped: int
    state_bytes_per_param: dict[str, float]
    speedup_vs_fp32: float | None = None
    speedup_vs_autocast: float | None = None
    state_ratio_vs_fp32: float | None = None
    peak_memory_bytes: int | None = None
    peak_ratio_vs_fp32: float | None = None
    estimated_peak_bytes: int | None = None
    peak_bytes_per_sample: float | None = None
    max_batch: int | None = None

    @property
    def label(self) -> str:
        return plan_label(self.plan)


@dataclass
class BenchResult:
    """Every row's measurements, the settings and the environment they were taken in."""

    rows: list[RowResult]
    settings: dict[str, Any]
    environment: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: ``{"format", "environment", "settings", "rows": [...]}``."""
        return {
            "format": "mixprec.bench/1",
            "environment": self.environment,
            "settings": self.settings,
            "rows": [{"label": r.label, **asdict(r)} for r in self.rows],
        }


def run_bench(
    rows: Sequence[Row],
    workloads: Mapping[str, Workload],
    *,
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
    memory_budget: int | None = None,
    progress: bool = False,
    device: str = "cpu",
) -> BenchResult:
    """Run ``rows``: for each (model, batch), every plan side by side with interleaved timed steps.

    ``repeats`` timed steps per row after ``warmup`` untimed ones (at least one: the
    first step also records training-state bytes); all rows of a model see the same
    batches. With ``memory_budget`` (bytes), the saved-activation bytes are measured at
    two batch sizes and the largest batch whose training state plus activations fits
    the budget is estimated from that linear model. ``device`` is recorded in the settings
    (the workloads put their models there).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 (the first step records the training state), got {warmup}")
    missing = sorted({r.model for r in rows} - set(workloads))
    if missing:
        raise ValueError(f"rows name unknown model(s) {missing}; known: {sorted(workloads)}")
    groups: dict[tuple[str, int | None], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.model, row.batch), []).append(row)
    total = sum(len(g) * (warmup + repeats) for g in groups.values())
    bar = _progress(total, "bench", progress)
    results: list[RowResult] = []
    try:
        for (model_name, batch), group in groups.items():
            done = _bench_group(workloads[model_name], group, batch, repeats, warmup, seed, memory_budget, bar)
            results.extend(done)
            if progress and bar is None:
                for r in done:
                    _progress_line(f"bench: {r.model} {r.label} batch {r.batch}: median step "
                                   f"{r.step_time_s * 1e3:.1f} ms, {r.skipped} skipped")
    finally:
        if bar is not None:
            bar.close()
    settings = {"repeats": repeats, "warmup": warmup, "seed": seed, "memory_budget_bytes": memory_budget,
                "optimizer": "AdamW", "device": device}
    return BenchResult(rows=results, settings=settings, environment=environment())


def _bench_group(
    workload: Workload, rows: Sequence[Row], batch: int | None, repeats: int, warmup: int, seed: int,
    memory_budget: int | None, bar: Any,
) -> list[RowResult]:
    runners: list[Runner] = []
    for row in rows:
        torch.manual_seed(seed)
        runners.append(Runner(row.plan, workload.make(seed), lr=workload.lr))
    bs = batch or runners[0].task.default_batch_size
    generator = torch.Generator().manual_seed(seed)
    times: list[list[float]] = [[] for _ in runners]
    last: list[StepOutcome | None] = [None] * len(runners)
    skipped = [0] * len(runners)
    for step in range(warmup + repeats):
        inputs, targets = runners[0].task.batch(bs, generator)
        for i in _interleaved(range(len(runners)), step):
            runner = runners[i]
            if bar is not None:
                bar.set_postfix_str(f"{workload.name} {plan_label(rows[i].plan)}")
            outcome = runner.step(inputs, targets)
            last[i] = outcome
            skipped[i] += outcome.skipped
            if step >= warmup:
                times[i].append(outcome.seconds)
            if bar is not None:
                bar.update(1)
    results = []
    for i, (row, runner) in enumerate(zip(rows, runners, strict=True)):
        final = last[i]
        results.append(RowResult(
            model=workload.name, plan=row.plan, batch=bs, params=runner.params,
            step_time_s=statistics.median(times[i]), min_step_time_s=min(times[i]), times_s=times[i],
            final_loss=final.loss if final is not None else math.nan,
            skipped=skipped[i], state_bytes_per_param=runner.state_bytes_per_param(),
        ))
    runners.clear()  # free the models before measuring memory
    for result in results:
        result.peak_memory_bytes = measure_peak(workload, result.plan, bs, seed)
        if memory_budget is not None:
            sizes = [bs, 2 * bs]
            peaks = estimate_peaks(workload, result.plan, sizes, seed)
            if peaks is not None:
                result.estimated_peak_bytes = peaks[0]
                result.max_batch, _, result.peak_bytes_per_sample = max_batch_for(memory_budget, sizes, peaks)
    _add_ratios(results)
    return results


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or not denominator:
        return None
    return numerator / denominator


def _add_ratios(results: list[RowResult]) -> None:
    by_plan = {r.plan: r for r in results}
    fp32, autocast = by_plan.get(FP32), by_plan.get(TORCH_AUTOCAST)
    for r in results:
        if fp32 is not None:
            r.speedup_vs_fp32 = fp32.step_time_s / r.step_time_s
            r.state_ratio_vs_fp32 = _ratio(r.state_bytes_per_param.get("total"), fp32.state_bytes_per_param.get("total"))
            r.peak_ratio_vs_fp32 = _ratio(r.peak_memory_bytes, fp32.peak_memory_bytes)
        if autocast is not None:
            r.speedup_vs_autocast = autocast.step_time_s / r.step_time_s


# -------------------------------------------------------------------- demo
@dataclass
class PlanHistory:
    """Everything the demo recorded for one plan."""

    plan: str
    losses: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    times_s: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)
    eval_accuracies: list[float | None] = field(default_factory=list)
    state_bytes_per_param: dict[str, float] = field(default_factory=dict)
    peak_memory_bytes: int | None = None
    warmup_steps: int = 0
    run_label: str | None = None
    """How the run is named where it is not the plain named plan (e.g. fp16-mixed with other scaler settings)."""
    explain: str = ""
    """The plan's dtype table (:meth:`Plan.explain`), as trained."""

    @property
    def label(self) -> str:
        return self.run_label or plan_label(self.plan)

    @property
    def median_step_s(self) -> float:
        """Median step time, leaving out the warm-up steps."""
        timed = self.times_s[self.warmup_steps:] or self.times_s
        return statistics.median(timed) if timed else math.nan

    @property
    def skipped_steps(self) -> int:
        return sum(self.skipped)

    @property
    def final_scale(self) -> float:
        return self.scales[-1] if self.scales else math.nan


@dataclass
class DemoResult:
    """The demo's runs, one :class:`PlanHistory` per plan, and how they were made."""

    workload: str
    histories: list[PlanHistory]
    settings: dict[str, Any]
    environment: dict[str, Any]
    chance: float | None
    wall_s: float = 0.0

    def history(self, plan: str) -> PlanHistory | None:
        """The history of ``plan``, if it was trained."""
        return next((h for h in self.histories if h.plan == plan), None)

    def speedup_vs_fp32(self, h: PlanHistory) -> float | None:
        ref = self.history(FP32)
        if ref is None:
            return None
        return ref.median_step_s / h.median_step_s

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of everything recorded."""
        return {
            "format": "mixprec.demo/1",
            "workload": self.workload,
            "settings": self.settings,
            "environment": self.environment,
            "chance": self.chance,
            "wall_s": self.wall_s,
            "plans": [
                {**asdict(h), "label": h.label, "median_step_s": h.median_step_s,
                 "speedup_vs_fp32": self.speedup_vs_fp32(h)}
                for h in self.histories
            ],
        }


DemoRun = tuple[str, Plan]
"""A run of the demo under a plan with its own settings: ``(label, plan)``."""


def train_side_by_side(
    workload: Workload,
    plans: Sequence[str | DemoRun],
    *,
    steps: int,
    batch_size: int | None = None,
    lr: float | None = None,
    seed: int = 0,
    eval_every: int | None = None,
    eval_batch_size: int | None = None,
    progress: bool = False,
) -> DemoResult:
    """Train ``workload`` under each of ``plans`` on the same batches, steps interleaved.

    Every plan starts from the same weights (``workload.make(seed)``); step ``i`` of
    every plan sees the same batch. The held-out loss and accuracy are evaluated every
    ``eval_every`` steps, before the first and after the last one. A plan is a name (or
    :data:`TORCH_AUTOCAST`), or ``(label, Plan)`` for a plan with its own settings.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not plans:
        raise ValueError("no plans to train")
    start = time.perf_counter()
    lr = workload.lr if lr is None else lr
    runners = []
    histories = []
    for entry in plans:
        torch.manual_seed(seed)
        if isinstance(entry, tuple):
            label, plan_obj = entry
            if not isinstance(plan_obj, Plan):
                raise TypeError(f"a demo run is (label, Plan), got ({label!r}, {type(plan_obj).__name__})")
            runner = Runner(plan_obj, workload.make(seed), lr=lr)
            histories.append(PlanHistory(plan=plan_obj.name, run_label=label, explain=plan_obj.explain()))
        else:
            runner = Runner(entry, workload.make(seed), lr=lr)
            explain = "" if entry == TORCH_AUTOCAST else get_plan(entry).explain()
            histories.append(PlanHistory(plan=entry, explain=explain))
        runners.append(runner)
    task = runners[0].task
    bs = batch_size or task.default_batch_size
    ebs = eval_batch_size or task.eval_batch_size
    eval_inputs, eval_targets = task.eval_batch(ebs)
    every = eval_every or max(steps // 15, 1)
    for h in histories:
        h.warmup_steps = min(5, steps // 10)
    width = max(len(h.label) for h in histories)
    bars = [_progress(steps, h.label.ljust(width), progress, position=i) for i, h in enumerate(histories)]
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)

    def evaluate(step: int) -> None:
        for runner, h, bar in zip(runners, histories, bars, strict=True):
            loss, acc = runner.evaluate(eval_inputs, eval_targets)
            h.eval_steps.append(step)
            h.eval_losses.append(loss)
            h.eval_accuracies.append(acc)
            if bar is not None:
                acc_text = "n/a" if acc is None else f"{acc:.3f}"
                bar.set_postfix_str(f"held-out loss {loss:.3f} acc {acc_text}", refresh=False)

    try:
        evaluate(0)
        for step in range(1, steps + 1):
            inputs, targets = task.batch(bs, generator)
            for i in _interleaved(range(len(runners)), step - 1):
                outcome = runners[i].step(inputs, targets)
                h = histories[i]
                h.losses.append(outcome.loss)
                h.scales.append(outcome.scale)
                h.skipped.append(outcome.skipped)
                h.times_s.append(outcome.seconds)
            if step % every == 0 or step == steps:
                evaluate(step)
            for bar in bars:
                if bar is not None:
                    bar.update(1)
    finally:
        for bar in bars:
            if bar is not None:
                bar.close()
    if progress and all(bar is None for bar in bars):
        for h in histories:
            acc = h.eval_accuracies[-1] if h.eval_accuracies else None
            _progress_line(f"{h.label.ljust(width)}: {steps} steps, median step {h.median_step_s * 1e3:.1f} ms, "
                           f"held-out loss {h.eval_losses[-1]:.4f}, accuracy {'n/a' if acc is None else f'{acc:.3f}'}, "
                           f"{h.skipped_steps} skipped")
    for runner, h in zip(runners, histories, strict=True):
        h.state_bytes_per_param = runner.state_bytes_per_param()
    runners.clear()  # free the models before measuring memory
    for entry, h in zip(plans, histories, strict=True):
        h.peak_memory_bytes = measure_peak(workload, entry[1] if isinstance(entry, tuple) else entry, bs, seed)
    settings = {"steps": steps, "batch_size": bs, "lr": lr, "seed": seed, "eval_every": every,
                "eval_batch_size": ebs, "optimizer": "AdamW", "plans": [h.label for h in histories]}
    return DemoResult(workload=workload.name, histories=histories, settings=settings,
                      environment=environment(), chance=task.chance, wall_s=time.perf_counter() - start)

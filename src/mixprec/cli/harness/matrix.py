"""The benchmark matrix: every row of a model side by side, steps interleaved, reported as ratios."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mixprec.cli.harness.environment import environment
from mixprec.cli.harness.measure import estimate_peaks, max_batch_for, measure_peak
from mixprec.cli.harness.progress import progress_bar, progress_line
from mixprec.cli.harness.rows import FP32, TORCH_AUTOCAST, Row, plan_label
from mixprec.cli.harness.runner import Runner, StepOutcome, interleaved
from mixprec.cli.harness.workloads import Workload

__all__ = ["BenchResult", "RowResult", "run_bench"]


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
    bar = progress_bar(total, "bench", progress)
    results: list[RowResult] = []
    try:
        for (model_name, batch), group in groups.items():
            done = _bench_group(workloads[model_name], group, batch, repeats, warmup, seed, memory_budget, bar)
            results.extend(done)
            if progress and bar is None:
                for r in done:
                    progress_line(f"bench: {r.model} {r.label} batch {r.batch}: median step "
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
        for i in interleaved(range(len(runners)), step):
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

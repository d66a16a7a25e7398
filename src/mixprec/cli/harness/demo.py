"""The demo runs: several plans trained side by side on the same batches, with held-out evaluations."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from mixprec.cli.harness.environment import environment
from mixprec.cli.harness.measure import measure_peak
from mixprec.cli.harness.progress import progress_bar, progress_line
from mixprec.cli.harness.rows import FP32, TORCH_AUTOCAST, plan_label
from mixprec.cli.harness.runner import Runner, interleaved
from mixprec.cli.harness.workloads import Workload
from mixprec.plans import Plan, get_plan

__all__ = ["DemoResult", "DemoRun", "PlanHistory", "train_side_by_side"]


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


CALIBRATION_STEPS = 3
"""Steps of every run timed before a time budget decides how many steps fit."""
MIN_BUDGET_STEPS = 20
"""A time budget never cuts a run below this many steps (the losses must still say something)."""
EVALUATIONS = 15
"""Held-out evaluations per run by default (every ``steps // 15`` steps)."""
BUDGET_EVALUATIONS = 4
"""Held-out evaluations after the first where a time budget cut the steps (an evaluation
costs several training steps' forward passes: on a slow device they would eat the budget)."""

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
    time_budget_s: float | None = None,
    min_steps: int = MIN_BUDGET_STEPS,
) -> DemoResult:
    """Train ``workload`` under each of ``plans`` on the same batches, steps interleaved.

    Every plan starts from the same weights (``workload.make(seed)``); step ``i`` of
    every plan sees the same batch. The held-out loss and accuracy are evaluated every
    ``eval_every`` steps, before the first and after the last one. A plan is a name (or
    :data:`TORCH_AUTOCAST`), or ``(label, Plan)`` for a plan with its own settings.

    With ``time_budget_s``, the step times of the first :data:`CALIBRATION_STEPS` steps
    (and the first evaluation) decide how many steps fit in the budget: fewer than
    ``steps`` where the device is slow (bf16 on a CPU without bf16 instructions), never
    fewer than ``min_steps``. ``settings["steps_requested"]`` keeps what was asked.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if time_budget_s is not None and not time_budget_s > 0:
        raise ValueError(f"time_budget_s must be positive, got {time_budget_s}")
    requested = steps
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
    device_type = runners[0].device_type
    bs = batch_size or task.default_batch_size
    ebs = eval_batch_size or task.eval_batch_size
    eval_inputs, eval_targets = task.eval_batch(ebs)
    every = eval_every or max(steps // EVALUATIONS, 1)
    for h in histories:
        h.warmup_steps = min(5, steps // 10)
    width = max(len(h.label) for h in histories)
    bars = [progress_bar(steps, h.label.ljust(width), progress, position=i) for i, h in enumerate(histories)]
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)

    eval_seconds: list[float] = []

    def evaluate(step: int) -> None:
        started = time.perf_counter()
        for runner, h, bar in zip(runners, histories, bars, strict=True):
            loss, acc = runner.evaluate(eval_inputs, eval_targets)
            h.eval_steps.append(step)
            h.eval_losses.append(loss)
            h.eval_accuracies.append(acc)
            if bar is not None:
                acc_text = "n/a" if acc is None else f"{acc:.3f}"
                bar.set_postfix_str(f"held-out loss {loss:.3f} acc {acc_text}", refresh=False)
        eval_seconds.append(time.perf_counter() - started)

    def fit_budget(step: int) -> int:
        """The number of steps that fit in what is left of the budget (at least ``min_steps``)."""
        assert time_budget_s is not None
        per_step = sum(statistics.median(h.times_s[1:] or h.times_s) for h in histories)
        left = time_budget_s - (time.perf_counter() - start) - BUDGET_EVALUATIONS * min(eval_seconds)
        fit = step + max(int(left / per_step), 0) if per_step > 0 else steps
        return max(min(steps, fit), min(min_steps, steps), step)

    try:
        evaluate(0)
        step = 0
        while step < steps:
            step += 1
            inputs, targets = task.batch(bs, generator)
            for i in interleaved(range(len(runners)), step - 1):
                outcome = runners[i].step(inputs, targets)
                h = histories[i]
                h.losses.append(outcome.loss)
                h.scales.append(outcome.scale)
                h.skipped.append(outcome.skipped)
                h.times_s.append(outcome.seconds)
            if time_budget_s is not None and step == CALIBRATION_STEPS and step < steps:
                fitted = fit_budget(step)
                if fitted < steps:
                    steps = fitted
                    every = eval_every or max(steps // BUDGET_EVALUATIONS, 1)
                    for h in histories:
                        h.warmup_steps = min(5, steps // 10)
                    for bar in bars:
                        if bar is not None:
                            bar.total = steps
                            bar.refresh()
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
            progress_line(f"{h.label.ljust(width)}: {steps} steps, median step {h.median_step_s * 1e3:.1f} ms, "
                           f"held-out loss {h.eval_losses[-1]:.4f}, accuracy {'n/a' if acc is None else f'{acc:.3f}'}, "
                           f"{h.skipped_steps} skipped")
    for runner, h in zip(runners, histories, strict=True):
        h.state_bytes_per_param = runner.state_bytes_per_param()
    runners.clear()  # free the models before measuring memory
    for entry, h in zip(plans, histories, strict=True):
        h.peak_memory_bytes = measure_peak(workload, entry[1] if isinstance(entry, tuple) else entry, bs, seed)
    settings = {"steps": steps, "batch_size": bs, "lr": lr, "seed": seed, "eval_every": every,
                "eval_batch_size": ebs, "optimizer": "AdamW", "plans": [h.label for h in histories],
                "device": device_type, "steps_requested": requested, "time_budget_s": time_budget_s}
    return DemoResult(workload=workload.name, histories=histories, settings=settings,
                      environment=environment(), chance=task.chance, wall_s=time.perf_counter() - start)

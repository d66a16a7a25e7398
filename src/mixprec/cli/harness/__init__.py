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

Modules: :mod:`~mixprec.cli.harness.workloads` (what is trained),
:mod:`~mixprec.cli.harness.rows` (rows and baselines), :mod:`~mixprec.cli.harness.runner`
(one variant's loop), :mod:`~mixprec.cli.harness.measure` (memory),
:mod:`~mixprec.cli.harness.matrix` (``mixprec bench``), :mod:`~mixprec.cli.harness.demo`
(``mixprec demo``); :mod:`~mixprec.cli.harness.progress` and
:mod:`~mixprec.cli.harness.environment` serve both.

>>> rows = plan_rows(["mlp"], ["bf16-mixed"])
>>> [(r.model, r.plan) for r in rows]
[('mlp', 'fp32'), ('mlp', 'torch-autocast'), ('mlp', 'bf16-mixed')]
"""

from mixprec.cli.harness.demo import DemoResult, DemoRun, PlanHistory, train_side_by_side
from mixprec.cli.harness.environment import environment
from mixprec.cli.harness.matrix import BenchResult, RowResult, run_bench
from mixprec.cli.harness.measure import estimate_peaks, max_batch_for, measure_peak
from mixprec.cli.harness.rows import (
    FP32,
    TORCH_AUTOCAST,
    Row,
    default_plans,
    is_fp16_plan,
    plan_compute_dtype,
    plan_label,
    plan_rows,
)
from mixprec.cli.harness.runner import Runner, StepOutcome
from mixprec.cli.harness.workloads import TaskLike, Workload, builtin_workload

__all__ = [
    "FP32",
    "TORCH_AUTOCAST",
    "BenchResult",
    "DemoResult",
    "DemoRun",
    "PlanHistory",
    "Row",
    "RowResult",
    "Runner",
    "StepOutcome",
    "TaskLike",
    "Workload",
    "builtin_workload",
    "default_plans",
    "environment",
    "estimate_peaks",
    "is_fp16_plan",
    "max_batch_for",
    "measure_peak",
    "plan_compute_dtype",
    "plan_label",
    "plan_rows",
    "run_bench",
    "train_side_by_side",
]

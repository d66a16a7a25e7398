"""The demo's summary table and report folder, and the benchmark matrix as Markdown.

The plots of the report are drawn by :mod:`mixprec.cli.plots`; every number is written
by :mod:`mixprec.formatting`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mixprec.cli.harness import TORCH_AUTOCAST, BenchResult, DemoResult, plan_compute_dtype
from mixprec.cli.plots import plot_demo
from mixprec.formatting import format_bytes, format_number, format_ratio, markdown_table, plural

__all__ = [
    "bench_markdown",
    "bf16_speed_note",
    "demo_markdown",
    "demo_table",
    "write_demo_report",
]


def bf16_speed_note(environment: dict[str, Any], settings: dict[str, Any], plans: Sequence[str]) -> str | None:
    """A warning for reports whose bf16 rows ran on a CPU where bf16 GEMMs are slower than
    fp32 ones (measured: no AVX512-BF16 or AMX, or oneDNN kept from them): there the bf16
    step times say nothing of the plans' speed where bf16 is native. ``None`` when it does
    not apply (another device, a CPU with fast bf16, no bf16 plan, a report from before
    this was recorded)."""
    if settings.get("device", "cpu") != "cpu" or environment.get("cpu_bf16", True):
        return None

    def bf16(plan: str) -> bool:
        try:
            return plan_compute_dtype(plan) == torch.bfloat16
        except ValueError:  # a demo run of a Plan built outside the registry: its name says nothing
            return False

    if not any(bf16(p) for p in plans):
        return None
    speedup = environment.get("cpu_bf16_speedup")
    measured = f" (measured: a bf16 GEMM at {speedup:.2f}x of fp32's speed)" if isinstance(speedup, float) else ""
    return (
        f"Note: this CPU runs bf16 matmuls slower than fp32 ones{measured}: it has no bf16 instructions "
        "(AVX512-BF16 or AMX) that torch uses, so the bf16 step times here are not the plans' speed on CPUs "
        "that have them or on GPUs. Memory, state bytes, losses and accuracy do not depend on it."
    )


# -------------------------------------------------------------------- demo

def _cell(value: float | None, spec: str) -> str:
    """A table cell: ``"n/a"`` where there is no (finite) measurement."""
    return format_number(value, spec, missing="n/a", keep_nonfinite=False)


_DEMO_HEADERS = ["plan", "step time (ms)", "speedup vs fp32", "peak memory", "state B/param",
                 "final loss", "accuracy", "skipped steps", "final loss scale"]


def demo_table(result: DemoResult) -> str:
    """The demo's summary table: one row per plan."""
    rows = []
    for h in result.histories:
        acc = h.eval_accuracies[-1] if h.eval_accuracies else None
        rows.append([
            h.label,
            _cell(h.median_step_s * 1e3, ".1f"),
            format_ratio(result.speedup_vs_fp32(h)),
            format_bytes(h.peak_memory_bytes),
            _cell(h.state_bytes_per_param.get("total"), ".1f"),
            _cell(h.eval_losses[-1] if h.eval_losses else None, ".4f"),
            _cell(acc, ".3f"),
            str(h.skipped_steps),
            f"{h.final_scale:g}",
        ])
    return markdown_table(_DEMO_HEADERS, rows, "lrrrrrrrr")


def demo_markdown(result: DemoResult, command: str, plots: Sequence[str] = ()) -> str:
    """The demo's report.md."""
    s, env = result.settings, result.environment
    chance = "n/a" if result.chance is None else f"{result.chance:.3f}"
    lines = [
        f"# mixprec demo: {result.workload}",
        "",
        f"Command: `{command}`",
        "",
        f"{s['steps']} AdamW steps (lr {s['lr']:g}, batch {s['batch_size']}, seed {s['seed']}) per plan; every plan "
        "starts from the same weights and sees the same batches, its steps interleaved with the others'. "
        f"Loss and accuracy are measured on a fixed held-out batch of {s['eval_batch_size']} every "
        f"{s['eval_every']} steps (chance accuracy {chance}).",
        "",
        demo_table(result),
        "",
        "- step time: median over the steps after the first "
        f"{result.histories[0].warmup_steps} (warm-up), forward + backward + optimizer step;",
        "- speedup: fp32 step time / the plan's step time (above 1: faster);",
        "- peak memory: of one training step, measured by `mixprec.diagnostics.memory.measure_memory` "
        "(every live tensor storage counted);",
        "- state B/param: training-state bytes per parameter (weights, buffers, gradients, fp32 masters and "
        "gradient accumulation, optimizer state, Kahan compensation);",
        "- final loss, accuracy: on the held-out batch after the last step.",
        "",
        f"Wall time {result.wall_s:.1f} s on {env['processor']} ({plural(env['threads'], 'thread')}, "
        f"torch {env['torch']}, mixprec {env['mixprec']}).",
        "",
    ]
    requested = s.get("steps_requested")
    if isinstance(requested, int) and requested > s["steps"]:
        lines += [f"The {s['time_budget_s']:g} s time budget fitted {s['steps']} of the {requested} steps asked for "
                  "on this machine (`--time-budget 0` trains them all).", ""]
    auto = s.get("auto")
    if isinstance(auto, dict):
        lines += [f"precision='auto' picks **{auto.get('plan')}** here:", ""]
        lines += [f"> {line}" for line in str(auto.get("why", "")).splitlines()] + [""]
    note = bf16_speed_note(env, s, [h.plan for h in result.histories])
    if note is not None:
        lines += [note, ""]
    titles = {"loss.png": "Loss", "accuracy.png": "Held-out accuracy", "loss_scale.png": "Loss scale",
              "step_time.png": "Step time"}
    for name in plots:
        lines += [f"## {titles.get(name, name)}", "", f"![{titles.get(name, name)}]({name})", ""]
    lines += ["## Plans", ""]
    from mixprec.plans import get_plan

    for h in result.histories:
        if h.plan != TORCH_AUTOCAST:
            title = [] if h.label == h.plan else [f"{h.label}:", ""]
            lines += [*title, "```", h.explain or get_plan(h.plan).explain(), "```", ""]
    return "\n".join(lines)




def write_demo_report(result: DemoResult, folder: Path, command: str, *, plots: bool = True) -> list[Path]:
    """Write report.md, results.json and (with ``plots``) the PNGs into ``folder``; returns the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    names = plot_demo(result, folder) if plots else []
    (folder / "report.md").write_text(demo_markdown(result, command, names), encoding="utf-8")
    (folder / "results.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n", encoding="utf-8")
    return [folder / "report.md", folder / "results.json", *(folder / n for n in names)]


# ------------------------------------------------------------------- bench
def bench_markdown(result: BenchResult, command: str | None = None) -> str:
    """The benchmark matrix as Markdown: one table for all rows, then how to read it."""
    budget = result.settings.get("memory_budget_bytes")
    headers = ["model", "plan", "batch", "step time (ms)", "best (ms)", "vs fp32", "vs torch.autocast",
               "peak memory", "peak vs fp32", "state B/param", "state vs fp32"]
    align = "llrrrrrrrrr"
    if budget is not None:
        headers.append(f"max batch @ {format_bytes(budget)}")
        align += "r"
    rows = []
    for r in result.rows:
        row = [r.model, r.label, str(r.batch), _cell(r.step_time_s * 1e3, ".1f"), _cell(r.min_step_time_s * 1e3, ".1f"),
               format_ratio(r.speedup_vs_fp32),
               format_ratio(r.speedup_vs_autocast), format_bytes(r.peak_memory_bytes), format_ratio(r.peak_ratio_vs_fp32),
               _cell(r.state_bytes_per_param.get("total"), ".1f"), format_ratio(r.state_ratio_vs_fp32)]
        if budget is not None:
            row.append("n/a" if r.max_batch is None else str(r.max_batch))
        rows.append(row)
    env, s = result.environment, result.settings
    lines = []
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += [
        f"{env['processor']}, {plural(env['threads'], 'thread')}, torch {env['torch']}, mixprec {env['mixprec']}; "
        f"AdamW; median of {plural(s['repeats'], 'interleaved timed step')} after "
        f"{plural(s['warmup'], 'warm-up step')}.",
        "",
        markdown_table(headers, rows, align),
        "",
        "- step time: median of the timed steps (forward, backward, optimizer step); best: the fastest of them. "
        "A best far below the median means the machine was busy during the run.",
        "- vs fp32 / vs torch.autocast: speedup, the baseline's median step time divided by the row's "
        "(above 1: faster). torch.autocast is the plain loop: fp32 model, "
        "`with torch.autocast(\"cpu\", dtype=torch.bfloat16)`, `loss.backward()`, `opt.step()`, `opt.zero_grad()`.",
        "- peak memory: measured for one training step by `mixprec.diagnostics.memory.measure_memory` (every live "
        "tensor storage counted, so it works on CPU); n/a for the plain torch.autocast loop, which it does not run "
        "(its tensors are those of bf16-mixed: fp32 weights, grads and AdamW state, the same autocast forward).",
        "- state B/param: training-state bytes per parameter (weights, buffers, grads, fp32 masters, fp32 grad "
        "accumulation, optimizer state, Kahan compensation), counted on the live model and optimizer.",
    ]
    if budget is not None:
        lines.append(
            "- max batch: the largest batch whose estimated step peak fits the budget, from a line through "
            "`mixprec.diagnostics.memory.estimate_memory` peaks at the row's batch and twice it (an estimate; "
            "allocator overhead not included)."
        )
    note = bf16_speed_note(env, s, [r.plan for r in result.rows])
    if note is not None:
        lines += ["", note]
    return "\n".join(lines) + "\n"

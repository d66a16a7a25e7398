"""Tables, Markdown reports and plots for the demo, the benchmark matrix and memory estimates.

Plots need matplotlib (``pip install 'mixprec[cli]'``); it is imported only when a
plot is drawn, with the non-interactive Agg backend.

>>> print(markdown_table(["plan", "ms"], [["fp32", "12.0"], ["bf16-mixed", "5.1"]]))
| plan       | ms   |
|------------|------|
| fp32       | 12.0 |
| bf16-mixed | 5.1  |
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mixprec.bench import TORCH_AUTOCAST, BenchResult, DemoResult, format_bytes

__all__ = [
    "bench_markdown",
    "demo_markdown",
    "demo_table",
    "markdown_table",
    "plot_demo",
    "write_demo_report",
]

_PLOTS = ("loss.png", "accuracy.png", "loss_scale.png", "step_time.png")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """A padded Markdown table (readable as plain text too). ``align``: one of "l"/"r" per column."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    align = align or "l" * len(headers)

    def line(cells: Sequence[str]) -> str:
        padded = [str(c).rjust(w) if a == "r" else str(c).ljust(w) for c, w, a in zip(cells, widths, align, strict=True)]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else "-" * (w + 2) for w, a in zip(widths, align, strict=True)) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def _ratio(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.2f}x"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _num(value: float | None, fmt: str = ".3f") -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, fmt)


# -------------------------------------------------------------------- demo
_DEMO_HEADERS = ["plan", "step time (ms)", "speedup vs fp32", "peak memory", "state B/param",
                 "final loss", "accuracy", "skipped steps", "final loss scale"]


def demo_table(result: DemoResult) -> str:
    """The demo's summary table: one row per plan."""
    rows = []
    for h in result.histories:
        acc = h.eval_accuracies[-1] if h.eval_accuracies else None
        rows.append([
            h.label,
            _num(h.median_step_s * 1e3, ".1f"),
            _ratio(result.speedup_vs_fp32(h)),
            format_bytes(h.peak_memory_bytes),
            _num(h.state_bytes_per_param.get("total"), ".1f"),
            _num(h.eval_losses[-1] if h.eval_losses else None, ".4f"),
            _num(acc, ".3f"),
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
        f"Wall time {result.wall_s:.1f} s on {env['processor']} ({_plural(env['threads'], 'thread')}, "
        f"torch {env['torch']}, mixprec {env['mixprec']}).",
        "",
    ]
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


def _smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` steps (non-finite values left out)."""
    out: list[float] = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1): i + 1] if math.isfinite(v)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(
            "plots need matplotlib: pip install 'mixprec[cli]' (or pass --no-plots)"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_demo(result: DemoResult, folder: Path) -> list[str]:
    """Draw loss, accuracy, loss-scale and step-time plots into ``folder``; returns the file names."""
    plt = _pyplot()
    s = result.settings
    subtitle = f"{result.workload}, batch {s['batch_size']}, AdamW lr {s['lr']:g}"
    styles = ["-", "--", "-.", ":"]
    hs = result.histories

    def style(i: int) -> dict[str, Any]:
        return {"color": f"C{i}", "linestyle": styles[i % len(styles)]}

    # loss, and its difference to fp32
    fp32 = result.history("fp32")
    if fp32 is not None:
        fig, (ax, ax_diff) = plt.subplots(2, 1, figsize=(8, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    else:
        fig, ax = plt.subplots(figsize=(8, 5))
        ax_diff = ax
    steps_axis = range(1, len(hs[0].losses) + 1)
    window = max(1, len(hs[0].losses) // 25)
    for i, h in enumerate(hs):
        ax.plot(steps_axis, _smooth(h.losses, window), label=f"{h.label} (train, mean of {window})", linewidth=1.6,
                **style(i))
        ax.plot(h.eval_steps, h.eval_losses, marker="o", markersize=4, linestyle="none", color=f"C{i}",
                label=f"{h.label} (held-out)")
    ax.set_ylabel("loss (cross-entropy)")
    ax.set_title(f"Training loss per plan\n{subtitle}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    if fp32 is not None:
        ref = _smooth(fp32.losses, window)
        for i, h in enumerate(hs):
            if h is not fp32:
                diff = [a - b for a, b in zip(_smooth(h.losses, window), ref, strict=True)]
                ax_diff.plot(steps_axis, diff, label=h.label, linewidth=1.4, **style(i))
        ax_diff.axhline(0.0, color="C0", linewidth=1.0, label="fp32 (reference)")
        ax_diff.set_ylabel("train loss - fp32 train loss")
        ax_diff.set_title("Difference to the fp32 run (same weights, same batches)", fontsize=10)
        ax_diff.grid(alpha=0.3)
        ax_diff.legend(fontsize=8, ncol=2)
    ax_diff.set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(folder / "loss.png", dpi=110)
    plt.close(fig)

    # accuracy
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, h in enumerate(hs):
        points = [(st, a) for st, a in zip(h.eval_steps, h.eval_accuracies, strict=True) if a is not None]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", markersize=4, label=h.label, **style(i))
    if result.chance is not None:
        ax.axhline(result.chance, color="grey", linestyle=":", label=f"chance ({result.chance:.3f})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0.0, 1.0)
    ax.set_title(f"Held-out accuracy per plan\n{subtitle}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(folder / "accuracy.png", dpi=110)
    plt.close(fig)

    # loss scale
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, h in enumerate(hs):
        skips = [st for st, sk in zip(steps_axis, h.skipped, strict=True) if sk]
        ax.plot(steps_axis, h.scales, label=f"{h.label} ({h.skipped_steps} skipped)", linewidth=1.6, **style(i))
        if skips:
            ax.plot(skips, [h.scales[st - 1] for st in skips], marker="x", linestyle="none", color=f"C{i}")
    if all(v == 1.0 for h in hs for v in h.scales):
        ax.text(0.5, 0.35, "no loss scaling in these plans (scale 1):\nonly fp16 plans scale the loss",
                transform=ax.transAxes, ha="center", fontsize=9, color="grey")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss scale (log2; 1 = no scaling)")
    ax.set_title(f"Loss scale after each step (x = skipped step)\n{subtitle}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "loss_scale.png", dpi=110)
    plt.close(fig)

    # step time
    fig, ax = plt.subplots(figsize=(8, 5))
    labels = [h.label for h in hs]
    times = [h.median_step_s * 1e3 for h in hs]
    bars = ax.bar(labels, times, color=[f"C{i}" for i in range(len(hs))], label="median step time")
    for bar, h in zip(bars, hs, strict=True):
        speedup = result.speedup_vs_fp32(h)
        ax.annotate(_ratio(speedup) + " vs fp32" if speedup is not None else "", (bar.get_x() + bar.get_width() / 2,
                    bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xlabel("plan")
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"Step time per plan (forward + backward + optimizer step)\n{subtitle}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(folder / "step_time.png", dpi=110)
    plt.close(fig)
    return list(_PLOTS)


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
        row = [r.model, r.label, str(r.batch), _num(r.step_time_s * 1e3, ".1f"), _num(r.min_step_time_s * 1e3, ".1f"),
               _ratio(r.speedup_vs_fp32),
               _ratio(r.speedup_vs_autocast), format_bytes(r.peak_memory_bytes), _ratio(r.peak_ratio_vs_fp32),
               _num(r.state_bytes_per_param.get("total"), ".1f"), _ratio(r.state_ratio_vs_fp32)]
        if budget is not None:
            row.append("n/a" if r.max_batch is None else str(r.max_batch))
        rows.append(row)
    env, s = result.environment, result.settings
    lines = []
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += [
        f"{env['processor']}, {_plural(env['threads'], 'thread')}, torch {env['torch']}, mixprec {env['mixprec']}; "
        f"AdamW; median of {_plural(s['repeats'], 'interleaved timed step')} after "
        f"{_plural(s['warmup'], 'warm-up step')}.",
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
    return "\n".join(lines) + "\n"

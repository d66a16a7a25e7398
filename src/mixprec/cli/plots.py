"""The demo's plots (loss, held-out accuracy, loss scale, step time), and matplotlib for every CLI plot.

Plots need matplotlib (``pip install 'mixprec[cli]'``); it is imported only when a
plot is drawn, with the non-interactive Agg backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mixprec.cli.harness import DemoResult
from mixprec.formatting import format_ratio

__all__ = ["PLOTS", "plot_demo", "pyplot"]

PLOTS: tuple[str, ...] = ("loss.png", "accuracy.png", "loss_scale.png", "step_time.png")
"""The files :func:`plot_demo` writes, in order."""


def _smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` steps (non-finite values left out)."""
    out: list[float] = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1): i + 1] if math.isfinite(v)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend; ImportError naming the extra to install when matplotlib is missing."""
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
    plt = pyplot()
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
        ax.annotate(format_ratio(speedup) + " vs fp32" if speedup is not None else "", (bar.get_x() + bar.get_width() / 2,
                    bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xlabel("plan")
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"Step time per plan (forward + backward + optimizer step)\n{subtitle}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(folder / "step_time.png", dpi=110)
    plt.close(fig)
    return list(PLOTS)

"""``mixprec inspect``: where a plan's numerics drift from fp32, module by module.

Builds the model, draws one batch and runs :func:`mixprec.diagnostics.compare` against
an fp32 shadow: modules are ranked by the error their own code introduces (forward or
backward), with relative errors and SQNR. Then :func:`mixprec.diagnostics.headroom`
runs the plan once more and reports each module's activation amax against its dtype's
largest value, and the fraction of its output gradients fp16 would flush to zero at
the loss scale. With ``--advise``, :func:`mixprec.diagnostics.advise` proposes fp32
islands and what they cost. Writes report.md and sqnr.png to ``--out``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mixprec.cli.common import (
    Command,
    add_model_arguments,
    apply_globals,
    check_writable_dir,
    command_line,
    positive_int,
    resolve_workload,
)
from mixprec.cli.plots import pyplot
from mixprec.formatting import format_number, markdown_table

__all__ = ["COMMAND"]

DEFAULT_OUT = "mixprec-inspect"
DEFAULT_PLAN = "bf16-mixed"
DEFAULT_BATCH_SIZE = 16
DEFAULT_TOP = 10
PLOT = "sqnr.png"
_ADVICE = "Advice: fp32 islands"
_UNSCALED_FP16_SCALE = 2.0**16  # the scaler's initial scale: what an fp16 run would start from


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, default="gpt", default_size="tiny")
    g = p.add_argument_group("inspect")
    g.add_argument("--plan", default=DEFAULT_PLAN, metavar="PLAN",
                   help="plan compared against fp32 (default: %(default)s)")
    g.add_argument("--batch-size", type=positive_int, default=DEFAULT_BATCH_SIZE, metavar="N",
                   help="size of the one batch compared (default: %(default)s)")
    g.add_argument("--top", type=positive_int, default=DEFAULT_TOP, metavar="N",
                   help="modules shown in the tables and the plot (default: %(default)s)")
    g.add_argument("--advise", action="store_true", help="also propose fp32 islands and their cost")
    g.add_argument("--tolerance", type=_positive_float, default=0.1, metavar="X",
                   help="with --advise: relative error allowed on loss and gradients (default: %(default)s)")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), metavar="DIR",
                   help="folder for report.md and the plot (default: ./%(default)s)")
    o.add_argument("--no-plots", action="store_true", help="write report.md without the PNG plot")


# ------------------------------------------------------------------ formatting
def _num(x: float | None, spec: str = ".3g") -> str:
    return format_number(x, spec, missing="-", keep_nonfinite=True)  # inf dB: an exact result


def _name(module: str) -> str:
    return module if module else "<root>"


def _own_db(own: float | None) -> float | None:
    """SQNR in dB of an own (introduced) relative error: ``-20 log10(err)``."""
    if own is None or math.isnan(own):
        return None
    if own == 0.0:
        return math.inf
    return -20.0 * math.log10(own) if math.isfinite(own) else -math.inf


def _error_table(report: Any, top: int) -> str:
    headers = ["module", "type", "fwd own err", "fwd own dB", "fwd err", "fwd dB",
               "bwd own err", "bwd own dB", "grad err", "grad dB"]
    rows = [
        [_name(m.module), m.module_type,
         _num(m.own_fwd_err), _num(_own_db(m.own_fwd_err), ".1f"), _num(m.fwd_rel_err), _num(m.fwd_sqnr_db, ".1f"),
         _num(m.own_bwd_err), _num(_own_db(m.own_bwd_err), ".1f"), _num(m.grad_rel_err), _num(m.grad_sqnr_db, ".1f")]
        for m in report.ranked()[:top]
    ]
    return markdown_table(headers, rows, "ll" + "r" * 8)


def _headroom_table(hr: Any, top: int) -> str:
    from mixprec.dtypes import dtype_name

    headers = ["module", "type", "dtype", "act amax", "dtype max", "headroom", "fp16 headroom",
               f"fp16 grad underflow @{hr.loss_scale:g}"]
    rows = []
    for m in hr.tightest(top):
        dtype = m.dtype if m.dtype is not None and m.dtype.is_floating_point else torch.float32
        rows.append([
            _name(m.module), m.module_type, dtype_name(dtype), _num(m.act_amax), _num(torch.finfo(dtype).max),
            _num(m.headroom(dtype)) + "x", _num(m.fp16_headroom) + "x",
            f"{m.grad_underflow_fp16:.2%}" if m.grad_values else "-",
        ])
    return markdown_table(headers, rows, "lll" + "r" * 5)


def _headroom_summary(hr: Any) -> str:
    modules = [m for m in hr.modules.values() if m.act_amax == m.act_amax]  # not nan
    if not modules:
        return "no floating-point activations seen"
    tight = min(modules, key=lambda m: m.fp16_headroom)
    nonfinite = sum(m.nonfinite_outputs for m in hr.modules.values())
    graded = [m for m in hr.modules.values() if m.grad_values]
    lines = [f"largest activation: {_num(tight.act_amax)} in {_name(tight.module)} ({tight.module_type}); "
             f"fp16 headroom {_num(tight.fp16_headroom)}x, bf16 headroom {_num(tight.bf16_headroom)}x"]
    if graded:
        total = sum(m.grad_values for m in graded)
        lost = sum(m.grad_underflow_fp16 * m.grad_values for m in graded)
        worst = max(graded, key=lambda m: m.grad_underflow_fp16)
        where = f"worst: {_name(worst.module)}, {worst.grad_underflow_fp16:.2%}" if lost else "none in any module"
        lines.append(f"fp16 gradient underflow at loss scale {hr.loss_scale:g}: {lost / total:.2%} of non-zero "
                     f"output-gradient values ({where})")
    lines.append(f"module outputs holding inf/NaN: {nonfinite}")
    return "\n".join(lines)


# ------------------------------------------------------------------ plot
def _plot(report: Any, top: int, title: str, path: Path) -> None:
    plt = pyplot()
    modules = report.ranked()[:top][::-1]  # worst at the top of the chart
    labels = [f"{_name(m.module)} ({m.module_type})" for m in modules]
    fwd = [_own_db(m.own_fwd_err if m.own_fwd_err is not None else m.fwd_rel_err) for m in modules]
    bwd = [_own_db(m.own_bwd_err if m.own_bwd_err is not None else m.grad_rel_err) for m in modules]
    finite = [v for v in (*fwd, *bwd) if v is not None and math.isfinite(v)]
    cap = max([*finite, 10.0]) * 1.15  # exact results (inf dB) are drawn at the cap, hatched

    def bars(values: list[float | None], offset: float, color: str, label: str) -> None:
        ys = [y + offset for y in range(len(values))]
        widths = [0.0 if v is None else max(min(v, cap), 0.0) for v in values]
        patches = ax.barh(ys, widths, height, color=color, label=label)
        for patch, v in zip(patches, values, strict=True):
            if v is not None and math.isinf(v) and v > 0:
                patch.set_hatch("//")
                ax.annotate("exact", (cap, patch.get_y() + height / 2), va="center", ha="right", fontsize=7)
            elif v is None:
                ax.annotate("n/a", (0, patch.get_y() + height / 2), va="center", ha="left", fontsize=7)

    height = 0.38
    fig, ax = plt.subplots(figsize=(9, 2.0 + 0.45 * max(len(modules), 1)))
    bars(fwd, height / 2, "C0", "forward: module outputs")
    bars(bwd, -height / 2, "C1", "backward: gradients of its inputs and parameters")
    ax.set_yticks(list(range(len(modules))), labels, fontsize=8)
    ax.set_xlim(0, cap * 1.02)
    ax.set_xlabel("SQNR of the error the module introduces, vs fp32 (dB; higher is better)")
    ax.set_ylabel("module (worst at the top)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18 * 10 / max(len(modules) + 4, 1)),
              ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# ------------------------------------------------------------------ run
def _markdown(sections: Sequence[tuple[str, str]], command: str, intro: str, plot: str | None) -> str:
    lines = ["# mixprec inspect", "", f"Command: `{command}`", "", intro, ""]
    for title, body in sections:
        if title == _ADVICE:  # its lines are aligned text
            body = f"```\n{body}\n```"
        lines += [f"## {title}", "", body, ""]
    if plot is not None:
        lines += ["## SQNR of the worst modules", "", f"![SQNR per module]({plot})", ""]
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    from mixprec.diagnostics import advise, compare, headroom
    from mixprec.plans import get_plan, resolve_plan_name

    plan = get_plan(resolve_plan_name(args.plan))
    workload = resolve_workload(args.model, args)
    out = check_writable_dir(args.out, "report folder")
    apply_globals(args)
    task = workload.make(args.seed)
    batch = task.batch(args.batch_size, torch.Generator().manual_seed(args.seed))
    criterion = task.criterion

    advice = None
    if args.advise:
        advice = advise(task.model, batch, plan, criterion=criterion, tolerance=args.tolerance, seed=args.seed)
        report = advice.baseline
    else:
        report = compare(task.model, batch, plan, criterion=criterion, seed=args.seed)
    scale = report.loss_scale if report.loss_scale > 1.0 else _UNSCALED_FP16_SCALE
    hr = headroom(task.model, batch, criterion=criterion, loss_scale=scale, plan=plan)

    intro = (f"{workload.name}: plan {plan.name} against an fp32 shadow on one batch of {args.batch_size} "
             f"(seed {args.seed}).\n\n{report.summary()}")
    errors = _error_table(report, args.top)
    rooms = _headroom_table(hr, args.top)
    summary = _headroom_summary(hr)
    n = min(args.top, len(report.modules))
    sections = [
        (f"Modules by error (worst {n} of {len(report.modules)})",
         errors + "\n\nerr: relative error ||plan - fp32|| / ||fp32||; dB: SQNR, 10 log10(||fp32||² / "
         "||plan - fp32||²). own: what the module's own code adds (fp32 inputs, children exact), forward on its "
         "outputs, backward on the gradients of its inputs and parameters; modules are ranked by the larger of "
         "the two. fwd/grad: end to end (its outputs; the gradients of its own parameters)."),
        (f"Headroom (tightest {min(args.top, len(hr))} of {len(hr)})", summary + "\n\n" + rooms),
    ]
    if advice is not None:
        sections.append((_ADVICE, str(advice)))

    print(intro)
    for title, body in sections:
        print(f"\n{title}\n{body}")

    plot = None
    if not args.no_plots:
        title = f"SQNR vs fp32 introduced per module: {workload.name}, plan {plan.name}, batch {args.batch_size}"
        _plot(report, args.top, title, out / PLOT)
        plot = PLOT
    (out / "report.md").write_text(_markdown(sections, command_line(args.argv), intro, plot), encoding="utf-8")
    print(f"\nwrote {out / 'report.md'}" + (f" and {out / PLOT}" if plot else ""))
    return 0


COMMAND = Command(
    name="inspect",
    help="numerics of a plan against fp32, per module: error table, headroom, advice, plot",
    description=__doc__.split("\n\n", 1)[1].replace("\n", " ") if __doc__ else "",
    add_arguments=_add_arguments,
    run=_run,
)

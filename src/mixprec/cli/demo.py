"""``mixprec demo``: train a model under fp32 and several plans side by side, then report.

Every plan trains its own copy of the model from the same initial weights on the same
batches, steps interleaved. Two fp16-mixed runs train beside them to show dynamic loss
scaling at work (growth, backoff and skipped steps): one with the default hysteresis and
one with hysteresis 2, both starting from a high scale (2^24) that overflows and growing
every 10 clean steps, so the scale climbs back into overflow several times in a short run. The command prints a table (step time, speedup vs fp32,
peak memory, training-state bytes per parameter, final held-out loss and accuracy,
skipped steps, final loss scale) and writes a report folder: ``report.md``,
``results.json`` and PNG plots (loss, accuracy, loss scale, step time).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from mixprec.cli.common import (
    Command,
    add_model_arguments,
    apply_globals,
    check_writable_dir,
    command_line,
    parse_plans,
    positive_float,
    positive_int,
    resolve_device,
    resolve_workload,
)
from mixprec.cli.harness import FP32, DemoRun, train_side_by_side
from mixprec.cli.plots import PLOTS
from mixprec.cli.report import bf16_speed_note, demo_table, write_demo_report
from mixprec.hardware import device_facts
from mixprec.plans.auto import choose_plan

__all__ = [
    "COMMAND",
    "DEFAULT_PLANS",
    "DEFAULT_STEPS",
    "DEFAULT_TIME_BUDGET_S",
    "REPORT_FILES",
    "SLOW_BF16_PLANS",
    "auto_summary",
    "fp16_scaling_runs",
    "publish_report",
]

DEFAULT_MODEL = "cnn"
DEFAULT_SIZE = "tiny"
DEFAULT_PLANS: tuple[str, ...] = ("fp32", "bf16-mixed", "bf16-master", "bf16-kahan")
SLOW_BF16_PLANS: tuple[str, ...] = ("fp32", "bf16-mixed", "bf16-kahan")
"""The default plans where ``precision="auto"`` finds bf16 slower than fp32 (a CPU without
bf16 instructions): what still pays there (half the activation memory, 10 B/param of
state, the same accuracy), without bf16-master, whose table row would repeat bf16-mixed's."""
DEFAULT_STEPS = 150
DEFAULT_TIME_BUDGET_S = 75.0
"""Training time the default demo spends at most (steps are cut to fit, never below 20)."""
DEFAULT_BATCH_SIZE = 64
DEFAULT_OUT = "mixprec-report"
DEFAULT_THREADS = 1
"""The defaults: a tiny ResNet on synthetic Gabor images, on one thread (fastest for a model this small)."""


FP16_INIT_SCALE = 2.0**24
"""Where the demo's fp16 scalers start: high enough that the first steps overflow and back off."""
FP16_GROWTH_INTERVAL = 10
"""The demo's fp16 scalers grow after 10 clean steps (torch's default, 2000, would never grow in a
demo), so the scale climbs back into overflow and backs off again several times per run."""
_CONV_OPS = ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")


def fp16_scaling_runs(device_type: str = "cpu") -> list[DemoRun]:
    """The demo's two fp16-mixed runs: default hysteresis, and hysteresis 2 (a backoff after two overflows).

    Both start at :data:`FP16_INIT_SCALE` and grow every :data:`FP16_GROWTH_INTERVAL` clean
    steps. On CPU, convolutions stay in fp32 (fp16 convolutions have no fast path there
    and take ~100x longer); everything else computes in fp16, so the gradients still pass
    through fp16 tensors and overflow as they would on a GPU.
    """
    from mixprec.plans import get_plan

    settings: dict[str, object] = {"init_scale": FP16_INIT_SCALE, "growth_interval": FP16_GROWTH_INTERVAL}
    if device_type == "cpu":
        settings["fp32_ops"] = list(_CONV_OPS)
    return [
        ("fp16-mixed", get_plan("fp16-mixed", **settings)),  # type: ignore[arg-type]
        ("fp16-mixed hysteresis=2", get_plan("fp16-mixed", hysteresis=2, **settings)),  # type: ignore[arg-type]
    ]


REPORT_FILES: tuple[str, ...] = ("report.md", "results.json", *PLOTS)
"""The files a demo report consists of (a new report replaces all of them)."""

_STAGING_PREFIX = ".mixprec-partial-"


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) and SIGTERM back for the few renames that publish a report."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def publish_report(result: object, out: Path, command: str, *, plots: bool = True) -> list[Path]:
    """Write the demo report into a staging folder inside ``out``, then move it into place.

    An interrupted or failed run (Ctrl-C or SIGTERM while plotting, a full disk) leaves the
    previous report as it was and no staging folder: the new files replace the old ones
    only once all are written, in a few renames during which Ctrl-C and SIGTERM are held
    back, and files of the old report that the new one does not have (plots, after
    ``--no-plots``) are removed, so a report folder never mixes two runs. Staging folders
    of killed runs (SIGKILL) are removed on the next run.
    """
    for stale in out.glob(_STAGING_PREFIX + "*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=out))
    try:
        written = write_demo_report(result, staging, command, plots=plots)  # type: ignore[arg-type]
        names = [p.name for p in written]
        with _signals_deferred():
            for name in REPORT_FILES:
                if name not in names:
                    with contextlib.suppress(FileNotFoundError):
                        (out / name).unlink()
            for path in written:
                os.replace(path, out / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [out / name for name in names]


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, default=DEFAULT_MODEL, default_size=DEFAULT_SIZE)
    g = p.add_argument_group("training")
    g.add_argument("--plans", nargs="+", default=None, metavar="PLAN",
                   help="plans to train (fp32 is always trained too, as the reference; 'auto' is the plan "
                        "precision='auto' picks here); fp16 plans work but have no fast path on most CPUs "
                        f"(default: {' '.join(DEFAULT_PLANS)}; {' '.join(SLOW_BF16_PLANS)} where bf16 is "
                        "slower than fp32)")
    g.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS, help="optimizer steps per plan (default: %(default)s)")
    g.add_argument("--time-budget", type=float, default=DEFAULT_TIME_BUDGET_S, metavar="SECONDS",
                   help="cut the steps so training takes about this long, never below 20 steps; 0: no budget "
                        "(default: %(default)s)")
    g.add_argument("--batch-size", type=positive_int, default=DEFAULT_BATCH_SIZE,
                   help="training batch size (default: %(default)s)")
    g.add_argument("--lr", type=positive_float, default=None, help="AdamW learning rate (default: 3e-3 for tiny, 1e-3 otherwise)")
    g.add_argument("--eval-every", type=positive_int, default=None, metavar="N",
                   help="evaluate the held-out batch every N steps (default: steps/15)")
    g.add_argument("--eval-batch-size", type=positive_int, default=None, metavar="N", help="default: the model's own")
    g.add_argument("--no-fp16", action="store_true",
                   help="leave out the two fp16-mixed runs that show dynamic loss scaling (growth, backoff, "
                        "skipped steps)")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), metavar="DIR",
                   help="report folder (default: ./%(default)s)")
    o.add_argument("--no-plots", action="store_true", help="write report.md and results.json without PNG plots")


def _run(args: argparse.Namespace) -> int:
    if not math.isfinite(args.time_budget) or args.time_budget < 0:
        raise ValueError(f"--time-budget must be a finite number of seconds >= 0 (0: no budget), got {args.time_budget}")
    device = resolve_device(args.device)
    choice = choose_plan(device_facts(device))
    if args.plans is None:
        plans = list(DEFAULT_PLANS if choice.plan != FP32 else SLOW_BF16_PLANS)
    else:
        plans = parse_plans(args.plans, device=device)
    if FP32 not in plans:
        plans.insert(0, FP32)
    if args.lr is not None and (not math.isfinite(args.lr) or not args.lr > 0):
        raise ValueError(f"--lr must be a finite positive number, got {args.lr}")
    workload = resolve_workload(args.model, args)
    out = check_writable_dir(args.out, "report folder")
    runs: list[str | DemoRun] = list(plans)
    if not args.no_fp16:
        runs += [run for run in fp16_scaling_runs(device.type) if run[0] not in plans]
    apply_globals(args, default_threads=DEFAULT_THREADS)
    if not args.quiet:
        names = [run if isinstance(run, str) else run[0] for run in runs]
        print(f"mixprec demo: {workload.name}, {args.steps} steps under {', '.join(names)}", flush=True)
        print(auto_summary(choice.plan, choice.reasons[0]), flush=True)
    start = time.perf_counter()
    result = train_side_by_side(
        workload, runs, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
        eval_every=args.eval_every, eval_batch_size=args.eval_batch_size, progress=not args.quiet,
        time_budget_s=args.time_budget or None,
    )
    result.settings["auto"] = {"plan": choice.plan, "why": choice.text()}
    if not args.quiet and result.settings["steps"] < args.steps:
        print(f"(the {args.time_budget:g} s time budget fitted {result.settings['steps']} of {args.steps} steps "
              "on this machine; --time-budget 0 trains them all)", flush=True)
    paths = publish_report(result, out, command_line(args.argv), plots=not args.no_plots)
    print(demo_table(result))
    note = bf16_speed_note(result.environment, result.settings, [h.plan for h in result.histories])
    if note is not None:
        print(f"\n{note}")
    print(f"\nwall time {time.perf_counter() - start:.1f} s; report: {paths[0]}"
          + ("" if args.no_plots else f" (+ {len(paths) - 2} plots)"))
    return 0


def auto_summary(plan: str, reason: str) -> str:
    """The demo's first word on the hardware: what precision='auto' picks here, and what the demo shows."""
    text = f"precision='auto' picks {plan} on this machine: {reason.split(': ', 1)[1]}"
    if plan == FP32:
        text += (" So this demo shows what low precision still gives here (half the activation memory, "
                 "bf16-kahan's 10 bytes of state per parameter instead of 16, fp16 loss scaling, the same "
                 "accuracy); its speed needs bf16 hardware (a CPU with AVX512-BF16 or AMX, or a GPU).")
    return text


COMMAND = Command(
    name="demo",
    help="train a model in fp32 and several plans side by side; table + report with plots",
    description=__doc__.split("\n\n", 1)[1].replace("\n", " ") if __doc__ else "",
    add_arguments=_add_arguments,
    run=_run,
)

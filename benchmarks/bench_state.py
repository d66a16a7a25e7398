"""Training-state bytes per parameter and the measured peak of one step, per plan.

On a model of :mod:`mixprec.cli.models` (the small GPT by default), each plan trains
through :class:`mixprec.MixedPrecision` with AdamW, and
:func:`mixprec.diagnostics.measure_memory` accounts every live tensor storage of one
step after a warm-up step (so it works on CPU): the persistent training state
(weights, gradients as the step holds them, masters, optimizer state, compensation) per
parameter and the step's peak, each also as a ratio to fp32. ``bf16-kahan in-backward``
is bf16-kahan with ``optimizer_in_backward=True`` (each gradient is used and freed
inside backward). A benchmark: it prints Markdown and never fails on a number.

Usage::

    python benchmarks/bench_state.py
    python benchmarks/bench_state.py --model gpt --size tiny --batch 4
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

import torch

from mixprec import get_plan
from mixprec.cli.models import build_task
from mixprec.diagnostics import measure_memory

ROWS: dict[str, tuple[Any, dict[str, Any]]] = {
    "fp32": ("fp32", {}),
    "bf16-mixed": ("bf16-mixed", {}),
    "bf16-master": ("bf16-master", {}),
    "bf16-pure": ("bf16-pure", {}),
    "bf16-kahan": ("bf16-kahan", {}),
    "bf16-kahan in-backward": ("bf16-kahan", {"optimizer_in_backward": True}),
    "bf16-sr": ("bf16-sr", {}),
    "bf16-master remainders": (get_plan("bf16-master", remainders=True), {}),
    "bf16-master remainders in-backward": (get_plan("bf16-master", remainders=True), {"optimizer_in_backward": True}),
    "bf16-master remainders 8-bit-state": (get_plan("bf16-master", remainders=True, state_dtype="8bit"), {}),
    "bf16-kahan 8-bit-state": (get_plan("bf16-kahan", state_dtype="8bit"), {}),
    "bf16-sr 8-bit-state in-backward": (get_plan("bf16-sr", state_dtype="8bit"), {"optimizer_in_backward": True}),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rows", default="", help=f"comma-separated subset of: {', '.join(ROWS)} (fp32 always runs)")
    args = parser.parse_args(argv)
    names = ["fp32", *(n for n in args.rows.split(",") if n and n != "fp32")] if args.rows else list(ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; expected some of {', '.join(ROWS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for name in names:
        plan, options = ROWS[name]
        task = build_task(args.model, size=args.size, seed=0)
        gen = torch.Generator().manual_seed(0)
        batch = task.batch(args.batch, gen)
        est = measure_memory(
            lambda task=task: task.model, plan, lambda batch=batch: batch, criterion=task.criterion,
            session_options=options,
        )
        per_param = est.per_param()["total"]
        rows.append((name, per_param, est.peak))
        print(f"bench_state: {name}: {per_param:.2f} B/param, peak {est.peak / 2**20:.1f} MiB", file=sys.stderr)
    fp32_state, fp32_peak = rows[0][1], rows[0][2]
    print(f"`{shlex.join(['python', 'benchmarks/bench_state.py', *(argv if argv is not None else sys.argv[1:])])}`")
    print(f"({args.model}-{args.size}, batch {args.batch}, AdamW, torch {torch.__version__})\n")
    print("| plan | training state B/param | vs fp32 | step peak | vs fp32 |")
    print("|---|---:|---:|---:|---:|")
    for name, per_param, peak in rows:
        print(f"| {name} | {per_param:.2f} | {per_param / fp32_state:.2f}x | {peak / 2**20:.1f} MiB | {peak / fp32_peak:.2f}x |")


if __name__ == "__main__":
    main()

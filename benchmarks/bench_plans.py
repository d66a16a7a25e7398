"""Every precision plan vs fp32 and vs the plain ``torch.autocast`` loop, side by side.

The benchmark of issue 4: the small GPT (6 layers, 512 wide, sequence 256, batch 8)
and the small CNN of :mod:`mixprec.cli.models`, each trained under every plan next to
fp32 and next to the plain loop (fp32 model, ``torch.autocast("cpu", dtype=torch.bfloat16)``,
``loss.backward()``, ``opt.step()``, ``opt.zero_grad()``), in one process with
interleaved steps (:func:`mixprec.cli.harness.run_bench`, the harness ``mixprec bench`` uses).
Reported per row: median step time and its ratios to both baselines, measured peak
memory of a step, training-state bytes per parameter, and the largest batch whose
estimated peak fits a memory budget (see docs/cli.md for how each is obtained). On CPU the fp16 plans are left out unless ``--include-fp16``
(CPUs have no fast fp16 path: they are slow, which is no news). This is a benchmark,
not a test: it prints Markdown with the command that produced it and never fails on time.

Usage::

    python benchmarks/bench_plans.py                       # small GPT and CNN, every bf16/fp8 plan
    python benchmarks/bench_plans.py --size tiny --repeats 5
    python benchmarks/bench_plans.py --include-fp16 --json bench.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from mixprec.cli.harness import (
    builtin_workload,
    default_plans,
    is_fp16_plan,
    plan_rows,
    run_bench,
)
from mixprec.cli.report import bench_markdown
from mixprec.formatting import parse_bytes


def main(argv: list[str] | None = None) -> int:
    """Run the matrix and print Markdown to stdout."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "cnn"], help="built-in models (default: gpt cnn)")
    parser.add_argument("--size", default="small", choices=["tiny", "small"], help="(default: small)")
    parser.add_argument("--plans", nargs="+", default=None, help="default: every plan (fp16 ones only with --include-fp16)")
    parser.add_argument("--include-fp16", action="store_true", help="also run the fp16 plans (slow on CPU)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per row, median reported (default: 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per row first (default: 2)")
    parser.add_argument("--memory-budget", default="2GiB", help="budget for the max-batch estimate (default: 2GiB)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write every number as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    plans = args.plans or default_plans(include_fp16=args.include_fp16)
    workloads = {w.name: w for w in (builtin_workload(m, args.size) for m in args.models)}
    rows = plan_rows(list(workloads), plans)
    start = time.perf_counter()
    result = run_bench(rows, workloads, repeats=args.repeats, warmup=args.warmup, seed=args.seed,
                       memory_budget=parse_bytes(args.memory_budget), progress=not args.quiet)
    command = shlex.join(["python", "benchmarks/bench_plans.py", *(sys.argv[1:] if argv is None else argv)])
    print(bench_markdown(result, command), end="")
    skipped = [p for p in default_plans(include_fp16=True) if is_fp16_plan(p) and p not in plans]
    if skipped:
        print(f"- fp16 plans left out on CPU (no fast fp16 path): {', '.join(skipped)}; add --include-fp16 to run them.")
    print(f"- wall time {time.perf_counter() - start:.0f} s.")
    if args.json is not None:
        args.json.write_text(json.dumps({"command": command, **result.to_dict()}, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``mixprec bench``: a matrix of models x plans, side by side in one process.

Each row is reported as ratios against fp32 and against the plain ``torch.autocast``
loop running the same step: step time (median of interleaved repeats after warm-up),
peak memory, training-state bytes per parameter, and the largest batch that fits a
memory budget. Markdown goes to stdout (and ``--markdown PATH``); ``--json PATH``
writes every number.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mixprec.cli.common import (
    Command,
    add_model_arguments,
    apply_globals,
    check_writable_file,
    command_line,
    parse_plans,
    positive_int,
    resolve_device,
    resolve_workload,
)
from mixprec.cli.harness import default_plans, plan_rows, run_bench
from mixprec.cli.report import bench_markdown
from mixprec.formatting import parse_bytes

__all__ = ["COMMAND"]


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, default=["gpt", "cnn"], many=True)
    g = p.add_argument_group("matrix")
    g.add_argument("--plans", nargs="+", default=None, metavar="PLAN",
                   help="plans to compare (fp32 and torch.autocast are always added as baselines) "
                        "(default: every plan; fp16 plans only with --include-fp16 on CPU)")
    g.add_argument("--include-fp16", action="store_true",
                   help="include the fp16 plans in the default list (slow on CPUs without fp16 arithmetic)")
    g.add_argument("--batch-size", type=positive_int, default=None, help="default: each model's own")
    g.add_argument("--repeats", type=positive_int, default=5, help="timed steps per row; the median is reported (default: %(default)s)")
    g.add_argument("--warmup", type=positive_int, default=2, help="untimed steps per row first (default: %(default)s)")
    g.add_argument("--memory-budget", default="2GiB", metavar="SIZE",
                   help="report the largest batch whose estimated training memory fits SIZE, e.g. 2GiB, 512MiB "
                        "(default: %(default)s; 'none' to skip)")
    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, default=None, metavar="PATH", help="write all results as JSON")
    o.add_argument("--markdown", type=Path, default=None, metavar="PATH", help="write the Markdown table to a file")


def _run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    plans = parse_plans(args.plans, device=device) if args.plans else default_plans(device.type, include_fp16=args.include_fp16)
    budget = None if str(args.memory_budget).lower() == "none" else parse_bytes(args.memory_budget)
    workloads = {}
    for spec in args.model:
        workload = resolve_workload(spec, args)
        workloads[workload.name] = workload
    for path, what in ((args.json, "JSON file"), (args.markdown, "Markdown file")):
        if path is not None:
            check_writable_file(path, what)
    apply_globals(args)
    rows = plan_rows(list(workloads), plans, batch=args.batch_size)
    result = run_bench(rows, workloads, repeats=args.repeats, warmup=args.warmup, seed=args.seed,
                       memory_budget=budget, progress=not args.quiet, device=str(device))
    command = command_line(args.argv)
    text = bench_markdown(result, command)
    print(text, end="")
    if args.markdown is not None:
        args.markdown.write_text(text, encoding="utf-8")
    if args.json is not None:
        data = {"command": command, **result.to_dict()}
        args.json.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return 0


COMMAND = Command(
    name="bench",
    help="benchmark matrix of models x plans vs fp32 and torch.autocast (Markdown, JSON)",
    description=__doc__.split("\n\n", 1)[1].replace("\n", " ") if __doc__ else "",
    add_arguments=_add_arguments,
    run=_run,
)

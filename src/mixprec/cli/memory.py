"""``mixprec memory``: the estimated training memory of a model under each plan.

Uses :func:`mixprec.diagnostics.memory.estimate_memory`: the model is copied with fake
tensors (shapes and dtypes, no storage), prepared by each plan exactly as
:class:`~mixprec.MixedPrecision` prepares it, and nothing is computed. Per plan: the
bytes of weights, buffers, gradients, fp32 masters and gradient accumulation,
optimizer state and Kahan compensation, and the estimated peak of a step. Activations
are included only with ``--batch-size N`` (one forward is traced at that batch size);
without it the peak covers the training state alone.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from mixprec.cli.common import (
    Command,
    add_model_arguments,
    apply_globals,
    check_writable_file,
    command_line,
    parse_plans,
    positive_int,
    resolve_workload,
)
from mixprec.cli.harness import Workload, default_plans
from mixprec.formatting import format_bytes, markdown_table

__all__ = ["COMMAND"]

OPTIMIZERS = ("adamw", "adam", "sgd-momentum", "sgd")
_COLUMNS = {
    "weights": "weights",
    "buffers": "buffers",
    "grads": "grads",
    "master_weights": "master weights",
    "grad_accumulation": "grad accum.",
    "optimizer_state": "optimizer state",
    "compensation": "compensation",
}


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, default="gpt", default_size="small")
    g = p.add_argument_group("estimate")
    g.add_argument("--plans", nargs="+", default=None, metavar="PLAN",
                   help="plans to estimate (default: every plan)")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="optimizer whose state is counted (default: %(default)s)")
    g.add_argument("--batch-size", type=positive_int, default=None, metavar="N",
                   help="also estimate the activations of a step at this batch size")
    g.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the estimates as JSON")


def _row(plan: str, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    from mixprec.diagnostics.memory import estimate_memory

    task = workload.make(args.seed)
    batch = None
    if args.batch_size is not None:
        batch = task.batch(args.batch_size, torch.Generator().manual_seed(args.seed))
    est = estimate_memory(task.model, plan, optimizer=args.optimizer, batch=batch,
                          criterion=task.criterion if batch is not None else None)
    return {**est.to_dict(), "bytes_per_param": est.per_param()["total"]}


def _run(args: argparse.Namespace) -> int:
    plans = parse_plans(args.plans) if args.plans else default_plans(include_fp16=True)
    workload = resolve_workload(args.model, args)
    if args.json is not None:
        check_writable_file(args.json, "JSON file")
    apply_globals(args)
    rows = [_row(plan, workload, args) for plan in plans]
    with_batch = args.batch_size is not None
    headers = ["plan", *_COLUMNS.values(), *(["activations"] if with_batch else []), "peak (est.)", "state B/param"]
    table = [
        [r["plan"], *(format_bytes(r[k]) for k in _COLUMNS), *([format_bytes(r["activations"])] if with_batch else []),
         format_bytes(r["peak"]), f"{r['bytes_per_param']:.1f}"]
        for r in rows
    ]
    print(f"{workload.name}: {rows[0]['params']:,} parameters, {args.optimizer}"
          + (f", batch {args.batch_size}" if with_batch else ""))
    print(markdown_table(headers, table, "l" + "r" * (len(headers) - 1)))
    if with_batch:
        note = (f"estimated without running the model (fake tensors); activations: what one forward at batch "
                f"{args.batch_size} keeps for backward; peak: state + the larger of (activations + backward's first "
                "gradients) and (gradients + the optimizer step's temporaries)")
    else:
        note = ("estimated without running the model (fake tensors); activations not included: the peak covers the "
                "training state only (pass --batch-size N to include a step's activations)")
    print(f"\n{note}")
    if args.json is not None:
        data = {"format": "mixprec.memory/1", "command": command_line(args.argv), "model": workload.name,
                "optimizer": args.optimizer, "batch_size": args.batch_size, "note": note, "rows": rows}
        args.json.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return 0


COMMAND = Command(
    name="memory",
    help="estimated training memory of a model under each plan",
    description=__doc__.split("\n\n", 1)[1].replace("\n", " ") if __doc__ else "",
    add_arguments=_add_arguments,
    run=_run,
)

"""``mixprec audit``: the precision plan a loop without mixprec effectively runs, its risks and the fix.

Builds the model (``--model``: a built-in one or your ``module:factory``), casts its weights
to ``--weights`` (as a loop that loads a checkpoint in bf16 or fp16 does), makes an AdamW
over its parameters and runs :func:`mixprec.diagnostics.audit` with the loop's autocast dtype
(``--autocast``) and loss scaler (``--scaler``) on one batch: the effective plan, each risk
in numbers (with the modules measured), the mixprec plan and fp32 islands that remove them,
and the one line to switch. ``--strict`` exits with status 1 when a risk was found.
"""

from __future__ import annotations

import argparse

import torch

from mixprec.cli.common import (
    Command,
    add_model_arguments,
    apply_globals,
    positive_int,
    resolve_workload,
)

__all__ = ["COMMAND"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, default="mlp", default_size="tiny")
    g = p.add_argument_group("the loop audited")
    g.add_argument("--weights", choices=sorted(_DTYPES), default="fp32",
                   help="dtype the loop keeps the weights in (default: %(default)s)")
    g.add_argument("--autocast", choices=["none", "bf16", "fp16"], default="none",
                   help="dtype of the loop's torch.autocast (default: %(default)s)")
    g.add_argument("--scaler", choices=["none", "torch"], default="none",
                   help="the loop's loss scaler: none, or torch.amp.GradScaler (default: %(default)s)")
    g.add_argument("--batch-size", type=positive_int, default=16, metavar="N",
                   help="size of the one batch measured (default: %(default)s)")
    g.add_argument("--strict", action="store_true", help="exit with status 1 when a risk is found")


def _run(args: argparse.Namespace) -> int:
    from mixprec.diagnostics import audit

    workload = resolve_workload(args.model, args)
    apply_globals(args)
    task = workload.make(args.seed)
    model = task.model
    if args.weights != "fp32":
        model = model.to(_DTYPES[args.weights])  # floating parameters and buffers only
    batch = task.batch(args.batch_size, torch.Generator().manual_seed(args.seed))
    scaler = torch.amp.GradScaler(batch[0].device.type if isinstance(batch, tuple) else "cpu") \
        if args.scaler == "torch" else None
    report = audit(model, torch.optim.AdamW(model.parameters(), lr=workload.lr), scaler, batch,
                   autocast=None if args.autocast == "none" else args.autocast, criterion=task.criterion)
    print(f"{workload.name}: weights {args.weights}, autocast {args.autocast}, scaler {args.scaler}, AdamW")
    print(report)
    return 1 if args.strict and not report.ok else 0


COMMAND = Command(
    name="audit",
    help="the precision a loop without mixprec effectively runs, its risks, and the plan that fixes them",
    description=__doc__.split("\n\n", 1)[1].replace("\n", " ") if __doc__ else "",
    add_arguments=_add_arguments,
    run=_run,
)

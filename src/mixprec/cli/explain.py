"""``mixprec explain [PLAN]``: the dtype each tensor class uses under a plan.

Without a plan, lists every plan with its one-line summary, and the aliases.
"""

from __future__ import annotations

import argparse

from mixprec.cli.common import Command
from mixprec.formatting import markdown_table
from mixprec.plans import ALIASES, PLANS, get_plan

__all__ = ["COMMAND"]


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", nargs="?", default=None, metavar="PLAN",
                   help="a plan name or alias (fp32, bf16-mixed, bf16-master, O2, ...); omit to list them")


def _run(args: argparse.Namespace) -> int:
    if args.plan is None:
        keys = ("weights", "compute", "master weights", "optimizer state", "loss scaling")
        rows = []
        for name in PLANS:
            dtypes = get_plan(name).tensor_dtypes()
            rows.append([name, *(dtypes[k].split(" (")[0] for k in keys[:-1]), get_plan(name).scaling.kind])
        print(markdown_table(["plan", *keys], rows))
        print("\nmixprec explain PLAN shows every tensor class of one plan.")
        print("\naliases: " + ", ".join(f"{alias}={name}" for alias, name in ALIASES.items()))
        return 0
    plan = get_plan(args.plan)
    given = args.plan.strip()
    if given != plan.name:
        alias = next((a for a in ALIASES if a.lower() == given.lower()), None)
        kind = f"an alias of {plan.name}" if alias is not None else f"read as {plan.name}"
        print(f"{given} is {kind}")
    print(plan.explain())
    return 0


COMMAND = Command(
    name="explain",
    help="show the per-tensor dtype table of a plan (or list the plans)",
    description=__doc__.split("\n\n", 1)[0] if __doc__ else "",
    add_arguments=_add_arguments,
    run=_run,
)

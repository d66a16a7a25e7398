"""What every subcommand shares: the command record, global options, model and plan arguments."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch

from mixprec.bench import TORCH_AUTOCAST, Workload, builtin_workload
from mixprec.plans import resolve_plan_name

__all__ = [
    "Command",
    "OneLineErrorParser",
    "add_model_arguments",
    "apply_globals",
    "check_writable_dir",
    "check_writable_file",
    "command_line",
    "global_options",
    "non_negative_int",
    "parse_plans",
    "positive_float",
    "positive_int",
    "resolve_workload",
    "seed_int",
]


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr, exit status 2 (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


@dataclass(frozen=True)
class Command:
    """A subcommand: its name, one-line help, how it adds its arguments, and what it runs.

    ``run(args)`` returns the exit status. Raise ``ValueError`` / ``OSError`` for bad
    input: ``main`` turns them into a one-line error.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str = ""


def global_options(*, suppress: bool) -> OneLineErrorParser:
    """A parent parser with ``--threads``, ``--seed``, ``--quiet``.

    The top-level parser takes them with defaults; each subcommand takes them too with
    ``suppress=True`` (no default), so ``mixprec --quiet demo`` and ``mixprec demo --quiet``
    both work and the later one wins.
    """
    parser = OneLineErrorParser(add_help=False)
    group = parser.add_argument_group("global options")

    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    group.add_argument("--threads", type=positive_int, default=default(None), metavar="N",
                       help="torch intra-op threads (default: the command's choice: 1 for the demo, "
                            "torch's default otherwise)")
    group.add_argument("--seed", type=seed_int, default=default(0), metavar="N",
                       help=f"seed of model weights, data and everything random, 0 to {MAX_SEED} (default: 0)")
    group.add_argument("--quiet", "-q", action="store_true", default=default(False),
                       help="no progress bars")
    return parser


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


MAX_SEED = 2**63 - 1
"""The largest seed torch's generators take."""


def seed_int(text: str) -> int:
    """argparse type: a seed, 0 <= N <= 2**63 - 1."""
    value = non_negative_int(text)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be at most 2**63-1 = {MAX_SEED}, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite positive number, got {text!r}")
    return value


def apply_globals(args: argparse.Namespace, default_threads: int | None = None) -> None:
    """Set torch's thread count and global seed from the global options."""
    threads = args.threads if args.threads is not None else default_threads
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(args.seed)


def add_model_arguments(parser: argparse.ArgumentParser, *, default: str | Sequence[str], many: bool = False,
                        default_size: str = "tiny") -> None:
    """``--model`` (a built-in name or module:factory), ``--size``, ``--input-shape``, ``--num-classes``."""
    from mixprec.models import SIZES, TASKS

    group = parser.add_argument_group("model")
    shown = " ".join(default) if isinstance(default, list | tuple) else default
    group.add_argument(
        "--model", nargs="+" if many else None, default=default, metavar="MODEL",
        help=f"a built-in model ({', '.join(TASKS)}) or module:factory / path.py:factory "
             f"(your own; see docs/cli.md) (default: {shown})",
    )
    group.add_argument("--size", choices=SIZES, default=default_size,
                       help=f"size of the built-in models (default: {default_size})")
    group.add_argument("--input-shape", default=None, metavar="D[,D...]",
                       help="shape of one input example (no batch dim), e.g. 3,32,32: for a factory that "
                            "returns a plain nn.Module")
    group.add_argument("--num-classes", type=positive_int, default=None, metavar="N",
                       help="number of output classes: for a factory that returns a plain nn.Module")


def resolve_workload(spec: str, args: argparse.Namespace) -> Workload:
    """The workload a ``--model`` value names: a built-in task, or a user factory."""
    if ":" in spec:
        from mixprec.cli.workloads import load_workload

        return load_workload(spec, input_shape=args.input_shape, num_classes=args.num_classes, seed=args.seed)
    return builtin_workload(spec, args.size)


def parse_plans(values: Sequence[str]) -> list[str]:
    """Plan names from ``--plans`` (space- or comma-separated), canonical and de-duplicated."""
    names: list[str] = []
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            names.append(TORCH_AUTOCAST if part == TORCH_AUTOCAST else resolve_plan_name(part))
    if not names:
        raise ValueError("--plans: no plan given")
    return list(dict.fromkeys(names))


def check_writable_dir(path: Path, what: str) -> Path:
    """Create ``path`` and check a file can be written there, before any long work starts."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".mixprec-write-test"
        probe.write_text("", encoding="utf-8")
        probe.unlink()
    except OSError as exc:
        raise OSError(f"cannot write the {what} {str(path)!r}: {exc.strerror or exc}") from None
    return path


def check_writable_file(path: Path, what: str) -> Path:
    """Check ``path`` can be written (creating its folder), before any long work starts."""
    try:
        if path.is_dir():
            raise IsADirectoryError(21, "is a directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with open(path, "a", encoding="utf-8"):
            pass
        if not existed:
            path.unlink()
    except OSError as exc:
        raise OSError(f"cannot write the {what} {str(path)!r}: {exc.strerror or exc}") from None
    return path


def command_line(argv: Sequence[str] | None) -> str:
    """The command as typed (for reports)."""
    words = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["mixprec", *words])

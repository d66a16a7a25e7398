"""What every subcommand shares: the command record, global options, model and plan arguments."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from mixprec.cli.harness import TORCH_AUTOCAST, TaskLike, Workload, builtin_workload
from mixprec.nested import map_tensors
from mixprec.plans import get_plan, resolve_plan_name
from mixprec.plans.auto import is_auto

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
    "on_device",
    "parse_plans",
    "plain_text",
    "positive_float",
    "positive_int",
    "resolve_device",
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
                       help="no progress output (bars on a terminal, one line per plan otherwise)")
    group.add_argument("--device", default=default("cpu"), metavar="DEVICE",
                       help="where models train: cpu, cuda or cuda:N where available (default: cpu)")
    return parser


def resolve_device(text: str) -> torch.device:
    """The device ``--device`` names; ValueError naming the value when torch does not know it
    or this machine does not have it."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {text!r}: not a device name torch knows; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"--device {text!r}: mixprec's commands run on cpu or cuda; use --device cpu or --device cuda")
    if not torch.cuda.is_available():
        raise ValueError(
            f"--device {text!r}: CUDA is not available here (torch {torch.__version__}, "
            "torch.cuda.is_available() is False); use --device cpu"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"--device {text!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        )
    return device


class _OnDevice:
    """A task whose model lives on ``device`` and whose batches are moved there."""

    def __init__(self, task: TaskLike, device: torch.device) -> None:
        self._task = task
        self._device = device
        self.model = task.model.to(device)
        criterion = task.criterion
        self.criterion = criterion.to(device) if isinstance(criterion, torch.nn.Module) else criterion

    def __getattr__(self, name: str) -> Any:  # chance, default_batch_size, ... of the task
        return getattr(self._task, name)

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[Any, Any]:
        return map_tensors(lambda t: t.to(self._device), self._task.batch(batch_size, generator))

    def eval_batch(self, batch_size: int = 256) -> tuple[Any, Any]:
        return map_tensors(lambda t: t.to(self._device), self._task.eval_batch(batch_size))

    def accuracy(self, outputs: Any, targets: Any) -> float | None:
        return self._task.accuracy(outputs, targets)


def on_device(workload: Workload, device: torch.device) -> Workload:
    """``workload`` with its models on ``device`` and its batches moved there (data is drawn on
    the CPU, so every device sees the same numbers)."""
    if device.type == "cpu":
        return workload
    make = workload.make
    return dataclasses.replace(workload, make=lambda seed: _OnDevice(make(seed), device),  # type: ignore[arg-type,return-value]
                               description=f"{workload.description} on {device}")


_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(~?)([^`<]*?)(?:\s*<([^>]+)>)?`")


def plain_text(text: str) -> str:
    """reStructuredText markup of a docstring made plain for ``--help``: roles such as
    ``:func:`~mixprec.diagnostics.advise``` become their target's name (the last part
    with ``~``), double back-quotes are dropped.

    >>> plain_text("writes ``report.md``; see :func:`~mixprec.diagnostics.advise` and :class:`mixprec.Plan`")
    'writes report.md; see advise and mixprec.Plan'
    """

    def role(match: re.Match[str]) -> str:
        tilde, title, target = match.groups()
        name = (target or title).strip()
        if target:
            return title.strip()
        return name.rsplit(".", 1)[-1] if tilde else name

    return _ROLE.sub(role, text).replace("``", "")


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
    from mixprec.cli.models import SIZES, TASKS

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
    """The workload a ``--model`` value names (a built-in task, or a user factory), on ``--device``."""
    device = resolve_device(getattr(args, "device", "cpu"))
    if ":" in spec:
        from mixprec.cli.workloads import load_workload

        workload = load_workload(spec, input_shape=args.input_shape, num_classes=args.num_classes, seed=args.seed)
    else:
        workload = builtin_workload(spec, args.size)
    return on_device(workload, device)


def parse_plans(values: Sequence[str], device: torch.device | str | None = None) -> list[str]:
    """Plan names from ``--plans`` (space- or comma-separated), canonical and de-duplicated;
    ``auto`` becomes the plan ``precision="auto"`` picks on ``device``."""
    names: list[str] = []
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            if is_auto(part):
                names.append(get_plan("auto", device=device).name)
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

"""The ``mixprec`` command: ``demo``, ``bench``, ``explain``, ``memory``, ``inspect``, ``audit``.

Each subcommand lives in a module of this package that defines ``COMMAND``
(a :class:`~mixprec.cli.common.Command`); adding one means adding a module and its
name to :data:`COMMAND_MODULES`. Bad input (an unknown plan or model, an unwritable
output path, a bad ``--model`` spec, an option out of range) ends with a one-line error
on stderr and exit status 2, without a traceback; a run that fails (a diverging model)
ends with a one-line error and exit status 1; Ctrl-C (also while the command starts)
with one line and status 130, SIGTERM with one line and status 143, after the run
removed what it had half-written. Set ``MIXPREC_TRACEBACK=1`` to see the traceback of a
failed run.

>>> main(["explain", "bf16-master"])  # doctest: +ELLIPSIS
plan bf16-master: ...
  master weights     fp32
...
0
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from types import FrameType

from mixprec.cli.common import Command, OneLineErrorParser, global_options, plain_text
from mixprec.startup import INTERRUPTED_STATUS, interrupted_while_starting

__all__ = ["COMMAND_MODULES", "Terminated", "build_parser", "commands", "main"]

COMMAND_MODULES: tuple[str, ...] = ("demo", "bench", "explain", "memory", "inspect", "audit")
"""Subcommand modules, in help order (``inspect`` joins here with ``mixprec.cli.inspect``)."""

EXIT_USAGE = 2
EXIT_FAILED = 1
EXIT_TERMINATED = 128 + 15  # SIGTERM, as shells report it


class Terminated(BaseException):
    """SIGTERM during a command, raised where the command runs so that its ``finally``
    blocks remove what it had half-written (a BaseException: ``except Exception`` lets it pass)."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def _ctrl_c_raises() -> None:
    """Ctrl-C as Python's KeyboardInterrupt again, where :mod:`mixprec.startup` made it exit
    at once while the command started (a run's ``finally`` blocks then clean up)."""
    if signal.getsignal(signal.SIGINT) is interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def _command_signals() -> Iterator[None]:
    """SIGTERM raising :class:`Terminated` while a command runs in the main thread (a
    handler someone else installed is left alone)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ours = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if ours:
        signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        if ours:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def commands() -> list[Command]:
    """The registered subcommands."""
    return [importlib.import_module(f"mixprec.cli.{name}").COMMAND for name in COMMAND_MODULES]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``mixprec`` and all its subcommands."""
    import torch

    import mixprec

    parser = OneLineErrorParser(
        prog="mixprec",
        description="Automatic mixed precision for PyTorch training: demo runs, benchmarks, plan tables, "
                    "memory estimates.",
        parents=[global_options(suppress=False)],
    )
    parser.add_argument("--version", action="version", version=f"mixprec {mixprec.__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrorParser)
    for command in commands():
        p = sub.add_parser(command.name, help=plain_text(command.help),
                           description=plain_text(command.description or command.help),
                           parents=[global_options(suppress=True)])
        command.add_arguments(p)
        for action in p._actions:  # option help written with docstring markup
            if action.help:
                action.help = plain_text(action.help)
        p.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mixprec`` with ``argv`` (default: the process arguments); returns the exit status."""
    name = "mixprec"
    with _command_signals():
        try:
            parser = build_parser()
            args = parser.parse_args(None if argv is None else list(argv))
            if args.command is None:
                parser.print_help(sys.stderr)
                return EXIT_USAGE
            name = f"mixprec {args.command}"
            args.argv = list(sys.argv[1:] if argv is None else argv)
            _ctrl_c_raises()
            return _run(args)
        except KeyboardInterrupt:
            print(f"{name}: interrupted", file=sys.stderr)
            return INTERRUPTED_STATUS
        except Terminated:
            print(f"{name}: terminated", file=sys.stderr)
            return EXIT_TERMINATED


def _run(args: argparse.Namespace) -> int:
    """``args.run(args)``, its expected failures as one line and an exit status."""
    try:
        return int(args.run(args))
    except (ValueError, OSError, ImportError) as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"mixprec {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except (RuntimeError, ArithmeticError) as exc:
        if os.environ.get("MIXPREC_TRACEBACK"):
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"mixprec {args.command}: failed: {message} (MIXPREC_TRACEBACK=1 shows where)", file=sys.stderr)
        return EXIT_FAILED

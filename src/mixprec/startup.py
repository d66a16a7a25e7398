"""Ctrl-C while the ``mixprec`` command starts: one line and exit status 130, no traceback.

Importing torch takes the first seconds of every ``mixprec`` run, before the command's
own handling (:func:`mixprec.cli.main`) exists. ``mixprec/__init__.py`` imports this module
first, and importing it calls :func:`quiet_interrupts_while_starting`: when this process is
the command (``mixprec ...``, ``python -m mixprec ...`` or ``python -m mixprec.cli ...``),
Ctrl-C until the command's arguments are parsed prints ``mixprec: interrupted`` and exits
with status 130; :func:`mixprec.cli.main` then hands SIGINT back to Python's
KeyboardInterrupt. A program that imports mixprec is left alone. Only the standard
library is imported here, so this runs before torch loads.

>>> launched_as_command(["python", "-m", "mixprec", "demo"], "-m")
True
>>> launched_as_command(["python", "train.py"], "train.py")
False
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import PurePath
from types import FrameType

__all__ = ["INTERRUPTED_STATUS", "interrupted_while_starting", "launched_as_command", "quiet_interrupts_while_starting"]

#: The exit status of a command ended by Ctrl-C (128 + SIGINT, what shells report).
INTERRUPTED_STATUS = 130

_MODULES = ("mixprec", "mixprec.cli", "mixprec.__main__", "mixprec.cli.__main__")


def launched_as_command(orig_argv: Sequence[str], argv0: str) -> bool:
    """Whether the process runs the ``mixprec`` command: ``python -m mixprec[.cli]`` (read
    from the interpreter's own arguments) or the ``mixprec`` console script."""
    args = list(orig_argv)[1:]
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-", "--"):
        arg = args[i]
        i += 1
        if arg.startswith("--"):  # --check-hash-based-pycs MODE; other long options take none
            i += arg == "--check-hash-based-pycs"
            continue
        for j, flag in enumerate(arg[1:], start=2):  # a cluster of short options: -IBm mixprec
            if flag in "cmWX":  # these take a value: the rest of the cluster, or the next argument
                value = arg[j:] or (args[i] if i < len(args) else "")
                i += not arg[j:]
                if flag == "m":
                    return value in _MODULES
                if flag == "c":
                    return False
                break
    return PurePath(argv0).name.removesuffix(".exe").removesuffix("-script.py") == "mixprec"


def interrupted_while_starting(signum: int, frame: FrameType | None) -> None:
    """The SIGINT handler while the command starts: one line on stderr, exit status 130.

    It exits at once rather than raising: an exception raised inside a module being
    imported can be swallowed by the code importing it (an extension module's
    initialisation), and nothing has been written yet that would need cleaning up."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.write("mixprec: interrupted\n")
        sys.stderr.flush()
    os._exit(INTERRUPTED_STATUS)


def quiet_interrupts_while_starting() -> None:
    """Install :func:`interrupted_while_starting` for SIGINT when this process is the
    ``mixprec`` command and SIGINT still has Python's default handler (nothing else
    installed one); otherwise do nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    if not launched_as_command(getattr(sys, "orig_argv", ()), sys.argv[0] if sys.argv else ""):
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, interrupted_while_starting)


quiet_interrupts_while_starting()  # on import: mixprec/__init__.py imports this module first

"""Progress output of long runs: bars on a terminal, one line per finished variant otherwise."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["progress_bar", "progress_bars_wanted", "progress_line"]


def progress_bars_wanted(enabled: bool, stream: Any = None) -> bool:
    """Progress bars only on a terminal: piped to a file, a bar's redraws are a wall of
    carriage returns, so callers print one line per finished plan instead."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return enabled and callable(isatty) and bool(isatty())


def progress_line(text: str) -> None:
    """One line of progress on stderr (where no bar is drawn)."""
    print(text, file=sys.stderr, flush=True)


def progress_bar(total: int, desc: str, enabled: bool, position: int = 0) -> Any:
    """A tqdm bar of ``total`` steps on a terminal; None when bars are off, not wanted or tqdm is missing."""
    if not progress_bars_wanted(enabled):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the cli extra is not installed: no bars
        return None
    return tqdm(total=total, desc=desc, position=position, leave=True, dynamic_ncols=True)

"""Formatting for people: bytes, numbers, module names and plain-text tables.

The one place these rules live; the diagnostics, the tracer and the command line use it.

>>> from mixprec.formatting import format_number, format_table, human_bytes
>>> human_bytes(1536), format_number(float("inf")), format_number(None)
('1.50 KiB', 'inf', '-')
>>> print(format_table(["module", "bytes"], [["fc", "12"], ["head", "3"]]))
module  bytes
------  -----
fc         12
head        3
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["display_name", "format_number", "format_table", "human_bytes"]


def display_name(name: str) -> str:
    """The root module's qualified name is ``""``; show it as ``<root>``."""
    return name if name else "<root>"


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.50 KiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"  # pragma: no cover


def format_number(x: float | None, spec: str = ".3g") -> str:
    """``x`` formatted with ``spec``; ``None`` is ``"-"``, non-finite values are spelled out."""
    if x is None:
        return "-"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return format(x, spec)


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, align_left: int = 1) -> str:
    """A plain-text table; the first ``align_left`` columns are left-aligned, the rest right."""
    cols = list(zip(header, *rows, strict=False)) if rows else [(h,) for h in header]
    widths = [max(len(str(c)) for c in col) for col in cols]

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, (c, w) in enumerate(zip(cells, widths, strict=False)):
            out.append(str(c).ljust(w) if i < align_left else str(c).rjust(w))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(r) for r in rows)])

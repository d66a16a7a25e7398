"""Small helpers shared by the diagnostics: floating tensors of nested outputs, module names, tables."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from mixprec.nested import map_tensors, tensors

__all__ = ["display_name", "floating_tensors", "format_number", "format_table", "human_bytes", "map_floating"]


def floating_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every floating-point tensor in a (nested) value, in order (see :mod:`mixprec.nested`)."""
    return (t for t in tensors(value) if t.is_floating_point())


def map_floating(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to every floating tensor; containers keep their types
    (see :func:`mixprec.nested.map_tensors`)."""
    return map_tensors(lambda t: fn(t) if t.is_floating_point() else t, value)


def display_name(name: str) -> str:
    """The root module's qualified name is ``""``; show it as ``<root>``."""
    return name if name else "<root>"


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"  # pragma: no cover


def format_number(x: float | None, spec: str = ".3g") -> str:
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

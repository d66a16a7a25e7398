"""Formatting for people: sizes, numbers, ratios, module names and tables.

The one set of formatters of mixprec: the tracer, the diagnostics and the command (its
reports and tables) write through it, and it reads sizes given on the command line.

>>> format_bytes(3 * 2**20), format_bytes(None)
('3.00 MiB', 'n/a')
>>> parse_bytes("2GiB"), parse_bytes("1.5 GB")
(2147483648, 1500000000)
>>> format_number(0.12345), format_number(float("inf")), format_number(None)
('0.123', 'inf', '-')
>>> format_number(float("nan"), ".3f", missing="n/a", keep_nonfinite=False), format_ratio(1.5), plural(2, "step")
('n/a', '1.50x', '2 steps')
>>> print(markdown_table(["plan", "ms"], [["fp32", "12.0"], ["bf16-mixed", "5.1"]]))
| plan       | ms   |
|------------|------|
| fp32       | 12.0 |
| bf16-mixed | 5.1  |
>>> print(format_table(["module", "bytes"], [["fc", "12"], ["head", "3"]]))
module  bytes
------  -----
fc         12
head        3
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

__all__ = [
    "Text",
    "display_name",
    "format_bytes",
    "format_number",
    "format_ratio",
    "format_table",
    "markdown_table",
    "parse_bytes",
    "plural",
]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"512 MiB"``, ``"1.5GB"``, ``"1000000"`` -> bytes.

    >>> parse_bytes("512 MiB")
    536870912
    >>> parse_bytes("2 parsecs")
    Traceback (most recent call last):
    ...
    ValueError: cannot read '2 parsecs' as a memory size; write it like 2GiB, 512MiB or 1.5GB
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a memory size; write it like 2GiB, 512MiB or 1.5GB")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return int(value)


def format_bytes(n: float | None) -> str:
    """Bytes in binary units (``"1.50 GiB"``, ``"12 B"``); ``"n/a"`` for None.

    >>> format_bytes(1536), format_bytes(12), format_bytes(5 * 2**30)
    ('1.50 KiB', '12 B', '5.00 GiB')
    """
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_number(value: float | None, spec: str = ".3g", *, missing: str = "-", keep_nonfinite: bool = True) -> str:
    """``value`` formatted with ``spec``; ``missing`` for None.

    Non-finite values are spelled out (``"nan"``, ``"inf"``, ``"-inf"``), or are ``missing``
    with ``keep_nonfinite=False`` (a table cell where an infinity means "no measurement").

    >>> format_number(2.0, ".1f"), format_number(float("-inf")), format_number(float("nan"), keep_nonfinite=False)
    ('2.0', '-inf', '-')
    """
    if value is None or (not keep_nonfinite and not math.isfinite(value)):
        return missing
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return format(value, spec)


def format_ratio(value: float | None) -> str:
    """A ratio as ``"1.23x"``; ``"n/a"`` for None or a non-finite value.

    >>> format_ratio(0.5), format_ratio(None)
    ('0.50x', 'n/a')
    """
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.2f}x"


def plural(n: int, word: str) -> str:
    """``n`` and ``word``, with an ``s`` unless ``n`` is 1.

    >>> plural(1, "thread"), plural(4, "thread")
    ('1 thread', '4 threads')
    """
    return f"{n} {word}" + ("" if n == 1 else "s")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """A padded Markdown table (readable as plain text too). ``align``: one of "l"/"r" per column.

    >>> print(markdown_table(["plan", "ms"], [["fp32", "12.0"]], "lr"))
    | plan |   ms |
    |------|-----:|
    | fp32 | 12.0 |
    """
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    align = align or "l" * len(headers)

    def line(cells: Sequence[str]) -> str:
        padded = [str(c).rjust(w) if a == "r" else str(c).ljust(w) for c, w, a in zip(cells, widths, align, strict=True)]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else "-" * (w + 2) for w, a in zip(widths, align, strict=True)) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def display_name(name: str) -> str:
    """The root module's qualified name is ``""``; show it as ``<root>``."""
    return name if name else "<root>"


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


class Text(str):
    r"""A string that an interactive session shows as the text itself (a table prints as a
    table when ``explain()`` is typed at a prompt), while code gets an ordinary ``str``.

    >>> Text("a\nb")
    a
    b
    >>> Text("a\nb").splitlines()
    ['a', 'b']
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)

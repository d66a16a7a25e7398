"""Operator statistics: how many times each op ran in each dtype (Paddle's op stats).

:func:`op_stats` counts the aten ops that actually execute, below autocast and
autograd, so each op is seen with the dtype autocast (and mixprec's op lists) gave
it, backward ops included when backward runs inside the block.

>>> import torch
>>> from mixprec.stats import op_stats
>>> lin = torch.nn.Linear(4, 4)
>>> with op_stats() as stats:
...     with torch.autocast("cpu", dtype=torch.bfloat16):
...         y = lin(torch.randn(2, 4))
>>> stats[("addmm", torch.bfloat16)]
1
>>> print(stats)  # doctest: +ELLIPSIS
| op | fp32 | bf16 | fp16 | other |
...
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.dtypes import dtype_name
from mixprec.nested import first_tensor

__all__ = ["OpStats", "op_stats"]

_COLUMNS = (torch.float32, torch.bfloat16, torch.float16)


class OpStats(Mapping[tuple[str, torch.dtype], int]):
    """A read-only mapping ``(op_name, dtype) -> count``; ``str()`` is a Markdown table.

    ``op_name`` is the aten op name without overload ("mm", "_to_copy"); ops of other
    namespaces keep it ("mylib::my_op"). ``dtype`` is the dtype the op ran in: that
    of its first floating output, else of its first floating input, else of its
    first tensor.
    """

    def __init__(self) -> None:
        self._counts: dict[tuple[str, torch.dtype], int] = {}
        self._lock = threading.Lock()

    def _add(self, op: str, dtype: torch.dtype) -> None:
        key = (op, dtype)
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1

    def counting_mode(self) -> TorchDispatchMode:
        """A dispatch mode that counts the ops run under it into this object (what
        :func:`op_stats` enters)."""
        return _CountingMode(self._add)

    def __getitem__(self, key: tuple[str, torch.dtype]) -> int:
        return self._counts[key]

    def __iter__(self) -> Iterator[tuple[str, torch.dtype]]:
        return iter(dict(self._counts))

    def __len__(self) -> int:
        return len(self._counts)

    def calls(self, op: str | None = None, dtype: torch.dtype | None = None) -> int:
        """Total calls, optionally of one op and/or in one dtype."""
        return sum(
            n for (o, d), n in self._counts.items()
            if (op is None or o == op) and (dtype is None or d == dtype)
        )  # fmt: skip

    def dtypes_of(self, op: str) -> set[torch.dtype]:
        """The dtypes ``op`` ran in."""
        return {d for (o, d) in self._counts if o == op}

    def __repr__(self) -> str:
        return f"OpStats({len(self._counts)} entries, {self.calls()} calls)"

    def __str__(self) -> str:
        ops = sorted({o for o, _ in self._counts})
        header = "| op | " + " | ".join(dtype_name(d) for d in _COLUMNS) + " | other |"
        lines = [header, "|---|" + "---:|" * (len(_COLUMNS) + 1)]
        for op in ops:
            cells = [str(self._counts.get((op, d), 0)) for d in _COLUMNS]
            other = {d: n for (o, d), n in self._counts.items() if o == op and d not in _COLUMNS}
            other_text = ", ".join(
                f"{dtype_name(d)}: {n}" for d, n in sorted(other.items(), key=str)
            )
            lines.append(f"| {op} | " + " | ".join(cells) + f" | {other_text or 0} |")
        return "\n".join(lines)


def _first_dtype(value: Any, floating: bool) -> torch.dtype | None:
    found = first_tensor(value, _is_floating if floating else None)
    return None if found is None else found.dtype


def _is_floating(t: torch.Tensor) -> bool:
    return t.is_floating_point()


def _op_name(func: Any) -> str:
    packet = func.overloadpacket
    namespace = getattr(func, "namespace", "aten")
    name = packet.__name__
    return name if namespace == "aten" else f"{namespace}::{name}"


class _CountingMode(TorchDispatchMode):
    def __init__(self, record: Callable[[str, torch.dtype], None]) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        dtype = (
            _first_dtype(out, True)
            or _first_dtype((args, kwargs), True)
            or _first_dtype(out, False)
            or _first_dtype((args, kwargs), False)
        )
        if dtype is not None:
            self.record(_op_name(func), dtype)
        return out


@contextlib.contextmanager
def op_stats() -> Iterator[OpStats]:
    """Count the aten ops run inside the block, per (op, dtype); yields an :class:`OpStats`.

    Works in eager mode (a ``torch.compile``'d function is counted only while it is
    traced). The counts stay readable after the block.
    """
    stats = OpStats()
    with stats.counting_mode():
        yield stats

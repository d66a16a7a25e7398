"""The default tables: the pinned ones corrected by what the running torch's autocast does.

PyTorch's autocast lists change between releases (torch 2.11's CUDA autocast has no
``rms_norm`` kernel but casts ``_cudnn_rnn``; 2.13's is the other way round), so the
default table of a device type is the pinned table (:mod:`mixprec.policy.tables`)
corrected op by op by the running torch:

- which ops torch autocasts is read from the dispatcher
  (:func:`~mixprec.policy.torch_autocast_ops`): a pinned op that the running torch
  does not autocast leaves the table;
- their classes come from a *table source*. :mod:`mixprec.amp` installs one that runs
  each op on tiny inputs under autocast and reads the dtypes that come out (this
  package never touches tensors). An op the source cannot run keeps its pinned class;
  one the pinned tables do not name either is *unresolved* and left to torch.

:func:`torch_table` is the running torch's word alone, :func:`default_table` the
corrected table (what :class:`~mixprec.policy.OpPolicy` edits) and
:func:`table_changes` the ops where it differs from the pinned tables. Each is worked
out once per process, device type and dtype, on first use (never at import).

>>> import torch
>>> from mixprec.policy import default_table, table_changes
>>> default_table("cpu", torch.bfloat16).precision_of("linear")
<Precision.LOW: 'low'>
>>> isinstance(table_changes("cpu"), dict)
True
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from mixprec.policy.compare import torch_autocast_ops
from mixprec.policy.tables import PINNED_SOURCE, OpTable, class_name, pinned_table

__all__ = [
    "TableSource",
    "clear_torch_tables",
    "corrected_table",
    "default_table",
    "set_torch_table_source",
    "table_changes",
    "torch_table",
    "torch_table_source",
]

#: ``source(device_type, dtype, ops)``: the running torch's classes of ``ops`` (the ops it
#: autocasts; every pinned op when the dispatcher does not say) as an :class:`OpTable`
#: whose ``unresolved`` holds the ops it could not classify, or a str saying why it
#: cannot run them now (then the pinned classes stand).
TableSource = Callable[[str, torch.dtype, frozenset[str]], "OpTable | str"]

_LOCK = threading.RLock()
_SOURCE: TableSource | None = None
_TORCH: dict[tuple[str, torch.dtype], OpTable] = {}
_REGISTRATIONS_ONLY: dict[tuple[str, torch.dtype, str], OpTable] = {}
_DEFAULT: dict[tuple[str, torch.dtype], tuple[OpTable, OpTable]] = {}


def set_torch_table_source(source: TableSource | None) -> TableSource | None:
    """Install the function that classifies the running torch's autocast ops (None: none,
    so the default tables are the pinned classes of the ops torch autocasts). Returns
    the previous one; the tables are worked out again on next use."""
    global _SOURCE
    with _LOCK:
        previous, _SOURCE = _SOURCE, source
        clear_torch_tables()
    return previous


def torch_table_source() -> TableSource | None:
    """The installed table source (:mod:`mixprec.amp`'s probe once mixprec is imported)."""
    return _SOURCE


def clear_torch_tables() -> None:
    """Forget the tables worked out so far; the next use works them out again."""
    with _LOCK:
        _TORCH.clear()
        _REGISTRATIONS_ONLY.clear()
        _DEFAULT.clear()


def torch_table(device_type: str, dtype: torch.dtype | str = torch.bfloat16) -> OpTable:
    """What the running torch's autocast does on ``device_type`` with ``dtype``, op by op.

    Holds only the ops torch autocasts (every pinned op when the dispatcher does not
    say); ``unresolved`` are those whose class could not be found. Worked out on first
    use and kept. Where the source cannot run the ops now (CUDA not initialized yet, or
    while ``torch.compile`` traces), the table is the registered ops with the pinned
    classes, and the source is asked again on the next use.

    >>> import torch
    >>> from mixprec.policy import torch_table
    >>> table = torch_table("cpu", torch.bfloat16)
    >>> table.precision_of("mm"), table.precision_of("relu")
    (<Precision.LOW: 'low'>, None)
    """
    pinned = pinned_table(device_type, dtype)  # refuses a device type or dtype without tables
    key = (device_type, pinned.dtype)
    with _LOCK:
        found = _TORCH.get(key)
        if found is not None:
            return found
        registered = torch_autocast_ops(device_type)
        asked = registered if registered is not None else pinned.ops
        source = _SOURCE
        if source is None:
            why = "no table source installed"
        elif torch.compiler.is_compiling():
            why = "not run while torch.compile traces"
        else:
            try:
                result = source(device_type, pinned.dtype, asked)
            except Exception as err:  # a broken source must not break autocast: the pinned classes stand
                why = f"the table source failed ({type(err).__name__}: {err})"
                _TORCH[key] = _registrations_only(pinned, asked, registered is not None, why)
                return _TORCH[key]
            if isinstance(result, OpTable):
                _TORCH[key] = result
                return result
            why = result
        only = _REGISTRATIONS_ONLY.get((*key, why))
        if only is None:
            only = _registrations_only(pinned, asked, registered is not None, why)
            _REGISTRATIONS_ONLY[(*key, why)] = only
        return only


def _registrations_only(pinned: OpTable, asked: frozenset[str], read: bool, why: str) -> OpTable:
    what = "its autocast registrations" if read else "the pinned ops (torch does not list its autocast ops)"
    return OpTable(
        pinned.device_type,
        pinned.dtype,
        frozenset(),
        frozenset(),
        frozenset(),
        unresolved=asked,
        source=f"{what} with the pinned classes, ops not run: {why}",
    )


def corrected_table(pinned: OpTable, running: OpTable) -> OpTable:
    """``pinned`` corrected by ``running`` (a :func:`torch_table`): each op takes the
    running torch's class; an unresolved one keeps its pinned class (or stays
    unresolved); a pinned op that ``running`` leaves alone leaves the table."""
    sets: dict[str, set[str]] = {"low": set(), "fp32": set(), "promote": set(), "refused": set(), "unknown": set()}
    for op in pinned.ops | running.ops | running.unresolved:
        word = class_name(running, op)
        if word == "unknown":
            word = class_name(pinned, op)
            if word == "none":
                word = "unknown"
        if word != "none":
            sets[word].add(op)
    return OpTable(
        pinned.device_type,
        pinned.dtype,
        frozenset(sets["low"]),
        frozenset(sets["fp32"]),
        frozenset(sets["promote"]),
        frozenset(sets["refused"]),
        frozenset(sets["unknown"]),
        source=f"of torch {torch.__version__} ({running.source}; fallback: {PINNED_SOURCE})",
    )


def default_table(device_type: str, dtype: torch.dtype | str = torch.bfloat16) -> OpTable:
    """The default table for ``device_type`` ("cpu" / "cuda") and ``dtype``: the pinned
    table corrected by what the running torch's autocast does (:func:`torch_table`).

    >>> import torch
    >>> from mixprec.policy import default_table
    >>> "softmax" in default_table("cpu", torch.bfloat16).fp32
    False
    >>> default_table("cpu", torch.bfloat16).precision_of("cat")
    <Precision.PROMOTE: 'promote'>
    """
    pinned = pinned_table(device_type, dtype)
    running = torch_table(device_type, pinned.dtype)
    key = (device_type, pinned.dtype)
    with _LOCK:
        hit = _DEFAULT.get(key)
        if hit is not None and hit[0] is running:
            return hit[1]
        table = corrected_table(pinned, running)
        _DEFAULT[key] = (running, table)
        return table


def table_changes(
    device_type: str, dtype: torch.dtype | str = torch.bfloat16
) -> dict[str, tuple[str, str]]:
    """The ops whose default class on this torch differs from the pinned tables:
    ``{op: (pinned class, this torch's class)}`` in words ("low", "fp32", "promote",
    "refused", "unknown", "none"), sorted by op.

    >>> import torch
    >>> from mixprec.policy import table_changes
    >>> all(pinned != here for pinned, here in table_changes("cpu").values())
    True
    """
    pinned = pinned_table(device_type, dtype)
    table = default_table(device_type, pinned.dtype)
    changes: dict[str, tuple[str, str]] = {}
    for op in sorted(pinned.ops | table.ops | table.unresolved):
        before, now = class_name(pinned, op), class_name(table, op)
        if before != now:
            changes[op] = (before, now)
    return changes

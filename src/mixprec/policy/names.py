"""Validating what users write in a policy: op names and fp32-module rules.

Op names are checked against mixprec's pinned tables and the aten ops torch knows,
so a typo fails at once with the close matches instead of silently doing nothing.

>>> from mixprec.policy.names import as_op_names, normalize_op_name
>>> normalize_op_name("__rmatmul__"), normalize_op_name("aten::linear")
('matmul', 'linear')
>>> as_op_names(["softmax", "__matmul__", "softmax"], "lower_ops")
('softmax', 'matmul')
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mixprec.policy.tables import OP_ALIASES, all_table_ops

__all__ = [
    "ModuleRule",
    "as_module_rules",
    "as_op_name",
    "as_op_names",
    "known_op_names",
    "normalize_op_name",
]

#: An fp32-module rule: an ``nn.Module`` class or a glob over qualified module names.
ModuleRule = type[nn.Module] | str


@functools.cache
def _aten_op_names() -> frozenset[str]:
    names: set[str] = set()
    list_ops = getattr(torch._C, "_dispatch_get_all_op_names", None)
    if list_ops is None:  # unknown names are then checked one by one on torch.ops.aten
        return frozenset()
    for qualified in list_ops():
        namespace, _, rest = qualified.partition("::")
        if namespace == "aten":
            names.add(rest.partition(".")[0])
    return frozenset(names)


def known_op_names() -> frozenset[str]:
    """Every op name an :class:`~mixprec.policy.OpPolicy` accepts: mixprec's tables plus torch's aten ops."""
    return all_table_ops() | _aten_op_names()


def _is_aten_op(name: str) -> bool:
    if name in _aten_op_names():
        return True
    try:  # ops registered lazily after the first scan
        getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def normalize_op_name(name: str) -> str:
    """The table name of a Python-level op name: ``"__matmul__"`` -> ``"matmul"``,
    ``"aten::softmax"`` -> ``"softmax"``, ``"cross_entropy"`` -> ``"cross_entropy_loss"``.

    >>> from mixprec.policy import normalize_op_name
    >>> normalize_op_name("__rmatmul__"), normalize_op_name("aten::linear")
    ('matmul', 'linear')
    """
    if not isinstance(name, str):
        raise TypeError(
            f"an op name is a str such as 'linear' or 'aten::softmax', got {name!r} of type {type(name).__name__}"
        )
    name = name.strip().removeprefix("aten::")
    return OP_ALIASES.get(name, name)


def as_op_name(name: object, field: str) -> str:
    """``name`` validated and normalized: TypeError unless a str, ValueError (with the close
    matches) unless mixprec's tables or torch.ops.aten know it. ``field`` names the
    argument in the messages."""
    if not isinstance(name, str):
        raise TypeError(
            f"{field} takes op names (str) such as 'linear' or 'softmax', got {name!r} "
            f"of type {type(name).__name__}"
        )
    op = normalize_op_name(name)
    if "." in op:
        base = op.partition(".")[0]
        raise ValueError(
            f"{field} got {name!r}: op names are given without overload; use {base!r}, "
            "which covers all its overloads"
        )
    if op in all_table_ops() or _is_aten_op(op):
        return op
    close = difflib.get_close_matches(op, sorted(known_op_names()), n=3, cutoff=0.6)
    hint = (
        "did you mean " + ", ".join(repr(c) for c in close) + "?"
        if close
        else "op names are aten names as in PyTorch's autocast tables, e.g. 'linear', 'softmax'"
    )
    raise ValueError(
        f"unknown op name {name!r} in {field}: neither mixprec's autocast tables nor "
        f"torch.ops.aten know it; {hint}"
    )


def as_op_names(value: Iterable[str] | str, field: str) -> tuple[str, ...]:
    """``value`` (one op name or a sequence of them) validated and normalized, duplicates dropped.

    ``field`` names the argument in error messages ("lower_ops", "fp32_ops").
    """
    items: Iterable[Any] = (value,) if isinstance(value, str) else value
    try:
        items = tuple(items)
    except TypeError:
        raise TypeError(f"{field} must be a sequence of op names, got {value!r}") from None
    return tuple(dict.fromkeys(as_op_name(v, field) for v in items))


def as_module_rules(value: Iterable[ModuleRule] | ModuleRule) -> tuple[ModuleRule, ...]:
    """``value`` (one rule or a sequence of them) validated as ``fp32_modules`` rules, duplicates dropped.

    >>> from torch import nn
    >>> from mixprec.policy import as_module_rules
    >>> as_module_rules(nn.LayerNorm), as_module_rules(["*.attn", "*.attn"])
    ((<class 'torch.nn.modules.normalization.LayerNorm'>,), ('*.attn',))
    """
    items: Iterable[Any] = (value,) if isinstance(value, str | type) else value
    try:
        items = tuple(items)
    except TypeError:
        raise TypeError(
            "fp32_modules takes a sequence of nn.Module classes (e.g. nn.LayerNorm) or qualified-name "
            f"globs (e.g. '*.attn.softmax'), got {value!r}"
        ) from None
    rules: list[ModuleRule] = []
    for item in items:
        if isinstance(item, str) or (isinstance(item, type) and issubclass(item, nn.Module)):
            rules.append(item)
        else:
            raise TypeError(
                "fp32_modules takes nn.Module classes (e.g. nn.LayerNorm) or qualified-name "
                f"globs (e.g. '*.attn.softmax'), got {item!r}"
            )
    return tuple(dict.fromkeys(rules))

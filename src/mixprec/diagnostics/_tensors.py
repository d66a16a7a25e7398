"""Floating tensors of nested outputs, for the diagnostics (formatting is in :mod:`mixprec.formatting`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from mixprec.nested import map_tensors, tensors

__all__ = ["floating_tensors", "map_floating"]


def floating_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every floating-point tensor in a (nested) value, in order (see :mod:`mixprec.nested`)."""
    return (t for t in tensors(value) if t.is_floating_point())


def map_floating(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to every floating tensor; containers keep their types
    (see :func:`mixprec.nested.map_tensors`)."""
    return map_tensors(lambda t: fn(t) if t.is_floating_point() else t, value)

"""Walking nested structures of tensors: the one set of rules every layer uses.

Batches, model outputs and op arguments nest tensors in lists, tuples, namedtuples,
dicts (also dict subclasses such as model-output records) and dataclasses. These
helpers visit them the same way everywhere:

- a container is rebuilt with its own type (a namedtuple stays that namedtuple, a dict
  subclass keeps its class and attributes, a dataclass is copied field by field);
- a container in which nothing changed is returned as is (no copy);
- anything else (numbers, strings, ``None``, custom objects) is left untouched.

>>> import collections, torch
>>> from mixprec.nested import map_tensors, tensors
>>> Batch = collections.namedtuple("Batch", "x y")
>>> out = map_tensors(lambda t: t.to(torch.bfloat16), {"b": Batch(torch.ones(2), [torch.zeros(1)])})
>>> type(out["b"]).__name__, out["b"].x.dtype, out["b"].y[0].dtype
('Batch', torch.bfloat16, torch.bfloat16)
>>> [t.shape[0] for t in tensors(out)]
[2, 1]
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["by_device_dtype", "first_tensor", "floating_tensors", "map_floating", "map_tensors", "tensors"]

# Leaves that are common in op arguments: checked first so walking them costs one lookup.
_ATOMS = frozenset({int, float, bool, str, bytes, type(None), torch.dtype, torch.device, slice, complex})


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor in it; containers keep their types."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    kind = type(value)
    if kind in _ATOMS:
        return value
    if isinstance(value, list | tuple):
        items = [map_tensors(fn, v) for v in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        if kind is list or kind is tuple:
            return kind(items)
        if hasattr(value, "_fields"):  # namedtuple
            return kind(*items)
        return kind(items)
    if isinstance(value, dict):
        changed = {}
        for k, v in value.items():  # a plain loop: torch.compile traces it without graph breaks
            m = map_tensors(fn, v)
            if m is not v:
                changed[k] = m
        if not changed:
            return value
        if kind is dict:
            return {k: changed.get(k, v) for k, v in value.items()}
        out = copy.copy(value)  # keeps dict subclasses (model-output records) and their attributes
        for k, v in changed.items():
            out[k] = v
        return out
    if _is_dataclass_instance(value):
        fields = {}
        for f in dataclasses.fields(value):
            old = getattr(value, f.name)
            m = map_tensors(fn, old)
            if m is not old:
                fields[f.name] = m
        if not fields:
            return value
        out = copy.copy(value)
        for name, v in fields.items():
            object.__setattr__(out, name, v)  # also for frozen dataclasses
        return out
    return value


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value``, depth first, in container order."""
    if isinstance(value, torch.Tensor):
        yield value
        return
    if type(value) in _ATOMS:
        return
    if isinstance(value, list | tuple):
        for v in value:
            yield from tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors(v)
    elif _is_dataclass_instance(value):
        for f in dataclasses.fields(value):
            yield from tensors(getattr(value, f.name))


def first_tensor(value: Any, predicate: Callable[[torch.Tensor], bool] | None = None) -> torch.Tensor | None:
    """The first tensor in ``value`` (for which ``predicate`` holds), or None."""
    for t in tensors(value):
        if predicate is None or predicate(t):
            return t
    return None


def by_device_dtype(items: Iterable[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """``items`` grouped by (device, dtype), in first-seen order: the unit of a foreach kernel.

    >>> import torch
    >>> groups = by_device_dtype([torch.ones(1), torch.ones(1, dtype=torch.bfloat16), torch.ones(2)])
    >>> [(str(k[1]), len(v)) for k, v in groups.items()]
    [('torch.float32', 2), ('torch.bfloat16', 1)]
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in items:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def floating_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every floating-point tensor in ``value``, in order."""
    return (t for t in tensors(value) if t.is_floating_point())


def map_floating(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to every floating-point tensor; containers keep their types."""
    return map_tensors(lambda t: fn(t) if t.is_floating_point() else t, value)


def local_share(param: torch.Tensor) -> float:
    """The fraction of ``param``'s elements this rank holds: its shard's of an FSDP2 DTensor, else 1."""
    local = shard_local(param)
    return 1.0 if local is param or not param.numel() else local.numel() / param.numel()


def shard_local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (sharing its storage; in-place ops act on the shard), else ``t``:
    per-rank elementwise work (a found-inf check, a clip factor) skips DTensor's dispatch."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


"""Argument checks shared by the diagnostics: each raises where the argument is given,
naming the function, the argument, the value and the fix (never an AttributeError from
deep inside a run)."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

from torch import nn


def show(value: object) -> str:
    """``repr(value)`` shortened, with its type."""
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def model(value: object, call: str) -> nn.Module:
    if not isinstance(value, nn.Module):
        raise TypeError(f"{call}: model must be a torch.nn.Module, got {show(value)}; pass the model itself")
    return value


def batch(value: object, call: str) -> Any:
    if value is None:
        raise TypeError(
            f"{call}: batch is None; pass one batch: the inputs (a tensor, a tuple of positional arguments or a "
            "dict of keyword arguments), or (inputs, targets) with a criterion; () for a model without inputs"
        )
    return value


def criterion(value: object, call: str) -> Any:
    if value is not None and not callable(value):
        raise TypeError(
            f"{call}: criterion must be a callable criterion(output, targets) -> loss or None, got {show(value)}; "
            "pass e.g. criterion=torch.nn.CrossEntropyLoss()"
        )
    return value


def integer(value: object, name: str, call: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{call}: {name} must be an int, got {show(value)}; pass e.g. {name}={minimum}")
    if value < minimum:
        raise ValueError(f"{call}: {name} must be >= {minimum}, got {value!r}; pass e.g. {name}={minimum}")
    return int(value)


def flag(value: object, name: str, call: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{call}: {name} must be True or False, got {show(value)}; pass {name}=True or {name}=False")
    return value


def factory(value: object, name: str, call: str, builds: str, example: str) -> Callable[[], Any]:
    """A callable that builds a fresh ``builds`` on every call (a module or a tensor is not one)."""
    if not callable(value) or isinstance(value, nn.Module):
        got = f"the {type(value).__name__} module itself" if isinstance(value, nn.Module) else show(value)
        raise TypeError(
            f"{call}: {name} must be a function that builds a fresh {builds} on every call, got {got}; "
            f"pass e.g. {name}=lambda: {example}"
        )
    return value


def optimizer(value: object, call: str) -> Any:
    if value is not None and not (hasattr(value, "param_groups") and callable(getattr(value, "step", None))):
        raise TypeError(
            f"{call}: optimizer must be the torch.optim.Optimizer prepare() returned (or None for no optimizer "
            f"state), got {show(value)}"
        )
    return value

"""What the harness trains: a task-like object, and :class:`Workload`, a named recipe for a fresh one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

__all__ = ["TaskLike", "Workload", "builtin_workload"]


class TaskLike(Protocol):
    """What the harness trains: :class:`mixprec.cli.models.Task` is one; so are adapted user models."""

    @property
    def model(self) -> nn.Module: ...

    @property
    def criterion(self) -> Callable[..., Tensor]: ...

    @property
    def default_batch_size(self) -> int: ...

    @property
    def eval_batch_size(self) -> int: ...

    @property
    def chance(self) -> float | None: ...

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[Any, Any]:
        """A training batch ``(inputs, targets)`` drawn with ``generator``."""
        ...

    def eval_batch(self, batch_size: int = 256) -> tuple[Any, Any]:
        """A fixed held-out batch."""
        ...

    def accuracy(self, outputs: Any, targets: Any) -> float | None:
        """Accuracy of ``outputs`` against ``targets`` (None where it has no meaning)."""
        ...


@dataclass(frozen=True)
class Workload:
    """A named recipe for a fresh task: ``make(seed)`` returns a new model with its data.

    Every variant calls ``make`` with the same seed, so all start from identical weights.
    """

    name: str
    make: Callable[[int], TaskLike]
    lr: float = 3e-3
    description: str = ""


def builtin_workload(name: str, size: str = "tiny") -> Workload:
    """A built-in task of :mod:`mixprec.cli.models` (``"gpt"``, ``"cnn"``, ``"vit"``, ``"mlp"``) at ``size``."""
    from mixprec.cli.models import SIZES, TASKS, build_task

    if name not in TASKS:
        raise ValueError(f"unknown model {name!r}; built-in models are {', '.join(TASKS)}, or pass module:factory")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {', '.join(SIZES)}")
    return Workload(
        name=f"{name}-{size}",
        make=lambda seed: build_task(name, size=size, seed=seed),
        lr=3e-3 if size == "tiny" else 1e-3,
        description=f"built-in {name} ({size})",
    )

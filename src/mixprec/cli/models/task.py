"""`Task`: a model, its loss, and a data source with a learnable signal, in one bundle.

A task is what benchmarks, the CLI demo and plan tests train: they never need to know
whether the model is a transformer or a CNN, only ``model``, ``criterion`` and
``batch()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

__all__ = ["DataSource", "Task", "accuracy"]


class DataSource(Protocol):
    """A distribution of (inputs, targets) pairs sampled with an explicit generator."""

    def sample(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Draw ``n`` examples; the same generator state gives the same examples."""
        ...


def accuracy(outputs: Tensor, targets: Tensor) -> float:
    """Fraction of positions whose arg-max over the last dim of ``outputs`` equals ``targets``.

    Works for classification logits ``(B, C)`` vs ``(B,)`` and for token logits
    ``(B, T, V)`` vs ``(B, T)`` alike.
    """
    if outputs.shape[:-1] != targets.shape:
        raise ValueError(
            f"accuracy(): outputs of shape {tuple(outputs.shape)} do not match targets of "
            f"shape {tuple(targets.shape)}; expected outputs to be targets' shape plus a "
            "class dimension"
        )
    if targets.numel() == 0:
        raise ValueError("accuracy(): got an empty batch")
    with torch.no_grad():
        return outputs.detach().argmax(dim=-1).eq(targets).float().mean().item()


def _check_batch_size(batch_size: int, call: str) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{call}: batch_size must be a positive int, got {batch_size!r}")


@dataclass(frozen=True, eq=False)
class Task:
    """A built-in training task: an fp32 CPU model, its criterion and its data.

    Build one with :func:`mixprec.cli.models.build_task`. The model and data are
    deterministic functions of the seed the task was built with.

    Attributes:
        name: task name, one of :data:`mixprec.cli.models.TASKS`.
        size: ``"tiny"`` or ``"small"``.
        seed: the seed model parameters and the data distribution derive from.
        model: the network, fp32 on CPU.
        criterion: ``criterion(model(inputs), targets)`` is the scalar mean loss.
        chance: accuracy of uniform guessing.
        default_batch_size: the batch size benchmarks use for this task and size.
        eval_batch_size: a held-out batch size that is cheap to evaluate for this task
            and size (the small GPT's 256 x 256 tokens cost dozens of training steps).
        data: the source of training and held-out examples.
        eval_seed: seed of the fixed held-out batch.
    """

    name: str
    size: str
    seed: int
    model: nn.Module = field(repr=False)
    criterion: nn.Module = field(repr=False)
    chance: float
    default_batch_size: int
    eval_batch_size: int
    data: DataSource = field(repr=False)
    eval_seed: int = field(repr=False)
    _eval_cache: dict[int, tuple[Tensor, Tensor]] = field(
        default_factory=dict, init=False, repr=False
    )

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """A fresh training batch ``(inputs, targets)`` drawn with ``generator`` (CPU)."""
        _check_batch_size(batch_size, "Task.batch()")
        if not isinstance(generator, torch.Generator):
            raise TypeError(
                f"Task.batch(): generator must be a torch.Generator, got {type(generator).__name__}; "
                "pass e.g. torch.Generator().manual_seed(0)"
            )
        return self.data.sample(batch_size, generator)

    def eval_batch(self, batch_size: int = 256) -> tuple[Tensor, Tensor]:
        """A fixed held-out batch: the same tensors (fresh copies) on every call."""
        _check_batch_size(batch_size, "Task.eval_batch()")
        cached = self._eval_cache.get(batch_size)
        if cached is None:
            generator = torch.Generator().manual_seed(self.eval_seed)
            heldout = getattr(self.data, "sample_heldout", None)  # a real dataset's held-out split
            cached = (heldout or self.data.sample)(batch_size, generator)
            self._eval_cache[batch_size] = cached
        return cached[0].clone(), cached[1].clone()

    def accuracy(self, outputs: Tensor, targets: Tensor) -> float:
        """Arg-max accuracy of ``outputs`` against ``targets``, in [0, 1]."""
        return accuracy(outputs, targets)

"""One variant's training loop: a fresh model and optimizer under a plan, stepped and timed."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mixprec.cli.harness.rows import TORCH_AUTOCAST
from mixprec.cli.harness.workloads import TaskLike
from mixprec.nested import first_tensor
from mixprec.plans import Plan
from mixprec.session import MixedPrecision

__all__ = ["Runner", "StepOutcome", "interleaved"]


@dataclass(frozen=True)
class StepOutcome:
    """What one training step of a :class:`Runner` did."""

    seconds: float
    loss: float
    skipped: bool
    scale: float


class Runner:
    """A fresh model and AdamW optimizer trained under one plan, or under the plain torch.autocast loop."""

    def __init__(self, plan: str | Plan, task: TaskLike, *, lr: float) -> None:
        """Prepare ``task.model`` for ``plan`` (a plan name, a :class:`Plan`, or :data:`TORCH_AUTOCAST`)."""
        self.plan = plan
        self.task = task
        first = next(iter(task.model.parameters()), None)
        if first is None:
            raise ValueError("the model has no parameters to train")
        self.device_type = first.device.type
        optimizer = torch.optim.AdamW(task.model.parameters(), lr=lr)
        self.mp: MixedPrecision | None = None
        self.model: nn.Module
        self.optimizer: torch.optim.Optimizer
        self.criterion: Callable[..., Tensor]
        if plan == TORCH_AUTOCAST:
            self.model, self.optimizer, self.criterion = task.model, optimizer, task.criterion
        else:
            self.mp = MixedPrecision(plan)
            self.model, self.optimizer, self.criterion = self.mp.prepare(
                task.model, optimizer, criterion=task.criterion
            )
        self.params = sum(p.numel() for p in {id(p): p for p in self.model.parameters()}.values())

    def _context(self) -> Any:
        if self.mp is None:
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return self.mp.autocast()

    def loss(self, inputs: Any, targets: Any) -> Tensor:
        """The loss of one forward pass, in the plan's autocast context (graph kept)."""
        with self._context():
            return self.criterion(self.model(inputs), targets)

    def step(self, inputs: Any, targets: Any) -> StepOutcome:
        """One timed training step: forward and loss, backward, optimizer step (on a GPU, the
        clock stops when the device has finished, for every row alike)."""
        _sync(inputs)
        start = time.perf_counter()
        loss = self.loss(inputs, targets)
        if self.mp is None:
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            skipped, scale = False, 1.0
        else:
            self.mp.backward(loss)
            result = self.mp.step()
            skipped, scale = result.skipped, result.scale
        _sync(loss)
        seconds = time.perf_counter() - start
        return StepOutcome(seconds=seconds, loss=float(loss.detach().float()), skipped=skipped, scale=scale)

    def state_bytes_per_param(self) -> dict[str, float]:
        """Training-state bytes per parameter by class (weights, buffers, grads, master weights,
        grad accumulation, optimizer state, compensation) and their ``total``, counted on the
        live model and optimizer by :func:`mixprec.diagnostics.memory.training_state_bytes_per_param`."""
        from mixprec.diagnostics.memory import training_state_bytes_per_param

        return training_state_bytes_per_param(self.model, self.optimizer)

    @torch.no_grad()
    def evaluate(self, inputs: Any, targets: Any) -> tuple[float, float | None]:
        """Held-out (loss, accuracy) in eval mode, under the plan's autocast."""
        self.model.eval()
        try:
            with self._context():
                outputs = self.model(inputs)
                loss = self.criterion(outputs, targets)
            return float(loss.float()), self.task.accuracy(outputs.float(), targets)
        finally:
            self.model.train()


def interleaved(indices: Sequence[int], repeat: int) -> Iterator[int]:
    """A B C on even repeats, C B A on odd ones: slow drift costs every variant alike."""
    return iter(indices if repeat % 2 == 0 else list(reversed(indices)))


def _sync(value: Any) -> None:
    """Wait for the device of ``value``'s first tensor (a no-op on CPU)."""
    first = first_tensor(value)
    if first is not None and first.device.type == "cuda":
        torch.cuda.synchronize(first.device)

"""``--model module:factory``: run the CLI's commands on your own model.

The factory is imported from ``module`` (a dotted module name, importable from the
current directory too) or from a file (``path/to/models.py:factory``), and called as
``factory(seed=seed)`` when it takes a ``seed`` argument, else ``factory()``, once per
plan with torch's global RNG seeded, so every plan starts from the same weights. It
returns one of:

1. a task-like object with ``model``, ``criterion`` and ``batch(batch_size, generator)``
   (optionally ``eval_batch(batch_size)``, ``accuracy(outputs, targets)``, ``chance``,
   ``default_batch_size``, ``eval_batch_size``), as :class:`mixprec.cli.models.Task` has;
2. a tuple ``(model, batch_fn, criterion)`` with
   ``batch_fn(batch_size: int, generator: torch.Generator) -> (inputs, targets)`` and
   ``criterion(model(inputs), targets) -> scalar loss``;
3. a plain ``nn.Module`` mapping ``(batch, *input_shape)`` floats to ``(batch, num_classes)``
   logits: pass ``--input-shape`` and ``--num-classes``. The data is synthetic with a
   learnable signal: Gaussian inputs labelled by a fixed random linear teacher, and
   the loss is cross-entropy.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

from mixprec.cli.harness import TaskLike, Workload

__all__ = ["load_workload", "parse_shape"]


def parse_shape(text: str) -> tuple[int, ...]:
    """``"3,32,32"`` (or ``"3x32x32"``) -> ``(3, 32, 32)``."""
    parts = [p for p in text.replace("x", ",").replace(" ", "").split(",") if p]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"--input-shape {text!r}: expected positive integers separated by commas, e.g. 3,32,32")
    return shape


def _import(module_part: str, spec: str) -> ModuleType:
    try:
        if module_part.endswith(".py") or os.sep in module_part or "/" in module_part:
            path = Path(module_part)
            if not path.is_file():
                raise ValueError(f"--model {spec!r}: no such file {module_part!r}")
            name = f"mixprec_user_{path.stem}"
            file_spec = importlib.util.spec_from_file_location(name, path)
            if file_spec is None or file_spec.loader is None:
                raise ValueError(f"--model {spec!r}: cannot load {module_part!r} as a Python module")
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[name] = module
            file_spec.loader.exec_module(module)
            return module
        cwd = os.getcwd()
        if cwd not in sys.path:
            sys.path.insert(0, cwd)
        return importlib.import_module(module_part)
    except ValueError:
        raise
    except Exception as exc:  # the user's module may raise anything while importing
        raise ValueError(f"--model {spec!r}: cannot import {module_part!r}: {type(exc).__name__}: {exc}") from None


def _takes_seed(factory: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return "seed" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _default_accuracy(outputs: Any, targets: Any) -> float | None:
    if (
        isinstance(outputs, Tensor) and isinstance(targets, Tensor) and outputs.dim() >= 1
        and not targets.is_floating_point() and outputs.shape[:-1] == targets.shape and targets.numel() > 0
    ):
        return outputs.detach().argmax(dim=-1).eq(targets).float().mean().item()
    return None


@dataclass(eq=False)
class CustomTask:
    """A user model adapted to what the harness trains (see :class:`mixprec.cli.harness.TaskLike`)."""

    model: nn.Module
    criterion: Callable[..., Tensor]
    batch_fn: Callable[[int, torch.Generator], tuple[Any, Any]]
    seed: int
    default_batch_size: int = 32
    eval_batch_size: int = 256
    chance: float | None = None
    eval_fn: Callable[[int], tuple[Any, Any]] | None = None
    accuracy_fn: Callable[[Any, Any], float | None] | None = None
    _eval_cache: dict[int, tuple[Any, Any]] = field(default_factory=dict, repr=False)

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[Any, Any]:
        """A training batch drawn with ``generator``."""
        return self.batch_fn(batch_size, generator)

    def eval_batch(self, batch_size: int = 256) -> tuple[Any, Any]:
        """The task's own held-out batch, or a fixed batch drawn from a seeded generator."""
        if self.eval_fn is not None:
            return self.eval_fn(batch_size)
        if batch_size not in self._eval_cache:
            self._eval_cache[batch_size] = self.batch_fn(batch_size, torch.Generator().manual_seed(self.seed + 7919))
        return self._eval_cache[batch_size]

    def accuracy(self, outputs: Any, targets: Any) -> float | None:
        """The task's own accuracy, or arg-max accuracy where outputs are logits over integer targets."""
        fn = self.accuracy_fn or _default_accuracy
        return fn(outputs, targets)


class _Teacher:
    """Synthetic classification data: Gaussian inputs labelled by a fixed random linear map."""

    def __init__(self, shape: tuple[int, ...], num_classes: int, seed: int) -> None:
        features = 1
        for d in shape:
            features *= d
        g = torch.Generator().manual_seed(seed + 104729)
        self.shape = shape
        self.weight = torch.randn(features, num_classes, generator=g)

    def __call__(self, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        x = torch.randn(batch_size, *self.shape, generator=generator)
        return x, (x.flatten(1) @ self.weight).argmax(dim=1)


def _adapt(built: Any, spec: str, shape: tuple[int, ...] | None, num_classes: int | None, seed: int) -> TaskLike:
    if isinstance(built, nn.Module):
        if shape is None or num_classes is None:
            raise ValueError(
                f"--model {spec!r} returned a plain nn.Module: pass --input-shape and --num-classes so mixprec can "
                "make synthetic data for it, or return (model, batch_fn, criterion) from the factory"
            )
        return CustomTask(model=built, criterion=nn.CrossEntropyLoss(), batch_fn=_Teacher(shape, num_classes, seed),
                          seed=seed, chance=1.0 / num_classes)
    if isinstance(built, tuple | list):
        if len(built) != 3 or not isinstance(built[0], nn.Module) or not callable(built[1]) or not callable(built[2]):
            raise ValueError(
                f"--model {spec!r} returned a {type(built).__name__} that is not (model: nn.Module, batch_fn, criterion)"
            )
        return CustomTask(model=built[0], batch_fn=built[1], criterion=built[2], seed=seed)
    model, criterion, batch = (getattr(built, k, None) for k in ("model", "criterion", "batch"))
    if isinstance(model, nn.Module) and callable(criterion) and callable(batch):
        return CustomTask(
            model=model, criterion=criterion, batch_fn=batch, seed=seed,
            default_batch_size=int(getattr(built, "default_batch_size", 32)),
            eval_batch_size=int(getattr(built, "eval_batch_size", 256)),
            chance=getattr(built, "chance", None),
            eval_fn=getattr(built, "eval_batch", None),
            accuracy_fn=getattr(built, "accuracy", None),
        )
    raise ValueError(
        f"--model {spec!r} returned a {type(built).__name__}; expected an nn.Module, (model, batch_fn, criterion), "
        "or an object with model, criterion and batch(batch_size, generator)"
    )


def _check(task: TaskLike, spec: str) -> None:
    """One small forward pass, so a mismatch is a clear error rather than a failure mid-run."""
    saved = {k: v.detach().clone() for k, v in task.model.state_dict().items()}  # e.g. BatchNorm statistics
    try:
        inputs, targets = task.batch(2, torch.Generator().manual_seed(0))
        with torch.no_grad():
            loss = task.criterion(task.model(inputs), targets)
        task.model.load_state_dict(saved)
    except Exception as exc:  # the user's model, data or loss: report it in one line
        raise ValueError(f"--model {spec!r}: a forward pass on a batch of 2 failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ValueError(f"--model {spec!r}: the criterion must return a scalar loss tensor")


def load_workload(
    spec: str, *, input_shape: str | None = None, num_classes: int | None = None, seed: int = 0
) -> Workload:
    """The workload ``module:factory`` (or ``path.py:factory``) names; ValueError if it cannot be used.

    The factory is called once right away (with ``seed``) and a forward pass on a batch
    of 2 is checked, so a broken factory fails before any long work starts; that first
    task is what the first ``make(seed)`` returns.
    """
    module_part, _, attr = spec.rpartition(":")
    if not module_part or not attr.isidentifier():
        raise ValueError(f"--model {spec!r}: expected a built-in name or module:factory (e.g. mypkg.models:make_model)")
    module = _import(module_part, spec)
    factory = getattr(module, attr, None)
    if factory is None:
        raise ValueError(f"--model {spec!r}: module {module_part!r} has no attribute {attr!r}")
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {attr!r} is a {type(factory).__name__}, not a callable factory")
    shape = parse_shape(input_shape) if input_shape is not None else None
    seeded = _takes_seed(factory)

    def build(seed: int) -> TaskLike:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            try:
                built = factory(seed=seed) if seeded else factory()
            except Exception as exc:  # the user's factory: report it in one line
                raise ValueError(f"--model {spec!r}: the factory raised {type(exc).__name__}: {exc}") from None
        return _adapt(built, spec, shape, num_classes, seed)

    first = build(seed)
    _check(first, spec)
    unused = [first]

    def make(s: int) -> TaskLike:
        if s == seed and unused:
            return unused.pop()
        return build(s)

    return Workload(name=attr, make=make, lr=1e-3, description=spec)

"""Capturing what every module of a run saw, and re-running one module alone.

:class:`Capture` hooks every module and keeps its inputs, outputs and output gradients
per call; :func:`run_isolated` runs one module alone on captured reference inputs
(rounded to the dtypes the plan's run gave it), optionally with every child answered
exactly in fp32 (:func:`exact_children`). :func:`~mixprec.diagnostics.compare` builds
its introduced and own errors from them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.nested import floating_tensors, map_floating

__all__ = ["Call", "Capture", "exact_children", "run_isolated", "seeded"]


# ------------------------------------------------------------------ capturing
@dataclass
class Call:
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    in_dtypes: list[torch.dtype] = field(default_factory=list)
    in_grad: list[bool] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    out_grads: dict[int, torch.Tensor] = field(default_factory=dict)


class Capture:
    """Hooks every module and keeps its inputs, outputs and output gradients per call."""

    def __init__(self, model: nn.Module, *, inputs: bool, grads: bool) -> None:
        self.calls: dict[str, list[Call]] = {}
        self._stack: dict[str, list[Call]] = {}
        self._handles: list[Any] = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._pre(name, inputs), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(name, grads)))

    def _pre(self, name: str, keep_inputs: bool) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            call = Call()
            floats = list(floating_tensors((args, kwargs)))
            call.in_dtypes = [t.dtype for t in floats]
            call.in_grad = [t.requires_grad for t in floats]
            if keep_inputs:
                clone: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.detach().clone()  # noqa: E731
                call.args = map_floating(args, clone)
                call.kwargs = map_floating(kwargs, clone)
            self.calls.setdefault(name, []).append(call)
            self._stack.setdefault(name, []).append(call)

        return hook

    def _post(self, name: str, keep_grads: bool) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            stack = self._stack.get(name)
            if not stack:
                return
            call = stack.pop()
            for i, t in enumerate(floating_tensors(output)):
                call.outputs.append(t.detach().clone())
                if keep_grads and t.requires_grad:
                    t.register_hook(_grad_saver(call, i))

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _grad_saver(call: Call, index: int) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        call.out_grads[index] = grad.detach().clone()

    return hook


@contextlib.contextmanager
def seeded(seed: int, cuda_devices: Sequence[int] = ()) -> Iterator[None]:
    """Both precisions draw the same random numbers (dropout masks) on CPU and the model's GPUs."""
    with torch.random.fork_rng(devices=list(cuda_devices)):
        torch.manual_seed(seed)
        yield


# --------------------------------------------------------------- isolated runs
def run_isolated(
    module: nn.Module,
    call: Call,
    dtypes: list[torch.dtype] | None,
    context: Callable[[], contextlib.AbstractContextManager[Any]],
    grad_scale: float,
    seed: int,
    children: dict[nn.Module, nn.Module] | None = None,
    *,
    upcast: bool = False,
    cuda_devices: Sequence[int] = (),
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]] | None:
    """Run ``module`` alone on the captured reference inputs, rounded to ``dtypes`` (the
    dtypes the plan's run gave it); return its floating outputs and the (unscaled)
    gradients of its differentiable inputs and parameters.

    ``upcast`` turns the rounded inputs back into their reference dtype: the fp32 module
    then computes exactly on the very values the plan's module received, so the
    comparison measures what the module's computation adds, not the rounding of its
    inputs (which the module that produced them is charged with).

    With ``children`` (low child -> fp32 reference child), every call of a child
    is answered by the fp32 child on fp32 inputs with autocast off, so only the module's
    own code runs in the plan's precision.
    """
    leaves: list[torch.Tensor] = []
    counter = iter(range(1 << 30))

    def prepare(t: torch.Tensor) -> torch.Tensor:
        i = next(counter)
        dtype = dtypes[i] if dtypes is not None and i < len(dtypes) else t.dtype
        wants_grad = i < len(call.in_grad) and call.in_grad[i]
        source = t.detach().clone().requires_grad_(True) if wants_grad else t
        if wants_grad:
            leaves.append(source)
        rounded = source.to(dtype, copy=True)
        return rounded.to(t.dtype) if upcast else rounded

    # Own parameters first, so the gradients of a run with exact children (own
    # parameters only) line up with a prefix of a full run's.
    own = [p for p in module.parameters(recurse=False) if p.requires_grad]
    seen = {id(p) for p in own}
    params = own if children else own + [
        p for p in module.parameters() if p.requires_grad and id(p) not in seen
    ]
    try:
        with seeded(seed, cuda_devices), exact_children(children or {}), context():
            args = map_floating(call.args, prepare)
            kwargs = map_floating(call.kwargs, prepare)
            output = module(*args, **kwargs)
    except (RuntimeError, TypeError, ValueError):
        return None
    outs = list(floating_tensors(output))
    pairs = [(o, call.out_grads[i]) for i, o in enumerate(outs) if i in call.out_grads and o.requires_grad]
    targets = leaves + params
    if not pairs or not targets:
        return [o.detach() for o in outs], []
    try:
        grads = torch.autograd.grad(
            [o for o, _ in pairs],
            targets,
            [(g.to(torch.float32) * grad_scale).to(o.dtype) for o, g in pairs],
            allow_unused=True,
        )
    except RuntimeError:
        return [o.detach() for o in outs], []
    return [o.detach() for o in outs], [None if g is None else g.to(torch.float32) / grad_scale for g in grads]


@contextlib.contextmanager
def exact_children(children: dict[nn.Module, nn.Module]) -> Iterator[None]:
    """Make each low-precision child answer with its fp32 reference (fp32 inputs, autocast off)."""
    saved = {child: child.__dict__.get("forward") for child in children}
    try:
        for child, reference in children.items():
            child.forward = _fp32_forward(reference)  # type: ignore[method-assign]
        yield
    finally:
        for child, previous in saved.items():
            if previous is None:
                child.__dict__.pop("forward", None)
            else:
                child.forward = previous  # type: ignore[method-assign]


def _fp32_forward(reference: nn.Module) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        device_type = next((t.device.type for t in floating_tensors((args, kwargs))), "cpu")
        up: Callable[[torch.Tensor], torch.Tensor] = lambda t: t if t.dtype == torch.float64 else t.float()  # noqa: E731
        with torch.autocast(device_type, enabled=False):
            return reference(*map_floating(args, up), **map_floating(kwargs, up))

    return forward

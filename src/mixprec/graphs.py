"""The whole safe training step in one CUDA graph: forward, backward and ``mp.step()``.

A GPT-size step on a GPU is close to launch-bound: the CPU spends about as long launching
kernels as the GPU spends running them. A CUDA graph launches the whole step at once. The
device-first step makes it capturable: the skip decision, the loss scale (every hysteresis
mode), the clip factor and the norm are device tensors, and the update is masked on the
device, so nothing in ``backward()`` + ``step()`` waits for the host.

:func:`capture_step` runs ``step_fn`` (the user's forward, ``mp.backward`` and ``mp.step``)
a few times eagerly on a side stream (torch's recipe: lazy initialisation and optimizer
state happen there; these steps train), then captures one call into a graph;
:meth:`CapturedStep.replay` copies new inputs into the captured ones and replays it. Each
replay's outcome is copied to the host after it and its bookkeeping runs before the next
replay, as after an eager step: counters, ``max_consecutive_skips``, the LR scheduler
(before the next update; its learning rate must be a device tensor, which the graph reads),
``mp.last_result`` and the lazy :class:`~mixprec.ledger.StepResult` it returns.

What a graph cannot hold is refused before anything is captured, naming the way that works:
a CPU model, an optimizer that needs the decision on the host (use torch's
``AdamW(fused=True)``; mixprec sets ``capturable=True`` on its fused groups), the pure,
Kahan and stochastic-rounding wrappers (their step counts and bias corrections are host numbers),
``optimizer_in_backward``, the overflow tracer (its hooks are Python, which a replay does
not run), ``raise_at_min_scale`` (a host check), and a scheduler over a float learning
rate. The overflow explainer is switched off for the session (it would arm such hooks);
skips are still counted and ``max_consecutive_skips`` still stops the run. Python code
inside ``step_fn`` runs once, at capture: what it computes on the host is fixed from then
on (a float learning rate too: change it through a device tensor).

>>> import torch
>>> from mixprec import MixedPrecision
>>> mp = MixedPrecision("bf16-mixed")
>>> model = torch.nn.Linear(4, 4)
>>> model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters()))
>>> capture_step(mp, lambda x: x, torch.ones(1))
Traceback (most recent call last):
...
ValueError: capture_step(): a CUDA graph captures CUDA work, and the step's tensors are on cpu; move the model and the inputs to a CUDA device (model.cuda()) before prepare(), or train eagerly on this device
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mixprec.ledger import StepResult
from mixprec.step import Decision, skips_on_device

__all__ = ["CapturedStep", "capture_step"]

_CALLER = "capture_step()"


class CapturedStep:
    """A training step captured in a CUDA graph (:func:`capture_step`); :meth:`replay` runs it."""

    def __init__(self, mp: Any, graph: Any, inputs: tuple[torch.Tensor, ...], outputs: Any,
                 decision: Decision) -> None:
        self.mp, self.graph, self.inputs, self.outputs = mp, graph, inputs, outputs
        self._decision = decision
        self.replays = 0

    def replay(self, *inputs: torch.Tensor) -> StepResult:
        """Copy ``inputs`` into the captured input tensors (same shapes and dtypes) and replay the
        step. The last replay's bookkeeping runs first (its scheduler step before this update,
        ``max_consecutive_skips``), on its outcome copied to the host after it ran: nothing
        here waits for the device. Returns this step's lazy result; what ``step_fn`` returned
        at capture (:attr:`outputs`) holds this replay's values once it ran."""
        if len(inputs) != len(self.inputs):
            raise TypeError(f"replay() takes the {len(self.inputs)} input(s) the step was captured with, got {len(inputs)}")
        for i, (static, new) in enumerate(zip(self.inputs, inputs, strict=True)):
            if not isinstance(new, torch.Tensor) or new.shape != static.shape or new.dtype != static.dtype:
                got = f"{tuple(new.shape)} {new.dtype}" if isinstance(new, torch.Tensor) else type(new).__name__
                raise ValueError(
                    f"replay() input {i} is {got}; the step was captured with {tuple(static.shape)} {static.dtype}. "
                    "A graph replays fixed shapes: capture one step per shape (or pad the batch)"
                )
            static.copy_(new, non_blocking=True)
        self.mp.settle_outcome(check=True)
        self.graph.replay()
        self.replays += 1
        return self.mp._replayed(self._decision)  # type: ignore[no-any-return]


def capture_step(mp: Any, step_fn: Callable[..., Any], *inputs: torch.Tensor, warmup: int = 3,
                 pool: Any = None) -> CapturedStep:
    """Capture ``step_fn(*inputs)`` (a forward under ``mp.autocast()``, ``mp.backward(loss)``,
    ``mp.step()``) in one CUDA graph, after ``warmup`` eager steps on a side stream (they train
    on ``inputs``). ``inputs`` are the tensors :meth:`CapturedStep.replay` refills; ``pool``: a
    graph memory pool to share (``torch.cuda.graph_pool_handle()``).

    Example (on a CUDA device)::

        mp = MixedPrecision("bf16-mixed", clip_grad_norm=1.0)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4, device="cuda"), fused=True)
        model, opt = mp.prepare(model.cuda(), opt)

        def train_step(x, y):
            with mp.autocast():
                loss = criterion(model(x), y)
            mp.backward(loss)
            mp.step()
            return loss

        step = capture_step(mp, train_step, x0, y0)
        for x, y in batches:
            result = step.replay(x, y)          # step.outputs: this replay's loss
    """
    if not callable(step_fn):
        raise TypeError(f"{_CALLER} expects the step function (inputs -> anything), got {step_fn!r}")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
        raise ValueError(f"{_CALLER}: warmup= must be an int >= 1 (torch needs eager steps before a capture), got {warmup!r}")
    _check_capturable(mp, inputs, state_ready=False)
    mp._explainer = None  # (its tracing would arm Python hooks that replays never run: off for this session)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*capturable=True.*")  # (torch warns for steps outside a graph)
        for _ in range(warmup):
            step_fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    mp.settle_outcome(check=True)  # (the warm-up's last step: nothing is left to read during the capture)
    _check_capturable(mp, inputs, state_ready=True)
    _make_capturable(mp.optimizers)
    graph = torch.cuda.CUDAGraph()
    serial = mp._step_serial
    with torch.cuda.graph(graph, pool=pool):
        outputs = step_fn(*inputs)
    if mp._step_serial != serial + 1:
        raise RuntimeError(
            f"{_CALLER}: step_fn ran {mp._step_serial - serial} step(s) at the accumulation boundary; it must run "
            "exactly one: its backward(s) and one mp.step() at the boundary"
        )
    lagged = mp._lagged  # the capture's own outcome: nothing ran, so nothing to learn from it
    decision = lagged.decision
    mp._lagged, mp.last_result = None, None
    return CapturedStep(mp, graph, tuple(inputs), outputs, decision)


def _check_capturable(mp: Any, inputs: Sequence[torch.Tensor], *, state_ready: bool) -> None:
    """Refuse what a CUDA graph cannot replay, naming what works."""
    if not all(isinstance(t, torch.Tensor) for t in inputs):
        raise TypeError(f"{_CALLER}: inputs must be tensors (the ones replay() refills)")
    if getattr(mp, "_in_backward", None) is not None:
        raise ValueError(f"{_CALLER}: optimizer_in_backward=True updates inside backward, in Python hooks; "
                         "use optimizer_in_backward=False to capture the step")
    if mp.tracer is not None:
        raise ValueError(
            f"{_CALLER}: the overflow tracer runs Python hooks in the forward, which a replay does not run. Use "
            "MixedPrecision(..., trace_overflow=False) for a captured step (skips are still counted, and "
            "max_consecutive_skips still stops the run), or trace an eager step"
        )
    for opt in mp.optimizers:
        if getattr(opt, "host_step_counts", False):
            raise ValueError(
                f"{_CALLER}: {type(opt).__name__} counts its steps on the host (the bias corrections of bf16-pure, "
                "bf16-kahan and bf16-sr are host numbers at every step), which a graph would capture as constants. "
                "Train these plans eagerly (their steady step reads nothing back either), or capture a mixed or "
                "master plan (bf16-mixed, bf16-master)"
            )
    if getattr(mp.scaler, "_raise_at_min_scale", False):
        raise ValueError(f"{_CALLER}: raise_at_min_scale=True checks the scale on the host every step; use "
                         "raise_at_min_scale=False (max_consecutive_skips stops a run whose scale collapsed)")
    scheduler = mp.scheduler
    if scheduler is not None:
        target = getattr(scheduler, "optimizer", None)
        groups = getattr(target, "param_groups", None) or []
        if not all(isinstance(g.get("lr"), torch.Tensor) and g["lr"].device.type == "cuda" for g in groups):
            raise ValueError(
                f"{_CALLER}: the scheduler changes a float learning rate, which a graph captures as a constant. Give "
                "the optimizer a device tensor: torch.optim.AdamW(params, lr=torch.tensor(3e-4, device='cuda'), "
                "fused=True); the scheduler then writes into it"
            )
    params = [p for opt in mp.optimizers for g in opt.param_groups for p in g["params"]]
    devices = {t.device.type for t in (*params, *inputs)}
    if devices != {"cuda"} or not torch.cuda.is_available():
        where = ", ".join(sorted(devices)) or "nowhere"
        raise ValueError(
            f"{_CALLER}: a CUDA graph captures CUDA work, and the step's tensors are on {where}; move the model and "
            "the inputs to a CUDA device (model.cuda()) before prepare(), or train eagerly on this device"
        )
    if state_ready:
        for opt in mp.optimizers:
            if not skips_on_device(opt):
                raise ValueError(
                    f"{_CALLER}: {type(opt).__name__} needs the skip decision on the host (a non-fused optimizer). "
                    "Use torch.optim.AdamW(..., fused=True) (or SGD/Adam with fused=True) with a mixed or master plan"
                )


def _make_capturable(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """torch's optimizers refuse a capture unless every group says ``capturable``; their fused
    kernels are capturable as they are (state steps on the device)."""
    for opt in optimizers:
        inner = getattr(opt, "optimizer", opt)
        for group in inner.param_groups:
            if "capturable" in group:
                group["capturable"] = True

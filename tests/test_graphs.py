"""capture_step() refuses, before anything runs, what a CUDA graph cannot replay (on any machine).

The capture and the replays themselves are in the CUDA tier (tests/cuda/test_graphs_cuda.py).
"""

from __future__ import annotations

import pytest
import torch

from mixprec import DynamicLossScaler, MixedPrecision
from mixprec.graphs import capture_step


def _prepared(plan: str = "bf16-mixed", **kwargs):  # type: ignore[no-untyped-def]
    mp = MixedPrecision(plan, **kwargs)
    model = torch.nn.Linear(4, 4)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters()))
    return mp, model, opt


def _noop(x: torch.Tensor) -> torch.Tensor:
    return x


def test_a_cpu_step_is_refused_naming_the_cuda_device() -> None:
    mp, _, _ = _prepared()
    with pytest.raises(ValueError, match=r"on cpu; move the model and the inputs to a CUDA device"):
        capture_step(mp, _noop, torch.ones(1))


def test_the_tracer_is_refused_with_the_option_that_works() -> None:
    mp, _, _ = _prepared(trace_overflow=True)
    with pytest.raises(ValueError, match=r"trace_overflow=False"):
        capture_step(mp, _noop, torch.ones(1))


def test_raise_at_min_scale_is_refused() -> None:
    mp, _, _ = _prepared("fp16-mixed", scaler=DynamicLossScaler(raise_at_min_scale=True))
    with pytest.raises(ValueError, match=r"raise_at_min_scale=False"):
        capture_step(mp, _noop, torch.ones(1))


def test_a_scheduler_over_a_float_lr_is_refused_naming_a_device_tensor_lr() -> None:
    mp = MixedPrecision("bf16-mixed")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, _ = mp.prepare(model, opt, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    with pytest.raises(ValueError, match=r"lr=torch.tensor\(3e-4, device='cuda'\)"):
        capture_step(mp, _noop, torch.ones(1))


@pytest.mark.parametrize("plan", ["bf16-pure", "bf16-kahan", "bf16-sr"])
def test_the_low_precision_wrappers_are_refused_for_their_host_step_counts(plan: str) -> None:
    mp, _, _ = _prepared(plan)
    with pytest.raises(ValueError, match=r"counts its steps on the host.*Train these plans eagerly"):
        capture_step(mp, _noop, torch.ones(1))


def test_the_optimizer_in_backward_is_refused() -> None:
    mp = MixedPrecision("bf16-sr", optimizer_in_backward=True)
    model = torch.nn.Linear(4, 4)
    model, _ = mp.prepare(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match=r"optimizer_in_backward=False"):
        capture_step(mp, _noop, torch.ones(1))


@pytest.mark.parametrize("warmup", [0, -1, 1.5, True])
def test_bad_arguments_name_the_value(warmup: object) -> None:
    mp, _, _ = _prepared()
    with pytest.raises(ValueError, match=rf"warmup= must be an int >= 1.*got {warmup!r}"):
        capture_step(mp, _noop, torch.ones(1), warmup=warmup)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expects the step function"):
        capture_step(mp, "step", torch.ones(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"inputs must be tensors"):
        capture_step(mp, _noop, [1.0])  # type: ignore[arg-type]

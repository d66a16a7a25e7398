"""Every plan on one CUDA GPU: the built-in GPT and CNN train through ``MixedPrecision``
and end within the CPU plan tests' tolerances of an fp32 run on the same GPU."""

from __future__ import annotations

import functools

import pytest
import torch

from mixprec import MixedPrecision
from mixprec.cli.models import build_task
from mixprec.fp8 import native_fp8_available
from tests.test_session import _STEPS, _TOL, ALL_PLANS

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

DEVICE = "cuda"


def _plan_skip_reason(plan: str) -> str | None:
    if (plan.startswith("bf16") or plan == "fp8-mixed") and not torch.cuda.is_bf16_supported():
        return f"{plan} needs bf16 support (compute capability >= 8.0)"
    if plan == "fp8-mixed" and not native_fp8_available(DEVICE):
        return "fp8-mixed on CUDA needs native fp8 GEMMs (compute capability >= 8.9)"
    return None


def _train(plan: str, task_name: str, steps: int, *, lr: float = 3e-3, seed: int = 0, batch: int = 8):
    """tests/test_session.py's ``_train``, with the model and every batch on the GPU."""
    task = build_task(task_name, size="tiny", seed=seed)
    model = task.model.to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    mp = MixedPrecision(plan)
    model, opt, criterion = mp.prepare(model, opt, criterion=task.criterion)
    assert mp.device is not None and mp.device.type == "cuda"
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x, y = (t.to(DEVICE) for t in task.batch(batch, gen))
        with mp.autocast():
            loss = criterion(model(x), y)
        mp.backward(loss)
        result = mp.step()
        assert result.stepped, (plan, result)
        losses.append(loss.item())
    model.eval()
    with torch.no_grad(), mp.autocast():
        x, y = (t.to(DEVICE) for t in task.eval_batch(64))
        eval_loss = criterion(model(x), y).item()
    return losses, eval_loss, mp, model, opt


@functools.cache
def _fp32_reference(task_name: str) -> float:
    return _train("fp32", task_name, _STEPS)[1]


@pytest.mark.parametrize("task_name", ["gpt", "cnn"])
@pytest.mark.parametrize("plan", ALL_PLANS)
def test_every_plan_trains_close_to_fp32_on_cuda(plan: str, task_name: str) -> None:
    reason = _plan_skip_reason(plan)
    if reason is not None:
        pytest.skip(reason)
    ref_eval = _fp32_reference(task_name)
    losses, eval_loss, mp, model, _ = _train(plan, task_name, _STEPS)
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert losses[-1] < losses[0] * 0.9, ("did not learn", plan, losses[::5])
    tol = _TOL.get(plan, 0.05)
    assert abs(eval_loss - ref_eval) <= tol * ref_eval, (plan, eval_loss, ref_eval)


def test_fp8_plan_runs_the_native_gemm_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On fp8 hardware the fp8-mixed plan really calls torch._scaled_mm (no silent emulation)."""
    reason = _plan_skip_reason("fp8-mixed")
    if reason is not None:
        pytest.skip(reason)
    calls: list[tuple[torch.dtype, torch.dtype]] = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append((args[0].dtype, args[1].dtype))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    _train("fp8-mixed", "gpt", 2)
    assert (torch.float8_e4m3fn, torch.float8_e4m3fn) in calls  # forward
    assert any(torch.float8_e5m2 in pair for pair in calls)  # backward: E5M2 gradients


def _rel_err(actual: torch.Tensor, ref: torch.Tensor) -> float:
    return float((actual.double() - ref).norm() / ref.norm())


def test_tf32_plan_uses_tf32_in_the_forward() -> None:
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("TF32 needs compute capability >= 8.0")
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(1024, 256, bias=False).to(DEVICE)
    x = torch.randn(64, 1024, generator=gen).to(DEVICE)
    ref = torch.nn.functional.linear(x.double(), lin.weight.double())
    mp = MixedPrecision("tf32")
    lin, _ = mp.prepare(lin, torch.optim.SGD(lin.parameters(), lr=0.0))
    with torch.no_grad():
        full = lin(x)
        with mp.autocast():
            tf32 = lin(x)
    assert _rel_err(full, ref) < 1e-5  # fp32 outside the plan's context (the fixture's default)
    assert _rel_err(tf32, ref) > 1e-5  # TF32 (10-bit mantissa inputs) inside it


def test_tf32_plan_uses_tf32_in_the_backward_too() -> None:
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("TF32 needs compute capability >= 8.0")
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(1024, 256, bias=False).to(DEVICE)
    x = torch.randn(64, 1024, generator=gen).to(DEVICE).requires_grad_()
    g = torch.randn(64, 256, generator=gen).to(DEVICE)
    ref = g.double() @ lin.weight.double()  # d(x W^T)/dx applied to g, in fp64
    mp = MixedPrecision("tf32")
    lin, _ = mp.prepare(lin, torch.optim.SGD(lin.parameters(), lr=0.0))
    with mp.autocast():
        loss = (lin(x) * g).sum()
    mp.backward(loss)
    assert x.grad is not None
    assert _rel_err(x.grad, ref) > 1e-5, "the backward GEMM ran in full fp32"

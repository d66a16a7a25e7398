"""Diagnostics on a CUDA GPU: the overflow tracer names the planted layer, and the memory
estimate is within 15% of the allocator's peak (``torch.cuda.max_memory_allocated``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision, StepResult
from mixprec.cli.models import build_task
from mixprec.diagnostics import OverflowFinding, OverflowTracer, trace_overflow
from mixprec.diagnostics.memory import estimate_memory
from tests.test_diagnostics import _planted_backward, _planted_forward

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]


def _x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).cuda()


def _train_step(mp: MixedPrecision, model: nn.Module, x: torch.Tensor) -> StepResult:
    with mp.autocast():
        loss = model(x).float().square().mean()
    mp.backward(loss)
    return mp.step()


# ------------------------------------------------------------------ overflow tracer
@pytest.mark.parametrize("plan", ["fp16-mixed", "fp16-pure"])
def test_tracer_names_the_planted_forward_overflow_on_cuda(plan: str) -> None:
    model = _planted_forward().cuda()
    mp = MixedPrecision(plan, trace_overflow=True)
    model, _ = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    result = _train_step(mp, model, _x())
    assert result.skipped and result.skip_reason == "nonfinite_loss"
    finding = result.overflow
    assert isinstance(finding, OverflowFinding)
    assert (finding.module, finding.module_type, finding.direction) == ("2", "Linear", "forward")
    assert finding.what == "output" and finding.dtype == torch.float16 and finding.kind in ("inf", "nan")
    assert finding.step == 0 and finding.call == 0
    assert all(p.device.type == "cuda" for p in model.parameters())
    mp.tracer.remove()


def test_tracer_names_the_planted_backward_blowup_on_cuda() -> None:
    model = _planted_backward().cuda()
    mp = MixedPrecision("fp16-mixed")
    model, _ = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    mp.tracer = OverflowTracer(model)
    result = _train_step(mp, model, _x())
    assert result.skipped and result.skip_reason == "overflow"
    finding = result.overflow
    assert finding is not None
    assert (finding.module, finding.module_type, finding.direction) == ("3", "_BackwardBlowUp", "backward")
    assert finding.what == "gradient of its input"
    assert finding.max_abs is not None and math.isfinite(finding.max_abs)
    mp.tracer.remove()


def test_tracer_is_silent_in_fp32_and_names_the_first_layer_under_cuda_autocast() -> None:
    model = _planted_forward().cuda()
    with trace_overflow(model) as tracer:
        model(_x()).sum().backward()
    assert tracer.first_overflow() is None  # 1e6 is fine in fp32
    with trace_overflow(model) as tracer:
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(_x())
        assert not torch.isfinite(out).all()  # later layers propagate the inf
    finding = tracer.first_overflow()
    assert finding is not None and finding.module == "2"


# ------------------------------------------------------------------ memory
MEMORY_PLANS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "bf16-pure", "bf16-kahan")


def _warm_up_gemm_libraries() -> None:
    """cuBLAS / cuBLASLt allocate their workspaces through the caching allocator at their
    first GEMM on a stream and keep them: make them exist before the baseline is taken."""
    lin = nn.Linear(64, 64).cuda()
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    lin(x).sum().backward()
    for dtype in (torch.float16, torch.bfloat16):
        with torch.autocast("cuda", dtype=dtype):
            out = lin(x)
        out.float().sum().backward()
    del lin, x, out
    torch.cuda.synchronize()


@pytest.mark.parametrize("plan", MEMORY_PLANS)
def test_memory_estimate_within_15_percent_of_the_cuda_allocator_peak(plan: str) -> None:
    if "bf16" in plan and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16 support")
    size, batch_size = "small", 8  # ~20M parameters: allocator rounding is noise at this size
    _warm_up_gemm_libraries()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()

    task = build_task("gpt", size=size, seed=0)
    model = task.model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # foreach on CUDA by default
    mp = MixedPrecision(plan)
    model, opt, criterion = mp.prepare(model, opt, criterion=task.criterion)
    x, y = (t.cuda() for t in task.batch(batch_size, torch.Generator().manual_seed(0)))

    def step() -> StepResult:
        with mp.autocast():
            loss = criterion(model(x), y)
        mp.backward(loss)
        return mp.step()

    for _ in range(5):  # the optimizer creates its state at the first real step (fp16 may skip some)
        if step().stepped:
            break
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    measured_step = step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    assert measured_step.stepped, ("the measured step was skipped", measured_step)

    fresh = build_task("gpt", size=size, seed=0).model.cuda()
    est = estimate_memory(fresh, plan, optimizer="adamw", batch=(x, y), criterion=task.criterion)
    ratio = est.peak / measured
    assert ratio == pytest.approx(1.0, abs=0.15), (plan, est.peak, measured, str(est))

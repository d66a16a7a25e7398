"""``precision="auto"`` on a real GPU: measured facts, the chosen plan, a prepared model's device."""

from __future__ import annotations

import pytest
import torch

from mixprec import MixedPrecision, get_plan
from mixprec.fp8 import native_fp8_available
from mixprec.hardware import device_facts

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]


def test_cuda_facts_are_measured_and_agree_with_torch() -> None:
    facts = device_facts("cuda")
    major, minor = torch.cuda.get_device_capability()
    assert facts.device_type == "cuda" and facts.cuda_capability == (major, minor)
    assert facts.native_fp8 is native_fp8_available("cuda")
    assert facts.bf16_supported is torch.cuda.is_bf16_supported()
    assert set(facts.gemm_ms) == {"fp32", "bf16", "fp16"} and all(ms > 0 for ms in facts.gemm_ms.values())
    if (major, minor) >= (8, 0):  # tensor cores: half-precision GEMMs are several times fp32's speed
        assert facts.speedup(torch.bfloat16) > 2.0 and facts.speedup(torch.float16) > 2.0


def test_auto_on_cuda_chooses_a_low_precision_plan_and_says_why() -> None:
    plan = get_plan("auto", device="cuda")
    expected = "bf16-mixed" if torch.cuda.get_device_capability() >= (8, 0) else "fp16-mixed"
    assert plan.name == expected
    assert "auto chose" in plan.explain() and torch.cuda.get_device_name() in plan.explain()


def test_auto_session_trains_on_the_gpu() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mp = MixedPrecision("auto")
    model, opt = mp.prepare(model, opt)
    x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 8, (32,), device="cuda")
    for _ in range(3):
        with mp.autocast():
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        mp.backward(loss)
        assert mp.step().stepped
    assert mp.state_dict()["plan"] == mp.plan.name != "auto"

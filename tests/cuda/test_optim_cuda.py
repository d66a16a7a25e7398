"""The optimizer wrappers' new state on a GPU: remainder masters, 8-bit moments, state kinds."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec import MixedPrecision, get_plan
from mixprec.optim import KahanOptimizer, MasterWeightOptimizer, StateKind
from mixprec.optim import states as qstates

pytestmark = pytest.mark.cuda

DEVICE = torch.device("cuda")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.LayerNorm(512), torch.nn.Linear(512, 4096),
        torch.nn.Linear(4096, 1024),  # 4M elements: more than one chunk on the fast path
    ).to(DEVICE)


def _train(plan, steps: int = 30, **kw):
    model = _model()
    mp = MixedPrecision(plan, **kw)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01))
    losses = []
    for step in range(steps):
        g = torch.Generator(device=DEVICE).manual_seed(step)
        x = torch.randn(16, 64, device=DEVICE, generator=g)
        y = torch.randn(16, 1024, device=DEVICE, generator=g)
        if step in (5, 17):
            x[0, 0] = float("inf")
        with mp.autocast():
            loss = (model(x).float() - y).pow(2).mean()
        mp.backward(loss)
        mp.step()
        losses.append(float(loss))
    return model, opt, losses


def _same(a: list[float], b: list[float]) -> bool:
    return all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True))


def test_remainder_masters_equal_fp32_masters_bit_for_bit_on_cuda() -> None:
    m1, o1, l1 = _train("bf16-master")
    m2, o2, l2 = _train(get_plan("bf16-master", remainders=True))
    assert _same(l1, l2)
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters(), strict=True))
    assert isinstance(o1, MasterWeightOptimizer)
    low1 = [p for p in m1.parameters() if p.dtype == torch.bfloat16]
    low2 = [p for p in m2.parameters() if p.dtype == torch.bfloat16]
    for p1, p2 in zip(low1, low2, strict=True):
        assert torch.equal(o1.master_of(p1).view(torch.int32), o2.master(p2).view(torch.int32))


def test_remainder_masters_in_backward_equal_the_step_path_on_cuda() -> None:
    plan = get_plan("bf16-master", remainders=True)
    m1, _, l1 = _train(plan)
    m2, _, l2 = _train(plan, optimizer_in_backward=True)
    assert _same(l1, l2)
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters(), strict=True))


@pytest.mark.parametrize("name", ["bf16-kahan", "bf16-sr"])
def test_8bit_states_train_like_fp32_states_on_cuda(name: str) -> None:
    _, _, l32 = _train(get_plan(name, state_dtype="fp32"))
    m8, o8, l8 = _train(get_plan(name, state_dtype="8bit"))
    finite32 = [v for v in l32 if math.isfinite(v)]
    finite8 = [v for v in l8 if math.isfinite(v)]
    assert abs(sum(finite8[-5:]) - sum(finite32[-5:])) / abs(sum(finite32[-5:])) < 0.02
    p = next(p for p in m8.parameters() if p.dtype == torch.bfloat16)
    assert o8.state[p]["exp_avg"].dtype == torch.uint8 and o8.state[p]["exp_avg"].device.type == "cuda"
    assert qstates.value(o8.state[p], "exp_avg_sq").min() >= 0


def test_a_state_kind_is_undone_with_an_fp16_overflow_on_cuda() -> None:
    ema = StateKind("ema", "optimizer_state", "fp32 moving average", dtype=torch.float32,
                    init=_float, after_step=_follow)
    w = torch.nn.Parameter(torch.full((1000,), 60000.0, dtype=torch.float16, device=DEVICE))
    opt = KahanOptimizer(torch.optim.SGD([w], lr=1.0))
    opt.add_state_kind(ema)
    w.grad = torch.full_like(w, -1.0)
    opt.step()
    before = opt.kinds.get("ema", w).clone()
    w.grad = torch.full_like(w, -1e4)  # 60001 + 1e4 is past fp16's 65504: the step is refused
    opt.step()
    assert bool(opt.step_nonfinite())
    assert torch.equal(opt.kinds.get("ema", w), before)


def _float(p: torch.Tensor) -> torch.Tensor:
    return p.float()


def _follow(p: torch.Tensor, ema: torch.Tensor) -> None:
    ema.lerp_(p.float(), 0.5)

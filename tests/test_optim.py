"""Optimizer wrappers: fp32 masters, fp32 grad accumulation, Kahan and stochastic-rounding updates."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch

from mixprec.optim import (
    KahanOptimizer,
    MasterWeightOptimizer,
    StochasticRoundingOptimizer,
    stochastic_round,
)
from mixprec.plans import cast_module_


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(step: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=g).to(dtype), torch.randn(16, 4, generator=g)


def _bf16_master(model, opt):
    values = cast_module_(model, torch.bfloat16)
    return MasterWeightOptimizer(opt, master_values=values)


def test_masters_start_from_fp32_values_and_track_fp32_training():
    ref = _mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    model = _mlp()
    opt = _bf16_master(model, torch.optim.SGD(model.parameters(), lr=0.05))
    for m, p in zip(opt.masters, ref.parameters(), strict=True):
        assert m.dtype == torch.float32 and torch.equal(m, p)  # no rounding loss at the start
    for step in range(30):
        x, y = _batch(step)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
        opt.step()
        opt.zero_grad()
    for m, p, low in zip(opt.masters, ref.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(m, p, rtol=0.02, atol=0.01)
        assert low.dtype == torch.bfloat16 and torch.equal(low, m.to(torch.bfloat16))


def test_low_precision_grads_accumulate_in_fp32():
    model = _mlp()
    opt = _bf16_master(model, torch.optim.SGD(model.parameters(), lr=0.1))
    expected = [torch.zeros(p.shape) for p in model.parameters()]
    for micro in range(3):
        x, y = _batch(micro, torch.bfloat16)
        grads = torch.autograd.grad(torch.nn.functional.mse_loss(model(x).float(), y), list(model.parameters()))
        for e, g in zip(expected, grads, strict=True):
            e.add_(g.float())
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        if micro < 2:
            opt.accumulate_grads()  # the front door calls it after each non-boundary micro-batch
            assert all(p.grad is None for p in model.parameters())  # moved into fp32 buffers
    opt.prepare_grads()
    for m, e in zip(opt.masters, expected, strict=True):
        assert m.grad.dtype == torch.float32
        assert torch.equal(m.grad, e)


def test_master_state_dict_round_trip_and_scheduler():
    model = _mlp()
    opt = _bf16_master(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3):
            x, y = _batch(step, torch.bfloat16)
            torch.nn.functional.mse_loss(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)
    sd = opt.state_dict()
    model2 = _mlp(seed=5)
    opt2 = _bf16_master(model2, torch.optim.AdamW(model2.parameters(), lr=1.0))
    opt2.load_state_dict(sd)
    for m1, m2, p2 in zip(opt.masters, opt2.masters, model2.parameters(), strict=True):
        assert torch.equal(m1, m2) and torch.equal(p2, m1.to(torch.bfloat16))
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    plain = torch.optim.AdamW(_mlp().parameters()).state_dict()
    with pytest.raises(ValueError, match=re.escape("has no fp32 master weights")):
        opt2.load_state_dict(plain)


def test_add_param_group_gets_masters():
    model = _mlp()
    first, second = model[0], model[2]
    cast_module_(model, torch.bfloat16)
    opt = MasterWeightOptimizer(torch.optim.SGD(first.parameters(), lr=0.1))
    opt.add_param_group({"params": list(second.parameters()), "lr": 0.01})
    assert all(p.dtype == torch.float32 for p in opt.param_groups[1]["params"])
    assert len(opt.masters) == 4


def test_wrapper_argument_errors():
    model = _mlp()
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="already a mixprec optimizer wrapper"):
        KahanOptimizer(opt)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not take a closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(ValueError, match="needs bf16 parameters"):
        StochasticRoundingOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(2, dtype=torch.float16))], lr=1.0))


def _tiny_lr_run(wrap, steps: int = 200) -> float:
    torch.manual_seed(0)
    w = torch.nn.Parameter((torch.rand(4096) + 1.0).to(torch.bfloat16))  # values in [1, 2): ulp = 2**-7
    start = w.detach().clone()
    opt = wrap(torch.optim.SGD([w], lr=1.0))
    for _ in range(steps):
        w.grad = torch.full_like(w, -2.0**-12)  # each update is 1/32 of an ulp: lost in plain bf16
        opt.step()
    return (w != start).float().mean().item()


def test_kahan_keeps_tiny_updates_that_plain_bf16_loses():
    assert _tiny_lr_run(lambda o: o) == 0.0
    assert _tiny_lr_run(KahanOptimizer) >= 0.95
    assert _tiny_lr_run(StochasticRoundingOptimizer) >= 0.95


def test_kahan_is_exact_in_the_sum():
    w = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    opt = KahanOptimizer(torch.optim.SGD([w], lr=1.0))
    for _ in range(64):
        w.grad = torch.full_like(w, -2.0**-12)
        opt.step()
    # 64 * 2**-12 = 2**-6 exactly: weight + compensation hold the exact sum
    total = w.float() + opt.compensation(w).float()
    assert torch.equal(total, torch.full((8,), 1.0 + 2.0**-6))


def test_stochastic_round_is_unbiased_and_exact_on_representable_values():
    gen = torch.Generator().manual_seed(0)
    x = torch.full((200_000,), 1.0 + 2.0**-9)  # a quarter ulp above 1.0
    y = stochastic_round(x, generator=gen).float()
    assert set(y.unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert abs(y.mean().item() - (1.0 + 2.0**-9)) < 2e-5
    exact = torch.tensor([1.5, -3.0, 0.0, 2.0**-20])
    assert torch.equal(stochastic_round(exact, generator=gen).float(), exact)
    with pytest.raises(ValueError, match=re.escape("supports dtype=torch.bfloat16 only")):
        stochastic_round(x, torch.float16)


@pytest.mark.parametrize("cls", [KahanOptimizer, StochasticRoundingOptimizer])
def test_lowbit_state_is_bf16_between_steps_and_resumes_exactly(cls):
    def make(seed=0):
        model = _mlp(seed)
        cast_module_(model, torch.bfloat16)
        return model, cls(torch.optim.AdamW(model.parameters(), lr=1e-3))

    def run(model, opt, steps):
        for step in steps:
            x, y = _batch(step, torch.bfloat16)
            torch.nn.functional.mse_loss(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad()

    model, opt = make()
    run(model, opt, range(6))
    state = opt.state[next(iter(model.parameters()))]
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg_sq"].dtype == torch.bfloat16
    msd, osd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    run(model, opt, range(6, 12))
    model2, opt2 = make(seed=3)
    model2.load_state_dict(msd)
    opt2.load_state_dict(osd)
    run(model2, opt2, range(6, 12))
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)

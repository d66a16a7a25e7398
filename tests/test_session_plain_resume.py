"""mixprec.resume.load_plain_optimizer_state: a plain torch optimizer's state into a prepared optimizer."""

from __future__ import annotations

import re

import pytest
import torch

from mixprec import MixedPrecision
from mixprec.resume import load_plain_optimizer_state


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def plain_state() -> tuple[torch.nn.Module, dict]:
    """Two AdamW steps of a plain fp32 model."""
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt.state_dict()


def prepared(plan: str):
    mp = MixedPrecision(plan)
    model = tiny()
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return mp, model, opt


@pytest.mark.parametrize("plan", ["bf16-master", "fp16-master", "bf16-kahan", "bf16-sr", "bf16-pure", "bf16-mixed"])
def test_plain_state_loads_into_every_plans_optimizer(plan):
    plain, sd = plain_state()
    mp, model, opt = prepared(plan)
    model.load_state_dict(plain.state_dict())
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    load_plain_optimizer_state(opt, sd)
    # the model is as loaded; the masters (master plans) are its fp32 values
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    fp32 = plain.state_dict()
    for name, p in model.named_parameters():
        master = opt.master_of(p) if hasattr(opt, "master_of") else None
        if master is not None:
            assert torch.equal(master, fp32[name]), name
    inner = getattr(opt, "optimizer", opt)
    state_dtype = getattr(opt, "state_dtype", None) or torch.float32
    held = [p for g in inner.param_groups for p in g["params"]]
    for index, (q, saved) in enumerate(zip(held, sd["state"].values(), strict=True)):
        now = inner.state[q]
        assert float(now["step"]) == float(saved["step"]) == 2.0
        low = q.dtype in (torch.float16, torch.bfloat16)
        for key in ("exp_avg", "exp_avg_sq"):
            want = saved[key].to(state_dtype) if low else saved[key]
            assert now[key].dtype == want.dtype and torch.equal(now[key], want), (index, key)
    x = torch.randn(4, 8)
    with mp.autocast():
        loss = model(x).float().pow(2).mean()
    mp.backward(loss)
    assert mp.step().stepped


def test_a_state_of_another_plans_optimizer_is_refused_and_changes_nothing():
    _, kahan_model, kahan_opt = prepared("bf16-kahan")
    kahan_model(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum().backward()
    kahan_opt.step()
    saved = kahan_opt.state_dict()
    mp, model, opt = prepared("bf16-master")
    before = opt.state_dict()
    with pytest.raises(ValueError, match=re.escape(
        "this optimizer state_dict holds 'mixprec_lowbit', kept by another kind of mixprec optimizer than the "
        "MasterWeightOptimizer of this run: it was saved under another plan. Resume it under the plan that saved it"
    )):
        load_plain_optimizer_state(opt, saved)
    after = opt.state_dict()
    assert after["state"] == before["state"] == {}
    assert all(torch.equal(a, b) for a, b in zip(after["mixprec_master_weights"], before["mixprec_master_weights"], strict=True))


def test_not_an_optimizer_state_dict():
    _, _, opt = prepared("bf16-master")
    with pytest.raises(ValueError, match=re.escape(
        "not an optimizer state_dict (it needs 'state' and 'param_groups'); pass what optimizer.state_dict() returned"
    )):
        load_plain_optimizer_state(opt, {"state": {}})

"""MixedPrecision(optimizer_in_backward=True): updates inside backward, exact skips, fewer bytes."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from mixprec import DynamicLossScaler, MixedPrecision


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(n)]


def _run(plan: str, in_backward: bool, batches, poison: int | None = None):
    model = _model()
    mp = MixedPrecision(plan, optimizer_in_backward=in_backward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = mp.prepare(model, opt)
    results = []
    for step, (x, y) in enumerate(batches):
        handle = None
        if step == poison:  # an inf gradient in the FIRST layer, whose gradient autograd produces last
            handle = model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        with mp.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        mp.backward(loss)
        if handle is not None:
            handle.remove()
        results.append(mp.step())
    return model, opt, results


@pytest.mark.parametrize("plan", ["bf16-pure", "bf16-kahan", "bf16-sr"])
def test_in_backward_equals_the_normal_step(plan):
    batches = _batches(6)
    a, _, ra = _run(plan, False, batches)
    b, _, rb = _run(plan, True, batches)
    assert all(r.stepped for r in ra + rb)
    assert all(r.grad_norm is None for r in rb)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        # bit-identical for pure and Kahan; stochastic rounding draws its noise in another order,
        # so after 6 AdamW steps weights may sit a few bf16 ulps (2**-7 relative) apart
        tol = 4 * 2**-7 * p.detach().float().abs().max().item() if plan == "bf16-sr" else 0.0
        torch.testing.assert_close(p.detach().float(), q.detach().float(), rtol=0, atol=tol)


@pytest.mark.parametrize("plan", ["bf16-pure", "bf16-kahan", "bf16-sr"])
def test_an_inf_gradient_anywhere_leaves_every_parameter_untouched(plan):
    batches = _batches(4)
    model, opt, results = _run(plan, True, batches[:2])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_before = copy.deepcopy(opt.state_dict())
    model2, opt2, results2 = _run(plan, True, batches[:3], poison=2)
    assert [r.skipped for r in results2] == [False, False, True]
    assert results2[2].skip_reason == "overflow"
    for k, v in model2.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a skipped in-backward step"
    after = opt2.state_dict()
    for i, st in state_before["state"].items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(after["state"][i][key], value), (i, key)


def test_gradients_are_freed_during_backward_and_state_is_8_bytes_per_parameter():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    mp = MixedPrecision("bf16-kahan", optimizer_in_backward=True)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    with mp.autocast():
        loss = model(torch.randn(4, 64)).float().pow(2).mean()
    mp.backward(loss)
    assert all(p.grad is None for p in model.parameters())  # released as soon as each was used
    assert mp.step().stepped
    n = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(
        t.numel() * t.element_size()
        for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    compensation = sum(t.numel() * t.element_size() for t in opt.state_dict()["mixprec_lowbit"]["compensation"].values())
    assert (weights + state + compensation) / n == 8.0  # bf16 weight 2 + compensation 2 + two bf16 moments 4


def test_in_backward_refuses_what_it_cannot_do_exactly():
    msg = "optimizer_in_backward=True does not work with "
    with pytest.raises(ValueError, match=re.escape(msg + "grad_accum_steps=2")):
        MixedPrecision("bf16-kahan", optimizer_in_backward=True, grad_accum_steps=2)
    with pytest.raises(ValueError, match=re.escape(msg + "clip_grad_norm=1.0")):
        MixedPrecision("bf16-kahan", optimizer_in_backward=True, clip_grad_norm=1.0)
    with pytest.raises(ValueError, match=re.escape("plan 'bf16-master' (use bf16-pure, bf16-kahan or bf16-sr)")):
        MixedPrecision("bf16-master", optimizer_in_backward=True)
    with pytest.raises(ValueError, match=re.escape("a loss scaler (DynamicLossScaler; use a bf16 plan)")):
        MixedPrecision("bf16-kahan", optimizer_in_backward=True, scaler=DynamicLossScaler())
    model = _model()
    a, b = torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[2].parameters(), lr=0.1)
    with pytest.raises(ValueError, match=re.escape("optimizer_in_backward=True takes one optimizer")):
        MixedPrecision("bf16-kahan", optimizer_in_backward=True).prepare(model, a, b)
    with pytest.raises(TypeError, match=re.escape("optimizer_in_backward= must be True or False")):
        MixedPrecision("bf16-kahan", optimizer_in_backward="yes")  # type: ignore[arg-type]

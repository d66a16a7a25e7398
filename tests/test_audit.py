"""mixprec.audit on loops that do not use mixprec: each planted risk is named, a clean loop gets
none, and the proposed plan, applied, removes the risk (measured)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec import MixedPrecision, audit
from mixprec.diagnostics import headroom


def _mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(dtype)


@pytest.mark.parametrize(("dtype", "autocast", "scaler"), [
    (torch.float32, None, None),
    (torch.float32, "bf16", None),
    (torch.float32, "fp16", "torch"),
])
def test_a_clean_loop_gets_no_risk(dtype, autocast, scaler):
    model = _mlp(dtype)
    grad_scaler = torch.amp.GradScaler("cpu") if scaler else None
    batch = (torch.randn(4, 8), torch.tensor([0, 1, 0, 1]))
    report = audit(model, torch.optim.AdamW(model.parameters()), grad_scaler, batch,
                   autocast=autocast, criterion=nn.CrossEntropyLoss())
    assert report.ok, str(report)
    assert "no precision risk found" in str(report)


@pytest.mark.parametrize("plan", ["fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-kahan",
                                  "bf16-sr", "bf16-pure", "fp16-pure"])
def test_a_loop_prepared_by_mixprec_gets_no_risk_and_keeps_its_plan(plan):
    model = _mlp()
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters()))
    autocast = mp.plan.compute_dtype if mp.plan.uses_autocast else None
    report = audit(model, opt, mp.scaler, (torch.randn(4, 8), torch.tensor([0, 1, 0, 1])), autocast=autocast,
                   criterion=nn.CrossEntropyLoss())
    assert report.ok, (plan, str(report))
    assert report.proposed_plan.name == plan  # no risk: nothing to switch to


def test_a_frozen_fp16_base_without_a_scaler_is_fp16_compute():
    """A LoRA-style loop: fp16 frozen base, fp32 adapters, no loss scaler."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16).half().requires_grad_(False), nn.Linear(16, 2))
    report = audit(model, torch.optim.AdamW(model[1].parameters()))
    assert [r.code for r in report.risks] == ["fp16_without_scaler"]
    assert "frozen fp16 base" in report.effective
    assert report.proposed_plan.name == "fp16-mixed"  # which leaves the frozen base in fp16


def test_pure_bf16_is_named_and_kahan_keeps_the_updates_it_loses():
    model = nn.Linear(1, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)
    report = audit(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    assert {r.code for r in report.risks} == {"pure_low_precision", "low_precision_state", "low_precision_accumulation"}
    assert report.proposed_plan.name == "bf16-kahan"
    assert "get_plan('bf16-kahan')" in report.switch

    def train(prepare: bool) -> float:
        m = nn.Linear(1, 1, bias=False).to(torch.bfloat16)
        with torch.no_grad():
            m.weight.fill_(1.0)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        mp = MixedPrecision(report.proposed_plan) if prepare else None
        if mp is not None:
            m, opt = mp.prepare(m, opt)
        for _ in range(20):  # each update is -1e-3: below half a bf16 unit of 1.0 (3.9e-3)
            m.weight.grad = torch.ones_like(m.weight)
            opt.step()
        return float(m.weight.detach())

    assert train(prepare=False) == 1.0  # every update lost
    assert train(prepare=True) == pytest.approx(0.98, abs=4e-3)  # kept (Kahan)


def test_fp16_autocast_without_a_scaler_is_named_and_the_proposal_keeps_the_gradients():
    model = _mlp()
    batch = (torch.randn(16, 8), torch.tensor([0, 1] * 8))

    def tiny_loss(out, y):  # a loss whose gradients live below fp16's smallest value
        return nn.functional.cross_entropy(out, y) * 1e-6

    report = audit(model, torch.optim.SGD(model.parameters(), lr=0.1), None, batch, autocast="fp16", criterion=tiny_loss)
    codes = {r.code for r in report.risks}
    assert {"fp16_without_scaler", "gradient_underflow"} <= codes
    assert report.proposed_plan.name == "fp16-mixed"
    before = headroom(model, batch, criterion=tiny_loss, loss_scale=1.0)
    mp = MixedPrecision(report.proposed_plan)
    after = headroom(model, batch, criterion=tiny_loss, loss_scale=mp.scaler.get_scale())
    worst = max(m.grad_underflow_fp16 for m in before.values() if m.grad_values)
    assert worst > 0.01
    assert max(m.grad_underflow_fp16 for m in after.values() if m.grad_values) < worst / 10


class _Hot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        with torch.no_grad():
            self.fc.bias.fill_(2e4)  # activations of 2e4: within 2**4 of 65504

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 1e-4


def test_activations_near_fp16s_range_are_named_and_the_island_keeps_a_larger_input_finite():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Hot(), nn.Linear(8, 2))
    batch = torch.randn(4, 8)
    report = audit(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu"), batch,
                   autocast="fp16")
    risk = next(r for r in report.risks if r.code == "activation_headroom")
    assert "1.fc" in risk.modules
    assert "1.fc" in report.proposed_plan.policy.fp32_modules and "fp32_modules=[" in report.switch

    def loss_is_finite(plan) -> bool:  # the same loop, on inputs whose activations pass 65504
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8), _Hot(), nn.Linear(8, 2))
        with torch.no_grad():
            m[1].fc.bias.fill_(8e4)
        mp = MixedPrecision(plan)
        m, _ = mp.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))
        with mp.autocast():
            return bool(torch.isfinite(m(batch).float().sum()))

    assert not loss_is_finite("fp16-mixed")
    assert loss_is_finite(report.proposed_plan)


def test_bad_arguments_are_named():
    model = _mlp()
    with pytest.raises(TypeError, match="optimizer must be a torch optimizer"):
        audit(model, "adamw")
    with pytest.raises(ValueError, match="autocast must be"):
        audit(model, None, autocast="fp8")
    with pytest.raises(TypeError, match="scaler must be"):
        audit(model, None, scaler=object())
    assert mixprec.audit is audit


@pytest.mark.parametrize("plan", ["fp16-mixed", "fp16-master", "fp16-pure"])
def test_a_loop_mixprec_prepared_is_recognised_without_its_scaler(plan):
    """A loop mixprec prepared, audited without ``scaler=mp.scaler``: the session's own loss scaling
    counts (fp16-mixed leaves the optimizer a plain torch one: the prepared model is what tells),
    and the proposal is the plan it already runs."""
    model = _mlp()
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters()))
    report = audit(model, opt, None, (torch.randn(4, 8), torch.tensor([0, 1, 0, 1])), autocast="fp16",
                   criterion=nn.CrossEntropyLoss())
    assert report.ok, (plan, str(report))
    assert report.effective_plan == plan
    assert report.proposed_plan.name == plan
    assert f"get_plan({plan!r})" in report.switch


def test_a_wrapper_without_its_session_decides_and_unscaled_fp16_loops_stay_flagged():
    import copy
    import gc

    # an fp16-master wrapper whose session is gone (a pickled / unpickled loop): the wrapper names the plan
    model = _mlp()
    mp = MixedPrecision("fp16-master")
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters()))
    del mp
    gc.collect()
    report = audit(model, opt, autocast="fp16")
    assert report.ok, str(report)
    assert report.proposed_plan.name == "fp16-master"

    # a prepared fp16-mixed model is part of its session; a copy of it, or the model stepped by another
    # optimizer than the session's, is not: nothing scales those losses
    model = _mlp()
    mp = MixedPrecision("fp16-mixed")
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters()))
    shadow = copy.deepcopy(model)
    for m, o in ((shadow, torch.optim.AdamW(shadow.parameters())), (model, torch.optim.SGD(model.parameters()))):
        report = audit(m, o, autocast="fp16")
        assert [r.code for r in report.risks] == ["fp16_without_scaler"], str(report)
        assert report.proposed_plan.name == "fp16-mixed"
    # an explicit scaler still wins over the session's
    assert audit(model, opt, torch.amp.GradScaler("cpu", enabled=False), autocast="fp16").risks[0].code == (
        "fp16_without_scaler")

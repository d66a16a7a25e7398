"""Overflow explained without asking (mixprec.explainer): once skips recur, the next skipped
step is traced and the warning names the module and the fp32 island that fixes it."""

from __future__ import annotations

import warnings

import pytest
import torch

from mixprec import MixedPrecision, get_plan
from mixprec.explainer import SKIPS, OverflowExplainer


class _Planted(torch.nn.Module):
    """A block whose activations leave fp16's range (a bias of 1e5), scaled back after."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(32, 32)
        with torch.no_grad():
            self.fc.bias.fill_(1e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 1e-5


def _model(planted: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    middle = _Planted() if planted else torch.nn.Linear(32, 32)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), middle, torch.nn.Linear(32, 4))


def _train(plan, model, steps: int, **kw) -> tuple[list[str | None], list[str], MixedPrecision]:
    mp = MixedPrecision(plan, **kw)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(0)
    reasons = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            with mp.autocast():
                loss = model(torch.randn(8, 16, generator=g)).float().pow(2).mean()
            mp.backward(loss)
            reasons.append(mp.step().skip_reason)
    return reasons, [str(w.message) for w in caught if "mixprec: steps are being skipped" in str(w.message)], mp


def test_a_planted_forward_overflow_is_named_and_the_suggested_island_fixes_it():
    reasons, warned, mp = _train("fp16-mixed", _model(), 6)
    assert reasons == ["nonfinite_loss"] * 6
    assert len(warned) == 1  # once
    assert "module '2.fc' (Linear): output became inf" in warned[0]
    assert "get_plan('fp16-mixed', fp32_modules=['2.fc'])" in warned[0]
    assert not mp._explainer.armed  # the hooks are gone again
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in mp.model.modules())
    # the suggestion, applied: no skip at all
    reasons, warned, _ = _train(get_plan("fp16-mixed", fp32_modules=["2.fc"]), _model(), 20)
    assert reasons == [None] * 20 and not warned


def test_the_skip_error_carries_the_diagnosis():
    with pytest.raises(RuntimeError, match=r"Diagnosis: the first traced overflow: forward overflow .*'2\.fc'"):
        _train("fp16-mixed", _model(), 10, max_consecutive_skips=4)


def test_nothing_is_hooked_while_nothing_overflows():
    reasons, warned, mp = _train("fp16-mixed", _model(planted=False), 30)
    assert not warned and not mp._explainer.armed
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in mp.model.modules())
    _, warned, mp = _train("fp16-mixed", _model(), 4, explain_overflow=False)
    assert not warned and mp._explainer is not None and not mp._explainer.enabled


def test_a_scale_settling_does_not_arm_the_tracer_but_recurring_overflows_do():
    explainer = OverflowExplainer(_model(), get_plan("fp16-mixed"))
    for _ in range(5):  # a fresh scale backing off before any step was taken
        explainer.after_step("overflow", 65536.0)
    assert not explainer.armed
    explainer.after_step(None, 2048.0)
    explainer.after_step("overflow", 2048.0)  # one back-off after a growth: normal
    for _ in range(50):
        explainer.after_step(None, 1024.0)
    assert not explainer.armed
    for _ in range(SKIPS - 1):
        explainer.after_step("overflow", 1024.0)
    assert explainer.armed  # SKIPS within the window
    explainer.remove()
    low = OverflowExplainer(_model(), get_plan("fp16-mixed"))
    low.after_step(None, 1.0)
    low.after_step("overflow", 0.5)  # overflowing even unscaled
    assert low.armed
    low.remove()

"""Overflow explained without asking (mixprec.explainer): once skips recur, the next skipped
step is traced and the warning names the module and the fp32 island that fixes it."""

from __future__ import annotations

import warnings

import pytest
import torch

import mixprec
from mixprec import MixedPrecision, get_plan
from mixprec.explainer import OverflowExplainer, suggestion
from mixprec.tracing import OverflowFinding


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


def test_back_offs_with_room_do_not_arm_the_tracer_but_a_scale_at_its_floor_does():
    explainer = OverflowExplainer(_model(), get_plan("fp16-mixed"))
    step = iter(range(1000))
    for scale in (65536.0, 32768.0, 16384.0):  # a fresh scale coming down
        explainer.after_step(next(step), "overflow", scale)
    for _ in range(30):  # growth then back-off, again and again (a short growth interval)
        explainer.after_step(next(step), None, None)
        explainer.after_step(next(step), "overflow", 16384.0)
    assert not explainer.armed
    explainer.after_step(next(step), "overflow", 0.5)  # overflowing even unscaled
    assert explainer.armed
    explainer.remove()
    bounded = OverflowExplainer(_model(), get_plan("fp16-mixed"), min_scale=128.0)
    bounded.after_step(0, "overflow", 200.0)  # within 2x of min_scale: near the floor
    assert bounded.armed
    bounded.remove()
    weights = OverflowExplainer(_model(), get_plan("fp16-mixed"))
    weights.after_step(0, "nonfinite_weights", None)  # weights outgrowing fp16: nothing to trace
    assert not weights.armed


def test_a_step_finished_again_after_an_interruption_is_counted_once():
    explainer = OverflowExplainer(_model(), get_plan("fp16-mixed"))
    explainer.after_step((0, 1), "nonfinite_loss", 65536.0)
    assert explainer.armed
    explainer.after_step((0, 1), "nonfinite_loss", 65536.0)  # the same step, again: no tracing round
    assert explainer.armed and explainer.finding is None
    explainer.remove()


def test_hooks_that_do_not_run_blame_nothing():
    """A model compiled after prepare runs no forward hooks: the tracer would name the wrong
    module (or none), so it is removed and nothing is said."""
    explainer = OverflowExplainer(_model(), get_plan("fp16-mixed"))
    explainer.after_step(0, "nonfinite_loss", 65536.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert explainer.after_step(1, "nonfinite_loss", 65536.0) is None  # no forward seen
    assert not explainer.armed and not explainer.enabled


def _finding(module: str, what: str = "output") -> OverflowFinding:
    return OverflowFinding(module=module, module_type="Linear", direction="forward", what=what, step=3, call=0,
                           dtype=torch.float16, kind="inf", max_abs=None)


def test_the_suggestion_fits_the_plan():
    known = ("fp16-mixed", "bf16-mixed")
    plan = get_plan("fp16-mixed", fp32_modules=["0"])
    text = suggestion(_finding("2.fc"), plan, known)
    assert "get_plan('fp16-mixed', fp32_modules=['0', '2.fc'])" in text and "bf16 plan" in text
    island = get_plan("fp16-mixed", fp32_modules=["0.inner"])  # an island already: its parent is widened
    assert "keep '0' in fp32 with get_plan('fp16-mixed', fp32_modules=['0.inner', '0'])" in suggestion(
        _finding("0.inner"), island, known)
    import dataclasses

    custom = dataclasses.replace(get_plan("fp16-mixed"), name="my-fp16")
    assert "get_plan" not in suggestion(_finding("2.fc"), custom, known)
    assert suggestion(_finding("3", what="gradient of its output"), plan, known).startswith("compute the loss in fp32")
    assert "bf16 plan" not in suggestion(_finding("2.fc"), get_plan("bf16-pure"), ("bf16-pure",))


def test_a_copy_of_an_armed_model_carries_no_live_hook():
    import copy
    import io

    model = _model()
    explainer = OverflowExplainer(model, get_plan("fp16-mixed"))
    explainer.after_step(0, "nonfinite_loss", 65536.0)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for clone in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        clone(torch.randn(2, 16))
    assert not explainer._forward_seen  # the copies' calls never reach this run's explainer
    model(torch.randn(2, 16))
    assert explainer._forward_seen
    explainer.remove()
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_a_constant_scale_that_overflows_is_explained_and_the_error_says_where():
    """A constant scale has no room to back off into: its overflows arm the tracer at once."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    mp = MixedPrecision("fp16-mixed", scaler=mixprec.ConstantLossScaler(2.0**15), max_consecutive_skips=6)
    model, _ = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(RuntimeError, match="Diagnosis: the first traced"):
        warnings.simplefilter("always")
        for _ in range(10):
            with mp.autocast():
                loss = model(x).float().sum() * 10.0
            mp.backward(loss)
            mp.step()
    assert any("mixprec: steps are being skipped" in str(w.message) for w in caught)


def test_the_session_gives_the_explainer_its_scalers_floor():
    def floor(scaler):
        mp = MixedPrecision("fp16-mixed", scaler=scaler)
        model = _model(planted=False)
        mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return mp._explainer.min_scale

    assert floor(mixprec.DynamicLossScaler(min_scale=128.0)) == 128.0
    assert floor(mixprec.DynamicLossScaler()) is None
    assert floor(mixprec.ConstantLossScaler(2.0**10)) == 2.0**9  # a constant scale: its own value is the floor


def test_an_inf_in_the_batch_blames_the_data_not_a_module():
    """A batch that already holds inf is the data's fault: no fp32 island is suggested (the
    first module used to be blamed for passing it on)."""
    mp = MixedPrecision("bf16-mixed")
    model = _model(planted=False)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randn(8, 16, generator=g)
            x[0, 0] = float("inf")
            with mp.autocast():
                loss = model(x).float().pow(2).mean()
            mp.backward(loss)
            assert mp.step().skip_reason == "nonfinite_loss"
    warned = [str(w.message) for w in caught if "mixprec: steps are being skipped" in str(w.message)]
    assert len(warned) == 1
    assert "the model's input already held inf" in warned[0]
    assert "check the data" in warned[0] and "fp32_modules" not in warned[0]


def test_an_additive_attention_mask_and_a_pure_plans_input_cast_are_not_blamed_on_the_data():
    """-inf in a float mask is by design; an fp16 cast of finite fp32 data that overflows is the
    plan's doing, not the data's (the tracer sees the inputs as the caller passed them)."""
    from mixprec.tracing import OverflowTracer

    class Masked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.fc(x) + mask, dim=-1)

    model = Masked()
    mask = torch.triu(torch.full((4, 4), float("-inf")), diagonal=1)
    with OverflowTracer(model) as tracer:
        model(torch.randn(4, 4), mask).sum().backward()
        assert tracer.first_overflow() is None
    with OverflowTracer(model) as tracer:  # a NaN given by keyword is the data's
        model(torch.randn(4, 4), mask=torch.full((4, 4), float("nan"))).sum().backward()
        finding = tracer.first_overflow()
        assert finding is not None and finding.in_input
    # fp16-pure casts finite fp32 data of 1e5 to inf: the first layer is named, not the data
    mp = MixedPrecision("fp16-pure")
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    net, opt = mp.prepare(net, torch.optim.SGD(net.parameters(), lr=1e-3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            loss = net(torch.full((2, 4), 1e5)).float().sum()
            mp.backward(loss)
            mp.step()
    warned = [str(w.message) for w in caught if "mixprec: steps are being skipped" in str(w.message)]
    assert warned and "check the data" not in warned[0], warned


def test_every_bad_batch_in_a_row_is_blamed_on_the_data():
    """After a finding was handed out, the next forward starts a new step: its inputs are read too."""
    from mixprec.tracing import OverflowTracer

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    with OverflowTracer(model) as tracer:
        for _ in range(3):
            x = torch.randn(2, 4)
            x[0, 0] = float("nan")
            model(x).sum().backward()
            finding = tracer.first_overflow()
            assert finding is not None and finding.in_input, finding

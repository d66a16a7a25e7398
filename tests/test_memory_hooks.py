"""The memory diagnostics learn everything from the plan and the optimizer's public hooks.

A plan the library has never heard of (defined here) wraps the optimizer in a wrapper it
has never heard of (defined here); the estimate and the measurement report that wrapper's
own bytes. Plain torch optimizers are sized generically, batches nest like everywhere else
(mixprec.nested), and the wrappers' public memory and compensation hooks are exact.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision
from mixprec.diagnostics import estimate_memory, measure_memory, training_state_bytes_per_param
from mixprec.optim import (
    KahanOptimizer,
    LowPrecisionOptimizer,
    MasterWeightOptimizer,
    StochasticRoundingOptimizer,
    WrappedOptimizer,
)
from mixprec.optim.footprint import optimizer_state_bytes, state_layout
from mixprec.plans import Plan

_STATE = ("weights", "buffers", "grads", "master_weights", "grad_accumulation", "optimizer_state", "compensation")


# ------------------------------------------------------------ a plan from outside
class EmaOptimizer(WrappedOptimizer):
    """Keeps an fp32 exponential moving average of every parameter (updated after each step)."""

    TRANSIENT = 3 << 20  # what this wrapper says its step needs besides the state

    def __init__(self, optimizer: torch.optim.Optimizer, decay: float = 0.9) -> None:
        super().__init__(optimizer)
        self.decay = decay
        self.ema: dict[torch.Tensor, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        result = self.optimizer.step()
        for p in self.params():
            avg = self.ema.get(p)
            if avg is None:
                self.ema[p] = p.detach().to(torch.float32, copy=True)
            else:
                avg.lerp_(p.float(), 1 - self.decay)
        return result

    def state_bytes(self) -> dict[str, int]:
        out = super().state_bytes()
        out["optimizer_state"] += sum(p.numel() * 4 for p in self.params())  # the averages, predicted
        out["compensation"] = 0
        return out

    def state_tensors(self) -> Iterator[torch.Tensor]:
        yield from super().state_tensors()
        yield from self.ema.values()

    def step_transient_bytes(self) -> int:
        return self.TRANSIENT


@dataclass(frozen=True)
class EmaPlan(Plan):
    """fp32 training whose optimizer keeps parameter averages: one file, no registry line needed here."""

    family: ClassVar[str] = "ema"
    summary: ClassVar[str] = "fp32 weights with fp32 parameter averages"

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, fp32_values: dict[torch.Tensor, torch.Tensor]
    ) -> torch.optim.Optimizer:
        return EmaOptimizer(optimizer)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def test_estimate_reports_the_bytes_of_a_wrapper_it_never_heard_of() -> None:
    model = _mlp()
    n = sum(p.numel() for p in model.parameters())
    plan = EmaPlan(name="ema-test")
    est = estimate_memory(model, plan, optimizer="adamw")
    steps = 4 * len(list(model.parameters()))  # AdamW's fp32 step counters
    assert est.plan == "ema-test"
    assert est.bytes["optimizer_state"] == n * 8 + steps + n * 4  # AdamW moments + the wrapper's averages
    assert est.bytes["master_weights"] == 0 and est.bytes["compensation"] == 0
    # no batch: the peak is the state plus the step, whose temporaries the wrapper reported
    assert est.peak == est.persistent + est.bytes["grads"] + EmaOptimizer.TRANSIENT
    meas = measure_memory(_mlp, plan, lambda: torch.randn(16, 32), optimizer="adamw")
    for key in _STATE:  # the measurement finds the averages through state_tensors()
        assert est.bytes[key] == meas.bytes[key], key


def test_a_wrapper_reporting_an_unknown_class_is_refused() -> None:
    class Typo(WrappedOptimizer):
        def state_bytes(self) -> dict[str, int]:
            return {"optimiser_state": 4}

    @dataclass(frozen=True)
    class TypoPlan(Plan):
        def wrap_optimizer(self, optimizer: torch.optim.Optimizer, fp32_values: Any) -> torch.optim.Optimizer:
            return Typo(optimizer)

    message = (
        "Typo.state_bytes() reported class 'optimiser_state'; expected keys among "
        "master_weights, grad_accumulation, optimizer_state, compensation"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        estimate_memory(nn.Linear(4, 4), TypoPlan(name="typo"))


# ------------------------------------------------------- plain optimizers, generically
class SignMomentum(torch.optim.Optimizer):
    """A third-party optimizer: a momentum buffer and a step count per parameter."""

    def __init__(self, params: Any, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["buf"] = torch.zeros_like(p)
                    state["count"] = torch.zeros((), dtype=torch.int64)
                state["buf"].mul_(0.9).add_(p.grad)
                state["count"] += 1
                p.add_(state["buf"].sign(), alpha=-group["lr"])


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: SignMomentum(ps),
        lambda ps: torch.optim.RMSprop(ps, momentum=0.9, centered=True),
        lambda ps: torch.optim.NAdam(ps),
        lambda ps: torch.optim.Adam(ps, amsgrad=True),
    ],
    ids=["third-party", "rmsprop-centered", "nadam", "adam-amsgrad"],
)
@pytest.mark.parametrize("plan", ["fp32", "bf16-master", "bf16-kahan"])
def test_optimizer_state_is_predicted_as_the_first_step_creates_it(make: Any, plan: str) -> None:
    """No table of optimizer names: whatever state the first step creates is what the
    prediction (before any step) and the estimate report."""
    model = _mlp()
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, make(model.parameters()))
    before = training_state_bytes_per_param(model, opt)
    mp.backward(model(torch.randn(4, 32, dtype=mp.plan.weight_dtype)).float().sum())
    mp.step()
    after = training_state_bytes_per_param(model, opt)
    assert before == pytest.approx(after)
    assert after["optimizer_state"] > 0
    est = estimate_memory(_mlp(), plan, optimizer=make)
    assert est.per_param() == pytest.approx(before)


def test_state_layout_keeps_the_real_optimizer_untouched() -> None:
    w = nn.Parameter(torch.ones(5))
    opt = torch.optim.SGD([w], lr=1.0, momentum=0.9)
    layout = state_layout(opt)
    assert layout == {id(w): {"momentum_buffer": (torch.Size([5]), torch.float32)}}
    assert len(opt.state) == 0 and torch.equal(w.detach(), torch.ones(5)) and w.grad is None
    assert optimizer_state_bytes(torch.optim.LBFGS([w])) == 0  # cannot step on meta tensors: nothing predicted


# ---------------------------------------------------------------- nested batches
Pair = collections.namedtuple("Pair", "a b")


class PairNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(16, 8)

    def forward(self, pair: Pair) -> torch.Tensor:
        return self.a(pair.a) + self.b(pair.b)


@pytest.mark.parametrize("plan", ["fp32", "bf16-master"])
def test_memory_of_a_namedtuple_batch(plan: str) -> None:
    """A model taking a namedtuple: the estimate fakes the batch with mixprec.nested (the
    namedtuple is rebuilt as a namedtuple), and estimate and measurement agree."""
    batch = ((Pair(torch.randn(32, 16), torch.randn(32, 16)),), torch.randn(32, 8))
    criterion = nn.MSELoss()
    est = estimate_memory(PairNet(), plan, batch=batch, criterion=criterion)
    meas = measure_memory(PairNet, plan, lambda: batch, criterion=criterion)
    assert est.bytes["activations"] > 0 and not est.notes
    for key in _STATE:
        assert est.bytes[key] == meas.bytes[key], key
    assert est.peak == pytest.approx(meas.peak, rel=0.15)


# ------------------------------------------------------------ the wrappers' hooks
def test_master_weight_optimizer_reports_masters_state_and_accumulation() -> None:
    model = nn.Linear(16, 16)
    values = {p: p.detach().clone() for p in model.parameters()}
    model.to(torch.bfloat16)
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters()), master_values=values)
    n = 16 * 16 + 16
    assert opt.state_bytes() == {"master_weights": n * 4, "optimizer_state": n * 8 + 2 * 4, "grad_accumulation": 0}
    model(torch.randn(2, 16, dtype=torch.bfloat16)).float().sum().backward()
    opt.accumulate_grads()
    assert opt.state_bytes()["grad_accumulation"] == n * 4  # fp32 buffers of the micro-batch sum
    assert opt.step_transient_bytes() == n * 4  # the fp32 gradients (the fused update makes no temporaries)
    opt.step()
    assert opt.state_bytes() == {"master_weights": n * 4, "optimizer_state": n * 8 + 2 * 4, "grad_accumulation": 0}


@pytest.mark.parametrize("cls", [LowPrecisionOptimizer, KahanOptimizer, StochasticRoundingOptimizer])
def test_low_precision_wrappers_report_state_in_their_state_dtype(cls: type[LowPrecisionOptimizer]) -> None:
    w = nn.Parameter(torch.ones(100, dtype=torch.bfloat16))
    opt = cls(torch.optim.AdamW([w]), state_dtype=torch.bfloat16)
    expected = {"optimizer_state": 100 * 2 * 2 + 4}
    if cls is KahanOptimizer:
        expected["compensation"] = 100 * 2
    assert opt.state_bytes() == expected
    w.grad = torch.ones_like(w)
    opt.step()
    assert opt.state_bytes() == expected  # predicted == created
    held = sum(t.numel() * t.element_size() for t in opt.state_tensors())
    assert held == sum(expected.values())


def test_kahan_compensation_public_api() -> None:
    w = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = KahanOptimizer(torch.optim.SGD([w], lr=1.0))
    assert opt.compensation(w) is None
    w.grad = torch.full_like(w, -1e-3)
    opt.step()
    comp = opt.compensation(w)
    assert comp is not None and float(w.detach()[0]) + float(comp[0]) == pytest.approx(1.001, abs=1e-5)
    opt.set_compensation(w, torch.zeros_like(w))
    assert torch.equal(opt.compensation(w), torch.zeros_like(w))
    opt.drop_compensation(w)
    assert opt.compensation(w) is None
    with pytest.raises(ValueError, match=re.escape("set_compensation(value=...) has shape (2,), but the parameter (4,)")):
        opt.set_compensation(w, torch.zeros(2, dtype=torch.bfloat16))
    plain = LowPrecisionOptimizer(torch.optim.SGD([w], lr=1.0))
    assert plain.compensation(w) is None and plain.rounding_state() == {}
    plain.drop_compensation(w)  # nothing to drop
    with pytest.raises(TypeError, match=re.escape("LowPrecisionOptimizer keeps no compensation buffers")):
        plain.set_compensation(w, torch.zeros_like(w))


def test_in_backward_optimizer_reports_its_wrapped_state_and_the_copies_it_keeps() -> None:
    from mixprec.optim import InBackwardOptimizer

    w = nn.Parameter(torch.ones(100, dtype=torch.bfloat16))
    opt = KahanOptimizer(torch.optim.AdamW([w]), state_dtype=torch.bfloat16)
    in_bwd = InBackwardOptimizer(opt)
    assert in_bwd.state_bytes() == opt.state_bytes() == {"optimizer_state": 404, "compensation": 200}
    # until finish(): a copy of the weight (200), its state (404) and its compensation (200)
    assert in_bwd.step_transient_bytes() == 200 + 404 + 200
    in_bwd.remove()


def test_measure_memory_takes_session_options_and_in_backward_holds_no_gradients():
    """``session_options`` reach the MixedPrecision: with optimizer_in_backward every
    gradient is freed inside backward (none held at its end), and the training state of
    bf16-kahan is 8 bytes per parameter instead of 10."""
    normal = measure_memory(_mlp, "bf16-kahan", lambda: torch.randn(16, 32), optimizer="adamw")
    in_bwd = measure_memory(
        _mlp, "bf16-kahan", lambda: torch.randn(16, 32), optimizer="adamw",
        session_options={"optimizer_in_backward": True},
    )
    assert normal.bytes["grads"] > 0 and in_bwd.bytes["grads"] == 0
    assert in_bwd.per_param()["total"] == pytest.approx(normal.per_param()["total"] - 2, abs=0.1)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"plan": "bf16-mixed"}, ValueError, r"session_options names the plan \('bf16-mixed'\).*plan argument"),
        ([("grad_accum_steps", 2)], TypeError, r"session_options must be a dict.*got list"),
        ({"grad_accum_steps": 0}, ValueError, r"grad_accum_steps.*0"),
    ],
)
def test_measure_memory_refuses_unusable_session_options_before_building_anything(options, error, message):
    """The plan belongs in ``plan=`` and the options in a mapping: either mistake is named,
    with the fix, before the model factory runs."""
    built = []

    def factory():
        built.append(1)
        return _mlp()

    with pytest.raises(error, match=message):
        measure_memory(factory, "fp32", lambda: torch.randn(16, 32), session_options=options)
    assert built == []


def test_a_frozen_base_is_not_counted_as_stepped_or_copied():
    """fp16-master guards its step with a copy of what it updates: a frozen base is never
    updated, so neither copied nor counted (before: 4 bytes per frozen parameter of phantom peak)."""
    def transient(freeze: bool) -> int:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(8, 8)).half()
        model[0].requires_grad_(not freeze)
        mp = MixedPrecision("fp16-master")
        model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        return opt.step_transient_bytes()

    torch.manual_seed(0)
    small = torch.nn.Sequential(torch.nn.Linear(8, 8)).half()
    mp = MixedPrecision("fp16-master")
    small, opt = mp.prepare(small, torch.optim.AdamW(small.parameters(), lr=1e-2))
    assert transient(freeze=True) == opt.step_transient_bytes()
    assert transient(freeze=False) > 512 * 512 * 4


def test_memory_report_converts_a_frozen_base_a_plan_refuses_and_says_so():
    from mixprec.diagnostics import memory_report

    def model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
        m[0].requires_grad_(False)  # a frozen fp32 layer: bf16-master would round it for good
        return m

    report = memory_report(model, ("fp32", "bf16-master"), lambda: torch.randn(8, 32), measure=False)
    assert any("convert_frozen=True" in n for n in report.estimates["bf16-master"].notes)
    assert report.estimates["bf16-master"].trainable == 32 * 32 + 32

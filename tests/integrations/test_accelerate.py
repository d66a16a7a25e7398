"""mixprec under an Accelerate loop, checked against mixprec's own loop on the same data."""

from __future__ import annotations

import copy
import importlib
import re
import sys

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from mixprec import DynamicLossScaler, MixedPrecision
from mixprec.integrations.accelerate import prepare
from tests.integrations._common import (
    PLAN_NAMES,
    TinyMLP,
    assert_close_losses,
    assert_same_params,
    make_optimizer,
    make_plan,
    mlp_data,
    mse,
    reference_run,
)

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def accelerate_run(model, batches, precision, *, gas=1, clip=None, stop_after=None, accelerator=None, setup=None,
                   clip_value=None):
    acc = accelerator or Accelerator(cpu=True, gradient_accumulation_steps=gas)
    mp = precision if isinstance(precision, MixedPrecision) else MixedPrecision(precision)
    opt, sched = make_optimizer(model)
    model, opt, sched = prepare(acc, mp, model, opt, sched)
    if setup is not None:
        setup(acc)
    losses, norms = [], []
    for i, (x, y) in enumerate(batches):
        if stop_after is not None and i == stop_after:
            break
        with acc.accumulate(model):
            loss = mse(model(x), y)
            losses.append(loss.item())
            acc.backward(loss)
            if acc.sync_gradients and clip is not None:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), clip)))
            if acc.sync_gradients and clip_value is not None:
                acc.clip_grad_value_(model.parameters(), clip_value)
            opt.step()
            sched.step()
            opt.zero_grad()
    return {"losses": losses, "norms": norms, "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "lr": sched.get_last_lr()[0], "mp": mp, "acc": acc, "model": model, "opt": opt}


@pytest.mark.parametrize("plan", PLAN_NAMES)
def test_same_losses_as_mixprec_loop_with_accumulation_and_clipping(plan):
    model, data = TinyMLP(), mlp_data(24)
    want = reference_run(model, data, lambda m, b: mse(m(b[0]), b[1]), make_plan(plan), grad_accum_steps=2, clip=0.5)
    got = accelerate_run(copy.deepcopy(model), data, make_plan(plan), gas=2, clip=0.5)
    assert_close_losses(got["losses"], want["losses"], exact=True)
    # 24 micro-batches with accumulation 2: 12 step decisions, not 24
    assert got["mp"].optimizer_steps == want["mp"].optimizer_steps
    assert got["mp"].optimizer_steps + got["mp"].scaler.skipped_steps == 12
    assert got["norms"] == [r.grad_norm for r in want["results"]]
    assert got["lr"] == want["lr"]
    assert_same_params(got["params"], want["params"])


def test_fp16_overflow_skips_steps_and_holds_the_scheduler():
    model, data = TinyMLP(), mlp_data(20)

    def session():
        return MixedPrecision("fp16-mixed", scaler=DynamicLossScaler(init_scale=2.0**24))

    want = reference_run(model, data, lambda m, b: mse(m(b[0]), b[1]), session())
    got = accelerate_run(copy.deepcopy(model), data, session(), clip=1.0e9)
    skipped = got["mp"].scaler.skipped_steps
    assert skipped >= 3, "the forced overflow did not happen"
    assert skipped == want["mp"].scaler.skipped_steps
    steps = got["mp"].optimizer_steps
    assert steps == 20 - skipped
    # the LambdaLR advanced once per real step only
    assert got["lr"] == pytest.approx(1e-2 / (1.0 + 0.1 * steps), rel=1e-12)
    assert got["acc"].optimizer_step_was_skipped is False
    assert_close_losses(got["losses"], want["losses"], exact=True)
    assert_same_params(got["params"], want["params"])


def test_clip_grad_norm_returns_the_true_norm_under_fp16_scaling():
    model, data = TinyMLP(), mlp_data(1)
    scaled = MixedPrecision("fp16-mixed", scaler=DynamicLossScaler(init_scale=2.0**10))
    got = accelerate_run(copy.deepcopy(model), data, scaled, clip=1e9)
    same = MixedPrecision("fp16-mixed", scaler=DynamicLossScaler(init_scale=2.0**10), clip_grad_norm=1e9)
    want = reference_run(model, data, lambda m, b: mse(m(b[0]), b[1]), same)
    assert got["norms"][0] == want["results"][0].grad_norm  # mixprec's own loop: the same true norm
    fp32 = accelerate_run(copy.deepcopy(model), data, "fp32", clip=1e9)
    # and the scale is 1024: a scaled norm would be 1024 times larger than fp32's
    assert got["norms"][0] == pytest.approx(fp32["norms"][0], rel=2e-2)


@pytest.mark.parametrize("plan", ["fp16-mixed", "bf16-master", "bf16-sr"])
def test_save_state_resume_is_bit_identical(tmp_path, plan):
    model, data = TinyMLP(), mlp_data(16)
    full = accelerate_run(copy.deepcopy(model), data, plan, gas=2, clip=1.0)

    first = accelerate_run(copy.deepcopy(model), data, plan, gas=2, clip=1.0, stop_after=8)
    first["acc"].save_state(str(tmp_path / "ckpt"))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()

    # a fresh process: new model (different weights), new accelerator, load, continue
    resumed = accelerate_run(
        TinyMLP(), data[8:], plan, gas=2, clip=1.0, setup=lambda acc: acc.load_state(str(tmp_path / "ckpt"))
    )
    assert resumed["mp"].optimizer_steps == full["mp"].optimizer_steps
    assert resumed["mp"].scaler.get_scale() == full["mp"].scaler.get_scale()
    assert_close_losses(first["losses"] + resumed["losses"], full["losses"], exact=True)
    assert_same_params(resumed["params"], full["params"])


def test_clip_grad_value_matches_accelerate_in_fp32():
    """fp32 plan: acc.clip_grad_value_ through mixprec gives Accelerate's own fp32 run, bit for bit."""
    model, data = TinyMLP(), mlp_data(8)
    got = accelerate_run(copy.deepcopy(model), data, "fp32", clip_value=1e-3)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True)
    ref = copy.deepcopy(model)
    opt, sched = make_optimizer(ref)
    ref, opt, sched = acc.prepare(ref, opt, sched)
    for x, y in data:
        acc.backward(mse(ref(x), y))
        acc.clip_grad_value_(ref.parameters(), 1e-3)
        opt.step()
        sched.step()
        opt.zero_grad()
    assert_same_params(got["params"], {k: v.detach() for k, v in ref.state_dict().items()})


def test_accelerator_mixed_precision_and_mixprec_conflict():
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model = TinyMLP()
    with pytest.raises(ValueError, match=re.escape(
        "Accelerator(mixed_precision='bf16') and mixprec would both run the precision; create the Accelerator "
        "with mixed_precision='no' and choose the plan in MixedPrecision(...)"
    )):
        prepare(acc, MixedPrecision("bf16-mixed"), model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_clip_in_the_middle_of_accumulation_is_refused():
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = TinyMLP()
    model, opt = prepare(acc, "fp16-mixed", model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = mlp_data(1)[0]
    with acc.accumulate(model):
        acc.backward(mse(model(x), y))
        with pytest.raises(RuntimeError, match=r"sync_gradients is False"):
            acc.clip_grad_norm_(model.parameters(), 1.0)


def test_missing_framework_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)
    monkeypatch.delitem(sys.modules, "mixprec.integrations.accelerate", raising=False)
    with pytest.raises(ImportError, match=re.escape("pip install mixprec[accelerate]")):
        importlib.import_module("mixprec.integrations.accelerate")
    monkeypatch.undo()
    module = importlib.import_module("mixprec.integrations.accelerate")
    assert module.prepare is prepare  # with the framework back, the module imports as before


def test_two_optimizers_one_skip_decision():
    model, data = TinyMLP(), mlp_data(12)

    def opts(m):
        first = torch.optim.AdamW(m.fc1.parameters(), lr=1e-2)
        rest = torch.optim.SGD([*m.norm.parameters(), *m.fc2.parameters()], lr=1e-2)
        return first, rest

    def session():
        return MixedPrecision("fp16-master", scaler=DynamicLossScaler(init_scale=2.0**24))

    ref_model = copy.deepcopy(model)
    ref = session()
    ref_model, *_ = ref.prepare(ref_model, *opts(ref_model))
    want = []
    for x, y in data:
        with ref.autocast():
            loss = mse(ref_model(x), y)
        want.append(loss.item())
        ref.backward(loss)
        ref.step()

    acc = Accelerator(cpu=True)
    mp = session()
    net = copy.deepcopy(model)
    net, opt_a, opt_b = prepare(acc, mp, net, *opts(net))
    got = []
    for x, y in data:
        loss = mse(net(x), y)
        got.append(loss.item())
        acc.backward(loss)
        opt_a.step()  # steps both (or neither): one decision for the iteration
        opt_b.step()  # no-op
        assert opt_a.step_was_skipped == opt_b.step_was_skipped == mp.last_step_skipped
    assert mp.scaler.skipped_steps >= 3
    assert mp.optimizer_steps == ref.optimizer_steps == 12 - mp.scaler.skipped_steps
    assert_close_losses(got, want, exact=True)
    assert_same_params(dict(net.named_parameters()), dict(ref_model.named_parameters()))


@pytest.mark.parametrize(("bf16_ms", "chosen"), [(0.4, "bf16-mixed"), (40.0, "fp32")])
def test_auto_trains_exactly_as_the_plan_it_chose(monkeypatch, bf16_ms, chosen):
    from mixprec import hardware

    facts = hardware.DeviceFacts("cpu", "test cpu", gemm_size=256, gemm_ms={"fp32": 1.0, "bf16": bf16_ms, "fp16": 90.0})
    monkeypatch.setattr(hardware, "device_facts", lambda device=None: facts)
    model, data = TinyMLP(), mlp_data(8)
    got = accelerate_run(copy.deepcopy(model), data, "auto", gas=2, clip=0.5)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    want = accelerate_run(copy.deepcopy(model), data, chosen, gas=2, clip=0.5)
    assert got["mp"].plan.name == chosen and got["mp"].plan.auto_reason
    assert got["losses"] == want["losses"] and got["norms"] == want["norms"]
    assert_same_params(got["params"], want["params"])

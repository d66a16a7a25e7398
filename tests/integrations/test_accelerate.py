"""mixprec under an Accelerate loop, checked against mixprec's own loop on the same data."""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
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
                   clip_value=None, callback=None):
    """The Accelerate loop under mixprec; ``callback(i, acc, mp)`` runs after each micro-batch."""
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
        if callback is not None:
            callback(i, acc, mp)
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


def _device_first_run(plan, batches, *, infs=(), guard=None, save_after=None, save_to=None, load=None):
    """A loop that reads nothing itself: a fused AdamW (it masks a skipped update on the device) and
    a LambdaLR; an inf planted in the first weight's gradient at the optimizer steps ``infs``;
    ``save_state`` to ``save_to`` after step ``save_after`` (then it stops), ``load_state`` from ``load`` first."""
    torch.manual_seed(0)
    acc, mp, model = Accelerator(cpu=True), MixedPrecision(plan), TinyMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    model, opt, sched = prepare(acc, mp, model, opt, sched)
    if load is not None:
        acc.load_state(str(load))
    for i, (x, y) in enumerate(batches):
        acc.backward(mse(model(x), y))
        if i in infs:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        with guard.guard(new_step=True) if guard else contextlib.nullcontext():
            opt.step()
        with guard.guard() if guard else contextlib.nullcontext():
            sched.step()
        opt.zero_grad()
        if i == save_after:
            acc.save_state(str(save_to))
            break
    return {"mp": mp, "lr": sched.get_last_lr()[0], "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("plan", ["bf16-mixed", "fp16-mixed"])
def test_steady_steps_with_a_prepared_scheduler_read_nothing_back(plan, monkeypatch):
    """``optimizer.step()`` and the prepared scheduler's ``step()`` wait for nothing on the device:
    no device value is read, and the skip decision's host copy is read one step late, never in the
    step that made it (``tests._syncs.LateReads``), also on the step an fp16 overflow skips. (After
    a bf16 skip, which should not happen, mixprec traces the next step and reads it at once.)"""
    from tests._syncs import LateReads

    late = LateReads(monkeypatch)
    got = _device_first_run(plan, mlp_data(10), infs=(6,) if plan == "fp16-mixed" else (), guard=late)
    assert late.step == 10 and late.calls == 20
    assert got["mp"].scaler.skipped_steps >= (plan == "fp16-mixed")
    assert got["mp"].optimizer_steps + got["mp"].scaler.skipped_steps == 10
    assert got["lr"] == pytest.approx(1e-2 / (1.0 + 0.1 * got["mp"].optimizer_steps), rel=1e-12)  # held on skips


def test_save_state_right_after_a_skipped_step_resumes_with_the_held_scheduler(tmp_path):
    """fp16: the step before ``save_state`` overflows. The scheduler, stepped at once and put back
    one step late, is put back before anything is saved (the model is saved first), so the saved
    optimizer and scheduler agree and the resumed run is the uninterrupted one, bit for bit."""
    data = mlp_data(10)
    full = _device_first_run("fp16-mixed", data, infs=(5,))
    first = _device_first_run("fp16-mixed", data, infs=(5,), save_after=5, save_to=tmp_path / "ckpt")["mp"]
    steps = first.optimizer_steps
    assert first.last_step_skipped and steps < 6
    assert torch.load(tmp_path / "ckpt" / "scheduler.bin", weights_only=False)["last_epoch"] == steps  # held
    saved = torch.load(tmp_path / "ckpt" / "optimizer.bin", weights_only=False)
    assert saved["param_groups"][0]["lr"] == pytest.approx(1e-2 / (1.0 + 0.1 * steps), rel=1e-12)  # the optimizer agrees
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    resumed = _device_first_run("fp16-mixed", data[6:], load=tmp_path / "ckpt")
    assert resumed["lr"] == full["lr"]
    assert resumed["mp"].optimizer_steps == full["mp"].optimizer_steps
    assert_same_params(resumed["params"], full["params"])


@pytest.mark.parametrize("safe", [False, True])
def test_load_state_right_after_a_skipped_step_keeps_what_it_loaded(tmp_path, safe):
    """fp16: a rollback (``load_state`` of an earlier checkpoint) right after a skipped step. The
    held scheduler step of that step belongs to the run being replaced and is forgotten, so the
    run goes on from the checkpoint as a fresh process loading it does. Before: with
    ``safe_serialization=False`` (nothing took the model's state_dict on the way) the next step put
    the pre-load scheduler and lr back over the loaded ones."""
    data = mlp_data(10)

    def setup():
        torch.manual_seed(0)
        acc, mp, model = Accelerator(cpu=True), MixedPrecision("fp16-mixed"), TinyMLP()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
        return (acc, mp, *prepare(acc, mp, model, opt, sched))

    def train(acc, model, opt, sched, batches, *, inf=None, save_at=None, load_at=None):
        for i, (x, y) in batches:
            acc.backward(mse(model(x), y))
            if i == inf:
                next(model.parameters()).grad.view(-1)[0] = float("inf")
            opt.step()
            sched.step()
            opt.zero_grad()
            if i == save_at:
                acc.save_state(str(tmp_path / "ckpt"), safe_serialization=safe)
            if i == load_at:
                acc.load_state(str(tmp_path / "ckpt"))

    acc, mp, model, opt, sched = setup()
    train(acc, model, opt, sched, enumerate(data), inf=4, save_at=1, load_at=4)
    assert mp.scaler.skipped_steps == 1
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc, fresh, model2, opt2, sched2 = setup()
    acc.load_state(str(tmp_path / "ckpt"))
    train(acc, model2, opt2, sched2, list(enumerate(data))[5:])
    assert sched.scheduler.last_epoch == sched2.scheduler.last_epoch
    assert sched.get_last_lr() == sched2.get_last_lr()
    assert opt.param_groups[0]["lr"] == opt2.param_groups[0]["lr"]
    assert_same_params({k: v.detach() for k, v in model.state_dict().items()},
                       {k: v.detach() for k, v in model2.state_dict().items()})


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


def test_an_fsdp_accelerator_is_refused_not_run_as_ddp(monkeypatch):
    """On CPU Accelerate ignores an FSDP plugin and runs DDP; mixprec says so instead (on GPUs,
    where Accelerate runs it, FSDP2 runs: test_accelerate_fsdp2.py)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")  # (Accelerator(fsdp_plugin=...) sets it: restored after)
    for make in (lambda: Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)),
                 lambda: (monkeypatch.setenv("ACCELERATE_USE_FSDP", "true"), Accelerator(cpu=True))[1]):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = make()
        model = TinyMLP()
        # (one process: Accelerate runs it alone; under a launcher on CPU it would run DDP, which is refused too)
        with pytest.raises(ValueError, match=re.escape("not launched as one of several (accelerate launch or torchrun)")):
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


# ------------------------------------------------------------- copies and pickles of a prepared model
def _fresh_state():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _output_dtype(plan):
    return {"bf16-mixed": torch.bfloat16, "bf16-master": torch.bfloat16, "bf16-pure": torch.bfloat16,
            "fp16-mixed": torch.float16}[plan]


@pytest.mark.parametrize("plan", ["bf16-mixed", "bf16-master", "fp16-mixed", "bf16-pure"])
def test_a_deepcopy_of_a_prepared_model_computes_with_its_own_weights(plan):
    """An EMA / evaluation copy runs its own weights in the plan's precision, and leaves the original alone."""
    acc = Accelerator(cpu=True)
    mp = MixedPrecision(plan)
    model = TinyMLP()
    model, opt = prepare(acc, mp, model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x = torch.randn(4, 8)
    want = model(x).detach()
    assert want.dtype == _output_dtype(plan)

    twin = copy.deepcopy(model)
    assert torch.equal(twin(x), want)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    assert torch.equal(twin(x), torch.zeros_like(want))  # the copy's weights, not the original's
    assert torch.equal(model(x), want)
    with torch.no_grad():
        twin.fc1.weight.copy_(torch.randn_like(twin.fc1.weight))
        twin.fc2.weight.fill_(0.5)
    plain = copy.deepcopy(twin)
    del plain.forward  # the class's forward again: the module as it was before prepare()
    with mp.autocast():  # the copy computes as the module would under the plan's autocast
        assert torch.equal(twin(x), plain(x))
    assert twin.forward.module is twin and twin.forward.plan == mp.plan
    assert inspect.signature(twin.forward) == inspect.signature(TinyMLP().forward)

    assert twin.state_dict().keys() == model.state_dict().keys()
    twin.load_state_dict(model.state_dict())
    assert torch.equal(twin(x), want)
    assert all(a is not b for a, b in zip(twin.parameters(), model.parameters(), strict=True))


def test_a_copy_prepared_again_runs_the_new_plan_once():
    model = prepare(Accelerator(cpu=True), "bf16-mixed", TinyMLP())
    twin = copy.deepcopy(model)
    _fresh_state()
    twin = prepare(Accelerator(cpu=True), "fp16-mixed", twin)
    x = torch.randn(4, 8)
    assert twin(x).dtype == torch.float16 and model(x).dtype == torch.bfloat16
    assert twin.forward.__wrapped__.__func__ is TinyMLP.forward  # one wrapper, not one per prepare


@pytest.mark.parametrize("plan", ["bf16-mixed", "bf16-master", "fp16-mixed"])
def test_an_ema_copy_does_not_change_the_training_run(plan):
    """A copy taken and loaded at every step (an EMA) changes neither the losses nor the weights of the run."""
    model, data = TinyMLP(), mlp_data(8)
    want = accelerate_run(copy.deepcopy(model), data, plan, gas=2, clip=1.0)
    _fresh_state()
    ema = {}

    def update_ema(i, acc, mp):
        live = acc._models[0]
        if "model" not in ema:
            ema["model"] = copy.deepcopy(live)
        with torch.no_grad():  # what an EMA callback does: blend, then load the blend into the copy
            blend = {k: v.lerp(live.state_dict()[k], 0.1) if v.is_floating_point() else v
                     for k, v in ema["model"].state_dict().items()}
            for p in ema["model"].parameters():
                p.zero_()  # anything the copy goes through must stay out of the run
        ema["model"].load_state_dict(blend)
        ema["out"] = ema["model"](data[0][0])
        plain = copy.deepcopy(ema["model"])
        del plain.forward
        with mp.autocast():
            ema["want"] = plain(data[0][0])  # what the EMA weights compute under the plan

    got = accelerate_run(copy.deepcopy(model), data, plan, gas=2, clip=1.0, callback=update_ema)
    assert_close_losses(got["losses"], want["losses"], exact=True)
    assert_same_params(got["params"], want["params"])
    assert ema["out"].dtype == _output_dtype(plan)
    assert torch.equal(ema["out"], ema["want"])


@pytest.mark.parametrize("plan", ["bf16-mixed", "bf16-master", "fp16-mixed"])
def test_torch_save_and_load_of_a_prepared_model(tmp_path, plan):
    model, data = TinyMLP(), mlp_data(4)
    run = accelerate_run(model, data, plan, gas=2)
    model, x = run["model"], torch.randn(4, 8)
    want = model(x).detach()
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert type(loaded) is TinyMLP and loaded.forward.module is loaded
    assert loaded.forward.plan == run["mp"].plan
    assert torch.equal(loaded(x), want) and want.dtype == _output_dtype(plan)  # the plan's precision
    assert_same_params({k: v.detach() for k, v in loaded.state_dict().items()}, run["params"])
    with torch.no_grad():
        loaded.fc2.weight.zero_()
        loaded.fc2.bias.zero_()
    assert torch.equal(loaded(x), torch.zeros_like(want)) and torch.equal(model(x), want)
    # and the copy of a copy, pickled again
    twin = copy.deepcopy(loaded)
    torch.save(twin, tmp_path / "twin.pt")
    again = torch.load(tmp_path / "twin.pt", weights_only=False)
    assert torch.equal(again(x), torch.zeros_like(want)) and again.forward.module is again


def test_torch_save_of_a_pure_plan_model(tmp_path):
    run = accelerate_run(TinyMLP(), mlp_data(2), "bf16-pure")
    model, x = run["model"], torch.randn(4, 8)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    want = model(x)  # fp32 inputs: the pure plan's input cast travels with the model
    assert want.dtype == torch.bfloat16 and torch.equal(loaded(x), want)


# ------------------------------------------------------------- save_state between accumulation boundaries
def plain_accelerate_run(model, batches, *, gas, callback=None, setup=None):
    """Accelerate's own fp32 loop (no mixprec), as accelerate_run runs it."""
    acc = Accelerator(cpu=True, gradient_accumulation_steps=gas)
    opt, sched = make_optimizer(model)
    model, opt, sched = acc.prepare(model, opt, sched)
    if setup is not None:
        setup(acc)
    for i, (x, y) in enumerate(batches):
        with acc.accumulate(model):
            acc.backward(mse(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
        if callback is not None:
            callback(i, acc, None)
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "acc": acc}


def _save_at(i_save, path):
    def callback(i, acc, mp):
        if i == i_save:
            acc.save_state(str(path))
    return callback


def test_save_state_between_boundaries_resumes_as_plain_accelerate(tmp_path):
    """fp32 plan against Accelerate's own loop, bit for bit: save after 6 micro-batches (accumulation 4,
    so 2 into a window), load in a fresh process, finish. Both drop the 2 micro-batches before the save."""
    model, data = TinyMLP(), mlp_data(16)
    runs = {}
    for name, run in (("mixprec", lambda m, **kw: accelerate_run(m, data[:6] if "callback" in kw else data[6:],
                                                                    "fp32", gas=4, **kw)),
                      ("plain", lambda m, **kw: plain_accelerate_run(m, data[:6] if "callback" in kw else data[6:],
                                                                     gas=4, **kw))):
        first = run(copy.deepcopy(model), callback=_save_at(5, tmp_path / name))
        assert first["acc"].step == 6
        _fresh_state()
        resumed = run(TinyMLP(), setup=lambda acc, name=name: acc.load_state(str(tmp_path / name)))
        _fresh_state()
        runs[name] = resumed
    assert_same_params(runs["mixprec"]["params"], runs["plain"]["params"])
    assert runs["mixprec"]["mp"].optimizer_steps == 4  # the boundaries stayed at micro-batches 4, 8, 12, 16


@pytest.mark.parametrize("plan", ["fp16-mixed", "bf16-master"])
def test_save_state_between_boundaries(tmp_path, plan):
    """A checkpoint every 6 micro-batches with accumulation 4 (the issue's '2 of 1 micro-batches')."""
    model, data = TinyMLP(), mlp_data(16)

    def session():
        return MixedPrecision(plan, scaler=DynamicLossScaler(init_scale=2.0**24, growth_interval=3)) \
            if plan.startswith("fp16") else MixedPrecision(plan)

    full = accelerate_run(copy.deepcopy(model), data, session(), gas=4, clip=1.0)
    _fresh_state()

    at_step = {}

    def save_mid_window(i, acc, mp):
        if i == 3:  # the boundary before the save
            at_step["state"] = mp.state_dict()
        if i == 5:
            acc.save_state(str(tmp_path / "ckpt"))
            # the plain-loop API still refuses between backward and step, and says how many backwards
            with pytest.raises(RuntimeError, match=re.escape(
                "state_dict() called in the middle of gradient accumulation (2 backward(s) since the last "
                "step()); save after step(), or pass mid_accumulation=True for the state as of the last step "
                "(the partial gradients are not in it)"
            )):
                mp.state_dict()

    saving = accelerate_run(copy.deepcopy(model), data, session(), gas=4, clip=1.0, callback=save_mid_window)
    # saving changed nothing in the run
    assert_close_losses(saving["losses"], full["losses"], exact=True)
    assert_same_params(saving["params"], full["params"])
    # the MixedPrecision state in the checkpoint is the state as of the last step
    saved = torch.load(tmp_path / "ckpt" / "custom_checkpoint_0.pkl", weights_only=True)
    assert saved == at_step["state"]
    _fresh_state()

    # a fresh process resumes there: the next step at micro-batch 8, as in the full run, on 2 micro-batches
    resumed = accelerate_run(TinyMLP(), data[6:], session(), gas=4, clip=1.0,
                             setup=lambda acc: acc.load_state(str(tmp_path / "ckpt")))
    decisions = resumed["mp"].optimizer_steps + resumed["mp"].scaler.skipped_steps
    assert decisions == full["mp"].optimizer_steps + full["mp"].scaler.skipped_steps == 4
    assert resumed["acc"].step == 16
    _fresh_state()

    # loading into the running process (a rollback) drops its partial gradients: the same as the fresh process
    def rollback(i, acc, mp):
        if i == 5:
            acc.save_state(str(tmp_path / "again"))
            acc.load_state(str(tmp_path / "again"))
            assert all(p.grad is None for p in acc._models[0].parameters())

    rolled = accelerate_run(copy.deepcopy(model), data, session(), gas=4, clip=1.0, callback=rollback)
    assert_close_losses(rolled["losses"][6:], resumed["losses"], exact=True)
    assert_same_params(rolled["params"], resumed["params"])
    assert rolled["mp"].scaler.get_scale() == resumed["mp"].scaler.get_scale()
    assert rolled["mp"].optimizer_steps == resumed["mp"].optimizer_steps
    assert rolled["lr"] == resumed["lr"]


def test_save_and_load_state_between_clip_and_step(tmp_path):
    """At a boundary, after clipping, before optimizer.step(): the checkpoint holds the state before that
    step; loading it in the running process drops that window's gradients, so its step() does nothing."""
    model, data = TinyMLP(), mlp_data(8)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    mp = MixedPrecision("fp16-mixed", scaler=DynamicLossScaler(init_scale=2.0**10, growth_interval=1))
    net = copy.deepcopy(model)
    opt, sched = make_optimizer(net)
    net, opt, sched = prepare(acc, mp, net, opt, sched)
    for i, (x, y) in enumerate(data):
        with acc.accumulate(net):
            acc.backward(mse(net(x), y))
            if acc.sync_gradients:
                acc.clip_grad_norm_(net.parameters(), 1.0)
            if i == 3:
                acc.save_state(str(tmp_path / "ckpt"))
                acc.load_state(str(tmp_path / "ckpt"))
            opt.step()
            if i == 3:
                assert opt.step_was_skipped and acc.optimizer_step_was_skipped  # the scheduler holds
            sched.step()
            opt.zero_grad()
    assert mp.optimizer_steps + mp.scaler.skipped_steps == 3  # windows 1, 3 and 4; window 2 was rolled back
    _fresh_state()
    resumed = accelerate_run(TinyMLP(), data[4:], MixedPrecision("fp16-mixed", scaler=DynamicLossScaler(
        init_scale=2.0**10, growth_interval=1)), gas=2, clip=1.0, setup=lambda a: a.load_state(str(tmp_path / "ckpt")))
    assert resumed["mp"].scaler.get_scale() == mp.scaler.get_scale()
    assert resumed["lr"] == sched.get_last_lr()[0]
    assert_same_params(resumed["params"], {k: v.detach() for k, v in net.state_dict().items()})

"""MixedPrecision, the front door: every plan against an fp32 run, accumulation, clipping, skipping, resume."""

from __future__ import annotations

import functools
import os
import re
import warnings

import pytest
import torch

from mixprec import MixedPrecision, StepResult, get_plan, load_checkpoint, save_checkpoint
from mixprec.cli.models import build_task
from mixprec.optim import MasterWeightOptimizer

ALL_PLANS = ("fp32", "tf32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master",
             "bf16-pure", "fp16-pure", "bf16-kahan", "bf16-sr", "fp8-mixed")


def _train(plan: str, task_name: str, steps: int, *, lr: float = 3e-3, seed: int = 0, batch: int = 8, **mp_kwargs):
    task = build_task(task_name, size="tiny", seed=seed)
    model = task.model
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    mp = MixedPrecision(plan, **mp_kwargs)
    model, opt, criterion = mp.prepare(model, opt, criterion=task.criterion)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x, y = task.batch(batch, gen)
        with mp.autocast():
            loss = criterion(model(x), y)
        mp.backward(loss)
        result = mp.step()
        assert result.stepped, (plan, result)
        losses.append(loss.item())
    model.eval()
    with torch.no_grad(), mp.autocast():
        x, y = task.eval_batch(64)
        eval_loss = criterion(model(x), y).item()
    return losses, eval_loss, mp, model, opt


# Tolerances on the held-out loss after 30 steps, relative to the fp32 run.
_TOL = {"bf16-pure": 0.15, "fp16-pure": 0.15, "bf16-sr": 0.10, "fp8-mixed": 0.10}
_STEPS = 30


@functools.cache
def _fp32_reference(task_name: str) -> float:
    return _train("fp32", task_name, _STEPS)[1]


@pytest.mark.parametrize("task_name", ["gpt", "cnn"])
@pytest.mark.parametrize("plan", ALL_PLANS)
def test_every_plan_trains_close_to_fp32(plan, task_name):
    ref_eval = _fp32_reference(task_name)
    losses, eval_loss, *_ = _train(plan, task_name, _STEPS)
    assert losses[-1] < losses[0] * 0.9, "did not learn"
    tol = _TOL.get(plan, 0.05)
    assert abs(eval_loss - ref_eval) <= tol * ref_eval, (plan, eval_loss, ref_eval)


@pytest.mark.parametrize("plan", ["bf16-master", "fp16-master"])
def test_master_plans_match_fp32_closely_on_a_tiny_model(plan):
    def run(p):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        mp = MixedPrecision(p)
        model, opt = mp.prepare(model, opt)
        gen = torch.Generator().manual_seed(1)
        for _ in range(25):
            x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen)
            with mp.autocast():
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            mp.backward(loss)
            mp.step()
        if isinstance(opt, MasterWeightOptimizer):
            return [m.detach() for m in opt.param_groups[0]["params"]]
        return [p.detach() for p in model.parameters()]

    for ours, ref in zip(run(plan), run("fp32"), strict=True):
        torch.testing.assert_close(ours, ref, rtol=0.02, atol=5e-3)


def _mlp_run(mp_kwargs, micro_batches, batch, steps=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = MixedPrecision("fp32", **mp_kwargs)
    model, opt = mp.prepare(model, opt)
    gen = torch.Generator().manual_seed(0)
    norms = []
    for _ in range(steps):
        x, y = torch.randn(batch, 8, generator=gen), torch.randn(batch, 3, generator=gen)
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
            with mp.autocast():
                loss = torch.nn.functional.mse_loss(model(xs), ys)
            mp.backward(loss)
            result = mp.step()
        norms.append(result.grad_norm)
    return [p.detach().clone() for p in model.parameters()], norms


def test_grad_accumulation_equals_one_big_batch():
    big, big_norms = _mlp_run({}, 1, 32)
    acc, acc_norms = _mlp_run({"grad_accum_steps": 4}, 4, 32)
    for a, b in zip(big, acc, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert acc_norms == pytest.approx(big_norms, rel=1e-5)


def test_accumulating_micro_steps_report_accumulating():
    mp = MixedPrecision("fp32", grad_accum_steps=2)
    model = torch.nn.Linear(2, 1)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    mp.backward(model(torch.ones(1, 2)).sum())
    first = mp.step()
    assert first.accumulating and not first.stepped and not first.skipped
    mp.backward(model(torch.ones(1, 2)).sum())
    assert mp.step().stepped


def test_clipping_uses_the_true_norm_under_loss_scaling():
    def run(plan, clip):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mp = MixedPrecision(plan, clip_grad_norm=clip)
        model, opt = mp.prepare(model, opt)
        x, y = torch.randn(32, 8), torch.randn(32, 3)
        with mp.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        mp.backward(loss)
        return mp.step(), model

    ref_result, ref_model = run("fp32", None)
    ref_norm = ref_result.grad_norm
    result, _ = run("fp16-mixed", ref_norm / 4)
    assert result.scale == 2.0**16  # the gradients were scaled by 65536 ...
    assert result.grad_norm == pytest.approx(ref_norm, rel=2e-2)  # ... but the norm reported and clipped is the true one
    clipped, clipped_model = run("fp32", ref_norm / 4)
    assert clipped.grad_norm == ref_norm
    # the clipped update equals torch's clip_grad_norm_ applied to the fp32 gradients
    torch.manual_seed(0)
    manual = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    x, y = torch.randn(32, 8), torch.randn(32, 3)
    torch.nn.functional.mse_loss(manual(x), y).backward()
    torch.nn.utils.clip_grad_norm_(manual.parameters(), ref_norm / 4)
    torch.optim.SGD(manual.parameters(), lr=0.1).step()
    for a, b in zip(manual.parameters(), clipped_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_injected_inf_skips_every_optimizer_and_the_scheduler():
    torch.manual_seed(0)
    enc, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    model = torch.nn.Sequential(enc, head)
    opt_a = torch.optim.SGD(enc.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(head.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt_a, step_size=1, gamma=0.5)
    mp = MixedPrecision("fp16-mixed")
    model, opt_a, opt_b, sched = mp.prepare(model, opt_a, opt_b, scheduler=sched)
    before = [p.detach().clone() for p in model.parameters()]
    with mp.autocast():
        loss = model(torch.ones(2, 4)).float().mean()
    mp.backward(loss)
    head.weight.grad[0, 0] = float("inf")  # only the second optimizer's gradients overflow
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = mp.step()
    assert isinstance(result, StepResult)
    assert result.skipped and not result.stepped and result.skip_reason == "overflow"
    assert result.scale == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert opt_a.param_groups[0]["lr"] == 0.1 and sched.last_epoch == 0
    assert all(p.grad is None for p in model.parameters())
    with mp.autocast():
        loss = model(torch.ones(2, 4)).float().mean()
    mp.backward(loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        assert mp.step().stepped
    assert opt_a.param_groups[0]["lr"] == 0.05


@pytest.mark.parametrize("plan", ["bf16-mixed", "fp32", "bf16-kahan"])
def test_non_scaling_plans_still_skip_nonfinite_gradients(plan):
    model = torch.nn.Linear(3, 1)
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    with mp.autocast():
        loss = model(torch.ones(1, 3)).float().sum()
    mp.backward(loss)
    next(iter(opt.param_groups[0]["params"])).grad[0, 0] = float("nan")
    result = mp.step()
    assert result.skipped and result.skip_reason == "overflow"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_nonfinite_loss_never_shrinks_the_scale_and_errors_after_limit():
    model = torch.nn.Linear(3, 1)
    mp = MixedPrecision("fp16-mixed", max_consecutive_skips=3)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for i in range(2):
        with mp.autocast():
            loss = model(torch.ones(1, 3)).float().sum() * float("inf")
        mp.backward(loss)
        result = mp.step()
        assert result.skipped and result.skip_reason == "nonfinite_loss"
        assert result.scale == 2.0**16, i
    mp.backward(model(torch.ones(1, 3)).float().sum() * float("nan"))
    mp.step()  # decided on the device: the host counts it, and raises, at the next step
    mp.backward(model(torch.ones(1, 3)).float().sum())
    with pytest.raises(RuntimeError, match=re.escape("3 consecutive steps were skipped because the loss itself was inf/NaN")):
        mp.step()
    assert torch.equal(opt.state_dict()["state"].get(0, {}).get("momentum_buffer", torch.zeros(1)), torch.zeros(1))


def test_overflow_loop_error_names_the_cause():
    model = torch.nn.Linear(3, 1)
    mp = MixedPrecision("fp16-mixed", max_consecutive_skips=2)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    mp.backward(model(torch.ones(1, 3)).sum())
    model.weight.grad.fill_(float("inf"))
    mp.step()
    mp.backward(model(torch.ones(1, 3)).sum())
    model.weight.grad.fill_(float("inf"))
    mp.step()
    mp.backward(model(torch.ones(1, 3)).sum())
    with pytest.raises(RuntimeError, match=re.escape("2 consecutive steps were skipped because the gradients were inf/NaN")):
        mp.step()  # the next step raises it, before its update


def _resumable_run(plan: str, steps: range, state=None, tmp=None):
    task = build_task("gpt", size="tiny", seed=0)
    model = task.model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    mp = MixedPrecision(plan, grad_accum_steps=2, clip_grad_norm=1.0)
    model, opt, sched, criterion = mp.prepare(model, opt, scheduler=sched, criterion=task.criterion)
    if state is not None:
        load_checkpoint(state, model=model, optimizers=[opt], mp=mp)
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        for _ in range(2):
            x, y = task.batch(8, gen)
            with mp.autocast():
                loss = criterion(model(x), y)
            if step == 4 and plan.startswith("fp16"):
                loss = loss * 1e30  # an overflow mid-run: the scaler's counters must survive the checkpoint
            mp.backward(loss)
            mp.step()
    if tmp is not None:
        save_checkpoint(tmp, model=model, optimizers=[opt], mp=mp)
    return model, opt, mp


@pytest.mark.parametrize("plan", ["fp16-mixed", "bf16-master", "bf16-kahan", "bf16-sr"])
def test_ten_plus_save_load_plus_ten_is_bit_identical_to_twenty(plan, tmp_path):
    full_model, full_opt, full_mp = _resumable_run(plan, range(20))
    path = str(tmp_path / "ckpt.pt")
    _resumable_run(plan, range(10), tmp=path)
    model, opt, mp = _resumable_run(plan, range(10, 20), state=path)
    for a, b in zip(full_model.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert mp.state_dict() == full_mp.state_dict()
    if plan.startswith("fp16"):
        assert mp.scaler.overflow_steps == 1


def test_checkpoint_from_another_plan_is_refused(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    model = torch.nn.Linear(4, 4)
    mp = MixedPrecision("bf16-mixed")
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    save_checkpoint(path, model=model, optimizers=[opt], mp=mp)
    other = torch.nn.Linear(4, 4)
    mp2 = MixedPrecision("bf16-master")
    other, opt2 = mp2.prepare(other, torch.optim.SGD(other.parameters(), lr=0.1))
    before = other.weight.detach().clone()
    with pytest.raises(ValueError, match=re.escape("this checkpoint was made under plan 'bf16-mixed', but this run uses 'bf16-master'")):
        load_checkpoint(path, model=other, optimizers=[opt2], mp=mp2)
    assert torch.equal(other.weight, before)  # a refused load changes nothing


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    model = torch.nn.Linear(4, 4)
    save_checkpoint(path, model=model, extra={"version": 1})
    good = path.read_bytes()

    def broken_save(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, model=model, extra={"version": 2})
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temp file left behind
    monkeypatch.undo()
    assert load_checkpoint(path, model=model)["version"] == 1


def test_prepare_returns_flat_tuple_and_wraps_criterion_in_fp32():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    mp = MixedPrecision("bf16-master")
    out = mp.prepare(model, opt, scheduler=sched, criterion=torch.nn.CrossEntropyLoss())
    assert len(out) == 4 and out[0] is model and out[2] is sched
    criterion = out[3]
    with mp.autocast():
        logits = model(torch.randn(2, 4))
        loss = criterion(logits, torch.tensor([0, 2]))
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert MixedPrecision("fp32").prepare(torch.nn.Linear(1, 1)).__class__ is torch.nn.Linear


def test_half_model_trains_under_master_plan():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2)).half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mp = MixedPrecision("fp16-master")
    model, opt = mp.prepare(model, opt)
    assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.float16
    before = model[0].weight.detach().clone()
    results = []
    for _ in range(20):  # (the first steps may overflow at the initial loss scale and skip: 59 of 200 seeds do)
        with mp.autocast():
            loss = model(torch.randn(4, 4)).float().pow(2).mean()
        mp.backward(loss)
        results.append(mp.step())
    assert sum(r.stepped for r in results) >= 15, results
    assert not torch.equal(model[0].weight, before)  # the fp16 weights follow their masters


def test_bad_arguments():
    with pytest.raises(ValueError, match=re.escape("grad_accum_steps must be an integer >= 1, got 0")):
        MixedPrecision(grad_accum_steps=0)
    with pytest.raises(ValueError, match=re.escape("clip_grad_norm must be a positive finite number or None, got -1")):
        MixedPrecision(clip_grad_norm=-1)
    with pytest.raises(TypeError, match=re.escape("scaler must be a mixprec LossScaler")):
        MixedPrecision(scaler=torch.amp.GradScaler("cpu"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("unknown precision plan 'bf17'")):
        MixedPrecision("bf17")
    mp = MixedPrecision()
    with pytest.raises(RuntimeError, match=re.escape("step() called before prepare()")):
        mp.step()
    model = torch.nn.Linear(2, 2)
    mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=re.escape("prepare() was already called")):
        mp.prepare(model)
    with pytest.raises(ValueError, match=re.escape("backward() expects a scalar loss, got shape (2,)")):
        mp.backward(model(torch.ones(1, 2)).squeeze(0))


def test_explicit_scaler_with_bf16_is_an_opt_in():
    from mixprec import DynamicLossScaler

    mp = MixedPrecision("bf16-mixed", scaler=DynamicLossScaler(init_scale=8.0))
    model = torch.nn.Linear(2, 1)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    mp.backward(model(torch.ones(1, 2)).sum())
    assert mp.step().scale == 8.0


@pytest.mark.slow
def test_compiled_training_step_has_no_graph_break_from_mixprec():
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    mp = MixedPrecision("bf16-master")
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))

    @torch.compile(fullgraph=True)
    def forward_loss(x, y):
        with mp.autocast():
            return torch.nn.functional.mse_loss(model(x).float(), y)

    for _ in range(2):
        loss = forward_loss(torch.randn(4, 8), torch.randn(4, 4))
        mp.backward(loss)
        assert mp.step().stepped
    assert model[0].weight.dtype == torch.bfloat16


@pytest.mark.slow
def test_compile_flag_compiles_the_model():
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    mp = MixedPrecision("bf16-mixed", compile=True)
    compiled, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert compiled is not model and hasattr(compiled, "_orig_mod")
    x = torch.randn(4, 8)
    with mp.autocast():
        out = compiled(x)
    with torch.autocast("cpu", torch.bfloat16):
        ref = model(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    mp.backward(out.float().sum())
    assert mp.step().stepped
    assert os.environ.get("TORCH_COMPILE_DISABLE") != "1"


def _moved_fraction(plan: str) -> float:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        model.weight.uniform_(1.0, 2.0)  # bf16 ulp here is 2**-7
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=2.0**-12))
    start = model.weight.detach().clone()
    x = torch.ones(1, 64)
    for _ in range(200):
        with mp.autocast():
            # d loss / d w = -1 for every weight: each update is 2**-12 = 1/32 ulp, which plain
            # bf16 rounds away; 200 of them add up to 6 ulp.
            loss = -model(x).float().mean() * 64
        mp.backward(loss)
        assert mp.step().stepped
    return (model.weight != start).float().mean().item()


def test_bf16_kahan_moves_weights_that_plain_bf16_cannot():
    assert _moved_fraction("bf16-pure") < 0.05
    assert _moved_fraction("bf16-kahan") >= 0.95
    assert _moved_fraction("bf16-sr") >= 0.95


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.softmax(self.fc1(t), -1), x, use_reentrant=False)
        return self.fc2(self.norm(h))


@pytest.mark.parametrize("plan", ["bf16-mixed", "bf16-master", "bf16-pure", "bf16-kahan"])
def test_custom_policy_islands_and_ops_through_the_front_door(plan):
    torch.manual_seed(0)
    model = _Block()
    mp = MixedPrecision(get_plan(plan, fp32_modules=("fc2",), fp32_ops=("softmax",), lower_ops=()))
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert model.fc2.weight.dtype == torch.float32  # island parameters stay fp32 in every plan
    for _ in range(2):
        with mp.autocast():
            out = model(torch.randn(8, 16))
            # an island's output is fp32 under autocast; without autocast (pure plans) it is
            # cast back to the dtype around it
            assert out.dtype == (torch.bfloat16 if plan == "bf16-pure" else torch.float32)
            loss = out.pow(2).mean()
        mp.backward(loss)  # recomputation under checkpoint runs under the same policy
        assert mp.step().stepped


def test_trace_overflow_option_names_the_first_overflowing_module():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    with torch.no_grad():
        model[2].weight.mul_(1e5)  # outputs beyond fp16's 65504
    mp = MixedPrecision("fp16-mixed", trace_overflow=True)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with mp.autocast():
        loss = model(torch.randn(4, 8) * 100).float().mean()
    mp.backward(loss)
    result = mp.step()
    assert result.skipped and result.overflow is not None
    assert result.overflow.module == "2" and result.overflow.direction == "forward"


def _overflow_every_tenth_step(steps: int, **mp_kwargs):
    """fp16-mixed with torch's default scaler settings and an inf gradient every 10th step:
    the scale backs off every 10 steps and never grows back (growth_interval=2000).
    Yields each StepResult."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    mp = MixedPrecision("fp16-mixed", **mp_kwargs)
    model, _ = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    for step in range(steps):
        with mp.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        mp.backward(loss)
        if step % 10 == 9:
            model[0].weight.grad[0, 0] = float("inf")
        yield mp, mp.step()


def test_a_collapsed_loss_scale_raises_instead_of_training_on_zero_gradients():
    """Before: the scale fell to the 2**-126 floor and 1,467 of 1,800 steps ran on all-zero
    gradients with one warning."""
    zero_steps, mp = 0, None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the one zero-gradient warning
        with pytest.raises(RuntimeError, match=re.escape(
            "20 consecutive optimizer steps ran on all-zero gradients with the loss scale collapsed to"
        )) as caught:
            for session, result in _overflow_every_tenth_step(1800):
                mp = session
                zero_steps += result.stepped and result.grad_norm == 0.0
    # the 20th raised: the overflows at a scale below 1 armed the overflow explainer, which reads each outcome
    # at once (unarmed, the next step() raises it, before its update): max_zero_grad_steps steps ran on nothing
    assert zero_steps == 19
    assert "MixedPrecision(on_scale_collapse='reset') restarts the scale at 65536" in str(caught.value)
    assert mp is not None and mp.state_dict()["optimizer_steps"] == mp.optimizer_steps  # the step was finished


def test_on_scale_collapse_reset_restarts_the_scale_with_the_diagnosis():
    zero_steps, resets = 0, 0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", RuntimeWarning)
        for _, result in _overflow_every_tenth_step(900, max_zero_grad_steps=5, on_scale_collapse="reset"):
            zero_steps += result.stepped and result.grad_norm == 0.0
            resets += result.scale == 65536.0 and result.stepped and result.grad_norm == 0.0
    collapsed = [w for w in seen if "restarting it now" in str(w.message)]
    assert len(collapsed) == resets >= 1
    assert "5 consecutive optimizer steps ran on all-zero gradients" in str(collapsed[0].message)
    assert zero_steps == 5 * resets  # never more than 5 in a row before the scale restarts
    with pytest.raises(ValueError, match=re.escape("max_zero_grad_steps must be an integer >= 1 or None (only warn), got 0")):
        MixedPrecision("fp16-mixed", max_zero_grad_steps=0)
    with pytest.raises(ValueError, match=re.escape("on_scale_collapse must be one of ('raise', 'reset'), got 'skip'")):
        MixedPrecision("fp16-mixed", on_scale_collapse="skip")
    with pytest.warns(RuntimeWarning, match="an optimizer step ran on all-zero gradients"):  # None: the warning only
        quiet = list(_overflow_every_tenth_step(450, max_zero_grad_steps=None))
    assert sum(r.stepped and r.grad_norm == 0.0 for _, r in quiet) > 20


def test_the_zero_gradient_count_is_checkpointed():
    """A run saved and resumed in the middle of a collapse raises where the uninterrupted run does."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for mp, result in _overflow_every_tenth_step(1800):
            if result.stepped and result.grad_norm == 0.0 and mp._ledger.zero_grad_steps == 7:
                break
    state = mp.state_dict()
    assert state["zero_grad_steps"] == 7
    fresh = MixedPrecision("fp16-mixed")
    fresh.load_state_dict(state)
    assert fresh._ledger.zero_grad_steps == 7
    with pytest.raises(ValueError, match=re.escape("state_dict['zero_grad_steps'] must be a non-negative integer, got -1")):
        fresh.load_state_dict({**state, "zero_grad_steps": -1})
    old = {k: v for k, v in state.items() if k != "zero_grad_steps"}  # a checkpoint from before the guard
    fresh.load_state_dict(old)
    assert fresh._ledger.zero_grad_steps == 0

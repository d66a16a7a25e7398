"""MasterWeightOptimizer: gradients stay in the model until the step, whoever zeroes or clips
them; fp32 accumulation; non-finite fp16 updates undone; all-or-nothing loading; DDP wrapped
after the optimizer was created (as Accelerate does).

References: explicit fp32 arithmetic on the same bf16 gradients (computed with
``torch.autograd.grad``), a run that zeroes gradients another way, and one process on the
concatenated batch for DDP.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from mixprec.optim import MasterWeightOptimizer
from mixprec.plans import cast_module_, get_plan
from tests._dist import run_ranks


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    )


def _batch(step: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def _make(opt_cls=torch.optim.SGD, dtype=torch.bfloat16, seed: int = 0, **opt_kwargs):
    model = _mlp(seed)
    opt = opt_cls(model.parameters(), **({"lr": 0.05} | opt_kwargs))
    values = cast_module_(model, dtype, keep=(torch.nn.LayerNorm,), keep_dtype=torch.float32)
    return model, MasterWeightOptimizer(opt, master_values=values)


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(step)
    dtype = next(model.parameters()).dtype
    return torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)


def _lowp(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.dtype != torch.float32]


def _snapshot(model, opt) -> dict:
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "masters": [m.detach().clone() for m in opt.masters],
        "opt": copy.deepcopy(opt.optimizer.state_dict()),
    }


def _assert_same(a: dict, b: dict) -> None:
    for x, y in zip(a["weights"] + a["masters"], b["weights"] + b["masters"], strict=True):
        assert torch.equal(x, y)
    sa, sb = a["opt"], b["opt"]
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        assert sa["state"][k].keys() == sb["state"][k].keys()
        for name, v in sa["state"][k].items():
            w = sb["state"][k][name]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w


# ------------------------------------------------------------- who zeroes grads
@pytest.mark.parametrize("zero", ["model", "optimizer", "frontdoor"])
def test_gradients_are_right_whoever_zeroes_them(zero):
    """Each step's master update is the fresh bf16 gradient in fp32 (it used to accumulate
    across steps when only model.zero_grad() cleared gradients)."""
    if zero == "frontdoor":
        from mixprec import MixedPrecision

        model = _mlp()
        mp = MixedPrecision("bf16-master")
        model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    else:
        model, opt = _make()
    ref = [m.detach().clone() for m in opt.param_groups[0]["params"]]
    params = list(model.parameters())
    for step in range(6):
        # the gradient this step must use: bf16 autograd on the current weights
        grads = torch.autograd.grad(_loss(model, step), params)
        for r, g in zip(ref, grads, strict=True):
            r.add_(g.float(), alpha=-0.05)
        if zero == "frontdoor":
            with mp.autocast():
                loss = _loss(model, step)
            mp.backward(loss)
            assert mp.step().stepped
            continue
        if zero == "model":
            model.zero_grad()
        _loss(model, step).backward()
        opt.step()
        if zero == "optimizer":
            opt.zero_grad()
        assert all(m.grad is None for m in opt.masters)  # the fp32 grads do not outlive the step
    for m, r in zip(opt.param_groups[0]["params"], ref, strict=True):
        torch.testing.assert_close(m, r, rtol=1e-6, atol=1e-7)


def test_model_grads_stay_visible_and_framework_clipping_is_gathered():
    model, opt = _make(lr=1.0)
    before = [m.detach().clone() for m in opt.param_groups[0]["params"]]
    _loss(model, 0).backward()
    assert all(p.grad is not None and p.grad.dtype == p.dtype for p in model.parameters())
    raw = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)  # what HF Trainer does
    assert raw > 0.01  # the trainer saw (and logged) the true norm
    clipped = [p.grad.float() for p in model.parameters()]
    opt.step()
    for m, b, g in zip(opt.param_groups[0]["params"], before, clipped, strict=True):
        assert torch.equal(m, b - g)


def test_clipping_after_prepare_grads_is_gathered_again():
    model, opt = _make(lr=1.0)
    before = [m.detach().clone() for m in opt.param_groups[0]["params"]]
    _loss(model, 0).backward()
    opt.prepare_grads()
    opt.prepare_grads()  # idempotent
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    clipped = [p.grad.float() for p in model.parameters()]
    opt.step()
    for m, b, g in zip(opt.param_groups[0]["params"], before, clipped, strict=True):
        assert torch.equal(m, b - g)


def test_master_side_changes_are_kept_and_two_sided_changes_refused():
    model, opt = _make(lr=1.0)
    _loss(model, 0).backward()
    opt.prepare_grads()
    expected = [(m.grad * 0.5).clone() for m in opt.masters]
    before = [m.detach().clone() for m in opt.masters]
    torch._foreach_mul_([m.grad for m in opt.masters], 0.5)  # the front door unscales/clips in fp32
    opt.step()
    for m, b, e in zip(opt.masters, before, expected, strict=True):
        assert torch.equal(m, b - e)

    opt.zero_grad()
    _loss(model, 1).backward()
    opt.prepare_grads()
    opt.masters[0].grad.mul_(0.5)
    model[0].weight.grad.mul_(0.5)
    with pytest.raises(RuntimeError, match=re.escape("changed after prepare_grads() although the master gradient was modified")):
        opt.step()


def test_publish_grads_shows_master_grads_in_the_model():
    model, opt = _make(lr=1.0)
    _loss(model, 0).backward()
    opt.prepare_grads()
    torch._foreach_mul_([m.grad for m in opt.masters], 0.25)
    opt.publish_grads()
    for p, m in zip(_lowp(model), opt.masters, strict=True):
        assert torch.equal(p.grad, m.grad.to(p.dtype))
    before = [m.detach().clone() for m in opt.masters]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # framework clips the published grads
    clipped = [p.grad.float() for p in _lowp(model)]
    opt.step()
    for m, b, g in zip(opt.masters, before, clipped, strict=True):
        assert torch.equal(m, b - g)


# ------------------------------------------------------------------ accumulation
def test_accumulate_grads_sums_micro_batches_in_fp32():
    model, opt = _make(lr=1.0)
    lowp = _lowp(model)
    expected = [torch.zeros(p.shape) for p in lowp]
    for micro in range(3):
        for e, g in zip(expected, torch.autograd.grad(_loss(model, micro), lowp), strict=True):
            e.add_(g.float())
        _loss(model, micro).backward()
        if micro < 2:
            opt.accumulate_grads()
            assert all(p.grad is None for p in lowp)  # freed: the sum lives in fp32
    opt.prepare_grads()
    for m, e in zip(opt.masters, expected, strict=True):
        assert m.grad.dtype == torch.float32 and torch.equal(m.grad, e)
    opt.step()
    assert all(m.grad is None for m in opt.masters) and opt.state_bytes()["grad_accumulation"] == 0


def test_zero_grad_drops_accumulated_micro_batches():
    model, opt = _make(lr=1.0)
    _loss(model, 0).backward()
    opt.accumulate_grads()
    opt.zero_grad()
    _loss(model, 1).backward()
    fresh = [p.grad.float() for p in _lowp(model)]
    opt.prepare_grads()
    for m, g in zip(opt.masters, fresh, strict=True):
        assert torch.equal(m.grad, g)
    with pytest.raises(RuntimeError, match=re.escape("accumulate_grads() called after prepare_grads()")):
        opt.accumulate_grads()


def test_fast_path_picks_fused_or_foreach_and_respects_explicit_choices():
    _, opt = _make(torch.optim.AdamW, lr=1e-3)
    assert opt.param_groups[0]["fused"] is True
    _, opt = _make(torch.optim.SGD)
    assert opt.param_groups[0]["foreach"] is True
    _, opt = _make(torch.optim.AdamW, lr=1e-3, foreach=False)
    assert opt.param_groups[0]["foreach"] is False and not opt.param_groups[0]["fused"]
    model = _mlp()
    values = cast_module_(model, torch.bfloat16)
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters()), master_values=values, fast_path=False)
    assert opt.param_groups[0]["foreach"] is None and opt.param_groups[0]["fused"] is None


def test_fused_masters_follow_the_foreach_update():
    runs = []
    for kwargs in ({}, {"foreach": True}):
        model, opt = _make(torch.optim.AdamW, lr=1e-2, **kwargs)
        for step in range(5):
            _loss(model, step).backward()
            opt.step()
            opt.zero_grad()
        runs.append([m.detach().clone() for m in opt.masters])
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------ memory
def test_no_fp32_gradient_lives_between_steps():
    from mixprec.diagnostics import measure_memory

    def factory():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))

    meas = measure_memory(factory, "bf16-master", lambda: torch.randn(4, 64))
    n = meas.params
    assert meas.bytes["grad_accumulation"] == 0  # no fp32 buffer when nothing accumulates
    assert meas.bytes["grads"] == 2 * n  # the bf16 grads, in the model
    assert meas.bytes["master_weights"] == 4 * n
    assert meas.bytes["weights"] == 2 * n


# ------------------------------------------------------------ non-finite weights
def _fp16_60000(opt_cls=torch.optim.SGD, **kw):
    w = torch.nn.Parameter(torch.tensor([60000.0, 1.0], dtype=torch.float16))
    opt = MasterWeightOptimizer(opt_cls([w], **({"lr": 1.0} | kw)))
    return w, opt


@pytest.mark.parametrize(
    "opt_cls,kw,lr", [(torch.optim.SGD, {"momentum": 0.9}, 1.0), (torch.optim.AdamW, {"weight_decay": 0.0}, 8000.0)]
)
def test_fp16_overflowing_update_is_undone(opt_cls, kw, lr):
    w, opt = _fp16_60000(opt_cls, **kw)
    assert opt.guard_nonfinite
    w.grad = torch.tensor([-1.0, 0.5], dtype=torch.float16)  # a good step first: state exists
    opt.step()
    assert not opt.step_nonfinite()
    opt.zero_grad()
    opt.param_groups[0]["lr"] = lr  # Adam moves by ~lr: 60001 + 8000
    before = {"w": w.detach().clone(), "m": opt.masters[0].detach().clone(), "sd": copy.deepcopy(opt.optimizer.state_dict())}
    w.grad = torch.tensor([-8000.0 / lr, 0.5], dtype=torch.float16)  # 60000 + 8000 = inf in fp16
    assert opt.step() is None
    assert bool(opt.step_nonfinite())
    assert torch.equal(w, before["w"]) and torch.equal(opt.masters[0], before["m"])
    _assert_same({"weights": [], "masters": [], "opt": opt.optimizer.state_dict()}, {"weights": [], "masters": [], "opt": before["sd"]})
    assert torch.isfinite(w).all()


def test_fp16_first_step_undone_leaves_no_state_and_undo_step_restores_a_good_step():
    w, opt = _fp16_60000(torch.optim.SGD, momentum=0.9)
    w.grad = torch.tensor([-8000.0, 0.5], dtype=torch.float16)
    opt.step()
    assert bool(opt.step_nonfinite()) and len(opt.optimizer.state) == 0
    assert w[0].item() == 60000.0
    opt.zero_grad()
    w.grad = torch.tensor([-1.0, 0.5], dtype=torch.float16)
    snap = (w.detach().clone(), opt.masters[0].detach().clone())
    opt.step()
    assert not w.equal(snap[0])
    opt.undo_step()  # another optimizer of the same step refused its update
    assert torch.equal(w, snap[0]) and torch.equal(opt.masters[0], snap[1]) and len(opt.optimizer.state) == 0
    with pytest.raises(RuntimeError, match=re.escape("undo_step() has no step to undo")):
        opt.undo_step()


def test_bf16_is_unguarded_by_default_and_guardable():
    w = torch.nn.Parameter(torch.tensor([3.3e38, 1.0], dtype=torch.float32))
    opt = MasterWeightOptimizer(torch.optim.SGD([w], lr=1.0))
    assert not opt.guard_nonfinite  # no low-precision parameter at all
    big = torch.nn.Parameter(torch.tensor([3.38e38, 1.0]).to(torch.bfloat16))
    opt = MasterWeightOptimizer(torch.optim.SGD([big], lr=1.0))
    assert not opt.guard_nonfinite and opt.step_nonfinite() is None
    guarded = MasterWeightOptimizer(torch.optim.SGD([big], lr=1.0), guard_nonfinite=True)
    before = big.detach().clone()
    big.grad = torch.tensor([-1e37, 0.0], dtype=torch.bfloat16)  # finite in fp32, inf in bf16
    guarded.step()
    assert bool(guarded.step_nonfinite()) and torch.equal(big, before)
    with pytest.raises(TypeError, match=re.escape("guard_nonfinite must be True, False or None, got 'yes'")):
        MasterWeightOptimizer(torch.optim.SGD([big], lr=1.0), guard_nonfinite="yes")  # type: ignore[arg-type]


# -------------------------------------------------------------------- loading
def _trained(seed: int = 0, steps: int = 2):
    model, opt = _make(torch.optim.AdamW, seed=seed, lr=1e-2)
    for step in range(steps):
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _bad_state_dicts(sd: dict) -> list[tuple[str, dict, type[Exception], str]]:
    key = "mixprec_master_weights"
    out = []
    d = copy.deepcopy(sd)
    d[key] = d[key][:-1]
    out.append(("count", d, ValueError, "the state_dict holds 3 master weights but this optimizer has 4"))
    d = copy.deepcopy(sd)
    d[key][1] = d[key][1][:-1]
    out.append(("shape", d, ValueError, "master weight 1 in the state_dict has shape (31,), expected (32,)"))
    d = copy.deepcopy(sd)
    d[key][0] = d[key][0].double()
    out.append(("dtype", d, ValueError, "master weight 0 in the state_dict has dtype torch.float64, expected torch.float32"))
    d = copy.deepcopy(sd)
    d["param_groups"][0]["params"] = d["param_groups"][0]["params"][:-1]
    out.append(("groups", d, ValueError, "holds 5 parameters, this optimizer's 6; was it saved from another model?"))
    d = copy.deepcopy(sd)
    first = next(iter(d["state"]))
    d["state"][first]["exp_avg"] = torch.zeros(3, 3)
    out.append(("inner state", d, ValueError, "optimizer state 'exp_avg' in the state_dict has shape (3, 3) but its parameter has shape"))
    return out


def test_load_state_dict_is_all_or_nothing():
    model, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    target_model, target = _trained(seed=3, steps=1)
    for _label, bad, exc, message in _bad_state_dicts(sd):
        before = _snapshot(target_model, target)
        with pytest.raises(exc, match=re.escape(message)):
            target.load_state_dict(bad)
        _assert_same(before, _snapshot(target_model, target))
    target_model.load_state_dict(model.state_dict())  # model first (its fp32 norm weights), then optimizer
    target.load_state_dict(sd)
    _assert_same(_snapshot(model, opt), _snapshot(target_model, target))


# ------------------------------------------------------------------------ plan
def test_master_plan_refuses_the_removed_hook_mode():
    assert get_plan("bf16-master").accumulate_grads_in_fp32_hooks is False
    with pytest.raises(ValueError, match=re.escape("accumulate_grads_in_fp32_hooks=True is no longer supported")):
        get_plan("bf16-master", accumulate_grads_in_fp32_hooks=True)


# ------------------------------------------------------------------------- DDP
def _ddp_worker(rank: int, world: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = _mlp()
    reference = copy.deepcopy(model)
    values = cast_module_(model, torch.bfloat16, keep=(torch.nn.LayerNorm,), keep_dtype=torch.float32)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), master_values=values)
    ddp = DistributedDataParallel(model)  # wrapped after the optimizer, as Accelerate does
    ref_values = cast_module_(reference, torch.bfloat16, keep=(torch.nn.LayerNorm,), keep_dtype=torch.float32)
    ref_opt = MasterWeightOptimizer(
        torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9), master_values=ref_values
    )
    for step in range(4):
        x, y = _batch(step, 16)
        n = x.shape[0] // world
        xs, ys = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
        torch.nn.functional.mse_loss(ddp(xs.bfloat16()).float(), ys).backward()
        opt.step()  # the framework calls only step(); it zeroes through the model
        ddp.zero_grad()
        torch.nn.functional.mse_loss(reference(x.bfloat16()).float(), y).backward()
        ref_opt.step()
        reference.zero_grad()
        mine = torch.cat([m.detach().flatten() for m in opt.param_groups[0]["params"]])
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        assert torch.equal(gathered[0], gathered[1]), f"ranks differ after step {step}"
        ref = torch.cat([m.detach().flatten() for m in ref_opt.param_groups[0]["params"]])
        diff = (mine - ref).abs()
        assert (diff <= 1e-3 + 2.0**-7 * ref.abs()).all(), f"step {step}: max |diff| {diff.max().item():.3g}"


def test_ddp_wrapped_after_the_optimizer_keeps_ranks_identical():
    run_ranks(_ddp_worker, 2)


def test_resume_is_exact_and_a_plain_state_dict_gets_the_fast_path_back():
    model, opt = _trained(steps=2)
    msd, osd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    for step in range(2, 4):
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()
    model2, opt2 = _trained(seed=7, steps=1)
    model2.load_state_dict(msd)
    opt2.load_state_dict(osd)
    for step in range(2, 4):
        _loss(model2, step).backward()
        opt2.step()
        opt2.zero_grad()
    _assert_same(_snapshot(model, opt), _snapshot(model2, opt2))

    plain = copy.deepcopy(osd)
    plain["param_groups"][0]["fused"] = None  # saved by a run that left torch's defaults
    opt2.load_state_dict(plain)
    assert opt2.param_groups[0]["fused"] is True
    _loss(model2, 5).backward()
    opt2.step()
    assert all(torch.isfinite(m).all() for m in opt2.masters)


def test_a_deep_copy_maps_its_own_parameters():
    model, opt = _make()
    model2, opt2 = copy.deepcopy((model, opt))
    for p, m in zip(_lowp(model2), opt2.masters, strict=True):
        assert opt2.master_of(p) is m
    _loss(model2, 0).backward()
    opt2.step()
    assert not torch.equal(model2[0].weight, model[0].weight)


def test_every_optimizer_of_an_fp16_plan_can_undo():
    from mixprec import MixedPrecision

    model = _mlp()
    norm_opt = torch.optim.SGD(model[1].parameters(), lr=0.1)  # fp32 LayerNorm parameters only
    rest = [p for i in (0, 3) for p in model[i].parameters()]
    mp = MixedPrecision("fp16-master")
    model, opt, norm = mp.prepare(model, torch.optim.SGD(rest, lr=0.1), norm_opt)
    assert opt.guard_nonfinite and norm.guard_nonfinite
    before = [p.detach().clone() for p in model[1].parameters()]
    _loss(model, 0).backward()
    norm.step()
    assert not bool(norm.step_nonfinite())
    norm.undo_step()  # as if `opt` had refused its update
    assert all(torch.equal(a, b) for a, b in zip(before, model[1].parameters(), strict=True))
    w, opt16 = _fp16_60000()
    w.grad = torch.tensor([-8000.0, 0.5], dtype=torch.float16)
    opt16.step()
    opt16.undo_step()  # already undone by itself: nothing to do
    assert w[0].item() == 60000.0


def test_gradscaler_style_loop_with_a_mixprec_scaler_needs_no_extra_call():
    import mixprec

    torch.manual_seed(0)
    base = torch.nn.Linear(8, 4)
    ref = torch.nn.Linear(8, 4)
    ref.load_state_dict(base.state_dict())
    fp32_values = {p: p.detach().clone() for p in base.parameters()}
    base.to(torch.bfloat16)
    opt = mixprec.optim.MasterWeightOptimizer(torch.optim.SGD(base.parameters(), lr=0.1), master_values=fp32_values)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = mixprec.DynamicLossScaler(init_scale=2.0**8)
    x = torch.randn(4, 8)
    scaler.scale(base(x.bfloat16()).float().sum()).backward()
    scaler.unscale_(opt)  # gathers the model's grads into the masters first
    assert opt.masters[0].grad is not None
    scaler.step(opt)
    scaler.update()
    ref(x).sum().backward()
    ref_opt.step()
    torch.testing.assert_close(opt.masters[0], ref.weight, rtol=0, atol=2e-2)
    assert not torch.equal(opt.masters[0], fp32_values[base.weight])

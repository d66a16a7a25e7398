"""The composable front door (prepare_model / prepare_optimizers / unscale_ / last_step_skipped),
side-effect-free skips and all-or-nothing session state loading."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch

from mixprec import DynamicLossScaler, MixedPrecision

ALL_PLANS = (
    "fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-pure", "fp16-pure",
    "bf16-kahan", "bf16-sr", "fp8-mixed", "tf32",
)


class BNNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _train_step(mp: MixedPrecision, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    with mp.autocast():
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    mp.backward(loss)
    return mp.step()


@pytest.mark.parametrize("plan", ALL_PLANS)
def test_skipped_step_leaves_batchnorm_statistics_untouched(plan):
    torch.manual_seed(0)
    model = BNNet()
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    assert _train_step(mp, model, x, y).stepped
    bn = model.bn
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    bad = x.clone()
    bad[3, 2] = float("nan")
    result = _train_step(mp, model, bad, y)
    assert result.skipped
    for key, value in bn.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} changed by a skipped step"
    assert _train_step(mp, model, x, y).stepped
    model.eval()
    with torch.no_grad(), mp.autocast():
        assert torch.isfinite(model(x).float()).all()


def test_eval_forward_between_steps_is_not_undone_by_a_later_skip():
    torch.manual_seed(0)
    model = BNNet()
    mp = MixedPrecision("fp32")
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    _train_step(mp, model, x, y)
    after_good = model.bn.running_mean.clone()
    bad = x.clone()
    bad[0, 0] = float("inf")
    assert _train_step(mp, model, bad, y).skipped
    torch.testing.assert_close(model.bn.running_mean, after_good, rtol=0, atol=0)
    assert _train_step(mp, model, x, y).stepped
    assert not torch.equal(model.bn.running_mean, after_good)


@pytest.mark.parametrize("plan", ["fp32", "bf16-master", "fp16-mixed", "bf16-kahan"])
def test_prepare_in_two_halves_equals_prepare(plan):
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    data = [(torch.randn(4, 8), torch.randn(4, 4)) for _ in range(5)]

    def run(split: bool) -> list[torch.Tensor]:
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mp = MixedPrecision(plan)
        if split:
            model = mp.prepare_model(model)
            opt = mp.prepare_optimizers(opt)
        else:
            model, opt = mp.prepare(model, opt)
        for x, y in data:
            assert _train_step(mp, model, x, y).stepped
        return [p.detach().float().clone() for p in model.parameters()]

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)


def test_master_weights_are_seeded_from_fp32_values_between_the_halves():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    exact = model.weight.detach().clone()
    mp = MixedPrecision("bf16-master")
    model = mp.prepare_model(model)
    assert model.weight.dtype == torch.bfloat16
    opt = mp.prepare_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    assert torch.equal(opt.master_of(model.weight), exact)


def test_unscale_gives_true_gradients_once_and_step_does_not_unscale_again():
    torch.manual_seed(0)
    base = torch.nn.Linear(8, 4)
    x, y = torch.randn(6, 8), torch.randn(6, 4)

    ref = copy.deepcopy(base)
    torch.nn.functional.mse_loss(ref(x), y).backward()

    model = copy.deepcopy(base)
    mp = MixedPrecision("fp32", scaler=DynamicLossScaler(init_scale=2.0**10))
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    mp.backward(torch.nn.functional.mse_loss(model(x), y))
    mp.unscale_()
    mp.unscale_()  # idempotent
    torch.testing.assert_close(model.weight.grad, ref.weight.grad)
    norm = mp.grad_norm()
    expected = torch.linalg.vector_norm(torch.stack([ref.weight.grad.norm(), ref.bias.grad.norm()]))
    torch.testing.assert_close(norm, expected)
    with torch.no_grad():
        stepped = ref.weight - 0.1 * ref.weight.grad
    result = mp.step()
    assert result.stepped and not mp.last_step_skipped
    torch.testing.assert_close(model.weight.detach(), stepped)
    torch.testing.assert_close(result.grad_norm, float(expected))


def test_clip_grad_norm_clips_true_gradients_under_a_large_scale():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    mp = MixedPrecision("fp16-mixed", scaler=DynamicLossScaler(init_scale=2.0**16))
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with mp.autocast():
        loss = model(torch.randn(6, 8)).float().pow(2).mean()
    mp.backward(loss)
    norm = mp.clip_grad_norm_(1e-3)
    assert 1e-3 < float(norm) < 100  # the true norm, not scaled by 65536
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    torch.testing.assert_close(float(clipped), 1e-3, rtol=1e-3, atol=0)
    assert mp.step().stepped


def test_backward_after_unscale_in_the_same_step_is_an_error():
    model = torch.nn.Linear(2, 2)
    mp = MixedPrecision("fp16-mixed")
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    mp.backward(model(torch.ones(1, 2)).sum())
    mp.unscale_()
    with pytest.raises(RuntimeError, match=re.escape("a backward after unscale_() in the same step")):
        mp.backward(model(torch.ones(1, 2)).sum())


def test_skipped_step_holds_the_scheduler_and_is_reported():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    mp = MixedPrecision("fp16-mixed", scaler=DynamicLossScaler(init_scale=2.0**20))
    model, opt, sched = mp.prepare(model, opt, scheduler=sched)
    mp.backward(model(torch.ones(1, 2)).sum())
    with torch.no_grad():  # an overflowing gradient
        model.weight.grad.fill_(float("inf"))
    result = mp.step()
    assert result.skipped and mp.last_step_skipped
    assert opt.param_groups[0]["lr"] == 1.0
    mp.backward(model(torch.ones(1, 2)).sum())
    assert mp.step().stepped and not mp.last_step_skipped
    assert opt.param_groups[0]["lr"] == 0.5


def test_misuse_is_an_error_not_a_silent_no_op():
    model = torch.nn.Linear(2, 2)
    mp = MixedPrecision("bf16-mixed")
    mp.prepare_model(model)
    mp.backward(model(torch.ones(1, 2)).sum())
    with pytest.raises(RuntimeError, match=re.escape("step() called with no optimizer: nothing would train")):
        mp.step()

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=re.escape("the same SGD was passed twice to prepare()")):
        MixedPrecision("bf16-mixed").prepare(model, opt, opt)

    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=re.escape("2 parameter(s) of the SGD passed to prepare() are not parameters")):
        MixedPrecision("bf16-mixed").prepare(model, torch.optim.SGD(other.parameters(), lr=0.1))

    with pytest.raises(RuntimeError, match=re.escape("prepare_optimizers() called before prepare_model()")):
        MixedPrecision("bf16-mixed").prepare_optimizers(opt)

    with pytest.raises(TypeError, match=re.escape("trace_overflow= must be True or False, got 'yes'")):
        MixedPrecision("bf16-mixed", trace_overflow="yes")  # type: ignore[arg-type]


def _session(plan="fp16-mixed", scheduler=False, **scaler_kwargs):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1) if scheduler else None
    scaler = DynamicLossScaler(**scaler_kwargs) if scaler_kwargs else None
    mp = MixedPrecision(plan, scaler=scaler)
    mp.prepare(model, opt, scheduler=sched)
    return mp


def test_checkpoint_scheduler_state_is_never_dropped_silently():
    saved = _session(scheduler=True).state_dict()
    mp = _session(scheduler=False)
    with pytest.raises(ValueError, match=re.escape("this checkpoint holds LR scheduler state, but no scheduler")):
        mp.load_state_dict(saved)
    without = _session(scheduler=False).state_dict()
    with pytest.raises(ValueError, match=re.escape("a scheduler was given to prepare(), but this checkpoint holds")):
        _session(scheduler=True).load_state_dict(without)


def test_scaler_settings_must_match_to_resume_and_a_refusal_changes_nothing():
    saved_mp = _session(init_scale=2.0**10, hysteresis=1)
    saved_mp._ledger.optimizer_steps = 7
    saved = saved_mp.state_dict()
    mp = _session(init_scale=2.0**4, hysteresis=2)
    before_scaler, before_steps = mp.scaler.state_dict(), mp.optimizer_steps
    with pytest.raises(ValueError, match=re.escape("hysteresis: saved 1 vs now 2")):
        mp.load_state_dict(saved)
    assert mp.scaler.state_dict() == before_scaler and mp.optimizer_steps == before_steps
    mp.load_state_dict(saved, allow_plan_change=True)  # this run's settings, the saved counters
    assert mp.scaler.state_dict()["hysteresis"] == 2
    assert mp.scaler.get_scale() == 2.0**10 and mp.optimizer_steps == 7


def test_bad_counters_in_state_dict_are_refused_before_anything_changes():
    mp = _session()
    sd = mp.state_dict()
    sd["optimizer_steps"] = float("inf")
    before = mp.scaler.state_dict()
    with pytest.raises(ValueError, match=re.escape("state_dict['optimizer_steps'] must be a non-negative integer")):
        mp.load_state_dict(sd)
    assert mp.scaler.state_dict() == before


def test_stepping_on_all_zero_gradients_with_loss_scaling_warns_once():
    model = torch.nn.Linear(2, 2)
    mp = MixedPrecision("fp16-mixed")
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    mp.backward(model(torch.ones(1, 2)).sum() * 0.0)
    assert mp.step().stepped
    with pytest.warns(RuntimeWarning, match="an optimizer step ran on all-zero gradients with loss scale"):
        mp.backward(model(torch.ones(1, 2)).sum() * 0.0)
        mp.step()  # the host's bookkeeping of the last step runs here, before this update
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            mp.backward(model(torch.ones(1, 2)).sum() * 0.0)
            mp.step()


def test_validate_state_dict_checks_the_scaler_part_without_changing_anything():
    mp = _session()
    sd = mp.state_dict()
    sd["scaler"] = dict(sd["scaler"], scale=1e39)
    before = mp.scaler.state_dict()
    with pytest.raises(ValueError, match="scale"):
        mp.validate_state_dict(sd)
    with pytest.raises(ValueError, match="scale"):
        mp.load_state_dict(sd)
    assert mp.scaler.state_dict() == before
    mp.validate_state_dict(mp.state_dict())  # a good one passes


def test_device_that_is_not_the_models_is_refused():
    with pytest.raises(ValueError, match=re.escape("MixedPrecision(device='meta') but the model's parameters are on 'cpu'")):
        MixedPrecision("bf16-mixed", device="meta").prepare_model(torch.nn.Linear(2, 2))


def test_pure_plan_island_as_first_layer_sees_the_fp32_input():
    from mixprec import OpPolicy, get_plan

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    x = torch.tensor([[1e5, 1.0, 2.0, 3.0]])  # 1e5 is inf in fp16
    expected = model[0](x).detach().to(torch.float16)
    plan = get_plan("fp16-pure", policy=OpPolicy(dtype=torch.float16, fp32_modules=("0",)))
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-9))
    seen = {}
    model[0].register_forward_hook(lambda m, i, o: seen.setdefault("out", o))
    with mp.autocast():
        model(x)
    assert model[0].weight.dtype == torch.float32
    assert torch.equal(seen["out"].detach(), expected)  # the island computed from 1e5, not from inf


def test_tf32_plan_holds_tf32_in_the_backward_too():
    model = torch.nn.Linear(4, 4)
    mp = MixedPrecision("tf32")
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    seen = []
    with mp.autocast():
        out = model(torch.randn(2, 4))
    out.register_hook(lambda g: seen.append(torch.get_float32_matmul_precision()))
    before = torch.get_float32_matmul_precision()
    mp.backward(out.sum())
    assert seen == ["high"] and torch.get_float32_matmul_precision() == before


@pytest.mark.parametrize("plan", ["bf16-mixed", "bf16-master", "bf16-kahan"])
def test_step_clears_every_gradient_also_of_parameters_no_optimizer_holds(plan):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, torch.optim.SGD(model[0].parameters(), lr=0.1))
    with mp.autocast():
        loss = model(torch.randn(3, 4)).float().sum()
    mp.backward(loss)
    assert model[1].weight.grad is not None
    assert mp.step().stepped
    assert all(p.grad is None for p in model.parameters())


def test_skip_restores_batchnorm_when_the_loop_calls_a_submodule_not_the_root():
    # Frameworks (a LightningModule's training_step) often call submodules directly.
    torch.manual_seed(0)
    root = torch.nn.Module()
    root.net = BNNet()
    mp = MixedPrecision("bf16-mixed")
    root, opt = mp.prepare(root, torch.optim.SGD(root.parameters(), lr=0.01))
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    before = root.net.bn.running_mean.clone()
    x[0, 0] = float("nan")
    with mp.autocast():
        loss = torch.nn.functional.mse_loss(root.net(x).float(), y)
    mp.backward(loss)
    assert mp.step().skipped
    assert torch.equal(root.net.bn.running_mean, before)


def test_step_can_leave_gradients_for_the_framework_to_clear():
    model = torch.nn.Linear(4, 2)
    mp = MixedPrecision("bf16-mixed")
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    mp.backward(model(torch.randn(3, 4)).sum())
    assert mp.step(zero_grad=False).stepped
    assert model.weight.grad is not None  # the framework's own zero_grad() clears it
    with pytest.raises(TypeError, match=re.escape("zero_grad= must be True or False, got 'no'")):
        mp.step(zero_grad="no")  # type: ignore[arg-type]


def test_clip_grad_value_clamps_the_unscaled_gradients_exactly():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    mp = MixedPrecision("fp16-mixed")
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with mp.autocast():
        loss = model(torch.randn(16, 8)).float().square().mean()
    mp.backward(loss)
    scale = mp.scaler.get_scale()
    scaled = [p.grad.clone() for p in model.parameters()]
    mp.clip_grad_value_(0.05)
    for p, g in zip(model.parameters(), scaled, strict=True):
        assert torch.equal(p.grad, (g / scale).clamp(-0.05, 0.05))  # a power-of-two scale: exact
    assert mp.step().stepped
    with pytest.raises(ValueError, match=re.escape("clip_value must be a positive finite number, got inf")):
        mp.clip_grad_value_(float("inf"))


def test_buffers_a_framework_replaces_after_prepare_are_still_guarded_and_the_device_follows_the_model():
    """Lightning and Accelerate move the model after prepare(): model.to() replaces buffer tensors."""
    torch.manual_seed(0)
    model = BNNet()
    mp = MixedPrecision("bf16-mixed")
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    model.bn.running_mean = model.bn.running_mean.clone()  # what a device move does to every buffer
    before = {k: v.clone() for k, v in model.bn.state_dict().items()}
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    result = _train_step(mp, model, x, y * float("nan"))
    assert result.skip_reason == "nonfinite_loss"
    for k, v in model.bn.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert mp.device == torch.device("cpu") and mp.device_type == "cpu"
    model.to("meta")
    assert mp.device == torch.device("meta") and mp.device_type == "meta"  # not frozen at prepare()


def _count_norm_kernels(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the total gradient norms the session measures (an optimizer's own checks aside)."""
    import mixprec.composable

    calls: list[int] = []
    real = mixprec.composable.total_norm
    monkeypatch.setattr(mixprec.composable, "total_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("plan", ["bf16-mixed", "fp16-mixed", "bf16-master", "bf16-kahan"])
def test_clipping_then_stepping_reads_the_gradients_once_and_reports_the_norm_before_clipping(plan, monkeypatch):
    torch.manual_seed(0)
    model = BNNet()
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    with mp.autocast():
        loss = torch.nn.functional.mse_loss(model(torch.randn(16, 8)).float(), torch.randn(16, 4))
    mp.backward(loss)
    calls = _count_norm_kernels(monkeypatch)
    norm = mp.clip_grad_norm_(1e-4)
    result = mp.step()
    assert result.stepped and len(calls) == 1
    assert result.grad_norm == float(norm) > 1e-4  # the norm before clipping, as clip_grad_norm_ returned it


def test_a_gradient_changed_after_clipping_is_measured_again_and_skips_the_step(monkeypatch):
    """The norm clipping measured is reused only while the gradients are the same, unchanged tensors."""
    for change in ("in place", "replaced"):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        mp = MixedPrecision("bf16-mixed")
        model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        before = model.weight.detach().clone()
        mp.backward(model(torch.randn(6, 8)).pow(2).mean())
        mp.clip_grad_norm_(1.0)
        if change == "in place":
            model.weight.grad[0, 0] = float("inf")  # a framework hook after the clipping
        else:
            model.weight.grad = torch.full_like(model.weight, float("nan"))
        calls = _count_norm_kernels(monkeypatch)
        result = mp.step()
        monkeypatch.undo()
        assert result.skip_reason == "overflow" and len(calls) == 1, change
        assert torch.equal(model.weight.detach(), before), change


def test_grad_norm_for_logging_is_the_norm_the_step_decides_on(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    mp = MixedPrecision("fp16-mixed", scaler=DynamicLossScaler(init_scale=2.0**10))
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with mp.autocast():
        mp.backward(model(torch.randn(6, 8)).float().pow(2).mean())
    calls = _count_norm_kernels(monkeypatch)
    logged = float(mp.grad_norm())
    result = mp.step()
    assert len(calls) == 1 and result.stepped and result.grad_norm == logged
    # the next step measures its own gradients
    with mp.autocast():
        mp.backward(model(torch.randn(6, 8)).float().pow(2).mean())
    assert mp.step().stepped and len(calls) == 2


def test_the_device_is_the_first_parameters_wherever_it_sits_and_follows_replacements():
    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.empty = torch.nn.Sequential()  # no parameters: skipped
            self.none = None  # a None child
            self.inner = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 2))
            self.register_parameter("absent", None)

    model = Holder()
    mp = MixedPrecision("bf16-mixed")
    mp.prepare_model(model)
    assert mp.device == next(model.parameters()).device == torch.device("cpu")
    model.inner[1].weight = torch.nn.Parameter(torch.ones(2, 2, device="meta"))  # a framework swaps a parameter
    assert mp.device == next(model.parameters()).device == torch.device("meta")
    model.inner = torch.nn.Sequential(torch.nn.Linear(2, 2, device="meta").to_empty(device="cpu"))  # ... or a module
    assert mp.device == next(model.parameters()).device == torch.device("cpu")
    model.to("meta")  # moved in place: the parameter objects stay, their device follows
    assert mp.device == torch.device("meta")
    model.inner[0].bias = torch.nn.Parameter(torch.ones(2))  # the second parameter on another device
    assert mp.device == torch.device("meta")  # the first one still answers
    del model.inner[0].weight  # the first parameter gone: the next one answers
    assert mp.device == next(model.parameters()).device == torch.device("cpu")
    assert MixedPrecision("bf16-mixed").device is None  # no model yet


def test_the_device_lookup_walks_the_model_once_while_nothing_changes(monkeypatch):
    import mixprec.composable as composable

    walks = []
    walk = composable._first_parameter
    monkeypatch.setattr(composable, "_first_parameter", lambda m: walks.append(m) or walk(m))
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Linear(2, 2))
    mp = MixedPrecision("bf16-mixed")
    mp.prepare_model(model)
    for _ in range(3):
        assert mp.device == torch.device("cpu")
    assert walks.count(model) == 1  # (the walk recurses through the same function)
    model[0][0] = torch.nn.Linear(2, 2)
    assert mp.device == torch.device("cpu") and walks.count(model) == 2


# ------------------------------------------------------------ the step's state machine
def _tiny(plan: str, *, seed: int = 0, lr: float = 1.0, two: bool = False, **mp_kwargs):
    """A two-layer model with SGD (one optimizer, or one per layer with ``two``) under ``plan``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    if two:
        opts = [torch.optim.SGD(model[0].parameters(), lr=lr), torch.optim.SGD(model[2].parameters(), lr=lr)]
    else:
        opts = [torch.optim.SGD(model.parameters(), lr=lr)]
    mp = MixedPrecision(plan, **mp_kwargs)
    model, *opts = mp.prepare(model, *opts)
    return mp, model, opts


def _mse(mp: MixedPrecision, model: torch.nn.Module, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    with mp.autocast():
        return torch.nn.functional.mse_loss(model(x).float(), y)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("plan", ALL_PLANS)
def test_clipping_twice_or_also_in_step_clips_once(plan):
    """clip_grad_norm_(0.05) twice, or with MixedPrecision(clip_grad_norm=0.05), is one clip.
    Before: the second clip divided by the remembered norm before the first (update norm 0.002)."""
    ref_mp, ref, _ = _tiny(plan)
    ref_mp.backward(_mse(ref_mp, ref, 0))
    ref_norm = ref_mp.clip_grad_norm_(0.05)
    assert ref_mp.step().stepped
    for how in ("twice", "and in step()"):
        mp, model, _ = _tiny(plan, clip_grad_norm=0.05 if how == "and in step()" else None)
        before = [p.detach().float().clone() for p in model.parameters()]
        mp.backward(_mse(mp, model, 0))
        norm = mp.clip_grad_norm_(0.05)
        if how == "twice":
            assert torch.equal(mp.clip_grad_norm_(0.05), norm)  # the norm before clipping, again
            assert torch.equal(mp.clip_grad_norm_(1.0), norm)  # a looser bound: nothing to clip
        result = mp.step()
        assert result.stepped and result.grad_norm == float(norm) == float(ref_norm) > 0.05, (plan, how)
        assert _same(model, ref), (plan, how)
        if plan == "fp32":  # SGD with lr=1: the update is the clipped gradient
            update = torch.cat([(b - p.detach()).reshape(-1) for b, p in zip(before, model.parameters(), strict=True)])
            assert float(update.norm()) == pytest.approx(0.05, rel=1e-4), how


def test_a_second_tighter_clip_or_a_clip_above_the_sessions_is_refused_and_changes_nothing():
    mp, model, _ = _tiny("fp16-mixed")
    ref_mp, ref, _ = _tiny("fp16-mixed")
    for m, r in ((mp, model), (ref_mp, ref)):
        m.backward(_mse(m, r, 0))
        m.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match=re.escape(
        "clip_grad_norm_() would clip this step's gradients to 0.05 after they were clipped to 1: a second clip"
    )):
        mp.clip_grad_norm_(0.05)
    assert mp.step().stepped and ref_mp.step().stepped and _same(model, ref)

    mp, model, _ = _tiny("bf16-mixed", clip_grad_norm=0.05)
    mp.backward(_mse(mp, model, 0))
    with pytest.raises(ValueError, match=re.escape(
        "clip_grad_norm_(1.0) with MixedPrecision(clip_grad_norm=0.05): step() would clip these gradients a second time"
    )):
        mp.clip_grad_norm_(1.0)
    assert mp.phase.value == "backward done"  # refused before anything changed


@pytest.mark.parametrize("plan", ["bf16-mixed", "fp16-master", "bf16-kahan"])
def test_a_boundary_the_framework_declares_is_where_step_steps(plan):
    """micro_batch_done(boundary=True) after 2 of 4 micro-batches: step() steps there, as
    grad_accum_steps=2 would. Before: accumulating=True, no step."""
    ref_mp, ref, _ = _tiny(plan, grad_accum_steps=2, lr=0.1)
    mp, model, _ = _tiny(plan, grad_accum_steps=4, lr=0.1)
    for i in range(2):
        ref_mp.backward(_mse(ref_mp, ref, i))
        with mp.backward_context():
            mp.scale_loss(_mse(mp, model, i) / 2).backward()  # the framework divides by its own window
        mp.micro_batch_done(boundary=i == 1)
        if i == 0:
            assert mp.step().accumulating
    result = mp.step()
    assert result.stepped and result.optimizer_steps == 1 and not result.accumulating
    assert ref_mp.step().stepped and _same(model, ref)
    assert mp.phase.value == "stepped"


def test_micro_batch_done_without_a_backward_counts_nothing():
    """Before: the next step() counted a real step and advanced the scheduler."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    mp = MixedPrecision("bf16-mixed")
    model, opt, sched = mp.prepare(model, opt, scheduler=sched)
    message = "micro_batch_done() called without a backward since the last one: nothing would be counted"
    with pytest.raises(RuntimeError, match=re.escape(message)):
        mp.micro_batch_done()
    with pytest.raises(RuntimeError, match=re.escape("step() called before any backward()")):
        mp.step()
    assert mp.optimizer_steps == 0 and sched.get_last_lr() == [0.1]
    mp.backward(model(torch.ones(1, 4)).sum())
    with pytest.raises(RuntimeError, match=re.escape(message)):  # backward() counted its own micro-batch
        mp.micro_batch_done()
    assert mp.step().stepped and mp.optimizer_steps == 1 and sched.get_last_lr() == [0.05]


def test_calls_out_of_order_raise_errors_that_name_the_order():
    mp, model, _ = _tiny("fp16-mixed", grad_accum_steps=2)
    with pytest.raises(RuntimeError, match=re.escape("unscale_() called before any backward()")):
        mp.unscale_()
    mp.backward(_mse(mp, model, 0))
    for call, name in ((mp.unscale_, "unscale_()"), (mp.grad_norm, "grad_norm()"), (lambda: mp.clip_grad_norm_(1.0), "clip_grad_norm_()")):
        with pytest.raises(RuntimeError, match=re.escape(
            f"{name} called in the middle of gradient accumulation (1 of 2 micro-batches): the gradients are partial sums"
        )):
            call()
    mp.backward(_mse(mp, model, 1))
    with pytest.raises(RuntimeError, match=re.escape(
        "backward() called after the accumulation boundary (2 of 2 micro-batches) without step()"
    )):
        mp.backward(_mse(mp, model, 2))
    loss = _mse(mp, model, 2)
    mp.grad_norm()
    with pytest.raises(RuntimeError, match=re.escape("a backward after unscale_() in the same step")):
        mp.scale_loss(loss)
    assert mp.step().stepped
    with pytest.raises(RuntimeError, match=re.escape("step() called again with no backward since the last step()")):
        mp.step()
    mp.scale_loss(_mse(mp, model, 3)).backward()
    with pytest.raises(RuntimeError, match=re.escape("step() called between scale_loss() and micro_batch_done()")):
        mp.step()
    with pytest.raises(TypeError, match=re.escape("boundary= must be True, False or None, got 1")):
        mp.micro_batch_done(boundary=1)  # type: ignore[arg-type]


def test_grad_norm_after_step_names_grad_norm_in_its_error():
    """Before: the error named unscale_()."""
    mp, model, _ = _tiny("bf16-mixed")
    mp.backward(_mse(mp, model, 0))
    mp.step()
    with pytest.raises(RuntimeError, match=re.escape(
        "grad_norm() called after step() with no backward since: step() used and cleared that step's gradients. "
        "Call grad_norm() between the backward and step()"
    )):
        mp.grad_norm()


def _interrupt_once(obj: object, name: str, exc: type[BaseException] = KeyboardInterrupt) -> None:
    """Make ``obj.name(...)`` raise ``exc`` once, before it does anything."""
    real = getattr(obj, name)
    state = {"armed": True}

    def wrapper(*args, **kwargs):
        if state["armed"]:
            state["armed"] = False
            raise exc("interrupted")
        return real(*args, **kwargs)

    setattr(obj, name, wrapper)


@pytest.mark.parametrize("plan", ["bf16-mixed", "fp16-master", "bf16-kahan"])
def test_a_step_interrupted_before_its_update_saves_and_then_finishes_exactly(plan, tmp_path):
    """Ctrl-C in step(): a save works (the state as of the last step), step() again finishes it.
    Before: state_dict() refused ('in the middle of gradient accumulation')."""
    from mixprec import save_checkpoint

    ref_mp, ref, _ = _tiny(plan, lr=0.1)
    mp, model, (opt,) = _tiny(plan, lr=0.1)
    for m, r in ((mp, model), (ref_mp, ref)):
        m.backward(_mse(m, r, 0))
        assert m.step().stepped
        m.backward(_mse(m, r, 1))
    saved = ref_mp.state_dict(mid_accumulation=True)
    _interrupt_once(opt, "step")
    with pytest.raises(KeyboardInterrupt):
        mp.step()
    assert mp.state_dict() == saved  # what a Ctrl-C handler saves: the last finished step
    save_checkpoint(tmp_path / "interrupted.pt", model=model, optimizers=[opt], mp=mp)
    result = mp.step()
    assert result.stepped and result.optimizer_steps == 2 and ref_mp.step() == result
    assert _same(model, ref)


def test_a_step_interrupted_between_optimizers_refuses_a_save_and_then_steps_each_once():
    ref_mp, ref, _ = _tiny("fp16-master", two=True, lr=0.1)
    mp, model, (_, second) = _tiny("fp16-master", two=True, lr=0.1)
    for m, r in ((mp, model), (ref_mp, ref)):
        m.backward(_mse(m, r, 0))
    _interrupt_once(second, "step", RuntimeError)
    with pytest.raises(RuntimeError, match="interrupted"):
        mp.step()  # the first optimizer stepped, the second did not
    with pytest.raises(RuntimeError, match=re.escape(
        "state_dict(): step() was interrupted after the update began and the update of 1 optimizer(s)"
    )):
        mp.state_dict()
    with pytest.raises(RuntimeError, match=re.escape("call step() again to finish that step first")):
        mp.backward(_mse(mp, model, 1))
    assert mp.step() == ref_mp.step() and _same(model, ref)  # the first optimizer did not step twice
    assert mp.state_dict() == ref_mp.state_dict()


def test_a_step_interrupted_while_unscaling_finishes_exactly(monkeypatch):
    """An interruption between the optimizers' unscaling: step() again unscales only the rest."""
    ref_mp, ref, _ = _tiny("fp16-master", two=True, lr=0.1)
    mp, model, (_, second) = _tiny("fp16-master", two=True, lr=0.1)
    for m, r in ((mp, model), (ref_mp, ref)):
        m.backward(_mse(m, r, 0))
    real = mp.scaler.unscale_
    armed = [True]

    def unscale_(opt, **kwargs):
        if opt is second and armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
        return real(opt, **kwargs)

    monkeypatch.setattr(mp.scaler, "unscale_", unscale_)
    with pytest.raises(KeyboardInterrupt):
        mp.step()
    assert mp.state_dict() == ref_mp.state_dict(mid_accumulation=True)
    assert mp.step() == ref_mp.step() and _same(model, ref)


def _scheduled_run(plan: str, where: str | None, steps: int = 4):
    """AdamW under a LambdaLR; with ``where``, step 1's scheduler step is interrupted once by a Ctrl-C
    ("inside": in the lambda, after torch moved ``last_epoch``; "after": once its step returned),
    and ``step()`` is called again. Returns the learning rates every update used, the weights and
    the MixedPrecision state."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    armed = [False]

    def lam(epoch: int) -> float:
        if armed[0] and where == "inside":
            armed[0] = False
            raise KeyboardInterrupt
        return 0.9 ** epoch

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    mp = MixedPrecision(plan)
    model, opt, sched = mp.prepare(model, opt, scheduler=sched)
    if where == "after":
        real = sched.step

        def step_then_interrupt(*args, **kwargs):
            real(*args, **kwargs)
            if armed[0]:
                armed[0] = False
                raise KeyboardInterrupt

        sched.step = step_then_interrupt  # type: ignore[method-assign]
    used = []
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        with mp.autocast():
            loss = model(torch.randn(4, 6, generator=gen)).float().pow(2).mean()
        mp.backward(loss)
        used.append(opt.param_groups[0]["lr"])
        if where is not None and i == 1:
            armed[0] = True
            with pytest.raises(KeyboardInterrupt):
                mp.step()
            assert not armed[0]  # the interruption happened
        mp.step()
    state = mp.state_dict()
    state["scheduler"].pop("step", None)  # (the test's own wrapper of sched.step, an instance attribute)
    return used, [p.detach().clone() for p in model.parameters()], state


@pytest.mark.parametrize("where", ["inside", "after"])
@pytest.mark.parametrize("plan", ALL_PLANS)
def test_a_ctrl_c_in_the_scheduler_is_finished_exactly_by_step_again(plan, where):
    """Before: a lambda interrupted after torch moved last_epoch left the next update at the old
    lr (0.00059 instead of 0.000531 in the report), and every later step and a resume differed."""
    ref_lrs, ref_weights, ref_state = _scheduled_run(plan, None)
    lrs, weights, state = _scheduled_run(plan, where)
    assert lrs == ref_lrs
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights, strict=True))
    assert state == ref_state  # the scheduler's state a resume takes included


@pytest.mark.parametrize("plan", ["bf16-mixed", "fp16-master"])
def test_an_exception_inside_backward_discards_the_step_and_a_retry_is_exact(plan):
    """The gradients of a backward stopped halfway are partial: the step starts again.
    Before: the retry added a full backward to the partial gradients."""
    ref_mp, ref, _ = _tiny(plan, lr=0.1, grad_accum_steps=2)
    mp, model, _ = _tiny(plan, lr=0.1, grad_accum_steps=2)
    mp.backward(_mse(mp, model, 5))  # a micro-batch of the window that fails
    loss = _mse(mp, model, 0)

    def boom(p):
        raise RuntimeError("boom")

    hook = model[2].weight.register_post_accumulate_grad_hook(boom)  # the first layer gets no gradient
    with pytest.raises(RuntimeError, match="boom"):
        mp.backward(loss)
    hook.remove()
    assert all(p.grad is None for p in model.parameters())
    saved = mp.state_dict()  # nothing of the dropped step is in flight
    for m, r in ((mp, model), (ref_mp, ref)):
        for i in range(2):
            m.backward(_mse(m, r, i))
    assert mp.step() == ref_mp.step() and _same(model, ref)
    assert saved["optimizer_steps"] == 0 and mp.phase.value == "stepped"


def test_a_skip_the_scaler_refuses_to_count_ends_the_step():
    """raise_at_min_scale (DeepSpeed's ZeRO behaviour) raises in the step's bookkeeping: before,
    the session then refused every save and every new backward as an unfinished update."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    scaler = DynamicLossScaler(init_scale=1.0, min_scale=1.0, raise_at_min_scale=True)
    mp = MixedPrecision("fp16-mixed", scaler=scaler)
    model, _ = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    with mp.autocast():
        loss = model(torch.randn(2, 4)).float().mean()
    mp.backward(loss)
    for p in model.parameters():
        p.grad.fill_(float("inf"))
    with pytest.raises(RuntimeError, match="already at its minimum"):
        mp.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    state = mp.state_dict()  # the state as of the last finished step
    assert state["optimizer_steps"] == 0 and state["scaler"]["scale"] == 1.0
    with mp.autocast():
        loss = model(torch.randn(2, 4)).float().mean()
    mp.backward(loss)  # a new step is accepted
    assert mp.step().stepped

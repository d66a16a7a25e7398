"""Loss scalers: torch.amp.GradScaler is the oracle for the defaults; exact sequences elsewhere."""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec import ConstantLossScaler, DynamicLossScaler, NoOpScaler

INF = float("inf")


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)


def _train_step(model, opt, scaler, step: int, poison: float | None) -> None:
    x, y = _data(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    if poison is not None:
        loss = loss * poison
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def _run_pair(pattern, make_opt, **kwargs):
    """Twin runs: mixprec's scaler and torch's GradScaler on identical models and data."""
    ours_model, ref_model = _model(), _model()
    ours_opt, ref_opt = make_opt(ours_model.parameters()), make_opt(ref_model.parameters())
    ours = DynamicLossScaler(**kwargs)
    ref = torch.amp.GradScaler("cpu", **kwargs)
    for step, poison in enumerate(pattern):
        _train_step(ours_model, ours_opt, ours, step, poison)
        _train_step(ref_model, ref_opt, ref, step, poison)
        assert ours.get_scale() == ref.get_scale(), f"scale differs at step {step}"
        for a, b in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
            assert torch.equal(a, b), f"parameters differ at step {step}"
    return ours, ref


@settings(max_examples=40, deadline=None)
@given(
    pattern=st.lists(st.sampled_from([None, None, None, INF, float("nan")]), min_size=1, max_size=30),
    init_scale=st.sampled_from([1.0, 3.0, 2.0**10, 2.0**16, 1e30, 2.0**127]),
    growth_factor=st.sampled_from([2.0, 1.5, 3.0, 1.0001]),
    backoff_factor=st.sampled_from([0.5, 0.8, 0.25, 0.999]),
    growth_interval=st.integers(1, 4),
)
def test_defaults_match_torch_gradscaler(pattern, init_scale, growth_factor, backoff_factor, growth_interval):
    ours, ref = _run_pair(
        pattern,
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
    )
    assert ours.state_dict()["_growth_tracker"] == ref.state_dict()["_growth_tracker"]


@pytest.mark.parametrize("fused", [False, True])
def test_adam_matches_torch_including_fused(fused):
    pattern = [None, INF, None, None, float("nan"), None, None, None]
    _run_pair(
        pattern,
        lambda p: torch.optim.AdamW(p, lr=1e-2, fused=fused),
        init_scale=2.0**8,
        growth_interval=2,
    )


def _scale_sequence(scaler: DynamicLossScaler, pattern: list[bool]) -> list[float]:
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.0)
    out = []
    for bad in pattern:
        scaler.scale((w * (INF if bad else 1.0)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out.append(scaler.get_scale())
    return out


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def test_hysteresis_consecutive_exact_sequence():
    s = DynamicLossScaler(init_scale=2048.0, backoff_factor=0.8, hysteresis=2, growth_interval=100)
    seq = _scale_sequence(s, [True, True])
    assert seq == [2048.0, _f32(1638.4)]
    # A clean step between two overflows resets the count: no backoff.
    s = DynamicLossScaler(init_scale=2048.0, backoff_factor=0.5, hysteresis=2, growth_interval=100)
    assert _scale_sequence(s, [True, False, True, False]) == [2048.0] * 4
    # After a backoff the count starts again from zero.
    s = DynamicLossScaler(init_scale=2048.0, backoff_factor=0.5, hysteresis=2, growth_interval=100)
    assert _scale_sequence(s, [True, True, True, True, True]) == [2048.0, 1024.0, 1024.0, 512.0, 512.0]


def test_hysteresis_since_growth_exact_sequence():
    s = DynamicLossScaler(
        init_scale=1024.0, hysteresis=2, hysteresis_mode="since_growth", growth_interval=2
    )
    # overflow: budget 2->1 (no backoff); clean; overflow: budget ->0, backoff; overflow: backoff again
    # (clean steps do not refill); two clean steps grow and refill; overflow tolerated once more.
    pattern = [True, False, True, True, False, False, True, True]
    assert _scale_sequence(s, pattern) == [1024.0, 1024.0, 512.0, 256.0, 256.0, 512.0, 512.0, 256.0]


def test_any_overflow_resets_growth_tracker_even_without_backoff():
    s = DynamicLossScaler(init_scale=64.0, hysteresis=3, growth_interval=2)
    assert _scale_sequence(s, [False, True, False, False]) == [64.0, 64.0, 64.0, 128.0]


def test_bounds_clamp_and_growth_never_inf():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=1, max_scale=20.0, min_scale=2.0)
    assert _scale_sequence(s, [False, False, False]) == [16.0, 20.0, 20.0]
    assert _scale_sequence(s, [True, True, True]) == [10.0, 5.0, 2.5]
    assert _scale_sequence(s, [True, True]) == [2.0, 2.0]
    big = DynamicLossScaler(init_scale=2.0**127, growth_interval=1)
    assert _scale_sequence(big, [False, False]) == [2.0**127, 2.0**127]


def test_update_new_scale():
    s = DynamicLossScaler(init_scale=4.0, max_scale=100.0)
    s.update(32.0)
    assert s.get_scale() == 32.0
    s.update(torch.tensor(1000.0))
    assert s.get_scale() == 100.0  # tensors are clamped into the bounds
    with pytest.raises(ValueError, match=re.escape("new_scale=200.0 is outside [min_scale, max_scale]")):
        s.update(200.0)
    with pytest.raises(ValueError, match=re.escape("new_scale must be a finite positive number, got -1.0")):
        s.update(-1.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"growth_factor": 1.0}, "growth_factor must be a finite number > 1, got 1.0"),
        ({"backoff_factor": 1.0}, "backoff_factor must be in (0, 1), got 1.0"),
        ({"backoff_factor": 0.0}, "backoff_factor must be in (0, 1), got 0.0"),
        ({"growth_interval": 0}, "growth_interval must be an integer >= 1, got 0"),
        ({"hysteresis": 0}, "hysteresis must be an integer >= 1, got 0"),
        ({"hysteresis_mode": "megatron"}, "hysteresis_mode must be one of ('consecutive', 'since_growth'), got 'megatron'"),
        ({"min_scale": 10.0, "max_scale": 1.0}, "min_scale=10.0 is larger than max_scale=1.0"),
        ({"init_scale": -1.0}, "init_scale must be a finite positive number, got -1.0"),
        ({"init_scale": 1.0, "min_scale": 2.0}, "init_scale=1.0 is below min_scale=2.0"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        DynamicLossScaler(**kwargs)


def test_state_machine_errors_name_the_call():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = DynamicLossScaler()
    s.scale(model(torch.ones(1, 4)).sum()).backward()
    s.unscale_(opt)
    with pytest.raises(RuntimeError, match=re.escape("unscale_() has already been called on this optimizer")):
        s.unscale_(opt)
    s.step(opt)
    with pytest.raises(RuntimeError, match=re.escape("unscale_() is being called after step()")):
        s.unscale_(opt)
    with pytest.raises(RuntimeError, match=re.escape("step() has already been called since the last update()")):
        s.step(opt)
    s.update()
    with pytest.raises(RuntimeError, match=re.escape("update() found no inf checks for this iteration")):
        s.update()
    with pytest.raises(RuntimeError, match=re.escape("step(closure=...) is not supported")):
        s.step(opt, closure=lambda: 0.0)


def test_step_unscales_exactly_once():
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=1.0)
    s = DynamicLossScaler(init_scale=8.0)
    s.scale((w * torch.tensor([1.0, 2.0])).sum()).backward()
    s.unscale_(opt)
    assert w.grad.tolist() == [1.0, 2.0]
    s.step(opt)
    assert w.tolist() == [-1.0, -2.0]


def test_skipped_step_leaves_everything_untouched():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    s = DynamicLossScaler(init_scale=2.0**4)
    _train_step(model, opt, s, 0, None)  # create Adam state
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    x, y = _data(1)
    loss = torch.nn.functional.mse_loss(model(x), y)
    s.scale(loss).backward()
    next(model.parameters()).grad[0, 0] = INF
    grads_before = [p.grad.clone() for p in model.parameters()]
    assert s.step(opt) is None
    for p, before, g in zip(model.parameters(), params, grads_before, strict=True):
        assert torch.equal(p, before)
        assert torch.equal(p.grad, g / 16.0) or not torch.isfinite(g).all()
    after = opt.state_dict()
    for k, v in state["state"].items():
        for name, tensor in v.items():
            assert torch.equal(tensor, after["state"][k][name]), (k, name)
    s.update()
    assert s.get_scale() == 8.0 and s.skipped_steps == 1 and s.overflow_steps == 1


def test_sparse_uncoalesced_fp16_duplicates_that_overflow_are_found():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=0.1)
    s = DynamicLossScaler(init_scale=1.0)
    idx = torch.tensor([[1, 1]])
    p.grad = torch.sparse_coo_tensor(
        idx, torch.tensor([60000.0, 60000.0], dtype=torch.float16), (4,), check_invariants=False
    )
    assert not p.grad.is_coalesced()
    s.unscale_(opt)
    assert s.found_inf(opt).item() == 1.0
    # finite sparse fp32 gradients are unscaled in place, no inf found
    q = torch.nn.Parameter(torch.zeros(4))
    opt2 = torch.optim.SGD([q], lr=0.1)
    q.grad = torch.sparse_coo_tensor(idx, torch.tensor([4.0, 2.0]), (4,), check_invariants=False)
    s2 = DynamicLossScaler(init_scale=2.0)
    s2.unscale_(opt2)
    assert s2.found_inf(opt2).item() == 0.0
    assert q.grad.to_dense().tolist() == [0.0, 3.0, 0.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_unscale_accepts_low_precision_grads(dtype):
    p = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
    opt = torch.optim.SGD([p], lr=1.0)
    s = DynamicLossScaler(init_scale=1024.0)
    p.grad = torch.tensor([1024.0, 2048.0, 3072.0], dtype=dtype)
    s.unscale_(opt)
    assert p.grad.dtype == dtype and p.grad.tolist() == [1.0, 2.0, 3.0]
    s.step(opt)
    s.update()
    assert s.get_scale() == 1024.0
    p.grad = torch.tensor([1.0, INF, 0.0], dtype=dtype)
    s.step(opt)
    s.update()
    assert s.get_scale() == 512.0


def test_scale_nested_structures():
    s = DynamicLossScaler(init_scale=4.0)
    out = s.scale({"a": torch.tensor(1.0), "b": [torch.tensor(2.0), (torch.tensor(3.0),)]})
    assert out["a"].item() == 4.0 and out["b"][0].item() == 8.0 and out["b"][1][0].item() == 12.0
    half = s.scale(torch.tensor([1.0], dtype=torch.float16))
    assert half.dtype == torch.float16
    with pytest.raises(TypeError, match="scale\\(\\) expects a tensor"):
        s.scale(3.0)


def _grad_penalty_step(model, opt, scaler, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    params = list(model.parameters())
    scaled = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
    inv = 1.0 / scaler.get_scale()
    penalty = sum((g * inv).pow(2).sum() for g in scaled)
    scaler.scale(loss + 0.1 * penalty).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def test_accumulation_clipping_and_gradient_penalty_match_fp32():
    ref, ours = _model(), _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ours_opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    s = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    noop = NoOpScaler()
    for step in range(6):
        # gradient accumulation over two micro-batches, clipping after unscale_
        for model, opt, scaler in ((ref, ref_opt, noop), (ours, ours_opt, s)):
            for micro in range(2):
                x, y = _data(10 * step + micro)
                scaler.scale(torch.nn.functional.mse_loss(model(x), y) / 2).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        # a gradient-penalty step (create_graph=True)
        x, y = _data(500 + step)
        _grad_penalty_step(ref, ref_opt, noop, x, y)
        _grad_penalty_step(ours, ours_opt, s, x, y)
    assert s.get_scale() > 2.0**10  # the scale grew, so different scales were exercised
    for a, b in zip(ref.parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # power-of-two scales are exact


def test_save_and_load_mid_run_is_bit_for_bit():
    pattern = [None, INF, None, None, None, INF, INF, None, None, None, None, None]
    kwargs = {"init_scale": 2.0**6, "growth_interval": 2, "hysteresis": 2, "backoff_factor": 0.8}

    def run(model, opt, scaler, steps):
        for step in steps:
            _train_step(model, opt, scaler, step, pattern[step])

    full_model = _model()
    full_opt = torch.optim.Adam(full_model.parameters(), lr=1e-2)
    full = DynamicLossScaler(**kwargs)
    run(full_model, full_opt, full, range(12))

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    s = DynamicLossScaler(**kwargs)
    run(model, opt, s, range(6))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": s.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2 = _model(seed=123)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    s2 = DynamicLossScaler()  # different settings: everything comes from the checkpoint
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    s2.load_state_dict(ckpt["scaler"])
    run(model2, opt2, s2, range(6, 12))
    assert s2.state_dict() == full.state_dict()
    for a, b in zip(model2.parameters(), full_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_state_dict_interoperates_with_torch():
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    ours = DynamicLossScaler()
    ours.load_state_dict(torch_scaler.state_dict())
    assert ours.get_scale() == 512.0 and ours.get_growth_interval() == 7
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(DynamicLossScaler(init_scale=32.0).state_dict())
    assert back.get_scale() == 32.0


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"scale": "big"}, "scaler state_dict['scale'] must be a number, got 'big'"),
        ({"scale": -2.0}, "scaler state_dict['scale'] must be finite and positive, got -2.0"),
        ({"_growth_tracker": -1}, "scaler state_dict['_growth_tracker'] must be >= 0, got -1"),
        ({"growth_factor": 0.5}, "growth_factor must be a finite number > 1, got 0.5"),
        ({"format": "other/9"}, "scaler state_dict has format 'other/9'"),
    ],
)
def test_load_rejects_malformed_state(patch, message):
    sd = DynamicLossScaler().state_dict()
    sd.update(patch)
    with pytest.raises(ValueError, match=re.escape(message)):
        DynamicLossScaler().load_state_dict(sd)
    sd = DynamicLossScaler().state_dict()
    del sd["growth_interval"]
    with pytest.raises(ValueError, match=re.escape("scaler state_dict is missing 'growth_interval'")):
        DynamicLossScaler().load_state_dict(sd)


def test_constant_scaler_skips_without_changing_scale():
    s = ConstantLossScaler(128.0)
    assert _scale_sequence(s, [False, True, False]) == [128.0, 128.0, 128.0]  # type: ignore[arg-type]
    assert s.skipped_steps == 1
    restored = ConstantLossScaler(1.0)
    restored.load_state_dict(s.state_dict())
    assert restored.get_scale() == 128.0 and restored.skipped_steps == 1


def test_noop_scaler_is_identity():
    s = NoOpScaler()
    t = torch.tensor(3.0)
    assert s.scale(t) is t and not s.is_enabled() and s.get_scale() == 1.0
    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=1.0)
    w.grad = torch.ones(1)
    s.unscale_(opt)
    s.step(opt)
    s.update()
    assert w.item() == 0.0
    with pytest.raises(ValueError, match="NoOpScaler has no state"):
        s.load_state_dict({"scale": 2.0})


def test_disabled_dynamic_scaler_is_identity():
    s = DynamicLossScaler(enabled=False)
    t = torch.tensor(2.0)
    assert s.scale(t) is t and s.get_scale() == 1.0 and s.state_dict() == {}


def test_skip_keeps_scale_and_counts():
    s = DynamicLossScaler(init_scale=64.0)
    s.skip()
    assert s.get_scale() == 64.0 and s.skipped_steps == 1 and s.overflow_steps == 0


def test_sync_found_inf_makes_one_decision_for_all_optimizers():
    a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    opt_a, opt_b = torch.optim.SGD([a], lr=1.0), torch.optim.SGD([b], lr=1.0)
    s = DynamicLossScaler(init_scale=1.0)
    a.grad, b.grad = torch.ones(1), torch.full((1,), INF)
    s.unscale_(opt_a)
    s.unscale_(opt_b)
    assert s.sync_found_inf([opt_a, opt_b]).item() == 1.0
    assert s.step(opt_a) is None and s.step(opt_b) is None
    assert a.item() == 1.0 and b.item() == 1.0


def test_hot_path_never_synchronises(monkeypatch):
    """scale, unscale_, step with a fused optimizer, and update never read a tensor on the host."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    s = DynamicLossScaler(init_scale=2.0**8, growth_interval=2, hysteresis=2, max_scale=2.0**20)
    x, y = _data(0)
    loss = torch.nn.functional.mse_loss(model(x), y)

    def forbidden(*args, **kwargs):
        raise AssertionError("host synchronisation on the hot path")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for _ in range(3):
        s.scale(loss).backward(retain_graph=True)
        s.unscale_(opt)
        s.step(opt)
        s.update()
        opt.zero_grad()
    monkeypatch.undo()
    assert s.get_scale() == 2.0**9  # and the state machine still did its job

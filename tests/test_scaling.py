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
        ({"hysteresis_mode": "megatron"}, "hysteresis_mode must be one of ('consecutive', 'since_growth', 'deepspeed'), got 'megatron'"),
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


def test_scale_keeps_namedtuples_dataclasses_and_dict_subclasses():
    """Containers are rebuilt with their own types (mixprec.nested's rules); other leaves are kept."""
    import collections
    import dataclasses

    Pair = collections.namedtuple("Pair", "loss aux")

    @dataclasses.dataclass
    class Out:
        loss: torch.Tensor
        note: str

    s = DynamicLossScaler(init_scale=4.0)
    pair = s.scale(Pair(torch.tensor(1.0), collections.OrderedDict(a=torch.tensor(2.0))))
    assert type(pair) is Pair and type(pair.aux) is collections.OrderedDict
    assert pair.loss.item() == 4.0 and pair.aux["a"].item() == 8.0
    out = s.scale(Out(torch.tensor(3.0), "kept"))
    assert type(out) is Out and out.loss.item() == 12.0 and out.note == "kept"


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


# --------------------------------------------------------------------------- robustness
# Every argument and state key is checked before anything changes; the scale stays in
# [SCALE_FLOOR, SCALE_CEILING]; GradScaler code runs unchanged.
from mixprec.scaling import SCALE_CEILING, SCALE_FLOOR  # noqa: E402

NAN = float("nan")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"init_scale": 1e39}, ValueError, "init_scale=1e+39 is outside the usable range"),
        ({"init_scale": 1e-50}, ValueError, "init_scale=1e-50 is outside the usable range"),
        ({"init_scale": 2.0**-130}, ValueError, "init_scale=7.346839692639297e-40 is outside the usable range"),
        ({"init_scale": NAN}, ValueError, "init_scale must be a finite positive number, got nan"),
        ({"init_scale": INF}, ValueError, "init_scale must be a finite positive number, got inf"),
        ({"init_scale": 0.0}, ValueError, "init_scale must be a finite positive number, got 0.0"),
        ({"init_scale": "big"}, TypeError, "init_scale must be a number, got 'big' (str)"),
        ({"init_scale": 10**400}, ValueError, "does not fit in a float"),
        ({"growth_factor": INF}, ValueError, "growth_factor must be a finite number > 1, got inf"),
        ({"growth_factor": NAN}, ValueError, "growth_factor must be a finite number > 1, got nan"),
        ({"growth_factor": 1e300}, ValueError, "growth_factor=1e+300 is larger than the fp32 maximum"),
        ({"growth_factor": None}, TypeError, "growth_factor must be a number, got None"),
        ({"backoff_factor": 1e-300}, ValueError, "backoff_factor=1e-300 is below 2**-126"),
        ({"backoff_factor": NAN}, ValueError, "backoff_factor must be in (0, 1), got nan"),
        ({"backoff_factor": -0.5}, ValueError, "backoff_factor must be in (0, 1), got -0.5"),
        ({"growth_interval": 2.5}, TypeError, "growth_interval must be an integer, got 2.5 (float)"),
        ({"growth_interval": True}, TypeError, "growth_interval must be an integer, got True (bool)"),
        ({"growth_interval": 2**40}, ValueError, "growth_interval must be an integer <= 2147483647"),
        ({"hysteresis": "2"}, TypeError, "hysteresis must be an integer, got '2' (str)"),
        ({"hysteresis": -3}, ValueError, "hysteresis must be an integer >= 1, got -3"),
        ({"hysteresis_mode": 3}, ValueError, "hysteresis_mode must be one of ('consecutive', 'since_growth', 'deepspeed'), got 3"),
        ({"min_scale": 0.0}, ValueError, "min_scale must be a finite positive number, got 0.0"),
        ({"max_scale": INF}, ValueError, "max_scale must be a finite positive number, got inf"),
        ({"init_scale": 4.0, "max_scale": 2.0}, ValueError, "init_scale=4.0 is above max_scale=2.0"),
        ({"enabled": "no"}, TypeError, "enabled must be True or False, got 'no' (str)"),
        ({"enabled": 1}, TypeError, "enabled must be True or False, got 1 (int)"),
        ({"enabled": None}, TypeError, "enabled must be True or False, got None"),
    ],
)
def test_constructor_rejects_bad_arguments_naming_them(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)) as info:
        DynamicLossScaler(**kwargs)
    assert type(info.value) is error
    assert "pass" in str(info.value) or "swap" in str(info.value) or "raise" in str(info.value) or "lower" in str(info.value)


def test_range_ends_are_accepted():
    assert DynamicLossScaler(init_scale=SCALE_FLOOR).get_scale() == SCALE_FLOOR == 2.0**-126
    assert DynamicLossScaler(init_scale=SCALE_CEILING).get_scale() == SCALE_CEILING
    assert DynamicLossScaler(backoff_factor=SCALE_FLOOR).get_backoff_factor() == SCALE_FLOOR


@pytest.mark.parametrize(
    ("scale", "error", "message"),
    [
        (1e39, ValueError, "scale=1e+39 is outside the usable range"),
        (0.0, ValueError, "scale must be a finite positive number, got 0.0"),
        ("x", TypeError, "scale must be a number, got 'x' (str)"),
    ],
)
def test_constant_scaler_rejects_bad_scale(scale, error, message):
    with pytest.raises(error, match=re.escape(message)):
        ConstantLossScaler(scale)


@pytest.mark.parametrize(
    ("new_scale", "error", "message"),
    [
        (torch.tensor(NAN), ValueError, "new_scale must be a finite positive number, got nan"),
        (torch.tensor(INF), ValueError, "new_scale must be a finite positive number, got inf"),
        (torch.tensor(0.0), ValueError, "new_scale must be a finite positive number, got 0.0"),
        (torch.tensor(-2.0), ValueError, "new_scale must be a finite positive number, got -2.0"),
        (torch.tensor(1e-40), ValueError, "is outside the usable range"),
        (NAN, ValueError, "new_scale must be a finite positive number, got nan"),
        (1e39, ValueError, "new_scale=1e+39 is outside the usable range"),
        ("8", TypeError, "new_scale must be a number or a one-element tensor, got '8' (str)"),
        (torch.tensor(True), TypeError, "new_scale must be a real-valued tensor"),
    ],
)
def test_update_new_scale_rejects_unusable_scales(new_scale, error, message):
    s = DynamicLossScaler(init_scale=4.0)
    with pytest.raises(error, match=re.escape(message)):
        s.update(new_scale)
    assert s.get_scale() == 4.0
    s.update(torch.tensor(16))  # an integer tensor is a scale too
    assert s.get_scale() == 16.0


def _overflow_steps(scaler, params, opt, n: int) -> None:
    for _ in range(n):
        scaler.scale(sum(p.sum() for p in params)).backward()
        params[0].grad[0] = INF
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


@pytest.mark.parametrize("kwargs", [{}, {"hysteresis": 2}, {"max_scale": 1.0}])
def test_scale_is_floored_and_overflows_still_counted_there(kwargs):
    """Backoff stops at SCALE_FLOOR (torch's scale would go subnormal, then 0 -> NaN weights)."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    s = DynamicLossScaler(init_scale=2.0**-120, growth_interval=3, **kwargs)
    _overflow_steps(s, [w], opt, 30)
    assert s.get_scale() == SCALE_FLOOR
    assert s.overflow_steps == 30 and s.skipped_steps == 30 and s.last_step_skipped
    assert torch.equal(w.detach(), torch.ones(3))
    for _ in range(2):  # clean steps at the floor: finite gradients, finite weights, not skipped
        s.scale(w.sum()).backward()
        s.step(opt)
        s.update()
        opt.zero_grad()
        assert not s.last_step_skipped
    assert torch.isfinite(w).all() and not torch.equal(w.detach(), torch.ones(3))
    assert s.overflow_steps == 30 and s.skipped_steps == 30


def test_growth_never_leaves_fp32():
    for kwargs in ({}, {"hysteresis": 2}):
        s = DynamicLossScaler(init_scale=SCALE_CEILING, growth_interval=1, growth_factor=16.0, **kwargs)
        assert _scale_sequence(s, [False, False]) == [SCALE_CEILING, SCALE_CEILING]


def _state_snapshot(s) -> dict:
    return {
        "state": s.state_dict(),
        "attrs": (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval(), s.hysteresis),
    }


def _bad_states():
    base = DynamicLossScaler(init_scale=256.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=5).state_dict()
    cases = {
        "tracker overflows int32": {"_growth_tracker": 10**30},
        "tracker above interval": {"_growth_tracker": 5},
        "scale too big": {"scale": 1e39},
        "scale zero (torch run that collapsed)": {"scale": 0.0},
        "scale subnormal": {"scale": 1e-40},
        "interval inf": {"growth_interval": INF},
        "interval huge int": {"growth_interval": 10**400},
        "steps huge": {"steps": 10**400},
        "hysteresis tracker too big": {"_hysteresis_tracker": 1},
        "counters inconsistent": {"skipped_steps": 1, "overflow_steps": 2, "steps": 3},
        "more skips than steps": {"skipped_steps": 5, "steps": 3},
        "mode junk": {"hysteresis_mode": ["consecutive"]},
        "min above max": {"min_scale": 8.0, "max_scale": 4.0},
        "scale outside bounds": {"max_scale": 100.0},
        "unknown key": {"growth_intervall": 3},
        "nan factor": {"backoff_factor": NAN},
    }
    for name, patch in cases.items():
        sd = dict(base)
        sd.update(patch)
        yield pytest.param(sd, id=name)


@pytest.mark.parametrize("bad", list(_bad_states()))
def test_failed_load_changes_nothing(bad):
    s = DynamicLossScaler(init_scale=8.0, growth_factor=1.5, backoff_factor=0.75, growth_interval=7, hysteresis=3)
    _scale_sequence(s, [False, True, False])
    before = _state_snapshot(s)
    with pytest.raises((ValueError, TypeError)) as info:
        s.load_state_dict(bad)
    assert "state_dict" in str(info.value)
    assert _state_snapshot(s) == before


def test_load_names_every_missing_key():
    s = DynamicLossScaler()
    with pytest.raises(
        ValueError, match=re.escape("scaler state_dict is missing 'backoff_factor', 'growth_interval'")
    ):
        s.load_state_dict({"scale": 2.0, "growth_factor": 2.0, "_growth_tracker": 0})
    with pytest.raises(ValueError, match=re.escape("The state_dict is empty")):
        s.load_state_dict({})


def test_constant_scaler_failed_load_changes_nothing():
    s = ConstantLossScaler(128.0)
    good = ConstantLossScaler(4.0).state_dict()
    for patch in ({"skipped_steps": 1, "overflow_steps": 2, "steps": 3}, {"steps": 10**400}, {"extra": 1}):
        before = s.state_dict()
        with pytest.raises(ValueError, match="state_dict"):
            s.load_state_dict({**good, **patch})
        assert s.state_dict() == before and s.get_scale() == 128.0


# --------------------------------------------------------------- torch.amp.GradScaler drop-in
def test_torch_device_argument_and_positional_order():
    assert DynamicLossScaler("cpu", init_scale=8.0).get_scale() == 8.0
    assert DynamicLossScaler(device="cpu").get_scale() == 2.0**16
    assert DynamicLossScaler(torch.device("cpu"), 4.0).get_scale() == 4.0
    # torch's positional order after device: init_scale, growth_factor, backoff_factor, growth_interval, enabled
    s = DynamicLossScaler("cuda", 1024.0, 3.0, 0.25, 7, True)
    t = torch.amp.GradScaler("cpu", 1024.0, 3.0, 0.25, 7, True)
    assert (s.get_scale(), s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (
        t.get_scale(), t.get_growth_factor(), t.get_backoff_factor(), t.get_growth_interval())
    assert s._device == "cuda"  # where torch would put it; the state follows the loss
    assert not DynamicLossScaler("cpu", 2.0, 2.0, 0.5, 10, False).is_enabled()
    assert DynamicLossScaler(1024.0).get_scale() == 1024.0  # mixprec's positional init_scale
    with pytest.raises(TypeError, match=re.escape("pass the other settings by keyword")):
        DynamicLossScaler(1024.0, 3.0)
    with pytest.raises(ValueError, match=re.escape("device='gpu' is not a device torch knows")):
        DynamicLossScaler("gpu")
    with pytest.raises(TypeError, match=re.escape("device must be a str or torch.device")):
        DynamicLossScaler([1])


def test_setters_match_torch_and_check_values():
    s = DynamicLossScaler(init_scale=2.0, growth_interval=4)
    _scale_sequence(s, [False, False, False])  # tracker 3
    s.set_growth_factor(4.0)
    s.set_backoff_factor(0.125)
    s.set_growth_interval(2)  # tracker capped at 1: the next clean step grows
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (4.0, 0.125, 2)
    assert s._get_growth_tracker() == 1
    assert _scale_sequence(s, [False, True]) == [8.0, 1.0]
    with pytest.raises(ValueError, match=re.escape("growth_factor must be a finite number > 1, got 0.5")):
        s.set_growth_factor(0.5)
    with pytest.raises(ValueError, match=re.escape("backoff_factor must be in (0, 1), got 2.0")):
        s.set_backoff_factor(2.0)
    with pytest.raises(TypeError, match=re.escape("growth_interval must be an integer, got '3'")):
        s.set_growth_interval("3")
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (4.0, 0.125, 2)
    assert torch.equal(s._get_scale_async(), torch.tensor(1.0))


def test_loading_into_a_disabled_scaler_is_a_no_op_as_in_torch():
    sd = DynamicLossScaler(init_scale=32.0).state_dict()
    ours, ref = DynamicLossScaler(enabled=False), torch.amp.GradScaler("cpu", enabled=False)
    ours.load_state_dict(sd)
    ref.load_state_dict(sd)
    assert ours.state_dict() == ref.state_dict() == {} and ours.get_scale() == ref.get_scale() == 1.0


def test_accelerate_checkpoint_path():
    """accelerate's FSDP2 load: load_state_dict, then scaler._lazy_init_scale_growth_tracker(scaler._device)."""
    s = DynamicLossScaler("cpu")
    buf = io.BytesIO()
    torch.save(DynamicLossScaler(init_scale=64.0).state_dict(), buf)
    buf.seek(0)
    s.load_state_dict(torch.load(buf, weights_only=True))
    s._lazy_init_scale_growth_tracker(s._device)
    assert s.get_scale() == 64.0 and s._scale.device.type == "cpu"


def test_step_rejects_what_is_not_an_optimizer():
    for scaler in (DynamicLossScaler(), DynamicLossScaler(enabled=False), NoOpScaler(), ConstantLossScaler(2.0)):
        with pytest.raises(TypeError, match=re.escape("step() expects a torch.optim.Optimizer")) as info:
            scaler.step("sgd")
        assert "got 'sgd' (str)" in str(info.value) and "scaler.step(optimizer)" in str(info.value)
        with pytest.raises(TypeError, match=re.escape("unscale_() expects a torch.optim.Optimizer")):
            scaler.unscale_(None)


class _AttrOptimizer(torch.optim.Optimizer):
    """Declares torch's _step_supports_amp_scaling, records what the scaler hands it, and does SGD."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.5})
        self._step_supports_amp_scaling = True
        self.seen: list[tuple[float | None, float]] = []

    @torch.no_grad()
    def step(self, closure=None):
        scale = self.grad_scale  # None when unscale_() already ran
        self.seen.append((None if scale is None else float(scale), float(self.found_inf)))
        if self.found_inf.item():
            return None
        for p in self.param_groups[0]["params"]:
            grad = p.grad if scale is None else p.grad / scale
            p.add_(grad, alpha=-0.5)
        return "stepped"


class _KwargOptimizer(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 0.5})
        self._step_supports_amp_scaling = True
        self.seen: list[tuple[str, bool, bool]] = []

    def step(self, closure=None, *, grad_scaler=None):
        found = grad_scaler._check_inf_per_device(self)
        self.seen.append((type(grad_scaler).__name__, hasattr(self, "grad_scale"), sum(v.item() for v in found.values()) > 0))
        return None


@pytest.mark.parametrize("unscale_first", [False, True])
def test_optimizers_that_unscale_themselves_get_what_torch_gives(unscale_first):
    seen = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1), DynamicLossScaler(init_scale=4.0, growth_interval=1)):
        w = torch.nn.Parameter(torch.ones(2))
        opt = _AttrOptimizer([w])
        for bad in (False, True, False):
            scaler.scale((w * (INF if bad else 1.0)).sum()).backward()
            if unscale_first:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        seen.append((opt.seen, w.tolist(), scaler.get_scale()))
    assert seen[0] == seen[1]


def test_grad_scaler_keyword_contract_as_torch():
    seen = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=2.0), DynamicLossScaler(init_scale=2.0)):
        w = torch.nn.Parameter(torch.ones(2))
        opt = _KwargOptimizer([w])
        scaler.scale((w * INF).sum()).backward()
        with pytest.warns(FutureWarning, match="GradScaler is going to stop passing itself"):
            scaler.step(opt)
        scaler.update()
        assert opt.seen == [(type(scaler).__name__, False, True)]  # the scaler itself, no attributes
        seen.append(scaler.get_scale())
    assert seen == [1.0, 1.0]  # the recorded inf check backed the scale off


def test_last_step_skipped_without_a_sync_for_ordinary_optimizers(monkeypatch):
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    s = DynamicLossScaler(init_scale=8.0)
    assert s.last_step_skipped is False
    results = []
    for bad in (False, True, False):
        s.scale((w * (INF if bad else 1.0)).sum()).backward()
        s.step(opt)
        s.update()
        opt.zero_grad()
        with monkeypatch.context() as m:  # step() already read the flag: the property does not sync
            m.setattr(torch.Tensor, "item", lambda *a: pytest.fail("host sync"))
            results.append(s.last_step_skipped)
    assert results == [False, True, False]
    s.skip()
    assert s.last_step_skipped is True


def test_last_step_skipped_with_a_fused_optimizer_reads_once():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    s = DynamicLossScaler(init_scale=2.0**8)
    x, y = _data(0)
    for poison in (None, INF):
        _train_step(model, opt, s, 0, poison)
    assert s.last_step_skipped is True and s.get_scale() == 2.0**7


def test_bounds_are_fp32_so_a_clamped_scale_reloads():
    """A bound that is not an fp32 value is rounded like the scale, so a scale clamped to it reloads."""
    s = DynamicLossScaler(init_scale=1.0, max_scale=1.0000001, growth_interval=1, hysteresis=2)
    _scale_sequence(s, [False])
    assert s.get_scale() == s.state_dict()["max_scale"] == _f32(1.0000001)
    fresh = DynamicLossScaler()
    fresh.load_state_dict(s.state_dict())
    assert fresh.state_dict() == s.state_dict()

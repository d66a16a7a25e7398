"""Optimizer state precision as a plan dimension: fp32, bf16 and the block-coded moments (8-bit, fp8).

Every block-coded form (mixprec.optim.states.BLOCKWISE) is checked against the same wrapper with
fp32 states (the oracle: decoded moments within the form's resolution), the fast path against
the generic path, and state dicts across paths and state dtypes.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mixprec import get_plan
from mixprec.diagnostics.memory.state import state_bytes
from mixprec.optim import (
    InBackwardOptimizer,
    KahanOptimizer,
    LowPrecisionOptimizer,
    StochasticRoundingOptimizer,
)
from mixprec.optim import states as qstates

WRAPPERS = {"nearest": LowPrecisionOptimizer, "kahan": KahanOptimizer, "stochastic": StochasticRoundingOptimizer}
#: every block-coded form
FORMS = {c.name: c for c in qstates.BLOCKWISE.values()}
#: how far one encoding may move a moment, relative to its block's absmax: 8-bit, the dynamic map's
#: top step (about 1/100); fp8 e4m3, half its top step (16/448, 0.036), a second moment kept as its
#: square root about twice that
TOP_GAP = {"8bit": 0.01, "fp8": 0.036}
#: five steps of encoding, fed back: measured 0.021 (8-bit) and 0.081 / 0.126 (fp8, first / second moment)
FOLLOW_GAP = {"8bit": 0.05, "fp8": 0.15}


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 600), torch.nn.LayerNorm(600), torch.nn.Linear(600, 8))
    model[0].to(torch.bfloat16)
    model[2].to(torch.bfloat16)
    return model


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    torch.manual_seed(50 + step)
    x = torch.randn(4, 16).to(torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _moments(opt, model, key: str) -> list[torch.Tensor]:
    return [qstates.value(opt.state[p], key).clone() for p in model.parameters() if p.dtype == torch.bfloat16]


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("kind", list(WRAPPERS))
@pytest.mark.parametrize("fast", [True, False])
def test_block_coded_moments_follow_the_fp32_ones(kind: str, fast: bool, form: str) -> None:
    runs = {}
    for dtype in (None, form):
        model = _model()
        opt = WRAPPERS[kind](torch.optim.AdamW(model.parameters(), lr=1e-3), state_dtype=dtype, fast=fast,
                             compile=False)
        for step in range(5):
            _step(model, opt, step)
        runs[dtype] = (model, opt)
    (m32, o32), (m8, o8) = runs[None], runs[form]
    for p in m8.parameters():
        if p.dtype == torch.bfloat16:
            assert o8.state[p]["exp_avg"].dtype == FORMS[form].dtype
            assert o8.state[p]["exp_avg_sq_absmax"].dtype == torch.float32
    gap = FOLLOW_GAP[form]
    for key in ("exp_avg", "exp_avg_sq"):
        for a, b in zip(_moments(o32, m32, key), _moments(o8, m8, key), strict=True):
            assert float((a - b).abs().max()) <= gap * float(a.abs().max()) + 1e-12, key
    for a, b in zip(m32.parameters(), m8.parameters(), strict=True):
        assert float((a.float() - b.float()).abs().max()) < 2e-2


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_the_fast_path_equals_the_generic_path_with_block_coded_states(kind: str, form: str) -> None:
    runs = []
    for fast in (True, False):
        model = _model()
        opt = WRAPPERS[kind](torch.optim.AdamW(model.parameters(), lr=1e-3), state_dtype=form, fast=fast,
                             fused=False, compile=False)
        for step in range(4):
            _step(model, opt, step)
        runs.append((model, opt))
    (m1, o1), (m2, o2) = runs
    for key in ("exp_avg", "exp_avg_sq"):
        for a, b in zip(_moments(o1, m1, key), _moments(o2, m2, key), strict=True):
            # the foreach fast path and torch's AdamW agree within fp32 rounding; one code apart at most
            assert float((a - b).abs().max()) <= 3 * TOP_GAP[form] * float(a.abs().max()) + 1e-12  # (measured 0 for fp8)
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert float((a.float() - b.float()).abs().max()) < 1e-2


@pytest.mark.parametrize(("first", "then"), [("8bit", None), ("8bit", "bf16"), (None, "8bit"), ("bf16", "8bit"),
                                             ("fp8", "bf16"), (None, "fp8"), ("fp8", "8bit"), ("8bit", "fp8")])
def test_a_state_dict_moves_across_state_dtypes(first, then) -> None:
    model = _model()
    opt = KahanOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), state_dtype=first, compile=False)
    for step in range(3):
        _step(model, opt, step)
    sd = copy.deepcopy(opt.state_dict())
    model2 = copy.deepcopy(model)
    opt2 = KahanOptimizer(torch.optim.AdamW(model2.parameters(), lr=1e-3), state_dtype=then, compile=False)
    opt2.load_state_dict(sd)
    target = qstates.parse_state_dtype(then) or torch.float32
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        if p.dtype != torch.bfloat16:
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt2.state[q][key].dtype == target
            assert (f"{key}_absmax" in opt2.state[q]) == (target in qstates.BLOCKWISE)
            before, after = qstates.value(opt.state[p], key), qstates.value(opt2.state[q], key)
            gap = 2 * TOP_GAP[then] if then in TOP_GAP else 0.02  # (measured: to fp8 0.063, from fp8 0.007)
            assert float((before - after).abs().max()) <= gap * float(before.abs().max()) + 1e-12
    _step(model2, opt2, 3)  # and trains on


@pytest.mark.parametrize("form", list(FORMS))
def test_a_block_coded_state_dict_round_trips_exactly_and_is_validated(form: str) -> None:
    model = _model()
    opt = StochasticRoundingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), state_dtype=form, compile=False)
    for step in range(2):
        _step(model, opt, step)
    sd = copy.deepcopy(opt.state_dict())
    model2 = copy.deepcopy(model)
    opt2 = StochasticRoundingOptimizer(torch.optim.AdamW(model2.parameters(), lr=1e-3), state_dtype=form,
                                       compile=False)
    opt2.load_state_dict(sd)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        for key, value in opt.state[p].items():
            assert torch.equal(value, opt2.state[q][key]), key
    for m, o in ((model, opt), (model2, opt2)):
        _step(m, o, 5)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))
    bad = copy.deepcopy(sd)
    bad["state"][0]["exp_avg_absmax"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"'exp_avg_absmax'\] has shape \(5,\).*38 blocks"):
        opt2.load_state_dict(bad)


def test_8bit_sr_in_backward_holds_at_most_4_5_bytes_per_parameter_and_undoes_exactly() -> None:
    model = _model()
    opt = StochasticRoundingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), state_dtype="8bit", compile=False)
    in_bwd = InBackwardOptimizer(opt)
    torch.manual_seed(0)
    model(torch.randn(4, 16).to(torch.bfloat16)).float().pow(2).mean().backward()
    assert in_bwd.finish()
    low = [p for p in model.parameters() if p.dtype == torch.bfloat16]
    held = sum(p.numel() * 2 for p in low) + sum(
        v.numel() * v.element_size() for p in low for v in opt.state[p].values()
    )
    assert held / sum(p.numel() for p in low) <= 4.5
    before = {k: v.clone() for p in low for k, v in opt.state[p].items() if k != "step"}
    x = torch.randn(4, 16).to(torch.bfloat16)
    x[0, 0] = float("nan")
    model(x).float().nan_to_num(0.0, 0.0, 0.0).sum().backward()
    assert not in_bwd.finish()
    after = {k: v for p in low for k, v in opt.state[p].items() if k != "step"}
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_the_memory_estimate_predicts_block_coded_state(kind: str, form: str) -> None:
    model = _model()
    opt = WRAPPERS[kind](torch.optim.AdamW(model.parameters(), lr=1e-3), state_dtype=form, compile=False)
    predicted = state_bytes(model, opt)["optimizer_state"]
    _step(model, opt, 0)
    assert state_bytes(model, opt)["optimizer_state"] == predicted
    low = [p for p in model.parameters() if p.dtype == torch.bfloat16]
    expected_low = sum(2 * (p.numel() + 4 * -(-p.numel() // 256)) + 4 for p in low)  # codes, scales, step
    fp32 = [p for p in model.parameters() if p.dtype == torch.float32]
    assert predicted == expected_low + sum(8 * p.numel() + 4 for p in fp32)


def test_state_dtype_is_a_plan_dimension() -> None:
    for name, kw in (("bf16-kahan", {}), ("bf16-sr", {}), ("bf16-pure", {}), ("bf16-master", {"remainders": True})):
        plan = get_plan(name, state_dtype="8bit", **kw)
        assert plan.optimizer_state_dtype == torch.uint8
        assert "8-bit blockwise" in plan.explain()
    assert get_plan("bf16-kahan", state_dtype="int8").optimizer_state_dtype == torch.uint8  # DESIGN.md's name
    with pytest.raises(ValueError, match="state_dtype must be 'fp32', 'bf16' or '8bit'"):
        get_plan("bf16-kahan", state_dtype="4bit")
    with pytest.raises(ValueError, match=r"Use get_plan\(.bf16-master., remainders=True, state_dtype=\.\.\.\)"):
        get_plan("bf16-master", state_dtype="bf16")


def test_an_8bit_state_dict_moves_between_the_fast_and_the_generic_path() -> None:
    model = _model()
    opt = KahanOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), state_dtype="8bit", compile=False)
    for step in range(3):
        _step(model, opt, step)
    sd = copy.deepcopy(opt.state_dict())
    model2 = copy.deepcopy(model)
    opt2 = KahanOptimizer(torch.optim.AdamW(model2.parameters(), lr=1e-3), state_dtype="8bit", fast=False,
                          compile=False)
    opt2.load_state_dict(sd)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert all(torch.equal(v, opt2.state[q][k]) for k, v in opt.state[p].items())
    for m, o in ((model, opt), (model2, opt2)):
        _step(m, o, 3)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert float((a.float() - b.float()).abs().max()) < 1e-2


@pytest.mark.parametrize("form", list(FORMS))
def test_block_coded_steps_do_not_depend_on_the_chunk_size(form: str) -> None:
    runs = []
    for chunk in (None, 1000, 384):  # rounded up to whole 256-element blocks
        model = _model()
        opt = KahanOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), state_dtype=form, chunk_numel=chunk,
                             compile=False)
        for step in range(3):
            _step(model, opt, step)
        runs.append((model, opt))
    for model, opt in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0][0].parameters(), model.parameters(), strict=True))
        for p, q in zip(runs[0][0].parameters(), model.parameters(), strict=True):
            assert all(torch.equal(v, opt.state[q][k]) for k, v in runs[0][1].state[p].items())


@pytest.mark.parametrize("form", list(FORMS))
def test_state_made_before_wrapping_is_brought_to_block_codes(form: str) -> None:
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, inner, 0)  # fp32/bf16 moments, made by torch itself
    opt = KahanOptimizer(inner, state_dtype=form, compile=False)
    _step(model, opt, 1)
    for p in model.parameters():
        if p.dtype == torch.bfloat16:
            assert opt.state[p]["exp_avg"].dtype == FORMS[form].dtype
    assert all(torch.isfinite(p).all() and p.abs().max() < 10 for p in model.parameters())


@pytest.mark.parametrize("route", ["eager", "auto"])
@pytest.mark.parametrize("kind", list(WRAPPERS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16", None])
def test_state_made_before_wrapping_is_brought_to_a_floating_state_dtype(dtype, kind: str, route: str) -> None:
    # a torch optimizer that stepped on the bf16 weights holds bf16 moments; wrapped with fp32
    # state they must become fp32 (and bf16 stays bf16), on every route ("auto": native/compiled)
    target = qstates.parse_state_dtype(dtype) or torch.float32
    for numel in (64, 5000):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(numel).bfloat16())
        inner = torch.optim.AdamW([w], lr=1e-3)
        w.grad = torch.randn(numel).bfloat16()
        inner.step()
        assert inner.state[w]["exp_avg"].dtype == torch.bfloat16
        opt = WRAPPERS[kind](inner, state_dtype=dtype, compile=False if route == "eager" else "auto")
        for _ in range(2):
            w.grad = torch.randn(numel).bfloat16()
            opt.step()
        for key in ("exp_avg", "exp_avg_sq"):
            assert inner.state[w][key].dtype == target, (numel, key)


@pytest.mark.parametrize("spelling", ["fp16", "float16", torch.float16])
def test_fp16_state_is_refused_with_the_reason_and_the_ways_that_work(spelling) -> None:
    # fp16 cannot hold Adam's state: a first moment of 1e5 is inf (NaN weights next), a second
    # moment under 6e-8 is zero (updates 6x too large on gradients of 1e-4)
    for name, kw in (("bf16-kahan", {}), ("bf16-sr", {}), ("bf16-pure", {}), ("bf16-master", {"remainders": True})):
        with pytest.raises(ValueError, match=r"state_dtype='fp16' cannot hold optimizer state.*'bf16'.*'8bit'") as err:
            get_plan(name, state_dtype=spelling, **kw)
        assert name in str(err.value)
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    for wrapper in WRAPPERS.values():
        with pytest.raises(ValueError, match="flushes to zero below 6e-8"):
            wrapper(torch.optim.AdamW([w]), state_dtype=spelling)


def test_a_state_dict_saved_with_fp16_state_loads_into_bf16_state_converted() -> None:
    # checkpoints written while fp16 state was accepted still load, into a state dtype that holds them
    model = _model()
    opt = KahanOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), state_dtype="bf16", compile=False)
    for step in range(3):
        _step(model, opt, step)
    sd = copy.deepcopy(opt.state_dict())
    for entry in sd["state"].values():
        for key in ("exp_avg", "exp_avg_sq"):
            if entry[key].dtype == torch.bfloat16:
                entry[key] = entry[key].to(torch.float16)
    model2 = copy.deepcopy(model)
    opt2 = KahanOptimizer(torch.optim.AdamW(model2.parameters(), lr=1e-3), state_dtype="bf16", compile=False)
    opt2.load_state_dict(sd)
    for index, q in enumerate(model2.parameters()):
        if q.dtype == torch.bfloat16:
            for key in ("exp_avg", "exp_avg_sq"):
                held = opt2.state[q][key]
                assert held.dtype == torch.bfloat16
                assert torch.equal(held, sd["state"][index][key].to(torch.bfloat16))
    _step(model2, opt2, 3)


@pytest.mark.parametrize("form", list(FORMS))
def test_block_codes_without_their_scales_are_refused(form: str) -> None:
    model = _model()
    opt = KahanOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), state_dtype=form, compile=False)
    _step(model, opt, 0)
    sd = copy.deepcopy(opt.state_dict())
    del sd["state"][0]["exp_avg_absmax"]
    with pytest.raises(ValueError, match=f"holds {FORMS[form].label} codes without their block scales"):
        opt.load_state_dict(sd)


def _regression_loss(state_dtype, steps: int = 300) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)).bfloat16()
    opt = KahanOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), state_dtype=state_dtype, compile=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 32, generator=g)
    y = x[:, :4].sin().sum(1, keepdim=True)
    for _ in range(steps):
        idx = torch.randint(0, 2048, (64,), generator=g)
        (model(x[idx].bfloat16()).float() - y[idx]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return float((model(x.bfloat16()).float() - y).pow(2).mean())


@pytest.mark.parametrize("form", list(FORMS))
def test_block_coded_moments_train_as_fp32_ones(form: str) -> None:
    """300 steps of AdamW on a small regression (bf16-kahan): the loss within 1% of fp32 moments'
    (measured: 8-bit +0.01%, fp8 +0.08%)."""
    reference = _regression_loss(None)
    assert abs(_regression_loss(form) - reference) <= 0.01 * reference


@pytest.mark.parametrize("form", list(FORMS))
def test_a_plain_optimizers_state_loads_into_block_codes(form: str) -> None:
    """A checkpoint of a plain torch loop (fp32 moments) resumed under a block-coded plan: encoded on load."""
    from mixprec.resume import load_plain_optimizer_state

    model = _model()
    plain = torch.optim.AdamW(copy.deepcopy(model).float().parameters(), lr=1e-3)
    for p in plain.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    plain.step()
    opt = KahanOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), state_dtype=form, compile=False)
    load_plain_optimizer_state(opt, plain.state_dict())
    for p, q in zip(model.parameters(), plain.param_groups[0]["params"], strict=True):
        if p.dtype != torch.bfloat16:
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt.state[p][key].dtype == FORMS[form].dtype and f"{key}_absmax" in opt.state[p]
            want = plain.state[q][key]
            got = qstates.value(opt.state[p], key)
            assert float((got - want).abs().max()) <= 2 * TOP_GAP[form] * float(want.abs().max())
    _step(model, opt, 1)


@pytest.mark.parametrize("form", list(FORMS))
def test_block_coded_states_are_refused_on_fsdp2_shards(form: str) -> None:
    from mixprec.optim import shards

    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=f"{FORMS[form].label} optimizer states are not supported on FSDP2 shards"):
        shards.check_shardable(torch.optim.AdamW([w]), FORMS[form].dtype, "KahanOptimizer")


def test_fp8_is_a_plan_dimension_too() -> None:
    plan = get_plan("bf16-sr", state_dtype="fp8")
    assert plan.optimizer_state_dtype == torch.float8_e4m3fn and "fp8 e4m3 blockwise" in plan.explain()
    assert qstates.parse_state_dtype(torch.float8_e4m3fn) == qstates.FP8 and qstates.element_bytes(qstates.FP8) == 1 + 4 / 256


@pytest.mark.parametrize("form", list(FORMS))
def test_block_codes_of_an_inner_state_dict_load_into_a_float_state(form: str) -> None:
    """The inner optimizer's state dict of a block-coded wrapper (codes and scales, no wrapper entry)
    resumed under bf16 state: decoded, not cast (fp8 codes are floating tensors)."""
    from mixprec.resume import load_plain_optimizer_state

    model = _model()
    opt = KahanOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), state_dtype=form, compile=False)
    _step(model, opt, 0)
    model2 = copy.deepcopy(model)
    opt2 = KahanOptimizer(torch.optim.AdamW(model2.parameters(), lr=1e-3), state_dtype="bf16", compile=False)
    load_plain_optimizer_state(opt2, copy.deepcopy(opt.optimizer.state_dict()))
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        if p.dtype == torch.bfloat16:
            for key in ("exp_avg", "exp_avg_sq"):
                assert opt2.state[q][key].dtype == torch.bfloat16 and f"{key}_absmax" not in opt2.state[q]
                want = qstates.value(opt.state[p], key)
                assert float((opt2.state[q][key].float() - want).abs().max()) <= 0.01 * float(want.abs().max())

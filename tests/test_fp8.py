"""fp8: scale math with exact values, the emulated GEMM against a float64 reference of the
same quantised values, SQNR floors against bf16, delayed-scaling timing, conversion, state."""

from __future__ import annotations

import copy
import io
import math
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec.dtypes import Format
from mixprec.fp8 import (
    FP32_MAX,
    CurrentScaling,
    DelayedScaling,
    Fp8Format,
    Fp8Linear,
    all_reduce_amax,
    compute_scale,
    convert_to_fp8,
    fp8_layers,
    native_fp8_available,
    quantize,
    quantize_with_stats,
    scaled_mm,
    stats,
)
from mixprec.fp8.gemm import native_operands
from tests._dist import run_ranks

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
U32 = 2.0**-24  # unit roundoff of fp32
INPUT, WEIGHT, GRAD = 0, 1, 2


def f32(value: float) -> torch.Tensor:
    """The fp32 number nearest to ``value``: the exact expected result of one fp32 division."""
    return torch.tensor(value, dtype=torch.float32)


def sqnr_db(ref: torch.Tensor, actual: torch.Tensor) -> float:
    ref, actual = ref.double(), actual.double()
    return 20 * math.log10(ref.norm().item() / (ref - actual).norm().item())


def assert_within(actual: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """|actual - ref| <= bound elementwise; on failure, report where the worst violation is."""
    err = (actual.double() - ref).abs()
    excess = err - bound
    if (excess > 0).any():
        idx = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
        raise AssertionError(
            f"{what}: |actual - ref| exceeds the fp32-accumulation bound at {idx}: "
            f"actual={actual[idx].item()!r} ref={ref[idx].item()!r} err={err[idx].item():.3e} "
            f"bound={bound[idx].item():.3e}"
        )


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- scale math


def test_scale_from_amax_history_in_e4m3_and_e5m2_is_exact():
    assert torch.equal(compute_scale(torch.tensor(1.25), E4M3_MAX), f32(448 / 1.25))
    assert torch.equal(compute_scale(torch.tensor(0.75), E5M2_MAX), f32(57344 / 0.75))
    # The Format itself carries its max.
    assert torch.equal(compute_scale(torch.tensor(0.75), Format.E5M2), f32(57344 / 0.75))


def test_scale_is_one_correctly_rounded_division_not_reciprocal_times_max():
    # 57344 * (1 / 0.75) rounds twice and lands one ulp away; the scale must not.
    assert (57344 * torch.tensor(0.75).reciprocal()).item() != f32(57344 / 0.75).item()
    assert compute_scale(torch.tensor(0.75), E5M2_MAX).item() == f32(57344 / 0.75).item()


@pytest.mark.parametrize("margin", [1, 2, 5])
def test_margin_divides_the_scale_by_powers_of_two(margin):
    base = compute_scale(torch.tensor(1.25), E4M3_MAX)
    assert torch.equal(compute_scale(torch.tensor(1.25), E4M3_MAX, margin=margin), base / 2**margin)
    assert torch.equal(compute_scale(torch.tensor(1.25), E4M3_MAX, margin=1), f32(224 / 1.25))


@pytest.mark.parametrize("amax", [0.0, math.inf, -math.inf, math.nan])
def test_uninformative_amax_keeps_the_previous_scale(amax):
    prev = torch.tensor(123.5)
    assert torch.equal(compute_scale(torch.tensor(amax), E4M3_MAX, prev_scale=prev), prev)
    assert torch.equal(compute_scale(amax, E5M2_MAX, margin=3, prev_scale=7.0), f32(7.0))


@pytest.mark.parametrize("amax", [1e-45, 1e-39, 1e-36, 1.3e-36])
def test_tiny_amax_gives_the_fp32_maximum_never_inf(amax):
    scale = compute_scale(torch.tensor(amax), E4M3_MAX)
    assert scale.item() == torch.finfo(torch.float32).max == FP32_MAX
    assert torch.isfinite(scale)


def test_compute_scale_is_elementwise_and_returns_fp32():
    amax = torch.tensor([1.25, 0.0, 2.0, math.nan], dtype=torch.float64)
    prev = torch.tensor([9.0, 9.0, 9.0, 9.0])
    out = compute_scale(amax, E4M3_MAX, prev_scale=prev)
    assert out.dtype == torch.float32
    assert out.tolist() == [f32(448 / 1.25).item(), 9.0, 224.0, 9.0]


@settings(max_examples=60, deadline=None)
@given(st.floats(min_value=1e-45, max_value=3e38, allow_nan=False, allow_infinity=False))
def test_scale_never_pushes_amax_past_fmt_max_and_is_finite(amax):
    a = torch.tensor(amax, dtype=torch.float32)
    if a.item() == 0:  # flushed to zero by fp32: keeps prev
        return
    scale = compute_scale(a, E4M3_MAX)
    assert torch.isfinite(scale) and scale > 0
    # After scaling, amax maps to at most fmt_max (up to one fp32 rounding of the product).
    assert (a.double() * scale.double()).item() <= E4M3_MAX * (1 + 2 * U32)


def test_scale_math_runs_without_host_sync():
    # Meta tensors have no data: any .item() or bool(tensor) here would raise.
    amax = torch.empty((), device="meta")
    assert compute_scale(amax, E4M3_MAX, prev_scale=torch.empty((), device="meta")).device.type == "meta"
    layer = Fp8Linear(16, 32, device="meta")
    x = torch.empty(4, 16, device="meta", requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and x.grad.device.type == "meta"


# --------------------------------------------------------------------------- recipes


_FMTS = "'hybrid' (E4M3 forward, E5M2 gradients), 'e4m3' (E4M3 everywhere) or 'e5m2' (E5M2 everywhere)"
_MARGIN_RANGE = (
    "margin must be between 0 and 64 (the scale is divided by 2**margin to leave headroom; beyond 64 it "
    "is no longer a finite, exact fp32 scale); pass e.g. margin=0 or margin=1"
)
_MARGIN_TYPE = (
    "margin must be an int (the scale is divided by 2**margin to leave headroom); pass e.g. margin=0 or margin=1"
)
_HISTORY = (
    "expected an int >= 1 (the number of past iterations whose amax is kept); use 1 to scale from "
    "the previous iteration only"
)
_ALGO = "expected 'max' (largest amax in the history) or 'most_recent' (the previous iteration's amax)"


@pytest.mark.parametrize(
    ("error", "factory", "message"),
    [
        (ValueError, lambda: DelayedScaling(fmt="e3m4"), f"DelayedScaling(fmt='e3m4'): unknown fp8 format; expected {_FMTS}"),
        (ValueError, lambda: CurrentScaling(fmt="fp8"), f"CurrentScaling(fmt='fp8'): unknown fp8 format; expected {_FMTS}"),
        (TypeError, lambda: DelayedScaling(fmt=None), f"DelayedScaling(fmt=None): expected a str or an Fp8Format: {_FMTS}"),
        (ValueError, lambda: DelayedScaling(margin=-1), f"DelayedScaling(margin=-1): {_MARGIN_RANGE}"),
        (ValueError, lambda: DelayedScaling(margin=130), f"DelayedScaling(margin=130): {_MARGIN_RANGE}"),
        (ValueError, lambda: CurrentScaling(margin=2000), f"CurrentScaling(margin=2000): {_MARGIN_RANGE}"),
        (TypeError, lambda: CurrentScaling(margin=0.5), f"CurrentScaling(margin=0.5): {_MARGIN_TYPE}"),
        (TypeError, lambda: DelayedScaling(margin=True), f"DelayedScaling(margin=True): {_MARGIN_TYPE}"),
        (ValueError, lambda: DelayedScaling(amax_history_len=0), f"DelayedScaling(amax_history_len=0): {_HISTORY}"),
        (TypeError, lambda: DelayedScaling(amax_history_len=2.0), f"DelayedScaling(amax_history_len=2.0): {_HISTORY}"),
        (TypeError, lambda: DelayedScaling(amax_init=1), "DelayedScaling(amax_init=1): expected True or False"),
        (ValueError, lambda: DelayedScaling(amax_compute_algo="mean"), f"DelayedScaling(amax_compute_algo='mean'): {_ALGO}"),
        (TypeError, lambda: DelayedScaling(amax_compute_algo=None), f"DelayedScaling(amax_compute_algo=None): {_ALGO}"),
        (ValueError, lambda: compute_scale(1.0, E4M3_MAX, margin=65), f"compute_scale(margin=65): {_MARGIN_RANGE}"),
    ],
)
def test_recipe_arguments_are_validated_with_the_value_and_the_fix(error, factory, message):
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        factory()


@pytest.mark.parametrize("margin", [0, 1, 64])
@pytest.mark.parametrize("amax", [1e-30, 1.0, 3e38])
def test_every_allowed_margin_gives_a_finite_positive_scale_with_a_finite_inverse(margin, amax):
    for fmt_max in (E4M3_MAX, E5M2_MAX):
        scale = compute_scale(torch.tensor(amax), fmt_max, margin=margin)
        assert torch.isfinite(scale) and scale > 0 and torch.isfinite(scale.reciprocal()), (margin, amax, scale)
    # Where nothing clamps, the scale is still the one correctly rounded division.
    assert torch.equal(compute_scale(torch.tensor(1.0), E4M3_MAX, margin=64), f32(448 / 2.0**64))


@pytest.mark.parametrize("margin", [64, 0])
def test_a_layer_with_the_largest_margin_trains_finite(margin):
    layer = Fp8Linear(16, 16, recipe=DelayedScaling(margin=margin, amax_history_len=2))
    for seed in range(2):
        x = _input_with_amax(3.0, seed=seed).requires_grad_()
        y = layer(x)
        y.backward(torch.ones_like(y))
        assert torch.isfinite(y).all() and torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()
    assert torch.isfinite(layer.fp8_scale).all() and (layer.fp8_scale > 0).all()


def test_e5m2_recipe_quantises_everything_to_e5m2():
    assert (Fp8Format.E5M2.forward, Fp8Format.E5M2.backward) == (Format.E5M2, Format.E5M2)
    torch.manual_seed(0)  # the layers' weights, whatever ran before
    for recipe in (DelayedScaling(fmt="e5m2", amax_history_len=2), CurrentScaling(fmt="e5m2")):
        assert recipe.fp8_format is Fp8Format.E5M2
        layer = Fp8Linear(16, 16, bias=False, recipe=recipe)
        assert [s.format for s in layer.fp8_state().values()] == [Format.E5M2] * 3
        x = _input_with_amax(2.0)
        y = _iterate(layer, x)
        qx = quantize(x, f32(57344 / 2.0), Format.E5M2).dequantize()
        qw = quantize(layer.weight.detach(), layer.fp8_scale[WEIGHT], Format.E5M2).dequantize()
        # the layer scales after its fp32 sums, the reference before: sums near zero differ by
        # an ulp of their terms (1.7e-7 seen), so atol is 1e-6 (no miss over 300 seeds)
        assert torch.allclose(y.detach(), qx @ qw.T, rtol=1e-6, atol=1e-6)


def test_recipes_are_frozen_and_formats_are_data():
    r = DelayedScaling()
    assert (r.fmt, r.margin, r.amax_history_len, r.amax_compute_algo) == (Fp8Format.HYBRID, 0, 1024, "max")
    with pytest.raises(AttributeError):
        r.margin = 1  # type: ignore[misc]
    assert DelayedScaling(fmt="hybrid") == DelayedScaling(fmt=Fp8Format.HYBRID)
    assert hash(DelayedScaling()) == hash(DelayedScaling())
    assert (Fp8Format.HYBRID.forward, Fp8Format.HYBRID.backward) == (Format.E4M3, Format.E5M2)
    assert (Fp8Format.E4M3.forward, Fp8Format.E4M3.backward) == (Format.E4M3, Format.E4M3)
    assert (Format.E4M3.max, Format.E5M2.max) == (E4M3_MAX, E5M2_MAX)
    assert CurrentScaling().history_len == 1


# --------------------------------------------------------------------------- delayed scaling in a layer


def _input_with_amax(amax: float, rows: int = 4, features: int = 16, seed: int = 0) -> torch.Tensor:
    x = torch.rand(rows, features, generator=gen(seed)) * amax * 0.9
    x[0, 0] = -amax
    return x


def _iterate(layer: Fp8Linear, x: torch.Tensor, grad: torch.Tensor | None = None) -> torch.Tensor:
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(torch.ones_like(y) if grad is None else grad)
    return y


def test_delayed_scale_at_t_comes_from_the_history_up_to_t_minus_1():
    layer = Fp8Linear(16, 16, recipe=DelayedScaling(amax_history_len=8))
    grad = torch.full((4, 16), 0.5)
    grad[1, 2] = -0.75
    _iterate(layer, _input_with_amax(1.25), grad)
    st0 = layer.fp8_state()
    # Iteration 0 has no history: it scales from its own amax (amax_init).
    assert torch.equal(st0["input"].scale, f32(448 / 1.25))
    assert torch.equal(st0["grad_output"].scale, f32(57344 / 0.75))
    # The current amax was recorded after use; it determines the next scale.
    assert st0["input"].amax_history[0].item() == 1.25
    assert torch.equal(st0["input"].next_scale, f32(448 / 1.25))
    assert torch.equal(st0["grad_output"].next_scale, f32(57344 / 0.75))
    weight_amax = layer.weight.detach().abs().max()
    assert torch.equal(st0["weight"].next_scale, compute_scale(weight_amax, E4M3_MAX))

    _iterate(layer, _input_with_amax(3.0, seed=1), grad)
    st1 = layer.fp8_state()
    # Iteration 1 used the scale from iteration 0's amax, not its own (3.0).
    assert torch.equal(st1["input"].scale, f32(448 / 1.25))
    assert torch.equal(st1["grad_output"].scale, f32(57344 / 0.75))
    assert st1["input"].amax_history[:2].tolist() == [3.0, 1.25]


@pytest.mark.parametrize(("amax_init", "first_scale", "underflow"), [(True, 57344 / 1e-6, 0.0), (False, 1.0, 1.0)])
def test_first_iteration_scale_with_and_without_amax_init(amax_init, first_scale, underflow):
    layer = Fp8Linear(16, 16, recipe=DelayedScaling(amax_history_len=4, amax_init=amax_init))
    # Gradients of order 1e-6 (a mean over many tokens) are below E5M2's smallest
    # subnormal (2**-16): with the initial scale 1 they all flush to zero.
    _iterate(layer, _input_with_amax(1.0), torch.full((4, 16), 1e-6))
    st = layer.fp8_state()["grad_output"]
    assert torch.equal(st.scale, f32(first_scale))
    assert st.underflow.item() == underflow
    # From the second iteration on, both follow the recorded history.
    _iterate(layer, _input_with_amax(1.0), torch.full((4, 16), 1e-6))
    assert torch.equal(layer.fp8_state()["grad_output"].scale, f32(57344 / 1e-6))


def test_delayed_scaling_quantises_with_the_previous_scale_and_saturates_a_spike():
    torch.manual_seed(0)  # the layer's weights, whatever ran before
    layer = Fp8Linear(16, 16, bias=False, recipe=DelayedScaling(amax_history_len=4))
    _iterate(layer, _input_with_amax(1.0))
    spike = torch.full((4, 16), 0.5)
    spike[:, :4] = 4.0  # 16 of 64 elements beyond amax 1: clipped at 448 after scale 448
    spike[:, 4:8] = 1e-6  # 16 of 64 non-zero elements below E4M3's smallest subnormal / 2
    y = _iterate(layer, spike)
    expected = quantize(spike, torch.tensor(448.0), Format.E4M3).dequantize()
    w = quantize(layer.weight.detach(), layer.fp8_scale[WEIGHT], Format.E4M3).dequantize()
    assert torch.allclose(y.detach(), expected @ w.T, rtol=1e-6, atol=1e-6)  # scaled after vs before the sums
    assert torch.isfinite(y).all()
    s = stats(torch.nn.Sequential(layer))["0"]["input"]
    assert (s["saturation"], s["underflow"], s["scale"], s["amax"]) == (0.25, 0.25, 448.0, 4.0)


def test_current_scaling_uses_the_tensor_itself_and_never_saturates():
    layer = Fp8Linear(16, 16, recipe=CurrentScaling())
    _iterate(layer, _input_with_amax(1.0))
    _iterate(layer, _input_with_amax(4.0, seed=3))
    st = layer.fp8_state()
    assert torch.equal(st["input"].scale, f32(448 / 4.0))
    assert st["input"].saturation.item() == 0.0
    assert st["input"].next_scale is None and st["input"].amax_history.shape == (1,)


def test_history_rolls_one_step_per_iteration():
    layer = Fp8Linear(16, 16, recipe=DelayedScaling(amax_history_len=3))
    for i, amax in enumerate([1.0, 2.0, 3.0, 4.0]):
        _iterate(layer, _input_with_amax(amax, seed=i))
        assert layer.fp8_amax_history[INPUT, 0].item() == amax
    assert layer.fp8_amax_history[INPUT].tolist() == [4.0, 3.0, 2.0]
    assert layer.fp8_amax_history[GRAD].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(("algo", "expected"), [("max", 448 / 2.0), ("most_recent", 448 / 1.0)])
def test_amax_compute_algo_max_vs_most_recent(algo, expected):
    layer = Fp8Linear(16, 16, recipe=DelayedScaling(amax_history_len=4, amax_compute_algo=algo))
    _iterate(layer, _input_with_amax(2.0))
    _iterate(layer, _input_with_amax(1.0, seed=1))
    assert torch.equal(layer.fp8_state()["input"].next_scale, f32(expected))
    _iterate(layer, _input_with_amax(1.0, seed=2))
    assert torch.equal(layer.fp8_scale[INPUT], f32(expected))


def test_margin_halves_the_scale_in_a_layer():
    layer = Fp8Linear(16, 16, recipe=DelayedScaling(margin=1, amax_history_len=2))
    _iterate(layer, _input_with_amax(1.25))
    assert torch.equal(layer.fp8_state()["input"].next_scale, f32(224 / 1.25))


def test_a_non_finite_amax_is_recorded_as_zero_and_keeps_the_scale():
    layer = Fp8Linear(16, 16, recipe=DelayedScaling(amax_history_len=4))
    _iterate(layer, _input_with_amax(2.0))
    scale = layer.fp8_scale.clone()
    bad = _input_with_amax(1.0)
    bad[1, 1] = math.inf
    with torch.no_grad():
        layer(bad)  # training mode: recorded, but no backward
    assert layer.fp8_amax_history[INPUT, :2].tolist() == [0.0, 2.0]  # never inf
    assert torch.equal(layer.fp8_scale, scale)
    assert torch.equal(layer.fp8_state()["input"].next_scale, f32(448 / 2.0))
    # A history loaded with an inf in it: "max" ignores it, "most_recent" keeps the scale.
    history = torch.tensor([math.inf, 2.0, 0.0, 0.0])
    assert torch.equal(DelayedScaling(amax_history_len=4).next_scale(history, E4M3_MAX, f32(1.0)), f32(224.0))
    most_recent = DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
    prev = torch.tensor(5.0)
    assert torch.equal(most_recent.next_scale(history, E4M3_MAX, prev), prev)


def test_eval_mode_uses_the_next_scale_and_changes_no_state():
    layer = Fp8Linear(16, 16, recipe=DelayedScaling(amax_history_len=4))
    _iterate(layer, _input_with_amax(1.25))
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    stats_before = layer.fp8_stats.clone()
    layer.eval()
    x = _input_with_amax(3.0)
    with torch.no_grad():
        y = layer(x)
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())
    assert torch.equal(layer.fp8_stats, stats_before)
    qx = quantize(x, f32(448 / 1.25), Format.E4M3).dequantize()
    qw = quantize(layer.weight.detach(), layer.fp8_state()["weight"].next_scale, Format.E4M3).dequantize()
    assert torch.allclose(y, qx @ qw.T + layer.bias.detach(), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- quantisation


@pytest.mark.parametrize("fmt", [Format.E4M3, Format.E5M2])
def test_values_beyond_fmt_max_saturate_never_inf(fmt):
    x = torch.tensor([1e30, -1e30, 3.0 * fmt.max, -fmt.max, 0.0])
    q = quantize(x, torch.tensor(1.0), fmt)
    assert q.data.dtype == fmt.dtype
    assert q.dequantize().tolist() == [fmt.max, -fmt.max, fmt.max, -fmt.max, 0.0]


def test_quantisation_round_trips_through_the_real_fp8_dtypes():
    x = torch.randn(1000, generator=gen(4))
    scale = torch.tensor(37.0)
    for fmt in (Format.E4M3, Format.E5M2):
        q = quantize(x, scale, fmt)
        expected = (x * scale).to(fmt.dtype).float() * scale.reciprocal()
        assert torch.equal(q.dequantize(), expected)


def test_saturation_and_underflow_fractions_are_exact():
    x = torch.tensor([1e-9, -1e-9, 1.0, 500.0, -600.0, 0.0, 0.0, 2.0])
    _, s = quantize_with_stats(x, torch.tensor(1.0), Format.E4M3)
    assert torch.equal(s, torch.tensor([2 / 8, 2 / 6]))  # 2 of 8 clamped; 2 of 6 non-zeros flushed
    _, s = quantize_with_stats(x, torch.tensor(1.0), Format.E5M2)
    assert torch.equal(s, torch.tensor([0.0, 2 / 6]))


@pytest.mark.parametrize("fmt", [Format.E4M3, Format.E5M2])
def test_stats_agree_with_their_definition_on_the_fp8_values(fmt):
    half = fmt.tiny * 2.0 ** -(fmt.mantissa_bits + 1)  # half the smallest subnormal
    edges = torch.tensor([half, -half, half * 1.0001, half * 0.9999, fmt.max, fmt.max * 1.0001, 0.0, 1e-44])
    x = torch.cat([torch.randn(4000, generator=gen(11)) * 10.0 ** torch.randint(-8, 4, (4000,), generator=gen(12)), edges])
    scale = torch.tensor(3.0)
    q, s = quantize_with_stats(x, scale, fmt)
    clipped = ((x.double() * 3.0).abs() > fmt.max).sum().item()
    flushed = ((q.data.float() == 0) & (x != 0)).sum().item()
    assert clipped > 0 and flushed > 0
    assert s.tolist() == [pytest.approx(clipped / x.numel()), pytest.approx(flushed / (x != 0).sum().item())]


def test_track_stats_false_skips_the_diagnostics_only():
    on, off = Fp8Linear(16, 16), Fp8Linear(16, 16, track_stats=False)
    off.load_state_dict(on.state_dict())
    x = _input_with_amax(2.0)
    x[0, 1] = 1e-9
    y_on, y_off = _iterate(on, x), _iterate(off, x)
    assert torch.equal(y_on, y_off) and torch.equal(on.fp8_amax_history, off.fp8_amax_history)
    assert on.fp8_stats[INPUT, 1].item() > 0 and off.fp8_stats.abs().sum().item() == 0
    assert not fp8_layers(convert_to_fp8(_mlp(), track_stats=False))["0"].track_stats


# --------------------------------------------------------------------------- emulated GEMM numerics


def _reference(qa, qb_t, inv):
    """float64 ``qa @ qb_t`` times the dequantisation factor, and the fp32 error bound's magnitude."""
    a, b = qa.double(), qb_t.double()
    return (a @ b) * inv, (a.abs() @ b.abs()) * abs(inv)


@pytest.mark.parametrize("recipe", [CurrentScaling(), DelayedScaling(amax_history_len=4)], ids=["current", "delayed"])
def test_emulated_linear_equals_float64_reference_of_the_same_quantised_values(recipe):
    m, k, n = 64, 96, 48
    torch.manual_seed(0)
    layer = Fp8Linear(k, n, recipe=recipe, emulate=True)
    x = torch.randn(m, k, generator=gen(1)) * 3
    g = torch.randn(m, n, generator=gen(2)) * 1e-3
    for _ in range(2):  # the second iteration runs with non-trivial delayed scales
        layer.zero_grad()
        x_ = x.clone().requires_grad_()
        y = layer(x_)
        y.backward(g)
    sx, sw, sg = layer.fp8_scale
    assert sx.item() != 1.0 and sg.item() != 1.0
    qx = quantize(x, sx, Format.E4M3)
    qw = quantize(layer.weight.detach(), sw, Format.E4M3)
    qg = quantize(g, sg, Format.E5M2)
    inv = lambda *q: math.prod(t.inv_scale.double().item() for t in q)  # noqa: E731

    ref, mag = _reference(qx.data, qw.data.T, inv(qx, qw))
    bias = layer.bias.detach().double()
    # fp32: k roundings in the accumulation, one for the scale product, one for the
    # scaling, one for the bias add.
    assert_within(y.detach(), ref + bias, (k + 4) * U32 * (mag + bias.abs()), "forward")

    ref, mag = _reference(qg.data, qw.data, inv(qg, qw))
    assert_within(x_.grad, ref, (n + 3) * U32 * mag, "grad_input")
    ref, mag = _reference(qg.data.T, qx.data, inv(qg, qx))
    assert_within(layer.weight.grad, ref, (m + 3) * U32 * mag, "grad_weight")
    assert torch.allclose(layer.bias.grad, g.sum(0), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("recipe", [CurrentScaling(), DelayedScaling(amax_history_len=4)], ids=["current", "delayed"])
def test_fp8_linear_sqnr_against_bf16_linear(recipe):
    m, k, n = 128, 256, 128
    torch.manual_seed(0)
    layer = Fp8Linear(k, n, recipe=recipe, emulate=True)
    x = torch.randn(m, k, generator=gen(5))
    g = torch.randn(m, n, generator=gen(6)) * 1e-2
    for _ in range(2):  # warm the delayed history with the same data
        layer.zero_grad()
        xf = x.clone().requires_grad_()
        y = layer(xf)
        y.backward(g)

    xb = x.bfloat16().requires_grad_()
    wb = layer.weight.detach().bfloat16().requires_grad_()
    yb = F.linear(xb, wb, layer.bias.detach().bfloat16())
    yb.backward(g.bfloat16())
    results = {
        "forward": sqnr_db(yb.float(), y.detach()),
        "grad_input": sqnr_db(xb.grad.float(), xf.grad),
        "grad_weight": sqnr_db(wb.grad.float(), layer.weight.grad),
    }
    assert all(v >= 20.0 for v in results.values()), results


def test_output_dtype_is_the_compute_dtype_and_grads_match_their_tensors():
    layer = Fp8Linear(16, 32)
    x = torch.randn(2, 3, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 32)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and x.grad.shape == x.shape
    assert layer.weight.grad.dtype == torch.float32 and layer.bias.grad.dtype == torch.float32
    xb = torch.randn(5, 16, dtype=torch.bfloat16)
    assert layer(xb).dtype == torch.bfloat16
    assert layer(xb.float()).dtype == torch.float32


def test_frozen_weight_and_input_without_grad_skip_their_gemms():
    layer = Fp8Linear(16, 16)
    layer.weight.requires_grad_(False)
    x = torch.randn(4, 16, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad is None and x.grad is not None and layer.bias.grad is not None


# --------------------------------------------------------------------------- the native path


def test_native_path_is_chosen_only_on_cuda_fp8_hardware():
    assert native_fp8_available("cpu") is False
    assert Fp8Linear(16, 16)._use_native(torch.zeros(1, 16)) is False
    with pytest.raises(RuntimeError, match=re.escape("Fp8Linear(emulate=False) got an input on cpu")):
        Fp8Linear(16, 16, emulate=False)(torch.zeros(1, 16))


def test_native_operand_layouts_are_what_scaled_mm_requires():
    a = torch.zeros(32, 64).to(torch.float8_e5m2).t()  # a transposed view, as grad_out.T
    b = torch.zeros(48, 64).to(torch.float8_e4m3fn).t()  # weight.T: already column-major
    a_n, b_n = native_operands(a, b)
    assert a_n.stride() == (32, 1)  # row-major
    assert b_n.stride() == (1, 64) and b_n.data_ptr() == b.data_ptr()  # column-major, no copy
    w = torch.zeros(48, 64).to(torch.float8_e4m3fn)  # weight as the dgrad operand: row-major
    assert native_operands(a.t(), w)[1].stride() == (1, 48)


def _cpu_scaled_mm_runs() -> bool:
    """Whether ``torch._scaled_mm`` runs on this CPU: oneDNN's fp8 matmul needs instructions an
    AVX2-only CPU (or ``ONEDNN_MAX_CPU_ISA=AVX2``) lacks ('could not create a primitive descriptor')."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    try:
        torch._scaled_mm(a, a.t(), one, one, out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


_scaled_mm_on_cpu = pytest.mark.skipif(
    not _cpu_scaled_mm_runs(), reason="torch._scaled_mm does not run on this CPU (no such function, or oneDNN "
    "has no fp8 matmul for this instruction set)"
)


@_scaled_mm_on_cpu
def test_native_code_path_matches_emulation_through_forward_and_backward(monkeypatch):
    # torch._scaled_mm also runs on CPU here, so the native branch (operand layouts,
    # transposes, scale arguments) is exercised end to end without a GPU.
    import mixprec.fp8.linear as linear_mod

    calls = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)

    torch.manual_seed(0)
    emulated = Fp8Linear(64, 48, recipe=CurrentScaling(), emulate=True)
    native = copy.deepcopy(emulated)
    native.emulate = None
    monkeypatch.setattr(linear_mod, "native_fp8_available", lambda device=None: True)
    monkeypatch.setattr(torch, "_scaled_mm", counting)
    x = torch.randn(32, 64, generator=gen(7))
    g = torch.randn(32, 48, generator=gen(8))
    xs = [x.clone().requires_grad_() for _ in range(2)]
    for layer, xi in zip((emulated, native), xs, strict=True):
        layer(xi).backward(g)
    assert calls == [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e5m2]  # fwd, dgrad, wgrad
    for a, b in [(xs[0].grad, xs[1].grad), (emulated.weight.grad, native.weight.grad)]:
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(emulated.fp8_scale, native.fp8_scale)


def test_native_gemm_falls_back_to_emulation_for_shapes_it_cannot_take():
    a = torch.randn(8, 24).to(torch.float8_e4m3fn)  # inner dim 24: not a multiple of 16
    b = torch.randn(24, 16).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    assert torch.equal(
        scaled_mm(a, b, one, one, torch.float32, native=True), scaled_mm(a, b, one, one, torch.float32)
    )


@pytest.mark.skipif(
    not native_fp8_available(), reason="needs a CUDA GPU with native fp8 GEMMs (compute capability >= 8.9)"
)
def test_native_cuda_fp8_linear_matches_emulation():
    torch.manual_seed(0)
    emulated = Fp8Linear(128, 64, recipe=CurrentScaling(), emulate=True).cuda()
    native = copy.deepcopy(emulated)
    native.emulate = None
    x = torch.randn(256, 128, device="cuda")
    g = torch.randn(256, 64, device="cuda")
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = []
    for layer, xi in zip((emulated, native), xs, strict=True):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(xi)
        y.backward(g.bfloat16())
        outs.append(y.float())
    assert torch.allclose(outs[0], outs[1], rtol=1e-2, atol=1e-2)
    assert torch.allclose(xs[0].grad, xs[1].grad, rtol=1e-4, atol=1e-5)
    assert torch.allclose(emulated.weight.grad, native.weight.grad, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- conversion


def _mlp(seed: int = 0, out: int = 16) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, out)
    )


def test_convert_swaps_eligible_linears_keeping_parameters_and_keys():
    model = _mlp(out=10)
    params = [p for p in model.parameters()]
    keys = set(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    converted = convert_to_fp8(model, DelayedScaling(amax_history_len=8))
    assert converted is model
    assert [type(m).__name__ for m in model] == ["Fp8Linear", "GELU", "Fp8Linear", "GELU", "Linear"]
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert set(model.state_dict()) == keys | {f"{i}.{b}" for i in (0, 2) for b in ("fp8_scale", "fp8_amax_history")}
    assert model[0].fp8_amax_history.shape == (3, 8)
    before = model[0].weight.detach().clone()
    model(torch.randn(4, 32)).sum().backward()
    opt.step()  # the optimizer built before conversion still updates the same Parameters
    assert not torch.equal(before, model[0].weight)


def test_module_filter_keeps_named_layers_and_root_and_shared_linears_convert():
    model = convert_to_fp8(_mlp(), module_filter=lambda name, mod: name not in {"0", "4"})
    assert sorted(fp8_layers(model)) == ["2"]
    root = convert_to_fp8(torch.nn.Linear(16, 16))
    assert isinstance(root, Fp8Linear)
    shared = torch.nn.Linear(16, 16)
    twice = convert_to_fp8(torch.nn.Sequential(shared, torch.nn.ReLU(), shared))
    assert isinstance(twice[0], Fp8Linear) and twice[0] is twice[2]
    mha = torch.nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, batch_first=True)
    convert_to_fp8(mha)
    assert sorted(fp8_layers(mha)) == ["linear1", "linear2"]  # out_proj is a Linear subclass


def test_convert_rejects_bad_arguments_with_clear_errors():
    with pytest.raises(
        TypeError,
        match=re.escape(
            "convert_to_fp8(recipe='hybrid'): expected a mixprec.fp8.DelayedScaling or "
            "CurrentScaling instance, e.g. DelayedScaling(fmt='hybrid')"
        ),
    ):
        convert_to_fp8(_mlp(), "hybrid")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=re.escape("convert_to_fp8(emulate='yes'): expected None (automatic), True or False")):
        convert_to_fp8(_mlp(), emulate="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=re.escape("Fp8Linear(recipe='e4m3'): expected a mixprec.fp8.DelayedScaling")):
        Fp8Linear(16, 16, recipe="e4m3")  # type: ignore[arg-type]


@pytest.mark.skipif(native_fp8_available(), reason="this machine has native fp8 GEMMs")
def test_emulate_false_without_fp8_gemm_is_a_clear_error():
    message = (
        "convert_to_fp8(emulate=False) needs native fp8 GEMMs (torch._scaled_mm on a CUDA GPU "
        "of compute capability >= 8.9, e.g. Ada or Hopper), and this machine has none; "
        "pass emulate=None to emulate fp8 where the hardware lacks it"
    )
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
        convert_to_fp8(_mlp(), DelayedScaling(), emulate=False)


def test_fp8_state_is_checkpointed_and_resumes_exactly():
    recipe = DelayedScaling(amax_history_len=4)
    model = convert_to_fp8(_mlp(), recipe)
    for i in range(3):
        model(torch.randn(8, 32, generator=gen(i))).square().mean().backward()
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    restored = convert_to_fp8(_mlp(seed=1), recipe)
    restored.load_state_dict(torch.load(buf, weights_only=True))
    for a, b in zip(fp8_layers(model).values(), fp8_layers(restored).values(), strict=True):
        assert torch.equal(a.fp8_scale, b.fp8_scale) and torch.equal(a.fp8_amax_history, b.fp8_amax_history)
    x = torch.randn(8, 32, generator=gen(9))
    assert torch.equal(model(x), restored(x))


def test_a_checkpoint_of_the_unconverted_model_loads_strictly():
    plain = _mlp(seed=3)
    converted = convert_to_fp8(_mlp(seed=4))
    converted.load_state_dict(plain.state_dict())  # strict: fp8 state starts fresh
    assert torch.equal(converted[0].weight, plain[0].weight)
    assert converted[0].fp8_scale.tolist() == [1.0, 1.0, 1.0]


def test_fp8_state_moves_with_to_but_stays_fp32():
    layer = Fp8Linear(16, 16)
    _iterate(layer, _input_with_amax(1.25))
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16
    assert layer.fp8_scale.dtype == torch.float32 and layer.fp8_amax_history.dtype == torch.float32
    assert layer.fp8_amax_history[INPUT, 0].item() == 1.25  # not rounded through bf16
    assert layer(torch.randn(2, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_stats_reports_every_layer_and_kind():
    model = convert_to_fp8(_mlp())
    model(torch.randn(8, 32)).sum().backward()
    s = stats(model)
    assert sorted(s) == ["0", "2", "4"]
    for per_kind in s.values():
        assert sorted(per_kind) == ["grad_output", "input", "weight"]
        for v in per_kind.values():
            assert sorted(v) == ["amax", "saturation", "scale", "underflow"]
            assert 0.0 <= v["saturation"] <= 1.0 and 0.0 <= v["underflow"] <= 1.0
    assert s["0"]["input"]["amax"] > 0 and s["0"]["grad_output"]["amax"] > 0
    assert stats(torch.nn.Linear(3, 3)) == {}


def test_all_reduce_amax_is_a_no_op_without_distributed():
    model = convert_to_fp8(_mlp())
    model(torch.randn(4, 32)).sum().backward()
    before = model[0].fp8_amax_history.clone()
    all_reduce_amax(model)
    assert torch.equal(before, model[0].fp8_amax_history)


def _all_reduce_rank(rank: int, world_size: int, out_dir: str) -> None:
    from mixprec.fp8 import DelayedScaling, Fp8Linear, all_reduce_amax

    torch.manual_seed(0)
    model = torch.nn.Sequential(Fp8Linear(16, 16, recipe=DelayedScaling(amax_history_len=4)))
    x = torch.full((2, 16), 0.5 * (rank + 1))
    model(x).sum().backward()
    all_reduce_amax(model)
    torch.save(model[0].fp8_amax_history.clone(), f"{out_dir}/rank{rank}.pt")


@pytest.mark.distributed
def test_all_reduce_amax_takes_the_max_over_ranks(tmp_path):
    run_ranks(_all_reduce_rank, 2, str(tmp_path))
    h0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    h1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert torch.equal(h0, h1)
    assert h0[INPUT].tolist() == [1.0, 0.0, 0.0, 0.0]


# --------------------------------------------------------------------------- training


def _train(model: torch.nn.Module, steps: int, wrap: Callable[[], object]) -> list[float]:
    x = torch.randn(256, 32, generator=gen(10))
    teacher = _mlp(seed=99)
    with torch.no_grad():
        y = teacher(x)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        with wrap():  # type: ignore[attr-defined]
            loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=16), CurrentScaling()], ids=["delayed", "current"])
def test_small_model_trains_under_fp8_close_to_bf16_autocast(recipe):
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    ref = _train(_mlp(seed=0), 60, bf16)
    fp8_model = convert_to_fp8(_mlp(seed=0), recipe, emulate=True)
    assert len(fp8_layers(fp8_model)) == 3
    got = _train(fp8_model, 60, bf16)
    assert ref[-1] < 0.2 * ref[0] and got[-1] < 0.2 * got[0], (ref[::10], got[::10])
    assert abs(got[-1] - ref[-1]) <= 0.1 * ref[-1], (ref[-1], got[-1])


# --------------------------------------------------------------------------- non-finite values


def _layer_and_input(**kwargs: object) -> tuple[Fp8Linear, torch.Tensor]:
    torch.manual_seed(0)
    layer = Fp8Linear(16, 16, recipe=DelayedScaling(amax_history_len=4), **kwargs)  # type: ignore[arg-type]
    _iterate(layer, _input_with_amax(2.0))  # a clean first iteration: a real history
    return layer, _input_with_amax(1.0, seed=1)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_input_is_not_saturated_it_reaches_the_loss_and_sets_the_flag(bad):
    layer, x = _layer_and_input()
    assert not layer.fp8_nonfinite
    x[2, 3] = bad
    y = layer(x)
    assert y.isnan().all()  # not a finite output computed from 448 in place of inf
    assert not torch.isfinite(y.sum())
    assert layer.fp8_nonfinite.item() is True
    assert torch.isfinite(layer.fp8_amax_history).all() and torch.isfinite(layer.fp8_scale).all()


def test_a_non_finite_weight_sets_the_flag_and_poisons_the_output():
    layer, x = _layer_and_input()
    with torch.no_grad():
        layer.weight[5, 0] = math.inf
    assert layer(x).isnan().all() and bool(layer.fp8_nonfinite)
    assert layer.fp8_amax_history[WEIGHT, 0].item() == 0.0


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_non_finite_output_gradient_is_not_saturated_and_sets_the_flag(bad):
    layer, x = _layer_and_input()
    x.requires_grad_()
    y = layer(x)
    assert not layer.fp8_nonfinite  # a clean forward
    g = torch.ones_like(y)
    g[0, 0] = bad
    y.backward(g)
    assert x.grad.isnan().all() and layer.weight.grad.isnan().all()
    assert not torch.isfinite(layer.bias.grad).all()
    assert bool(layer.fp8_nonfinite)
    assert layer.fp8_amax_history[GRAD, 0].item() == 0.0 and torch.isfinite(layer.fp8_scale).all()


def test_eval_mode_propagates_but_does_not_flag():
    layer, x = _layer_and_input()
    layer.eval()
    x[0, 0] = math.inf
    with torch.no_grad():
        assert layer(x).isnan().all()
    assert not layer.fp8_nonfinite


def test_nonfinite_flag_is_the_or_of_all_layers_and_reset_clears_it():
    from mixprec.fp8 import nonfinite_flag, reset_nonfinite

    model = convert_to_fp8(_mlp(), DelayedScaling(amax_history_len=4))
    assert nonfinite_flag(torch.nn.Sequential(torch.nn.Linear(3, 3))) is None
    model(torch.randn(4, 32)).sum().backward()
    flag = nonfinite_flag(model)
    assert flag is not None and flag.shape == () and flag.dtype == torch.bool and not flag
    # Only the last layer's output gradient is bad; its NaN input gradient reaches the others.
    h = model[:4](torch.randn(4, 32))
    out = model[4](h)
    out.backward(torch.full_like(out, math.inf))
    assert [bool(m.fp8_nonfinite) for m in fp8_layers(model).values()] == [True, True, True]
    reset_nonfinite(model)
    assert not nonfinite_flag(model)
    with torch.no_grad():
        model[2].weight[0, 0] = math.nan
    model(torch.randn(4, 32))
    # The NaN weight flags its layer, and its NaN output flags the next one downstream.
    assert [bool(m.fp8_nonfinite) for m in fp8_layers(model).values()] == [False, True, True]
    assert nonfinite_flag(model)


def test_nonfinite_flag_needs_no_host_sync():
    from mixprec.fp8 import nonfinite_flag, reset_nonfinite

    model = torch.nn.Sequential(Fp8Linear(16, 16, device="meta"), Fp8Linear(16, 16, device="meta"))
    model(torch.empty(4, 16, device="meta")).sum().backward()
    assert nonfinite_flag(model).device.type == "meta"
    reset_nonfinite(model)


def test_all_mutable_fp8_state_is_in_persistent_buffers_so_restoring_them_undoes_an_iteration():
    # The front door undoes a skipped step by restoring the modules' persistent buffers.
    layer, x = _layer_and_input()
    persistent = set(layer.state_dict()) - {"weight", "bias"}
    assert persistent == {"fp8_scale", "fp8_amax_history"}
    saved = {k: v.clone() for k, v in layer.state_dict().items()}
    twin = copy.deepcopy(layer)
    for seed in range(2):
        _iterate(layer, _input_with_amax(5.0 + seed, seed=seed))
    layer.load_state_dict(saved)
    # Every later result is as if the two iterations had never run.
    x1 = _input_with_amax(3.0, seed=5)
    assert torch.equal(_iterate(layer, x1), _iterate(twin, x1))
    assert torch.equal(layer.fp8_amax_history, twin.fp8_amax_history)
    assert torch.equal(layer.fp8_scale, twin.fp8_scale)


def test_convert_to_fp8_rejects_wrong_types_naming_the_argument():
    cases = [
        (lambda: convert_to_fp8(None), "convert_to_fp8(model=None): expected a torch.nn.Module"),
        (lambda: convert_to_fp8("model"), "convert_to_fp8(model='model'): expected a torch.nn.Module"),
        (lambda: convert_to_fp8(_mlp(), module_filter="head"), "convert_to_fp8(module_filter='head'): expected None or a callable"),
        (lambda: convert_to_fp8(_mlp(), track_stats=1), "convert_to_fp8(track_stats=1): expected True or False"),
        (lambda: Fp8Linear(16, 16, emulate=1), "Fp8Linear(emulate=1): expected None (automatic), True or False"),
        (lambda: Fp8Linear(16, 16, track_stats=None), "Fp8Linear(track_stats=None): expected True or False"),
    ]
    for factory, message in cases:
        with pytest.raises(TypeError, match=f"^{re.escape(message)}"):
            factory()  # type: ignore[arg-type]


# --------------------------------------------------------------------------- plan hooks


def test_plan_hooks_have_safe_defaults():
    from mixprec import get_plan

    model = _mlp()
    for name in ("bf16-mixed", "fp32", "fp16-master"):
        plan = get_plan(name)
        assert plan.before_unscale(model, None) is None
        assert plan.nonfinite_flag(model) is None
        assert plan.after_step(model) is None


def test_fp8_plan_hooks_flag_reset_and_all_reduce():
    from mixprec import get_plan

    plan = get_plan("fp8-mixed")
    model = _mlp()
    plan.convert_model(model)
    assert not plan.nonfinite_flag(model)
    x = torch.randn(4, 32)
    x[0, 0] = math.inf
    model(x).sum().backward()
    history = model[0].fp8_amax_history.clone()
    plan.before_unscale(model, None)  # no process group: the all-reduce is a no-op
    assert torch.equal(history, model[0].fp8_amax_history)
    assert plan.nonfinite_flag(model)
    plan.after_step(model)
    assert not plan.nonfinite_flag(model)


def test_fp8_mixed_front_door_skips_a_step_whose_input_is_inf():
    from mixprec import MixedPrecision

    torch.manual_seed(0)
    mp = MixedPrecision("fp8-mixed")
    model = _mlp()
    model, _ = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert fp8_layers(model)
    x = torch.randn(8, 32, generator=gen(3))
    with mp.autocast():
        loss = model(x).float().square().mean()
    mp.backward(loss)
    assert mp.step().stepped
    weights = [p.detach().clone() for p in model.parameters()]
    x[1, 2] = math.inf
    with mp.autocast():
        loss = model(x).float().square().mean()
    assert not torch.isfinite(loss)  # before: 448 in place of inf gave a finite loss
    mp.backward(loss)
    result = mp.step()
    assert result.skipped and not result.stepped
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))


# --------------------------------------------------------------------------- bf16 GEMMs for the emulation


def test_emulated_gemm_restores_the_math_mode_and_uses_bf16_where_available():
    from mixprec.fp8.gemm import _bf16_math, cpu_bf16_gemm_available, emulated_mm

    before = torch.backends.mkldnn.matmul.fp32_precision
    a = (torch.randn(128, 256, generator=gen(1)) * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(256, 64, generator=gen(2)) * 1e3).to(torch.float8_e5m2)
    emulated_mm(a, b)
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    with pytest.raises(RuntimeError), _bf16_math():
        raise RuntimeError("inside")
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    if cpu_bf16_gemm_available():
        # The mode is real: on values that are not bf16 it rounds them (so it is in effect
        # in the GEMM above, where the fp8 operands are exact bf16 values). On x86 CPUs
        # without bf16 instructions oneDNN leaves fp32 GEMMs in fp32.
        x, y = torch.randn(64, 64, generator=gen(3)), torch.randn(64, 64, generator=gen(4))
        with _bf16_math():
            rounded = x @ y
        assert not torch.allclose(rounded, x @ y, rtol=1e-5, atol=1e-5)
        exact = x.bfloat16().double() @ y.bfloat16().double()
        assert torch.allclose(rounded.double(), exact, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("machine", "avx512_bf16", "amx", "expected"),
    [
        ("x86_64", False, False, False),  # plain AVX512: oneDNN converts in software, slower than fp32
        ("x86_64", True, False, True),
        ("AMD64", False, True, True),
        ("aarch64", False, False, True),  # not x86: oneDNN's own check decides
    ],
)
def test_bf16_instructions_are_read_from_the_cpu_flags(monkeypatch, machine, avx512_bf16, amx, expected):
    import platform

    from mixprec.hardware import cpu_bf16_instructions

    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        pytest.skip("oneDNN has no bf16 on this build or CPU")
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert cpu_bf16_instructions() is expected


@pytest.mark.parametrize(
    ("instructions", "bf16_ms", "takes_effect", "expected"),
    [
        (True, 0.5, True, True),  # AMX / AVX512-BF16 and oneDNN honours the math mode
        (False, 0.5, True, False),  # no bf16 instructions
        (True, 40.0, True, False),  # flags, but bf16 slower than fp32 (ONEDNN_MAX_CPU_ISA=AVX2)
        (True, 0.5, False, False),  # fast bf16, but torch routes fp32 GEMMs past oneDNN (some AMD CPUs)
        (True, None, True, False),  # bf16 did not run
    ],
)
def test_bf16_math_mode_is_used_only_where_it_is_real_and_faster(monkeypatch, instructions, bf16_ms, takes_effect, expected):
    from mixprec import hardware
    from mixprec.fp8 import gemm

    ms = {"fp32": 1.0} if bf16_ms is None else {"fp32": 1.0, "bf16": bf16_ms}
    facts = hardware.DeviceFacts(device_type="cpu", name="test", bf16_instructions=instructions, gemm_size=256, gemm_ms=ms)
    monkeypatch.setattr(gemm, "cpu_bf16_instructions", lambda: instructions)
    monkeypatch.setattr(gemm, "device_facts", lambda device=None: facts)
    monkeypatch.setattr(gemm, "_bf16_math_takes_effect", lambda: takes_effect)
    gemm.cpu_bf16_gemm_available.cache_clear()
    try:
        assert gemm.cpu_bf16_gemm_available() is expected
    finally:
        gemm.cpu_bf16_gemm_available.cache_clear()


def test_bf16_math_mode_probe_matches_what_a_gemm_does():
    from mixprec.fp8.gemm import _bf16_math, _bf16_math_takes_effect

    x, y = torch.randn(64, 64, generator=gen(5)), torch.randn(64, 64, generator=gen(6))
    with _bf16_math():
        rounded = x @ y
    assert _bf16_math_takes_effect() is (not torch.equal(rounded, x @ y))


@pytest.mark.parametrize("fmts", [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e5m2", "e5m2")])
@pytest.mark.parametrize("shape", [(256, 512, 384), (64, 96, 48), (5, 16, 16)])
def test_emulated_gemm_equals_float64_reference_within_fp32_accumulation(fmts, shape):
    from mixprec.fp8.gemm import emulated_mm

    m, k, n = shape
    dtypes = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    # Spread over the whole fp8 range, subnormals included.
    a = (torch.randn(m, k, generator=gen(5)) * 2.0 ** torch.randint(-12, 8, (m, k), generator=gen(6))).to(dtypes[fmts[0]])
    b = (torch.randn(n, k, generator=gen(7)) * 2.0 ** torch.randint(-12, 8, (n, k), generator=gen(8))).to(dtypes[fmts[1]])
    assert torch.isfinite(a.float()).all() and torch.isfinite(b.float()).all()
    ref, mag = _reference(a, b.T, 1.0)
    out = emulated_mm(a, b.t())  # a transposed operand, as in the backward GEMMs
    assert out.dtype == torch.float32
    assert_within(out, ref, k * U32 * mag, f"emulated_mm {fmts} {shape}")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_widening_fp8_by_table_equals_torch_cast_for_every_code_and_layout(dtype):
    from mixprec.fp8.gemm import widen

    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    as_float = codes.float()
    got = widen(codes)
    assert got.dtype == torch.float32
    same = (got == as_float) | (got.isnan() & as_float.isnan())
    assert same.all() and torch.equal(got.signbit(), as_float.signbit())  # -0.0 stays -0.0
    grid = codes[torch.randint(0, 256, (48, 40), generator=gen(9))]
    for view in (grid, grid.t(), grid[::2], grid[:, 3:]):
        expected, actual = view.float(), widen(view)
        assert actual.shape == expected.shape and torch.equal(actual.nan_to_num(), expected.nan_to_num())


def test_fp8_mixed_front_door_skips_a_step_whose_output_gradient_is_inf():
    from mixprec import MixedPrecision

    torch.manual_seed(0)
    mp = MixedPrecision("fp8-mixed")
    model = _mlp()
    model[2] = torch.nn.Linear(64, 64, bias=False)  # no bias gradient to carry the inf past fp8
    model, _ = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    weights = [p.detach().clone() for p in model.parameters()]

    def inject(module, grad_output):
        bad = grad_output[0].clone()
        bad[0, 0] = math.inf
        return (bad,)

    handle = model[2].register_full_backward_pre_hook(inject)
    with mp.autocast():
        loss = model(torch.randn(8, 32, generator=gen(4))).float().square().mean()
    mp.backward(loss)
    handle.remove()
    assert torch.isfinite(loss)
    result = mp.step()  # before: the inf was saturated to 57344 and the step was taken
    assert result.skipped and not result.stepped
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))


def test_the_flag_buffer_is_bool_after_dtype_casts_and_not_checkpointed():
    layer = Fp8Linear(16, 16)
    layer.to(torch.bfloat16)
    layer.half()
    assert layer.fp8_nonfinite.dtype == torch.bool and layer.fp8_nonfinite.shape == ()
    assert "fp8_nonfinite" not in layer.state_dict() and "fp8_stats" not in layer.state_dict()


def test_fp8_plan_leaves_fp32_islands_out_of_fp8():
    from mixprec import MixedPrecision, OpPolicy, get_plan
    from mixprec.fp8 import fp8_layers

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    plan = get_plan("fp8-mixed", policy=OpPolicy(dtype=torch.bfloat16, fp32_modules=("2",)))
    model, opt = MixedPrecision(plan).prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert list(fp8_layers(model)) == ["0"]


def test_the_bf16_gemm_probe_runs_on_real_tensors_when_first_asked_under_fake_tensors(monkeypatch) -> None:
    """The memory estimator runs fp8 layers on fake tensors; when that was the first fp8 GEMM of
    the process, the probe compared fake tensors and failed (DataDependentOutputException)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mixprec.fp8 import gemm

    class _Faster:
        def faster(self, dtype: torch.dtype) -> bool:
            return True

    monkeypatch.setattr(gemm, "cpu_bf16_instructions", lambda: True)
    monkeypatch.setattr(gemm, "device_facts", lambda device: _Faster())
    gemm.cpu_bf16_gemm_available.cache_clear()
    try:
        expected = gemm._bf16_math_takes_effect()
        with FakeTensorMode():
            got = gemm.cpu_bf16_gemm_available()
        assert got == expected
    finally:
        gemm.cpu_bf16_gemm_available.cache_clear()  # measured again, unpatched, when next asked

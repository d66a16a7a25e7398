"""The compiled fp8 quantiser against the eager one: the same codes, widened values and
statistics, bit for bit; and the eager fallback where compilation fails."""

from __future__ import annotations

import pytest
import torch

from mixprec.compiling import compile_works
from mixprec.dtypes import Format
from mixprec.fp8 import quantize, quantize_with_stats
from mixprec.fp8.gemm import widen
from mixprec.fp8.quantize import fused_quantize

pytestmark = pytest.mark.skipif(not compile_works("cpu"), reason="torch.compile does not work on this machine")


@pytest.fixture(autouse=True)
def _fresh_compilations(monkeypatch):
    """Each test compiles its own kernels (nothing left over from other tests' dtypes and
    formats), so every comparison below is of compiled code against eager code."""
    import mixprec.compiling as compiling

    torch._dynamo.reset()
    monkeypatch.setattr(compiling, "_CACHE", {})
    monkeypatch.setattr(compiling, "_KEYS", {})
    yield
    torch._dynamo.reset()


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    wide_range = torch.randn(64, 96, generator=gen) * torch.logspace(-12, 6, 96)  # saturates and flushes
    with_zeros = torch.randn(33, 17, generator=gen)
    with_zeros[::3] = 0
    every_bf16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    every_bf16 = every_bf16[torch.isfinite(every_bf16)].reshape(-1, 2)  # all finite bf16 values, as 2-d
    return [t.to(dtype) for t in (wide_range, with_zeros, every_bf16, torch.zeros(0, 8))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.E5M2])
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.0e4])
def test_fused_quantize_equals_the_eager_quantiser_bit_for_bit(dtype, fmt, scale):
    s = torch.tensor(scale)
    graphs = _graphs()
    for x in _inputs(dtype):
        finite = torch.isfinite(x).all()
        q, wide, fractions = fused_quantize(x, s, fmt, finite=finite, stats=True)
        if x.numel():
            assert _graphs() > graphs, "the quantiser did not run compiled"
        ref, ref_fractions = quantize_with_stats(x, s, fmt, finite=finite)
        assert q.data.dtype == fmt.dtype and torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(q.inv_scale, ref.inv_scale)
        assert wide.dtype == torch.float32 and torch.equal(wide, widen(ref.data))
        assert torch.equal(fractions, ref_fractions), (fractions, ref_fractions)
        q2, wide2, none = fused_quantize(x, s, fmt, finite=finite, stats=False)
        assert none is None and torch.equal(q2.data.view(torch.uint8), quantize(x, s, fmt).data.view(torch.uint8))
        assert torch.equal(wide2, wide)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_fused_quantize_of_a_non_finite_tensor_is_all_nan(bad):
    x = torch.randn(16, 16).bfloat16()
    x[3, 4] = bad
    finite = torch.isfinite(x).all()
    q, wide, _ = fused_quantize(x, torch.tensor(1.0), Format.E4M3, finite=finite, stats=True)
    assert torch.isnan(wide).all() and torch.isnan(q.data.float()).all()
    eager = quantize(x, torch.tensor(1.0), Format.E4M3, finite=finite)
    assert torch.equal(q.data.view(torch.uint8), eager.data.view(torch.uint8))  # the same NaN code


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_tensor_with_zeros_reports_no_underflow_and_no_saturation(bad):
    """Its zeros become NaN codes with everything else: nothing is flushed (was a negative fraction)."""
    x = torch.randn(8, 8)
    x[0, :4] = 0.0
    x[5, 5] = bad
    finite = torch.isfinite(x).all()
    _, eager = quantize_with_stats(x, torch.tensor(1.0), Format.E4M3, finite=finite)
    _, _, fused = fused_quantize(x, torch.tensor(1.0), Format.E4M3, finite=finite, stats=True)
    assert torch.equal(eager, torch.zeros(2)) and torch.equal(fused, eager), (eager, fused)


def test_fused_quantize_falls_back_to_eager_when_compilation_fails(monkeypatch):
    import sys

    import mixprec.compiling as compiling

    quantize_module = sys.modules["mixprec.fp8.quantize"]  # the package exports a function of that name
    gemm_module = sys.modules["mixprec.fp8.gemm"]

    def failing(*args, **kwargs):
        raise torch._dynamo.exc.TorchDynamoException("no C++ compiler found")

    monkeypatch.setattr(compiling, "_FAILED", set())
    monkeypatch.setitem(compiling._CACHE, quantize_module._fused, failing)
    monkeypatch.setitem(compiling._CACHE, gemm_module._to_float, failing)
    x = torch.randn(8, 8) * 100
    with pytest.warns(RuntimeWarning, match="torch.compile is unavailable on cpu"):
        q, wide, fractions = fused_quantize(x, torch.tensor(1.0), Format.E4M3, finite=torch.tensor(True), stats=True)
    ref, ref_fractions = quantize_with_stats(x, torch.tensor(1.0), Format.E4M3)
    assert torch.equal(wide, widen(ref.data)) and torch.equal(fractions, ref_fractions)
    assert not compile_works("cpu")  # remembered: later calls go eager without trying


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_compiled_widening_equals_the_table_for_every_code(dtype):
    from mixprec.fp8.gemm import _widen_by_table

    codes = torch.arange(256, dtype=torch.uint8).repeat(300).reshape(300, 256).view(dtype)
    graphs = _graphs()
    got, want = widen(codes), _widen_by_table(codes)
    assert _graphs() > graphs, "the widening did not run compiled"
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    transposed = widen(codes.t())  # a transposed view widens through its base
    assert torch.equal(transposed.nan_to_num(0.0), want.t().nan_to_num(0.0))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_compiled_gemm_epilogue_rounds_once_like_the_eager_one(out_dtype, with_bias):
    from mixprec.fp8.gemm import _epilogue, _epilogue_in_place

    gen = torch.Generator().manual_seed(1)
    acc = torch.randn(512, 384, generator=gen) * 100
    scale = torch.tensor(0.3712)
    bias = torch.randn(384, generator=gen) if with_bias else None
    eager = acc.clone().mul_(scale)
    if bias is not None:
        eager.add_(bias.to(out_dtype))
    from mixprec.compiling import call_compiled

    low_bias = None if bias is None else bias.to(out_dtype)
    graphs = _graphs()
    got = call_compiled(_epilogue, acc, scale, low_bias, out_dtype)
    assert _graphs() > graphs, "the epilogue did not run compiled"
    assert got.dtype == out_dtype and torch.equal(got, eager.to(out_dtype))
    fallback = _epilogue_in_place(acc.clone(), scale, low_bias, out_dtype)  # what runs where nothing compiles
    assert torch.equal(fallback, got)


@pytest.mark.parametrize("autocast", [False, True])
def test_fp8_linear_is_bit_identical_with_and_without_the_compiled_kernels(autocast, monkeypatch):
    """Forward, input / weight / bias gradients, scales, amax histories and statistics of
    two training iterations: the compiled kernels change no bit of any of them."""
    import mixprec.compiling as compiling
    from mixprec.fp8 import DelayedScaling, Fp8Linear

    def run() -> list[torch.Tensor]:
        torch.manual_seed(0)
        layer = Fp8Linear(96, 80, recipe=DelayedScaling(amax_history_len=4))
        out: list[torch.Tensor] = []
        for step in range(2):
            x = (torch.randn(4, 33, 96) * 10 ** (step - 1)).requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = layer(x)
            (y.float() * torch.linspace(-3, 3, 80)).sum().backward()
            out += [y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()]
            out += [layer.fp8_scale.clone(), layer.fp8_amax_history.clone(), layer.fp8_stats.clone()]
        return out

    graphs = _graphs()
    compiled = run()
    assert _graphs() > graphs, "the fp8 layer ran no compiled kernel"
    monkeypatch.setattr(compiling, "compiles_for", lambda x: False)
    eager = run()
    for i, (a, b) in enumerate(zip(compiled, eager, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), i


def test_many_dtype_and_format_combinations_all_run_compiled_and_the_rest_eagerly(monkeypatch):
    """More combinations than dynamo's recompile limit (8 per function): each of the first
    MAX_SPECIALISATIONS compiles (none silently runs uncompiled), later ones run eagerly;
    all give the eager quantiser's bits."""
    import sys

    import mixprec.compiling as compiling
    from mixprec.fp8.gemm import _widen_by_table

    monkeypatch.setattr(compiling, "MAX_SPECIALISATIONS", 10)
    # the eager fallback's widening by table, so that only the quantiser may compile here
    monkeypatch.setattr(sys.modules["mixprec.fp8.quantize"], "widen", _widen_by_table)
    combos = [
        (dtype, fmt, stats, shape)
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
        for fmt in (Format.E4M3, Format.E5M2)
        for stats in (False, True)
        for shape in ((7, 5), (1, 9))
    ]
    assert len(combos) > 10 > 8
    for n, (dtype, fmt, stats, shape) in enumerate(combos):
        x = (torch.randn(shape, generator=torch.Generator().manual_seed(n)) * 300).to(dtype)
        graphs = _graphs()
        q, wide, fractions = fused_quantize(x, torch.tensor(0.5), fmt, finite=torch.tensor(True), stats=stats)
        compiled = _graphs() > graphs
        assert compiled == (n < 10), (n, compiled)
        ref = quantize_with_stats(x, torch.tensor(0.5), fmt)[0] if stats else quantize(x, torch.tensor(0.5), fmt)
        assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8))


def test_mixprec_compile_environment_variable(monkeypatch):
    """MIXPREC_COMPILE=0 turns the automatic compilation off (the eager quantiser runs, same
    bits); a value it does not understand is an error naming it and the fix."""
    monkeypatch.setenv("MIXPREC_COMPILE", "0")
    assert not compile_works("cpu")
    x = torch.randn(8, 8) * 100
    graphs = _graphs()
    q, wide, _ = fused_quantize(x, torch.tensor(1.0), Format.E4M3, finite=torch.tensor(True), stats=False)
    assert _graphs() == graphs and torch.equal(wide, widen(quantize(x, torch.tensor(1.0), Format.E4M3).data))
    monkeypatch.setenv("MIXPREC_COMPILE", "sometimes")
    with pytest.raises(ValueError, match=r"MIXPREC_COMPILE='sometimes' is not understood: set it to 0"):
        compile_works("cpu")
    monkeypatch.setenv("MIXPREC_COMPILE", "1")
    assert compile_works("cpu")


@pytest.mark.parametrize("build", ["session", "optimizer"])
def test_a_bad_mixprec_compile_is_refused_when_built_not_mid_training(monkeypatch, build):
    """MIXPREC_COMPILE is otherwise read at the first compilation (the first Kahan step, the
    first fp8 forward): MixedPrecision and a Kahan / stochastic-rounding optimizer with
    compile="auto" refuse it when built. Where it cannot matter (compile=True/False, a
    round-to-nearest store, which "auto" never compiles, a plan looked up) nothing refuses it."""
    import mixprec
    from mixprec.optim import KahanOptimizer, LowPrecisionOptimizer

    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    monkeypatch.setenv("MIXPREC_COMPILE", "sometimes")
    with pytest.raises(ValueError, match=r"MIXPREC_COMPILE='sometimes' is not understood: set it to 0"):
        if build == "session":
            mixprec.MixedPrecision("bf16-mixed")
        else:
            KahanOptimizer(torch.optim.AdamW(model.parameters()), compile="auto")
    for compile in (True, False):
        KahanOptimizer(torch.optim.AdamW(model.parameters()), compile=compile)
    LowPrecisionOptimizer(torch.optim.AdamW(model.parameters()), compile="auto")
    assert mixprec.get_plan("bf16-kahan").explain()
    monkeypatch.setenv("MIXPREC_COMPILE", "0")
    mixprec.MixedPrecision("bf16-kahan")
    KahanOptimizer(torch.optim.AdamW(model.parameters()), compile="auto")

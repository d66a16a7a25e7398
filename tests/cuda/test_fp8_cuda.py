"""fp8 on a CUDA GPU: the native GEMM (``torch._scaled_mm``) against the exact emulation and a
float64 reference of the same quantised values, SQNR floors against bf16, a short fp8
training run, and an fp8 layer step that never synchronises with the host."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from mixprec.dtypes import Format
from mixprec.fp8 import (
    CurrentScaling,
    DelayedScaling,
    Fp8Linear,
    convert_to_fp8,
    fp8_layers,
    native_fp8_available,
    quantize,
    scaled_mm,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

needs_fp8 = pytest.mark.skipif(
    not native_fp8_available(), reason="needs a CUDA GPU with native fp8 GEMMs (compute capability >= 8.9)"
)

U32 = 2.0**-24  # unit roundoff of fp32
# fp8 tensor cores do not keep a full fp32 mantissa while they add products inside one
# MMA (about 14 bits on Hopper); cuBLAS without fast accumulation promotes the partial sums
# into fp32 registers regularly. Each addition is therefore charged 2**-13 of the running
# magnitude: a bound that still fails by orders of magnitude for a wrong scale, a wrong
# operand layout or a transposed operand.
U_FP8_MMA = 2.0**-13
SQNR_FLOOR_DB = 20.0  # fp8 against a bf16 computation, as tests/test_fp8.py


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sqnr_db(ref: torch.Tensor, actual: torch.Tensor) -> float:
    ref, actual = ref.double().cpu(), actual.double().cpu()
    noise = (ref - actual).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(ref.norm().item() / noise)


def assert_within(actual: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """|actual - ref| <= bound elementwise; on failure, report where the worst violation is."""
    actual = actual.double().cpu()
    err = (actual - ref).abs()
    excess = err - bound
    if (excess > 0).any():
        idx = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
        raise AssertionError(
            f"{what}: |actual - ref| exceeds the bound at {idx}: actual={actual[idx].item()!r} "
            f"ref={ref[idx].item()!r} err={err[idx].item():.3e} bound={bound[idx].item():.3e}"
        )


def _quantised(shape: tuple[int, int], fmt: Format, seed: int, spread: float = 3.0):
    x = (torch.randn(*shape, generator=gen(seed)) * spread).cuda()
    scale = (fmt.max / x.abs().max()).float()
    return quantize(x, scale, fmt)


# The three GEMMs of an fp8 linear layer: (name, a's format, b's format, a transposed?).
GEMMS = [
    pytest.param(Format.E4M3, Format.E4M3, False, id="forward-e4m3xe4m3"),
    pytest.param(Format.E5M2, Format.E4M3, False, id="dgrad-e5m2xe4m3"),
    pytest.param(Format.E5M2, Format.E4M3, True, id="wgrad-e5m2Txe4m3"),
]


@needs_fp8
@pytest.mark.parametrize(("fmt_a", "fmt_b", "transposed_a"), GEMMS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32-out", "bf16-out"])
def test_native_gemm_against_float64_reference_and_emulation(
    fmt_a: Format, fmt_b: Format, transposed_a: bool, out_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    m, k, n = 64, 96, 48
    qa = _quantised((k, m) if transposed_a else (m, k), fmt_a, seed=1)
    qb = _quantised((k, n), fmt_b, seed=2)
    a = qa.data.t() if transposed_a else qa.data  # a strided view, as the weight-gradient GEMM passes
    calls = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    native = scaled_mm(a, qb.data, qa.inv_scale, qb.inv_scale, out_dtype, native=True)
    emulated = scaled_mm(a, qb.data, qa.inv_scale, qb.inv_scale, out_dtype, native=False)
    assert calls == [fmt_a.dtype], "the native GEMM did not run"
    assert native.dtype == emulated.dtype == out_dtype and native.device.type == "cuda"

    a64, b64 = a.double().cpu(), qb.data.double().cpu()
    inv = qa.inv_scale.double().item() * qb.inv_scale.double().item()
    ref, mag = (a64 @ b64) * inv, (a64.abs() @ b64.abs()) * abs(inv)
    # fp32 result c within acc of ref; a bf16 output rounds c once more: |bf16(c) - c| <= 2**-8 |c|.
    rounding = 0.0 if out_dtype == torch.float32 else 2.0**-8
    for actual, u, what in ((emulated, U32, "emulated on cuda"), (native, U_FP8_MMA, "torch._scaled_mm")):
        acc = (k + 3) * u * mag
        assert_within(actual, ref, acc + rounding * (ref.abs() + acc), what)
    floor = 45.0 if out_dtype == torch.bfloat16 else 60.0
    assert sqnr_db(ref, native) >= floor


@needs_fp8
def test_native_gemm_with_bias_adds_it_after_the_gemm() -> None:
    """torch._scaled_mm refuses a bias with an fp32 output: mixprec adds it afterwards, in the output dtype."""
    qa, qb = _quantised((32, 64), Format.E4M3, 3), _quantised((64, 32), Format.E4M3, 4)
    bias = torch.randn(32, generator=gen(5)).cuda()
    for out_dtype in (torch.float32, torch.bfloat16):
        with_bias = scaled_mm(qa.data, qb.data, qa.inv_scale, qb.inv_scale, out_dtype, bias, native=True)
        without = scaled_mm(qa.data, qb.data, qa.inv_scale, qb.inv_scale, out_dtype, native=True)
        assert torch.equal(with_bias, without + bias.to(out_dtype))


@needs_fp8
@pytest.mark.parametrize("recipe", [CurrentScaling(), DelayedScaling(amax_history_len=4)], ids=["current", "delayed"])
def test_native_linear_matches_emulated_linear_and_bf16(recipe) -> None:
    """The same layer through the native and the emulated GEMM: same scales, same
    quantised values, results within the accumulation bound of each other, and both
    within the SQNR floor of a bf16 linear."""
    m, k, n = 128, 256, 128
    torch.manual_seed(0)
    emulated = Fp8Linear(k, n, recipe=recipe, emulate=True).cuda()
    native = copy.deepcopy(emulated)
    native.emulate = False
    x = torch.randn(m, k, generator=gen(5)).cuda()
    g = (torch.randn(m, n, generator=gen(6)) * 1e-2).cuda()
    results = {}
    for name, layer in (("emulated", emulated), ("native", native)):
        for _ in range(2):  # the second iteration runs with non-trivial delayed scales
            layer.zero_grad()
            xi = x.clone().requires_grad_()
            y = layer(xi)
            y.backward(g)
        results[name] = (y.detach(), xi.grad, layer.weight.grad.clone())
    assert torch.equal(emulated.fp8_scale, native.fp8_scale)  # the scales of the last iteration
    native.fold_pending()  # the native layer's fused cast keeps its last amaxes pending until then
    assert torch.equal(emulated.fp8_amax_history, native.fp8_amax_history)
    for (e, nat), what in zip(zip(results["emulated"], results["native"], strict=True), ("forward", "grad_input", "grad_weight"), strict=True):
        assert sqnr_db(e, nat) >= 60.0, what

    xb = x.bfloat16().requires_grad_()
    wb = emulated.weight.detach().bfloat16().requires_grad_()
    yb = F.linear(xb, wb, emulated.bias.detach().bfloat16())
    yb.backward(g.bfloat16())
    y, gx, gw = results["native"]
    floors = {
        "forward": sqnr_db(yb.float(), y),
        "grad_input": sqnr_db(xb.grad.float(), gx),
        "grad_weight": sqnr_db(wb.grad.float(), gw),
    }
    assert all(v >= SQNR_FLOOR_DB for v in floors.values()), floors


def _mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)
    ).cuda()


def _train(model: torch.nn.Module, steps: int) -> list[float]:
    x = torch.randn(256, 32, generator=gen(10)).cuda()
    with torch.no_grad():
        y = _mlp(seed=99)(x)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@needs_fp8
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=16), CurrentScaling()], ids=["delayed", "current"])
def test_short_native_fp8_training_run_is_close_to_bf16_autocast(recipe) -> None:
    ref = _train(_mlp(seed=0), 60)
    fp8_model = convert_to_fp8(_mlp(seed=0), recipe, emulate=False)  # native or an error, never emulated
    assert len(fp8_layers(fp8_model)) == 3
    got = _train(fp8_model, 60)
    assert ref[-1] < 0.2 * ref[0] and got[-1] < 0.2 * got[0], (ref[::10], got[::10])
    assert abs(got[-1] - ref[-1]) <= 0.1 * ref[-1], (ref[-1], got[-1])


@contextlib.contextmanager
def _sync_forbidden() -> Iterator[None]:
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@pytest.mark.parametrize("recipe", [CurrentScaling(), DelayedScaling(amax_history_len=4)], ids=["current", "delayed"])
def test_fp8_layer_forward_and_backward_never_synchronise(recipe) -> None:
    """Amax, scale selection, quantisation, statistics and the GEMMs all stay on the device
    (native GEMM where the GPU has one, the emulation elsewhere)."""
    layer = Fp8Linear(64, 32, recipe=recipe).cuda()
    x = torch.randn(48, 64, generator=gen(1)).cuda().requires_grad_()
    g = torch.randn(48, 32, generator=gen(2)).cuda()
    layer(x).backward(g)  # warm-up: lazy initialisation of kernels and handles
    torch.cuda.synchronize()
    for _ in range(3):
        with _sync_forbidden():
            y = layer(x)
            y.backward(g)
    assert torch.isfinite(layer.weight.grad).all()


# --------------------------------------------------------------------------- the fused cast (#44)

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


def _cast_slots():
    from mixprec.fp8.fused import CastSlots

    return CastSlots(torch.full((), -1.0, device="cuda"), torch.zeros((), dtype=torch.bool, device="cuda"),
                     torch.zeros(2, device="cuda"), torch.zeros(8, dtype=torch.int32, device="cuda"))


@needs_triton
@pytest.mark.parametrize(("exact", "fmt"), [(False, Format.E4M3), (False, Format.E5M2), (True, Format.E4M3)],
                         ids=["cvt-e4m3", "cvt-e5m2", "integer-rounding-e4m3"])
def test_triton_cast_on_the_gpu_equals_the_eager_quantiser(exact, fmt, monkeypatch) -> None:
    """The compiled kernels, both roundings (the GPU's conversion instruction, the integer
    arithmetic the interpreter checks on CPU): codes, transposed codes, 1/scale, amax and
    statistics bit for bit; the column sums within fp32 rounding."""
    from mixprec.fp8 import fused, quantize_with_stats

    monkeypatch.setattr(fused, "EXACT", exact)
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[torch.isfinite(every)].reshape(-1, 128).cuda()
    wide = (torch.randn(1000, 3000, generator=gen(7)) * torch.logspace(-12, 6, 3000)).cuda()
    launches = fused.LAUNCHES["fp8_cast"]
    for x in (every, wide, wide.bfloat16(), wide[:, :500].t()):
        for scale in (1.0, 0.37, 3.0e4):
            s = torch.tensor(scale, device="cuda")
            slots = _cast_slots()
            data, data_t, inv, _, sums = fused.fused_cast(x, s, fmt, slots, cols=True, stats=True, dbias=True,
                                                          backend="triton")
            q, stats = quantize_with_stats(x, s, fmt)
            assert torch.equal(data.view(torch.uint8), q.data.view(torch.uint8)), (x.shape, x.dtype, scale)
            assert torch.equal(data_t.view(torch.uint8), q.data.view(torch.uint8).t())
            assert torch.equal(inv, q.inv_scale) and torch.equal(slots.stats, stats)
            assert torch.equal(slots.pending, x.float().abs().amax())
            assert not slots.scratch.any()
            ref = x.double().sum(0)
            assert ((sums.double() - ref).abs() <= 1e-5 * x.double().abs().sum(0) + 1e-30).all()
    assert fused.LAUNCHES["fp8_cast"] > launches  # the kernels ran, not the torch implementation


@needs_fp8
@needs_triton
@pytest.mark.parametrize(("recipe", "autocast"), [(DelayedScaling(amax_history_len=4), True), (CurrentScaling(), False)],
                         ids=["delayed-bf16-autocast", "current-fp32"])
def test_fused_native_linear_equals_the_eager_native_one(recipe, autocast) -> None:
    """The same fp8 GEMMs on the same codes (the fused cast's transposes are the bytes the
    eager path copies into column-major): outputs and input and weight gradients bit for
    bit, the bias gradient within fp32 rounding, the same histories."""
    torch.manual_seed(0)
    eager = Fp8Linear(256, 128, recipe=recipe, cast="eager", emulate=False).cuda()
    fused_layer = copy.deepcopy(eager)
    fused_layer.cast = "triton"
    for it in range(3):
        x = (torch.randn(128, 256, generator=gen(20 + it)) * 4.0**it).cuda()
        g = (torch.randn(128, 128, generator=gen(30 + it)) * 1e-3).cuda()
        out = []
        for layer in (eager, fused_layer):
            layer.zero_grad()
            xi = x.clone().requires_grad_()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                y = layer(xi)
            y.backward(g.to(y.dtype))
            out.append((y.detach(), xi.grad, layer.weight.grad.clone(), layer.bias.grad.clone()))
        (ye, gxe, gwe, gbe), (yf, gxf, gwf, gbf) = out
        assert torch.equal(ye, yf) and torch.equal(gxe, gxf) and torch.equal(gwe, gwf), it
        torch.testing.assert_close(gbf, gbe, rtol=1e-5, atol=1e-6)
    fused_layer.fold_pending()
    assert torch.equal(eager.fp8_amax_history, fused_layer.fp8_amax_history)


def _cuda_kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@needs_fp8
@needs_triton
def test_a_fused_layer_step_is_three_casts_three_gemms_and_one_update_for_all_layers() -> None:
    """Steady state, delayed scaling: per layer forward + backward three cast kernels (no amax
    pass), three _scaled_mm calls, and no copy of a transposed fp8 operand; the per-step
    update of all layers launches as many kernels for eight layers as for two."""
    from mixprec.fp8 import update_scales

    def model(layers: int) -> torch.nn.Sequential:
        return torch.nn.Sequential(*(Fp8Linear(256, 256, cast="triton", scale_update="step") for _ in range(layers))).cuda()

    one = model(1)
    x = torch.randn(256, 256, device="cuda", requires_grad=True)

    def step(m: torch.nn.Module) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = m(x)
        y.backward(torch.ones_like(y))
        update_scales(m)

    for _ in range(3):
        step(one)
    calls: list[str] = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append("mm")
        return real(*args, **kwargs)

    names = _cuda_kernels(lambda: step(one))
    casts = sum("_cast_kernel" in n for n in names)
    amaxes = sum("_amax_kernel" in n for n in names)
    copies = [n for n in names if "copy" in n.lower() and "float8" in n.lower()]
    assert casts == 3 and amaxes == 0 and not copies, (casts, amaxes, len(names), names)
    torch._scaled_mm = counting
    try:
        step(one)
    finally:
        torch._scaled_mm = real
    assert len(calls) == 3

    counts = {}
    for layers in (2, 8):
        m = model(layers)
        for _ in range(2):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = m(x)
            y.backward(torch.ones_like(y))
        counts[layers] = len(_cuda_kernels(lambda m=m: update_scales(m)))
    assert counts[2] == counts[8], counts

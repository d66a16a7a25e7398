"""The fused fp8 cast (mixprec.fp8.fused) against the eager quantiser, and Fp8Linear with it.

Both implementations of the cast run on CPU: "compile" (torch ops, compiled) and "triton"
(the Triton kernels, through Triton's interpreter). The interpreter runs a kernel only when
Triton was first imported with ``TRITON_INTERPRET=1``; in a process that imported Triton
without it (``torch.compile`` does), the Triton tests run in a subprocess of pytest with
the variable set (``test_triton_kernels_under_the_interpreter``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixprec.compiling import compile_works
from mixprec.dtypes import Format
from mixprec.fp8 import (
    CurrentScaling,
    DelayedScaling,
    Fp8Linear,
    compute_scale,
    quantize_with_stats,
    update_scales,
)
from mixprec.fp8 import fused as F

HAS_TRITON = importlib.util.find_spec("triton") is not None
IN_SUBPROCESS = os.environ.get("TRITON_INTERPRET") == "1"


def _interpreting() -> bool:
    if not HAS_TRITON:
        return False
    from mixprec.fp8._triton_kernels import interpreting

    return interpreting()


def _backend(name: str) -> str:
    """``name``, or a skip where that implementation cannot run in this process."""
    if name == "triton":
        if not HAS_TRITON:
            pytest.skip("Triton is not installed (the 'triton' extra)")
        if not _interpreting():
            pytest.skip("Triton was imported without TRITON_INTERPRET=1: run in a subprocess "
                        "(test_triton_kernels_under_the_interpreter)")
    elif not compile_works("cpu"):
        pytest.skip("torch.compile does not work on this machine (the cast then runs as eager torch ops)")
    return name


BACKENDS = ["compile", "triton"]


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    """Tiles of 32 x 32 elements: the test tensors span several Triton programs (the last one
    folds the others' partial results), and the interpreter stays quick."""
    monkeypatch.setattr(F, "BLOCK", (32, 32))


def _slots() -> F.CastSlots:
    return F.CastSlots(torch.zeros(()), torch.zeros((), dtype=torch.bool), torch.zeros(2),
                       torch.zeros(8, dtype=torch.int32))


def _inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    wide_range = torch.randn(40, 70, generator=gen) * torch.logspace(-12, 6, 70)  # saturates and flushes
    with_zeros = torch.randn(33, 17, generator=gen)
    with_zeros[::3] = 0
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    midpoints = torch.cat([(codes[1:] + codes[:-1]) / 2, -(codes[1:] + codes[:-1]) / 2]).reshape(4, -1)  # ties
    transposed = torch.randn(50, 36, generator=gen).t()  # any strides
    return [t.to(dtype) for t in (wide_range, with_zeros, midpoints, transposed)]


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.E5M2])
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.0e4])
def test_fused_cast_equals_the_eager_quantiser_bit_for_bit(backend, dtype, fmt, scale):
    backend = _backend(backend)
    s = torch.tensor(scale)
    for x in _inputs(dtype):
        slots = _slots()
        data, data_t, inv, bias_low, sums = F.fused_cast(x, s, fmt, slots, cols=True, stats=True, backend=backend)
        q, stats = quantize_with_stats(x, s, fmt)
        assert torch.equal(_u8(data), _u8(q.data)), (backend, x.shape)
        assert data_t.is_contiguous() and torch.equal(_u8(data_t), _u8(q.data).t())
        assert torch.equal(inv, q.inv_scale)
        assert torch.equal(slots.stats, stats)
        assert torch.equal(slots.pending, x.float().abs().amax())
        assert not slots.flag
        assert bias_low is None and sums is None
        assert torch.equal(slots.scratch, torch.zeros(8, dtype=torch.int32))  # reset for the next call


def test_every_bf16_value_rounds_as_torch_does(monkeypatch):
    """All 65,280 finite bf16 values, both formats: the kernel's integer rounding (what the
    interpreter runs) gives torch's codes. (Its other path, the GPU's conversion instruction,
    is checked on the GPU: the interpreter's own conversion rounds ties away from zero.)"""
    _backend("triton")
    monkeypatch.setattr(F, "BLOCK", (128, 128))
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[torch.isfinite(every)].reshape(-1, 128)
    for fmt in (Format.E4M3, Format.E5M2):
        for scale in (1.0, 0.37, 2.0**-10):
            data = F.fused_cast(every, torch.tensor(scale), fmt, _slots(), backend="triton")[0]
            q, _ = quantize_with_stats(every, torch.tensor(scale), fmt)
            assert torch.equal(_u8(data), _u8(q.data)), (fmt, scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_tensor(backend, bad):
    """Documented difference: the finite elements keep their codes and the non-finite ones get
    the NaN code (the eager quantiser makes every code NaN); ``inv`` is NaN, so every GEMM
    result is NaN either way. The flag is set, the pending amax is not finite (recorded as 0
    by the fold), the statistics are 0, as eagerly."""
    backend = _backend(backend)
    x = torch.randn(37, 45)
    x[5, 7] = bad
    for fmt in (Format.E4M3, Format.E5M2):
        slots = _slots()
        data, data_t, inv, _, _ = F.fused_cast(x, torch.tensor(2.0), fmt, slots, cols=True, stats=True, backend=backend)
        q, stats = quantize_with_stats(x, torch.tensor(2.0), fmt)
        finite = torch.isfinite(x)
        expected = _u8(quantize_with_stats(torch.where(finite, x, 0.0), torch.tensor(2.0), fmt)[0].data).clone()
        expected[~finite] = 0x7F
        assert torch.equal(_u8(data), expected) and torch.equal(_u8(data_t), expected.t())
        assert data.float()[5, 7].isnan() and torch.isnan(inv)
        assert q.dequantize().isnan().all() and (data.float() * inv).isnan().all()  # all NaN, either way
        assert slots.flag and not torch.isfinite(slots.pending)
        assert torch.equal(slots.stats, stats) and torch.equal(stats, torch.zeros(2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_pending_amax_is_the_maximum_and_eval_records_nothing(backend):
    backend = _backend(backend)
    slots = _slots()
    x = torch.randn(20, 30)
    F.fused_cast(x, torch.tensor(1.0), Format.E4M3, slots, backend=backend)
    F.fused_cast(x * 0.5, torch.tensor(1.0), Format.E4M3, slots, backend=backend)
    assert torch.equal(slots.pending, x.abs().amax())
    F.fused_cast(x * 4, torch.tensor(1.0), Format.E4M3, slots, update=False, stats=True, backend=backend)
    assert torch.equal(slots.pending, x.abs().amax()) and torch.equal(slots.stats, torch.zeros(2))
    data, data_t, *_ = F.fused_cast(x, torch.tensor(1.0), Format.E4M3, slots, rows=False, backend=backend)
    assert data is None and data_t is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_column_sums_and_bias(backend):
    """The column sums (a bias gradient) within fp32 rounding of a float64 sum, the same on
    every call (a fixed order); the bias rounded to bf16 as torch rounds it."""
    backend = _backend(backend)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(100, 70, generator=gen).bfloat16()
    bias = torch.cat([torch.randn(98, generator=gen), torch.tensor([float("nan"), 3.4028235e38])])
    w = torch.randn(100, 40, generator=gen)
    _, _, _, low, sums = F.fused_cast(x, torch.tensor(1.0), Format.E5M2, _slots(), dbias=True, backend=backend)
    _, _, _, _, again = F.fused_cast(x, torch.tensor(1.0), Format.E5M2, _slots(), dbias=True, backend=backend)
    assert low is None and torch.equal(sums, again)
    torch.testing.assert_close(sums, x.double().sum(0).float(), rtol=1e-6, atol=1e-5)
    _, _, _, low, _ = F.fused_cast(w, torch.tensor(1.0), Format.E4M3, _slots(), bias=bias, backend=backend)
    number = ~bias.isnan()
    assert torch.equal(low[number].view(torch.int16), bias[number].bfloat16().view(torch.int16))
    assert low[~number].isnan().all()  # (a NaN stays NaN; its payload may differ from torch's)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.E5M2])
def test_fused_scale_is_compute_scale_of_the_amax(backend, fmt):
    backend = _backend(backend)
    prev = torch.tensor(7.0)
    cases = [torch.randn(40, 50), torch.randn(3, 5).bfloat16(), torch.zeros(4, 4), torch.full((2, 2), 1e-45),
             torch.tensor([[1.0, float("inf")]]), torch.tensor([[float("nan"), 1.0]]), torch.full((2, 3), 3e38)]
    for margin in (0, 3):
        for x in cases:
            got = F.fused_scale(x, prev, fmt, margin, _slots(), backend=backend)
            want = compute_scale(x.float().abs().amax(), fmt.max, margin, prev)
            assert torch.equal(got, want), (x, margin)


def test_a_failing_triton_kernel_falls_back_once_with_a_warning_where_allowed(monkeypatch):
    """What Fp8Linear(cast="auto") relies on where a kernel never compiled before fails on a
    GPU: one warning naming the error and the way out, then the torch implementation."""
    if not compile_works("cpu"):
        pytest.skip("torch.compile does not work on this machine")
    monkeypatch.setattr(F, "_TRITON_FAILED", {})
    monkeypatch.setattr(F, "_triton_runs", lambda x, backend: backend == "triton")

    def broken(*args, **kwargs):
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(F, "_triton_cast", broken)
    monkeypatch.setattr(F, "_triton_scale", broken)
    x = torch.randn(20, 30)
    with pytest.raises(RuntimeError, match="PassManager"):
        F.fused_cast(x, torch.tensor(1.0), Format.E4M3, _slots(), backend="triton")
    with pytest.warns(RuntimeWarning, match=r"Triton fp8 cast failed on cpu \(RuntimeError: PassManager.*cast='triton'"):
        data = F.fused_cast(x, torch.tensor(1.0), Format.E4M3, _slots(), backend="triton", fallback=True)[0]
    assert torch.equal(data.view(torch.uint8), quantize_with_stats(x, torch.tensor(1.0), Format.E4M3)[0].data.view(torch.uint8))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        F.fused_cast(x, torch.tensor(1.0), Format.E4M3, _slots(), backend="triton", fallback=True)
        got = F.fused_scale(x, torch.tensor(1.0), Format.E4M3, 0, _slots(), backend="triton", fallback=True)
    assert torch.equal(got, compute_scale(x.abs().amax(), 448.0))


def test_bad_arguments_name_what_works():
    with pytest.raises(ValueError, match="'cuda-graph' is unknown; expected one of"):
        F.fused_cast(torch.ones(2, 2), torch.tensor(1.0), Format.E4M3, _slots(), backend="cuda-graph")
    with pytest.raises(ValueError, match=r"non-empty 2-d tensor, got shape \(4,\)"):
        F.fused_cast(torch.ones(4), torch.tensor(1.0), Format.E4M3, _slots())
    with pytest.raises(ValueError, match="cast='fast'"):
        Fp8Linear(16, 16, cast="fast")
    with pytest.raises(ValueError, match="scale_update='epoch'"):
        Fp8Linear(16, 16, scale_update="epoch")
    assert not F.triton_available("meta")
    with pytest.raises(TypeError, match="list of Fp8Linear layers, got Linear"):
        update_scales([torch.nn.Linear(2, 2)])


# --------------------------------------------------------------------------- Fp8Linear(cast=...)


RECIPES = [
    DelayedScaling(amax_history_len=3),
    DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent", margin=1),
    DelayedScaling(amax_init=False),
    CurrentScaling(),
]


def _same_state(a: Fp8Linear, b: Fp8Linear) -> None:
    """The same history, next scale and statistics. (``scale`` differs by design: eagerly the
    scale of the last iteration, fused after the fold the scale of the next one.)"""
    sa, sb = a.fp8_state(), b.fp8_state()
    for kind in sa:
        for field in ("amax_history", "saturation", "underflow"):
            assert torch.equal(getattr(sa[kind], field), getattr(sb[kind], field)), (kind, field)
        if sa[kind].next_scale is not None:
            assert torch.equal(sa[kind].next_scale, sb[kind].next_scale), kind


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: repr(r)[:40])
@pytest.mark.parametrize("scale_update", ["layer", "step"])
def test_fused_layer_trains_as_the_eager_one_bit_for_bit(backend, recipe, scale_update):
    """One micro-batch per step: the fused layer's outputs, gradients, histories, next scales
    and statistics equal the eager layer's at every iteration, whoever folds the amaxes."""
    backend = _backend(backend)
    torch.manual_seed(0)
    a = Fp8Linear(48, 32, recipe=recipe, cast="eager")
    b = Fp8Linear(48, 32, recipe=recipe, cast=backend, scale_update=scale_update)
    b.load_state_dict(a.state_dict())
    for it in range(4):
        x = torch.randn(40, 48) * 10.0**it
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = a(xa), b(xb)
        assert torch.equal(ya, yb), it
        g = torch.randn_like(ya) * 1e-3
        ya.backward(g)
        yb.backward(g)
        if scale_update == "step":
            update_scales(b)
        for u, v in ((xa.grad, xb.grad), (a.weight.grad, b.weight.grad), (a.bias.grad, b.bias.grad)):
            assert torch.equal(u, v), it
        _same_state(a, b)
        a.zero_grad()
        b.zero_grad()
    a.eval()
    b.eval()
    x = torch.randn(8, 48)
    assert torch.equal(a(x), b(x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_fused_cast_per_tensor_per_pass(backend, monkeypatch):
    """Forward + backward: three casts (input, weight, output gradient); the amax pass only at
    the first iteration (delayed scaling with amax_init) or at each (current scaling)."""
    backend = _backend(backend)
    monkeypatch.setattr(F, "LAUNCHES", type(F.LAUNCHES)())
    cast, amax = ("fp8_cast", "fp8_amax") if backend == "triton" else ("fp8_cast_torch", "fp8_amax_torch")
    for recipe, amax_passes in ((DelayedScaling(), [3, 0, 0]), (CurrentScaling(), [3, 3, 3])):
        layer = Fp8Linear(32, 32, recipe=recipe, cast=backend)
        for expected in amax_passes:
            F.LAUNCHES.clear()
            layer(torch.randn(16, 32, requires_grad=True)).sum().backward()
            assert F.LAUNCHES[cast] == 3 and F.LAUNCHES[amax] == expected, dict(F.LAUNCHES)


@pytest.mark.parametrize("backend", BACKENDS)
def test_update_scales_is_one_call_per_step_for_all_layers(backend):
    """scale_update="step": micro-batches share the step's scales and their amaxes are
    reduced to the maximum; one update_scales call folds every layer (a second is a no-op)."""
    backend = _backend(backend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Fp8Linear(32, 32, recipe=DelayedScaling(amax_history_len=4), cast=backend,
                                            scale_update="step") for _ in range(3)))
    small, large = torch.randn(8, 32), torch.randn(8, 32) * 8
    model(small).sum().backward()
    model(large).sum().backward()
    assert all(not layer.fp8_amax_history.any() for layer in model)  # nothing folded before the step
    update_scales(model)
    assert torch.equal(model[0].fp8_amax_history[0, 0], torch.maximum(small.abs().amax(), large.abs().amax()))
    assert all(layer.fp8_amax_history[:, 0].gt(0).all() and layer.fp8_pending.eq(-1).all() for layer in model)
    history = [layer.fp8_amax_history.clone() for layer in model]
    update_scales(model)  # nothing pending: unchanged
    assert all(torch.equal(h, layer.fp8_amax_history) for h, layer in zip(history, model, strict=True))
    for layer in model:  # the next scales, from the folded histories
        for kind, fmt in enumerate(layer._formats):
            assert torch.equal(layer.fp8_scale[kind], compute_scale(layer.fp8_amax_history[kind].amax(), fmt.max))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_layer_nonfinite_input(backend):
    backend = _backend(backend)
    layer = Fp8Linear(16, 16, cast=backend)
    x = torch.randn(4, 16)
    x[1, 2] = float("inf")
    assert layer(x).isnan().all() and layer.fp8_nonfinite
    assert layer.fp8_state()["input"].amax_history[0] == 0  # recorded as 0, as eagerly


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoints_move_between_eager_and_fused_layers(backend):
    """A checkpoint of an eager layer continues in a fused one as in the eager one (the next
    scale is recomputed from the loaded history), and a fused layer's checkpoint holds the
    amaxes it has seen (the pending ones are folded before saving)."""
    backend = _backend(backend)
    torch.manual_seed(0)
    a = Fp8Linear(32, 32, recipe=DelayedScaling(amax_history_len=4), cast="eager")
    for _ in range(2):
        a(torch.randn(8, 32)).sum().backward()
    b = Fp8Linear(32, 32, recipe=DelayedScaling(amax_history_len=4), cast=backend)
    b.load_state_dict(a.state_dict())
    x = torch.randn(8, 32)
    assert torch.equal(a(x), b(x))
    saved = b.state_dict()
    assert torch.equal(saved["fp8_amax_history"], a.state_dict()["fp8_amax_history"])
    assert b.fp8_pending.eq(-1).all()  # (-1: nothing pending)


def test_auto_cast_is_eager_without_native_fp8_gemms():
    layer = Fp8Linear(16, 16)
    assert layer.cast == "auto" and layer._resolve_cast(False, torch.device("cpu")) == "eager"
    assert "cast=auto" in repr(layer)


@pytest.mark.long
@pytest.mark.skipif(not HAS_TRITON or IN_SUBPROCESS, reason="needs Triton; runs the Triton tests in a subprocess")
def test_triton_kernels_under_the_interpreter():
    """Where this process cannot interpret the kernels (Triton imported without
    TRITON_INTERPRET=1), the tests above that need them run in a subprocess that can."""
    if _interpreting():
        pytest.skip("this process interprets the kernels: the tests above ran them")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-k", "triton or every_bf16", __file__],
        cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True, timeout=900,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "passed" in summary and "failed" not in summary, summary


def _plan_run(cast: str, steps: int = 4) -> tuple[list[torch.Tensor], list[torch.Tensor], list[bool]]:
    """fp8-mixed training on CPU (emulated GEMMs) with ``cast``; the third step's input holds
    an inf, so that step is skipped (its amaxes and scales must not stick)."""
    from mixprec import MixedPrecision, get_plan

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    mp = MixedPrecision(get_plan("fp8-mixed", cast=cast))
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    gen = torch.Generator().manual_seed(1)
    skipped = []
    for step in range(steps):
        x = torch.randn(16, 32, generator=gen) * (1 + step)
        if step == 2:
            x[3, 4] = float("inf")
        with mp.autocast():
            loss = model(x).float().square().mean()
        mp.backward(loss)
        skipped.append(bool(mp.step().skipped))
        opt.zero_grad()
    buffers = [b.clone() for name, b in model.named_buffers() if "history" in name or "scale" in name]
    return [p.detach().clone() for p in model.parameters()], buffers, skipped


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_mixed_with_a_fused_cast_trains_as_with_the_eager_one(backend):
    """The plan folds every layer's amaxes once per step (before unscaling: a skipped step
    restores them); weights and amax histories equal the eager cast's bit for bit."""
    backend = _backend(backend)
    eager_params, eager_buffers, eager_skips = _plan_run("eager")
    params, buffers, skips = _plan_run(backend)
    assert skips == eager_skips == [False, False, True, False]
    assert all(torch.equal(a, b) for a, b in zip(eager_params, params, strict=True))
    histories = [(a, b) for a, b in zip(eager_buffers, buffers, strict=True) if a.dim() == 2]
    assert histories and all(torch.equal(a, b) for a, b in histories)


def _hooks_on_two_ranks(rank: int, world_size: int) -> None:
    """Each rank: fp8-mixed's hooks on its own batch, eager cast against the fused one. The
    amaxes (a fused layer's pending ones) are MAX-reduced before the fold: both casts end
    with the same histories, on both ranks, and the fused layers with the same next scales."""
    import torch.distributed as dist

    from mixprec import get_plan

    histories, scales = {}, {}
    for cast in ("eager", "compile"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 32))
        plan = get_plan("fp8-mixed", cast=cast)
        plan.convert_model(model)
        for step in range(3):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank)) * (1 + 3 * rank)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(x).float().square().mean().backward()
            plan.before_unscale(model, None)  # (the default group: both ranks)
            plan.after_step(model)
        histories[cast] = torch.cat([model[0].fp8_amax_history.flatten(), model[2].fp8_amax_history.flatten()])
        scales[cast] = torch.cat([model[0].fp8_scale, model[2].fp8_scale])
    assert torch.equal(histories["eager"], histories["compile"]), rank
    assert histories["compile"][0] > 0
    mine = torch.cat([histories["compile"], scales["compile"]])
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "the ranks' fp8 state differs"


@pytest.mark.distributed
def test_fused_layers_reduce_their_pending_amaxes_across_ranks():
    if not compile_works("cpu"):
        pytest.skip("torch.compile does not work on this machine")
    from tests._dist import run_ranks

    run_ranks(_hooks_on_two_ranks, 2)

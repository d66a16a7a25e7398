"""The Triton executor (mixprec.optim.triton_adam) compiled for a GPU: what the interpreter cannot tell.

tests/test_optim_triton.py checks the kernel's logic under Triton's interpreter (numpy arithmetic,
no fused multiply-adds, no compile cache); here it runs compiled, on CUDA tensors: the steps
against the eager path on the GPU (torch's fused CUDA kernels) within fp32 rounding (the tier
stated there), the round-to-nearest store bit for bit against torch's CUDA cast (ties, subnormals,
infinities; NaN: NaN), the stochastic store against the codecs' formula on the kernel's own fp32
results, a skipped step, what a call launches (torch.profiler: kernels and host-to-device copies)
for 12 and 24 layers, 8-bit moments (codes bit for bit against the eager quantizer, steps within
the tier), that new hyperparameters, step counts and seeds do not recompile (the
kernel's compile cache), and that a learning rate held on the device is never read on the host.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mixprec.optim import KahanOptimizer, StochasticRoundingOptimizer, codecs
from mixprec.optim import triton_adam as TA
from tests.test_optim_triton import (
    CASES,
    NONFINITE_ON_PURPOSE,
    Q8_CASES,
    _call,
    _kahan_within_tier,
    _launches,
    _layers,
    _low_within_tier,
    _operands,
    _same_inputs,
    _special_values,
    _state_within_tier,
    _update_scale,
    q8_codes_bit_for_bit,
    q8_steps_within_tier,
)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not TA.available("cuda"), reason="needs Triton and a CUDA GPU")]

DEVICE = torch.device("cuda")
SHAPES = [(256, 384), (70001,), (5,), (3, 1029)]  # many programs, a partial last one, less than one


def _params(dtype: torch.dtype = torch.bfloat16, shapes=SHAPES) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype).to(DEVICE)) for s in shapes]


def _grads(params, step: int, dtypes) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p, dtype in zip(params, itertools.cycle(dtypes)):
        p.grad_dtype = None
        p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(dtype).to(DEVICE)


@pytest.mark.parametrize(("wrapper", "inner", "adam", "state_dtype", "dtype", "grad_dtypes", "comp_dtype"), CASES)
def test_steps_equal_the_eager_path_on_the_gpu_within_fp32_rounding(
    wrapper, inner, adam, state_dtype, dtype, grad_dtypes, comp_dtype
) -> None:
    a, b = _params(dtype), _params(dtype)
    hyper = {"lr": 1e-2} | adam
    oa = wrapper(inner(a, **hyper), state_dtype=state_dtype, compile=False)
    ob = wrapper(inner(b, **hyper), state_dtype=state_dtype, compile=False)
    for p in a if comp_dtype is not None else []:
        oa.set_compensation(p, torch.zeros(p.shape, dtype=comp_dtype, device=DEVICE))
    l2 = 0.0 if inner is torch.optim.AdamW else adam.get("weight_decay", 0.0)
    for step in range(3):
        _grads(a, step, grad_dtypes)
        _same_inputs(oa, a, ob, b)
        operands = _operands(oa, a, l2)
        count = oa.rounding_state()["counter"] if oa.rounding == "stochastic" else None
        oa.step()
        assert _call(ob, b, noise=None if count is None else codecs.call_noise(count, 0, b)) == []
        for i, (pa, pb) in enumerate(zip(a, b, strict=True)):
            what = f"step {step} tensor {i} {tuple(pa.shape)}"
            _low_within_tier(pa, pb, what)
            _state_within_tier(oa.optimizer.state[pa], ob.optimizer.state[pb], operands[i], what)
            if oa.rounding == "kahan":
                update = _update_scale(oa, pa, operands[i]["exp_avg"])
                _kahan_within_tier(pa, oa.compensation(pa), pb, ob.compensation(pb), operands[i]["w"], update, what)


@NONFINITE_ON_PURPOSE
@pytest.mark.parametrize("amsgrad", [False, True])
def test_8bit_moments_are_the_codecs_codes_bit_for_bit_on_the_gpu(monkeypatch, amsgrad) -> None:
    """The kernel's 8-bit store against the eager quantizer on the GPU (see the interpreter's test)."""
    q8_codes_bit_for_bit(_params(), _grads, amsgrad, _launches(monkeypatch))


@pytest.mark.parametrize(("wrapper", "inner", "adam"), Q8_CASES)
def test_8bit_moments_step_as_the_eager_path_on_the_gpu_within_fp32_rounding(monkeypatch, wrapper, inner, adam) -> None:
    q8_steps_within_tier(_params(), _params(), _grads, wrapper, inner, adam, _launches(monkeypatch))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_to_nearest_store_is_torchs_cuda_cast_bit_for_bit(dtype) -> None:
    """As under the interpreter: a step that changes nothing of zero weights whose fp32 Kahan
    compensations hold the values (NaN: any NaN; torch's CUDA cast gives 0x7FFF, the kernel 0x7FC0)."""
    values = _special_values().to(DEVICE)
    params = [torch.nn.Parameter(torch.zeros(row.shape, device=DEVICE).copysign(row).to(dtype)) for row in values]
    opt = KahanOptimizer(torch.optim.Adam(params, lr=0.0), state_dtype=None, compile=False)
    for p, row in zip(params, values, strict=True):
        p.grad_dtype = None
        p.grad = torch.zeros(p.shape, device=DEVICE)
        opt.set_compensation(p, row.clone())
    assert _call(opt, params) == []
    for p, row in zip(params, values, strict=True):
        expect, nan = row.to(dtype), row.isnan()
        assert torch.equal(p.isnan(), nan)
        assert torch.equal(p.detach()[~nan].view(torch.int16), expect[~nan].view(torch.int16))
        finite = row.isfinite()
        assert torch.equal(opt.compensation(p)[finite].view(torch.int32), (row - expect.float())[finite].view(torch.int32))


def test_stochastic_store_is_the_codecs_formula_on_the_gpu() -> None:
    """The stochastic store of the kernel's fp32 result (read back exactly from a Kahan step with fp32
    compensations, the same update compiled): hash16((first + i) ^ seed32(count)) added, truncated."""
    a, b = _params(), _params()
    sr = StochasticRoundingOptimizer(torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1), state_dtype=None, compile=False)
    kahan = KahanOptimizer(torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1), state_dtype=None, compile=False)
    for step in range(2):
        _grads(a, step, (torch.bfloat16, torch.float32))
        _same_inputs(sr, a, kahan, b)
        for p in b:
            kahan.set_compensation(p, torch.zeros(p.shape, device=DEVICE))
        _call(sr, a, noise=codecs.call_noise(777 + step, 0, a))
        _call(kahan, b)
        first = 0
        for pa, pb in zip(a, b, strict=True):
            exact = pb.float() + kahan.compensation(pb)
            positions = torch.arange(pa.numel(), device=DEVICE) + first
            noise = codecs.hash16(positions ^ codecs.seed32(777 + step)).view(pa.shape)
            expect = ((exact.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)
            assert torch.equal(pa.detach().view(torch.int16), expect.view(torch.int16)), (step, pa.shape)
            first += pa.numel()


def test_a_skipped_step_writes_nothing_on_the_gpu() -> None:
    params = _params()
    opt = KahanOptimizer(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=True), compile=False)
    _grads(params, 0, (torch.float32,))
    _call(opt, params)
    _grads(params, 1, (torch.float32,))
    before = [(p.detach().clone(), opt.compensation(p).clone(), {k: v.clone() for k, v in opt.optimizer.state[p].items()})
              for p in params]
    _call(opt, params, skip=torch.ones((), device=DEVICE))
    for p, (w, c, s) in zip(params, before, strict=True):
        assert torch.equal(p.view(torch.int16), w.view(torch.int16))
        assert torch.equal(opt.compensation(p).view(torch.int16), c.view(torch.int16))
        assert all(torch.equal(opt.optimizer.state[p][k], s[k]) for k in s if k != "step")
    _call(opt, params, skip=torch.zeros((), device=DEVICE))
    assert all(not torch.equal(p, w) for p, (w, _, _) in zip(params, before, strict=True))


def _profiled(fn) -> tuple[list[str], list[str]]:
    """(the CUDA kernels, the host-to-device copies) ``fn`` launched."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [n for n in names if not n.startswith(("Memcpy", "Memset"))], [n for n in names if "HtoD" in n]


def test_a_call_launches_as_many_kernels_for_24_layers_as_for_12() -> None:
    """One kernel per dtype combination (bf16 and fp32 gradients: two) and, in steady state, one
    host-to-device copy (the call's table), however many tensors there are."""
    counts = {}
    for n in (12, 24):
        params = [torch.nn.Parameter(p.detach().to(DEVICE)) for p in _layers(n)]
        opt = KahanOptimizer(torch.optim.AdamW(params, lr=1e-2), compile=False)
        _grads(params, 0, (torch.bfloat16, torch.float32))
        _call(opt, params)  # compiles; state made; the program table cached
        kernels, copies = _profiled(lambda opt=opt, params=params: _call(opt, params))
        counts[n] = (len(kernels), len(copies))
        assert sum("_adam_kernel" in k for k in kernels) == 2, kernels
    assert counts[12] == counts[24] and counts[12][1] == 1, counts


def _compiled_variants() -> int | None:
    caches = getattr(TA.kernels.ADAM_KERNEL, "device_caches", None)
    return None if caches is None else sum(len(c[0]) for c in caches.values())


def test_new_hyperparameters_do_not_recompile_and_a_device_lr_is_not_read_on_the_host() -> None:
    params = _params()
    lr = torch.tensor(1e-2, device=DEVICE)
    opt = StochasticRoundingOptimizer(torch.optim.AdamW(params, lr=lr, weight_decay=0.1), compile=False)
    _grads(params, 0, (torch.bfloat16,))
    _call(opt, params, noise=codecs.call_noise(3, 0, params))  # compiles
    variants = _compiled_variants()
    for step, value in enumerate((3e-3, 1e-4, 0.5), start=1):
        lr.fill_(value)
        _grads(params, step, (torch.bfloat16,))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # (restored by the conftest)
        try:
            _call(opt, params, noise=codecs.call_noise(3 + step, 0, params))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    if variants is not None:
        assert _compiled_variants() == variants
    assert all(torch.isfinite(p).all() for p in params)

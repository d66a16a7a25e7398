"""The native CPU route (mixprec.optim.native): Adam/AdamW of one low-precision weight in one C loop.

Oracles: the eager fast path (the same wrapper with ``compile=False``) bit for bit, where both
compute the same fp32 operations (everything but the last few elements of a vector loop, which
torch's kernels compute without fused multiply-adds); the eager quantizer bit for bit; the masters
themselves for remainders (a step that changes nothing gives back every bit, ties included);
and the compiled route's noise for stochastic rounding.
"""

from __future__ import annotations

import pytest
import torch

from mixprec import get_plan
from mixprec.optim import (
    InBackwardOptimizer,
    KahanOptimizer,
    LowPrecisionOptimizer,
    RemainderOptimizer,
    StochasticRoundingOptimizer,
    codecs,
    native,
    native_build,
)
from mixprec.optim.quant import dequantize_blockwise, quantize_blockwise, split_master

# skipped only where there is no C compiler (or the route is turned off); a compiler that fails fails
pytestmark = pytest.mark.skipif(not native.status(build=False)[0], reason=f"no native kernel here: {native.status(build=False)[1]}")


def test_the_kernel_builds_where_a_c_compiler_is_found() -> None:
    assert native.status() == (True, "")

SHAPES = [(300, 64), (1000,), (7,), (70001,)]  # whole 8-bit blocks, a partial last block, less than one, a tail


def _params(shapes=SHAPES, dtype=torch.bfloat16) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]


def _grads(params: list[torch.nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(p.dtype)


def _calls(monkeypatch) -> list[int]:
    """Counts the kernel's calls (one per weight or range)."""
    calls = [0]
    real = native._call

    def counted(lib, job):
        calls[0] += 1
        return real(lib, job)

    monkeypatch.setattr(native, "_call", counted)
    return calls


def _run(make, setting, steps=6, shapes=SHAPES, dtype=torch.bfloat16, inner=torch.optim.AdamW, **adam):
    params = _params(shapes, dtype)
    opt = make(inner(params, **({"lr": 1e-2, "weight_decay": 0.1} | adam)), setting)
    for step in range(steps):
        _grads(params, step)
        opt.step()
    return params, opt


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> float:
    """The fraction of elements of ``a`` and ``b`` with the same bits."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    x, y = a.detach().view(ints[a.element_size()]), b.detach().view(ints[b.element_size()])
    return float((x == y).float().mean())


def _differ_only_in_the_last_block(a: torch.Tensor, b: torch.Tensor, numel: int) -> bool:
    """Whether ``a`` and ``b`` (of a weight of ``numel`` elements, or its 8-bit block scales) have
    the same bits but in the weight's last 256-element block, and only where torch's vector loop
    over the weight had a scalar tail (``numel`` not a multiple of 16)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    x, y = a.detach().reshape(-1).view(ints[a.element_size()]), b.detach().reshape(-1).view(ints[b.element_size()])
    differ = (x != y).nonzero().view(-1)
    if numel % 16 == 0:
        return differ.numel() == 0
    last = (numel - 1) // 256
    first = last if x.numel() < numel else last * 256  # a block scale, or an element
    return bool((differ >= first).all())


CASES = [
    pytest.param(LowPrecisionOptimizer, "8bit", {}, id="pure-8bit-adamw"),
    pytest.param(KahanOptimizer, "8bit", {"amsgrad": True, "maximize": True}, id="kahan-8bit-amsgrad-maximize"),
    pytest.param(KahanOptimizer, "8bit", {"inner": torch.optim.Adam}, id="kahan-8bit-adam-l2"),
    pytest.param(KahanOptimizer, "8bit", {"dtype": torch.float16}, id="kahan-fp16-weights-8bit"),
    pytest.param(LowPrecisionOptimizer, "8bit", {"dtype": torch.float16, "amsgrad": True}, id="pure-fp16-weights-8bit"),
    pytest.param(RemainderOptimizer, "8bit", {}, id="remainder-8bit"),
    pytest.param(RemainderOptimizer, "bf16", {}, id="remainder-bf16"),
    pytest.param(RemainderOptimizer, "bf16", {"amsgrad": True}, id="remainder-bf16-amsgrad"),
]


@pytest.mark.parametrize(("wrapper", "state_dtype", "adam"), CASES)
def test_native_steps_equal_the_eager_fast_path_bit_for_bit_but_for_vector_tails(
    wrapper, state_dtype, adam, monkeypatch
) -> None:
    def make(inner, setting):
        return wrapper(inner, state_dtype=state_dtype, compile=setting)

    eager, opt_e = _run(make, False, **adam)
    calls = _calls(monkeypatch)
    taken, opt_n = _run(make, "auto", **adam)
    assert calls[0] >= 6 * len(SHAPES)  # every weight took the native route, every step
    assert not opt_n._compiled_layouts
    for a, b in zip(eager, taken, strict=True):
        n = a.numel()
        assert _differ_only_in_the_last_block(a, b, n), a.shape
        sa, sb = opt_e.optimizer.state[a], opt_n.optimizer.state[b]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert sa[key].dtype == sb[key].dtype and sa[key].shape == sb[key].shape, key
            if key != "step":
                assert _differ_only_in_the_last_block(sa[key], sb[key], n), (a.shape, key)
        if wrapper is RemainderOptimizer:
            assert _differ_only_in_the_last_block(opt_e.master(a), opt_n.master(b), n)
            assert torch.equal(b.detach().view(torch.int16), opt_n.master(b).to(torch.bfloat16).view(torch.int16))
        if wrapper is KahanOptimizer:
            assert _differ_only_in_the_last_block(opt_e.compensation(a), opt_n.compensation(b), n)
    assert _same_bits(eager[3], taken[3]) > 0.99  # (70001 elements: the last block is a small part)
    # the state dicts are the same kind: one continues on the other route
    opt_e.load_state_dict(opt_n.state_dict())
    _grads(eager, 9)
    opt_e.step()


def test_the_native_8bit_store_gives_the_eager_quantizers_codes_at_every_boundary() -> None:
    # beta1 = beta2 = 0 and lr = 0: the step stores the gradient as exp_avg and its square as exp_avg_sq,
    # through the kernel's quantizer, whose codes must be quantize_blockwise's
    from mixprec.optim.quant import lookup_tables

    points = torch.cat([lookup_tables(s, torch.device("cpu"))[1][:-1] for s in (True, False)])
    bits = points.view(torch.int32)
    edges = torch.cat([(bits + d).view(torch.float32) for d in (-1, 0, 1)])
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 1e-40, 5e-8, -5e-8, 0.5, 2.0 ** -20])
    g = torch.Generator().manual_seed(0)
    values = torch.cat([edges, special, torch.randn(4000, generator=g) * torch.rand(4000, generator=g) ** 8])
    values = torch.cat([values, torch.zeros(256 - values.numel() % 256 + 100)])  # a partial last block
    blocks = values.numel() // 256
    for scale in (1.0, 3.0):  # in blocks whose absmax is exactly 1 (the edges land on the points), and not
        p = torch.nn.Parameter(torch.zeros(values.numel(), dtype=torch.bfloat16))
        opt = LowPrecisionOptimizer(torch.optim.Adam([p], lr=0.0, betas=(0.0, 0.0)), state_dtype="8bit")
        x = values * scale
        x.view(-1, 1)[:: 256] = scale  # each block's absmax
        x[256 * (blocks - 1) : 256 * blocks] = 0.0  # an all-zero block (divided by 1)
        x[256 * (blocks - 2)] = -scale  # a block whose largest magnitude is negative
        x[256 * (blocks - 3) : 256 * (blocks - 2)] *= 1e-39  # a block of subnormals (its largest one too)
        p.grad_dtype = None
        p.grad = x.clone()  # an fp32 gradient: the values land on the decision points and next to them
        opt.step()
        state = opt.optimizer.state[p]
        grad = x
        for key, value, signed in (("exp_avg", grad, True), ("exp_avg_sq", grad * grad, False)):
            codes, absmax = quantize_blockwise(value, signed=signed)
            assert torch.equal(state[key], codes), key
            assert torch.equal(state[key + "_absmax"], absmax), key
            assert torch.equal(dequantize_blockwise(state[key], state[key + "_absmax"], signed=signed),
                               dequantize_blockwise(codes, absmax, signed=signed))


@pytest.mark.parametrize("amsgrad", [False, True])
def test_a_block_holding_inf_or_nan_quantizes_as_the_eager_quantizer_does(amsgrad) -> None:
    p = torch.nn.Parameter(torch.zeros(1024, dtype=torch.bfloat16))
    opt = KahanOptimizer(torch.optim.Adam([p], lr=0.0, betas=(0.0, 0.0), amsgrad=amsgrad), state_dtype="8bit")
    grad = torch.randn(1024)
    grad[3], grad[300], grad[301], grad[600] = float("inf"), float("nan"), -float("inf"), 1.0
    grad[800:1024] *= 1e-20  # its square underflows: a block of v with zeros and subnormals beside one of m without
    p.grad = grad.to(torch.bfloat16)
    opt.step()
    g = p.grad.float()
    m = torch.zeros(1024).lerp(g, 1.0)  # torch's moments of this step, inf and NaN included
    v = torch.zeros(1024).mul(0.0).addcmul(g, g, value=1.0)
    state = opt.optimizer.state[p]
    keys = [("exp_avg", m, True), ("exp_avg_sq", v, False)] + ([("max_exp_avg_sq", v, False)] if amsgrad else [])
    for key, value, signed in keys:
        codes, absmax = quantize_flat_codes(value, signed)
        assert torch.equal(state[key], codes), key
        assert torch.equal(state[key + "_absmax"].isnan(), absmax.isnan()), key
        assert torch.equal(state[key + "_absmax"].nan_to_num(), absmax.nan_to_num()), key


def quantize_flat_codes(value: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager quantizer's codes and scales of ``value`` (NaN and negative values included)."""
    from mixprec.optim.quant import quantize_flat

    codes, absmax = torch.empty(value.numel(), dtype=torch.uint8), torch.empty(-(-value.numel() // 256))
    quantize_flat(value.reshape(-1), codes, absmax, signed, 256)
    return codes.view(value.shape), absmax


def test_a_shrinking_second_moment_keeps_its_maximum_apart_with_amsgrad() -> None:
    runs = []
    for setting in (False, "auto"):
        params = _params([(4096,)])
        opt = KahanOptimizer(torch.optim.Adam(params, lr=1e-2, betas=(0.9, 0.5), amsgrad=True), state_dtype="8bit",
                             compile=setting)
        for scale in (1.0, 0.01, 0.01):  # v falls under its running maximum in every block
            params[0].grad = (torch.randn(4096, generator=torch.Generator().manual_seed(7)) * scale).bfloat16()
            opt.step()
        state = opt.optimizer.state[params[0]]
        assert bool((state["max_exp_avg_sq_absmax"] > state["exp_avg_sq_absmax"] * 3).all())
        runs.append((params[0].detach().clone(), state["max_exp_avg_sq"].clone(), state["max_exp_avg_sq_absmax"].clone()))
    (w_e, c_e, s_e), (w_n, c_n, s_n) = runs
    assert torch.equal(w_e.view(torch.int16), w_n.view(torch.int16))
    assert torch.equal(c_e, c_n) and torch.equal(s_e, s_n)


def test_a_native_remainder_step_that_changes_nothing_gives_back_every_master_bit_ties_included() -> None:
    params = _params()
    opt = RemainderOptimizer(torch.optim.AdamW(params, lr=0.0, weight_decay=0.0), state_dtype="bf16")
    g = torch.Generator().manual_seed(1)
    masters = []
    for p in params:  # every 50th master a tie rounded down (low 17 bits 0x8000), next to it one rounded up
        bits = (torch.randn(p.shape, generator=g) * 3).view(torch.int32)
        bits.view(-1)[::50] = (bits.view(-1)[::50] & ~0x1FFFF) | 0x8000
        bits.view(-1)[1::50] = (bits.view(-1)[1::50] & ~0x1FFFF) | 0x18000
        master = bits.view(torch.float32)
        with torch.no_grad():
            p.copy_(master.to(torch.bfloat16))
        opt._set_master(p, master)
        masters.append(master.clone())
    opt.note_written(params)
    assert all(opt._ties(p).numel() > 0 for p in params)
    _grads(params, 0)
    opt.step()
    for p, master in zip(params, masters, strict=True):
        assert torch.equal(opt.master(p).view(torch.int32), master.view(torch.int32))
        assert torch.equal(p.detach().view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
        assert torch.equal(opt._ties(p), split_master(master)[2])


def test_native_stochastic_rounding_draws_the_compiled_routes_noise(monkeypatch) -> None:
    from mixprec.compiling import compile_works

    if not compile_works(torch.device("cpu")):
        pytest.skip("torch.compile does not work here")

    def make(inner, setting):
        return StochasticRoundingOptimizer(inner, state_dtype="8bit", compile=setting)

    calls = _calls(monkeypatch)
    shapes = [(300, 64), (1024,)]  # whole 8-bit blocks: the compiled route takes both too
    native_run, opt_n = _run(make, "auto", shapes=shapes)
    assert calls[0] and not opt_n._compiled_layouts
    compiled_run, opt_c = _run(make, True, shapes=shapes)
    assert opt_c._compiled_layouts
    for a, b in zip(native_run, compiled_run, strict=True):  # the same noise; the update within fp32 rounding
        assert _same_bits(a, b) > 0.99
    assert opt_n._counter == opt_c._counter == [6]


def test_ranges_on_several_threads_give_the_bits_of_one(monkeypatch) -> None:
    def make(inner, setting):
        return RemainderOptimizer(inner, state_dtype="8bit", compile=setting)

    shapes = [(3 * native.PARALLEL_NUMEL + 1000,), (1000,)]
    runs = []
    for threads in (1, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        calls = _calls(monkeypatch)
        params, opt = _run(make, "auto", steps=3, shapes=shapes)
        assert calls[0] == 3 * (threads + 1)  # the large weight in `threads` ranges
        runs.append((params, opt))
    (a, opt_a), (b, opt_b) = runs
    for x, y in zip(a, b, strict=True):
        assert torch.equal(opt_a.master(x).view(torch.int32), opt_b.master(y).view(torch.int32))
        assert torch.equal(opt_a._ties(x), opt_b._ties(y))


def test_optimizer_in_backward_steps_natively_one_weight_at_a_time(monkeypatch) -> None:
    calls = _calls(monkeypatch)
    results = []
    for setting in (False, "auto"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8)).bfloat16()
        opt = InBackwardOptimizer(KahanOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), state_dtype="8bit",
                                                 compile=setting))
        x = torch.randn(32, 64).bfloat16()
        for _ in range(3):
            model(x).float().pow(2).mean().backward()  # each weight is stepped as its gradient is ready
            assert opt.finish()
        results.append([p.detach().clone() for p in model.parameters()])
    assert calls[0] == 3 * 4  # four weights, each stepped by itself, three times
    for a, b in zip(*results, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_an_interrupt_waits_for_the_kernels_and_the_step_is_counted(monkeypatch) -> None:
    params = _params(SHAPES[:2])
    opt = KahanOptimizer(torch.optim.AdamW(params, lr=1e-2), state_dtype="8bit")
    real_wait, raised = native.wait, []

    def interrupted(futures):
        if not raised:
            raised.append(True)
            raise KeyboardInterrupt
        return real_wait(futures)

    monkeypatch.setattr(native, "wait", interrupted)
    _grads(params, 0)
    before = [p.detach().clone() for p in params]
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    for p, old in zip(params, before, strict=True):
        assert float(opt.optimizer.state[p]["step"]) == 1.0  # stepped, and counted
        assert not torch.equal(p.detach(), old)


def test_auto_takes_the_native_route_for_8bit_moments_and_remainders_with_low_precision_moments() -> None:
    use = native.use_native_route
    for rounding in ("nearest", "kahan", "stochastic", "remainder"):
        assert use("auto", rounding, torch.uint8)
        assert not use(True, rounding, torch.uint8) and not use(False, rounding, torch.uint8)
    assert use("auto", "remainder", torch.bfloat16) and use("auto", "remainder", torch.float16)
    assert not use("auto", "remainder", None)  # fp32 moments: torch's fused kernel, bit for bit bf16-master
    assert not use("auto", "kahan", torch.bfloat16)  # the compiled route is fast there already
    w = torch.zeros(10, dtype=torch.bfloat16)
    assert native.takes_param("remainder", w) and not native.takes_param("remainder", w.half())
    assert not native.takes_param("kahan", torch.zeros(4, 4, dtype=torch.bfloat16).t())  # not contiguous


def test_moments_of_another_layout_are_made_contiguous_and_a_wrong_size_is_refused() -> None:
    params = _params([(40, 30)])
    p = params[0]
    opt = KahanOptimizer(torch.optim.AdamW(params, lr=1e-2), state_dtype="bf16", compile=False)
    _grads(params, 0)
    opt.step()
    opt8 = RemainderOptimizer(torch.optim.AdamW(params, lr=1e-2), state_dtype="bf16")
    state = opt8.optimizer.state[p]
    state["step"] = torch.tensor(1.0)
    state["exp_avg"] = torch.zeros(30, 40, dtype=torch.bfloat16).t()  # a transposed copy: same shape, other strides
    state["exp_avg_sq"] = torch.zeros(30, 40, dtype=torch.bfloat16).t()
    _grads(params, 1)
    opt8.step()
    assert opt8.optimizer.state[p]["exp_avg"].is_contiguous()
    assert float(opt8.optimizer.state[p]["exp_avg"].float().abs().sum()) > 0
    state = opt8.optimizer.state[p]
    state["exp_avg"] = torch.zeros(7, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"exp_avg.*1200 elements"):
        native.native_adam_step(opt8.optimizer, opt8.optimizer.param_groups[0], [p], state_dtype=torch.bfloat16,
                                rounding="remainder", comps=opt8._compiled_rounding_inputs(),
                                remainder=opt8._compiled_remainder())


def test_the_compact_lookup_is_checked_against_the_full_one() -> None:
    from mixprec.optim.quant import lookup_tables

    first, points = lookup_tables(True, torch.device("cpu"))
    table = codecs.compact_lookup(first, points, 103)
    codecs.compact_agrees(table, first, points, 103)
    broken = table.clone()
    broken[5000] += 1  # one run's code off by one
    with pytest.raises(AssertionError, match="compact"):
        codecs.compact_agrees(broken, first, points, 103)


def test_the_step_memory_estimate_counts_no_scratch_for_native_weights() -> None:
    from mixprec.optim.footprint import low_precision_step_transient

    params = [torch.nn.Parameter(torch.zeros(1000, 1024, dtype=torch.bfloat16))]
    common = {"fast": True, "fused": True, "chunk_numel": None, "state_dtype": torch.uint8}
    for rounding in ("kahan", "remainder"):
        auto = low_precision_step_transient(torch.optim.AdamW(params), compile="auto", rounding=rounding, **common)
        eager = low_precision_step_transient(torch.optim.AdamW(params), compile=False, rounding=rounding, **common)
        assert auto == 0 < eager


def test_the_plans_take_the_native_route_by_default(monkeypatch) -> None:
    calls = _calls(monkeypatch)
    for plan in (get_plan("bf16-master", remainders=True, state_dtype="bf16"), get_plan("bf16-sr", state_dtype="8bit")):
        params = _params(SHAPES[:1])
        opt = plan.wrap_optimizer(torch.optim.AdamW(params, lr=1e-2), {})
        _grads(params, 0)
        before = calls[0]
        opt.step()
        assert calls[0] == before + 1, plan.name


def test_turned_off_by_the_environment_it_names_the_setting_and_the_other_routes_step(monkeypatch) -> None:
    monkeypatch.setenv(native.ENV, "0")
    native_build.reset()
    try:
        ok, why = native.status()
        assert not ok and native.ENV in why
        assert not native.use_native_route("auto", "kahan", torch.uint8)
        params, opt = _run(lambda inner, s: KahanOptimizer(inner, state_dtype="8bit", compile=s), "auto", steps=2,
                           shapes=SHAPES[:2])
        assert float(opt.optimizer.state[params[0]]["step"]) == 2.0
    finally:
        monkeypatch.delenv(native.ENV)
        native_build.reset()
    assert native.status()[0]


def test_a_compiler_that_fails_leaves_the_route_off_with_its_message(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native_build.reset()
    try:
        ok, why = native.status()
        assert not ok and "failed" in why
    finally:
        monkeypatch.delenv("CC")
        monkeypatch.delenv("XDG_CACHE_HOME")
        native_build.reset()
    assert native.status()[0]


@pytest.mark.parametrize("target", ["-march=x86-64-v3", "-march=x86-64"], ids=["avx2", "plain-c"])
def test_the_avx2_and_plain_c_loops_give_the_same_bits(target, monkeypatch, tmp_path) -> None:
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 target flags")
    if target.endswith("v3") and "avx2" not in native_build.cpu_flags():
        pytest.skip("this CPU has no AVX2")

    def make(inner, setting):
        return RemainderOptimizer(inner, state_dtype="8bit", compile=setting)

    reference, opt_r = _run(make, "auto", steps=3, amsgrad=True)  # this machine's widest loops
    monkeypatch.setenv(native.FLAGS_ENV, target)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native_build.reset()
    try:
        assert native.status()[0], native.status()[1]
        other, opt_o = _run(make, "auto", steps=3, amsgrad=True)
    finally:
        monkeypatch.delenv(native.FLAGS_ENV)
        monkeypatch.delenv("XDG_CACHE_HOME")
        native_build.reset()
    assert list((tmp_path / "mixprec" / "native").glob("*.so"))
    for a, b in zip(reference, other, strict=True):
        assert torch.equal(opt_r.master(a).view(torch.int32), opt_o.master(b).view(torch.int32))
        sa, sb = opt_r.optimizer.state[a], opt_o.optimizer.state[b]
        assert all(torch.equal(sa[k], sb[k]) for k in sa), a.shape


def test_deferred_clip_factors_are_applied_in_turn_as_the_eager_path_does() -> None:
    results = []
    for setting in (False, "auto"):
        params = _params([(300, 64)])
        opt = RemainderOptimizer(torch.optim.AdamW(params, lr=1e-2), state_dtype="bf16", compile=setting)
        _grads(params, 0)
        opt.scale_grads_later(torch.tensor(0.3))
        opt.scale_grads_later(torch.tensor(0.7))
        opt.step()
        results.append((opt.master(params[0]), opt.optimizer.state[params[0]]["exp_avg"]))
    (master_e, m_e), (master_n, m_n) = results
    assert torch.equal(master_e.view(torch.int32), master_n.view(torch.int32))
    assert torch.equal(m_e.view(torch.int16), m_n.view(torch.int16))
    assert float(m_n.float().abs().max()) < 0.3 * 0.7 * 0.1 * 0.1 * 5  # applied: (1 - beta1) * 0.21 * |grad|


def test_moments_held_in_fp32_are_kept_in_the_state_dtype_from_the_first_native_step() -> None:
    params = _params([(300, 64)])
    inner = torch.optim.AdamW(params, lr=1e-2)
    _grads(params, 0)
    inner.step()  # fp32 moments, made before the wrapper
    opt = RemainderOptimizer(inner, state_dtype="bf16")
    _grads(params, 1)
    opt.step()
    state = inner.state[params[0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert float(state["step"]) == 2.0



def test_one_step_differs_from_the_eager_one_only_where_torchs_vector_loop_ends() -> None:
    # one step: a weight or moment element differs only in torch's scalar tail (the last numel % 16
    # elements); 8-bit codes only in the block holding the tail (its absmax may move), scales only there
    def make(inner, setting):
        return KahanOptimizer(inner, state_dtype="8bit", compile=setting)

    shapes = [(1000,), (70001,), (4096,)]
    eager, opt_e = _run(make, False, steps=1, shapes=shapes)
    taken, opt_n = _run(make, "auto", steps=1, shapes=shapes)
    for a, b in zip(eager, taken, strict=True):
        n = a.numel()
        tail = n - n % 16
        differ = (a.detach().view(torch.int16) != b.detach().view(torch.int16)).nonzero().view(-1)
        assert bool((differ >= tail).all()), (n, differ[:5])
        for key in ("exp_avg", "exp_avg_sq"):
            codes = (opt_e.optimizer.state[a][key] != opt_n.optimizer.state[b][key]).nonzero().view(-1)
            assert bool((codes >= tail // 256 * 256).all()), (n, key)
    assert torch.equal(eager[2].detach().view(torch.int16), taken[2].detach().view(torch.int16))


def test_an_empty_weight_is_counted_and_touched_nowhere() -> None:
    params = _params([(0,), (300,)])
    opt = KahanOptimizer(torch.optim.AdamW(params, lr=1e-2), state_dtype="8bit")
    for step in range(2):
        _grads(params, step)
        opt.step()
    assert float(opt.optimizer.state[params[0]]["step"]) == float(opt.optimizer.state[params[1]]["step"]) == 2.0


def test_gradients_of_another_dtype_are_read_as_they_are() -> None:
    runs = []
    for setting in (False, "auto"):
        params = _params([(4096,)])
        opt = RemainderOptimizer(torch.optim.AdamW(params, lr=1e-2), state_dtype="8bit", compile=setting)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            params[0].grad_dtype = None
            params[0].grad = torch.randn(params[0].shape, generator=g) * 0.1  # fp32
            opt.step()
        runs.append(opt.master(params[0]))
    assert torch.equal(runs[0].view(torch.int32), runs[1].view(torch.int32))


def test_parameters_with_different_step_counts_each_get_their_own_bias_correction() -> None:
    runs = []
    for setting in (False, "auto"):
        params = _params([(4096,), (2048,)])
        opt = KahanOptimizer(torch.optim.AdamW(params, lr=1e-2), state_dtype="8bit", compile=setting)
        for step in range(4):
            _grads(params, step)
            if step % 2:
                params[1].grad = None  # an expert that got no tokens
            opt.step()
        runs.append([p.detach().clone() for p in params])
        assert float(opt.optimizer.state[params[1]]["step"]) == 2.0
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_native_writes_are_seen_by_autograd_and_by_the_undo_copies() -> None:
    params = _params([(512,)])
    opt = KahanOptimizer(torch.optim.AdamW(params, lr=1e-2), state_dtype="8bit")
    loss = (params[0] * params[0]).float().sum()  # the product saves the weight for its backward
    loss.backward(retain_graph=True)
    version = params[0]._version
    opt.step()
    assert params[0]._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_the_fp16_overflow_guard_undoes_a_native_step() -> None:
    params = _params([(512,)], dtype=torch.float16)
    with torch.no_grad():
        params[0].fill_(60000.0)
    opt = LowPrecisionOptimizer(torch.optim.Adam(params, lr=1.0), state_dtype="8bit")
    params[0].grad = torch.full_like(params[0], 1.0)
    opt.step()  # a finite step (down, by about lr)
    assert not bool(opt.step_nonfinite())
    before = params[0].detach().clone()
    codes = opt.optimizer.state[params[0]]["exp_avg"].clone()
    opt.optimizer.param_groups[0]["lr"] = 1e6
    params[0].grad = torch.full_like(params[0], -1.0)  # this update takes the weights past fp16's 65504
    opt.step()
    assert bool(opt.step_nonfinite())
    assert torch.equal(params[0].detach(), before)  # undone, the moments too
    assert torch.equal(opt.optimizer.state[params[0]]["exp_avg"], codes)
    assert float(opt.optimizer.state[params[0]]["step"]) == 1.0


@pytest.mark.parametrize("kind", ["2-D", "int32", "unsorted"])
def test_tie_lists_of_another_form_are_read_as_flat_sorted_indices(kind) -> None:
    params = _params([(5000,)])
    opt = RemainderOptimizer(torch.optim.AdamW(params, lr=0.0, weight_decay=0.0), state_dtype="bf16")
    p = params[0]
    bits = torch.randn(5000).view(torch.int32)
    bits[::97] = (bits[::97] & ~0x1FFFF) | 0x8000
    master = bits.view(torch.float32)
    with torch.no_grad():
        p.copy_(master.to(torch.bfloat16))
    opt._set_master(p, master)
    opt.note_written(params)
    ties = opt._ties(p)
    assert ties.numel() > 10
    odd = {"2-D": ties.flip(0).view(-1, 1), "int32": ties.to(torch.int32), "unsorted": ties[torch.randperm(ties.numel())]}
    opt.kinds.set("remainder_ties", p, odd[kind])
    _grads(params, 0)
    opt.step()
    assert torch.equal(opt.master(p).view(torch.int32), master.view(torch.int32))


def test_the_memory_estimate_does_not_build_the_kernel(monkeypatch) -> None:
    from mixprec.optim.footprint import low_precision_step_transient

    monkeypatch.setattr(native_build, "_build", lambda: pytest.fail("the estimate built the kernel"))
    monkeypatch.setattr(native_build, "_state", {})
    params = [torch.nn.Parameter(torch.zeros(1000, 1024, dtype=torch.bfloat16))]
    assert low_precision_step_transient(torch.optim.AdamW(params), compile="auto", rounding="kahan", fast=True,
                                        fused=True, chunk_numel=None, state_dtype=torch.uint8) == 0


def test_a_compiler_without_float16_builds_a_kernel_that_leaves_fp16_tensors_to_the_other_routes(
    monkeypatch, tmp_path
) -> None:
    monkeypatch.setenv(native.FLAGS_ENV, "-march=native -U__FLT16_MAX__")  # as GCC 11 or clang 14 would build it
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native_build.reset()
    try:
        assert native.status()[0] and not native_build.has_f16()
        calls = _calls(monkeypatch)
        w16 = _params([(512,)], dtype=torch.float16)
        w16[0].grad = torch.ones_like(w16[0])
        assert not native.takes("kahan", w16[0], None)
        assert not native.use_native_route("auto", "remainder", torch.float16)
        opt = KahanOptimizer(torch.optim.AdamW(w16, lr=1e-2), state_dtype="8bit")
        opt.step()  # the eager path
        assert calls[0] == 0 and float(opt.optimizer.state[w16[0]]["step"]) == 1.0
        bf = _params([(512,)])
        opt = KahanOptimizer(torch.optim.AdamW(bf, lr=1e-2), state_dtype="8bit")
        _grads(bf, 0)
        opt.step()
        assert calls[0] == 1  # bf16 weights still step natively
    finally:
        monkeypatch.delenv(native.FLAGS_ENV)
        monkeypatch.delenv("XDG_CACHE_HOME")
        native_build.reset()


def test_the_kernel_refuses_tensor_kinds_or_ranges_it_does_not_take_before_touching_anything() -> None:
    import ctypes

    lib = native_build.library()
    out = ctypes.c_void_p()
    bad = [
        {"w_kind": 0, "g_kind": 1, "s_kind": 1, "rounding": 0},  # an fp32 weight
        {"w_kind": 1, "g_kind": 3, "s_kind": 1, "rounding": 0},  # 8-bit "gradients"
        {"w_kind": 2, "g_kind": 1, "s_kind": 1, "rounding": 2},  # stochastic rounding of fp16
        {"w_kind": 1, "g_kind": 1, "s_kind": 1, "rounding": 7},  # no such store
        {"w_kind": 1, "g_kind": 1, "s_kind": 1, "rounding": 0, "begin": 16},  # not a block boundary
    ]
    for fields in bad:  # null pointers: a kernel that read or wrote anything would crash
        args = native_build.Args(**({"begin": 0, "end": 256} | fields))
        assert lib.mp_adam(ctypes.byref(args), ctypes.byref(out)) == -2, fields


def test_a_switch_value_it_does_not_understand_is_refused_when_the_optimizer_is_built(monkeypatch) -> None:
    monkeypatch.setenv(native.ENV, "maybe")
    native_build.reset()
    try:
        with pytest.raises(ValueError, match=r"MIXPREC_NATIVE='maybe' is not understood: set it to 0"):
            KahanOptimizer(torch.optim.AdamW(_params([(8,)]), lr=1e-2), state_dtype="8bit")
        with pytest.raises(ValueError, match="MIXPREC_NATIVE"):
            native.status(build=False)
    finally:
        monkeypatch.delenv(native.ENV)
        native_build.reset()


@pytest.mark.parametrize("plan", [{"name": "bf16-sr", "state_dtype": "8bit"},
                                  {"name": "bf16-master", "remainders": True, "state_dtype": "8bit"}])
def test_the_front_doors_checkpoint_resumes_native_steps_bit_for_bit(plan, monkeypatch, tmp_path) -> None:
    from mixprec import MixedPrecision, load_checkpoint, save_checkpoint

    calls = _calls(monkeypatch)

    def session():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 300), torch.nn.GELU(), torch.nn.Linear(300, 4))
        spec = dict(plan)
        mp = MixedPrecision(get_plan(spec.pop("name"), **spec))
        model, opt = mp.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        return mp, model, opt

    def train(mp, model, steps) -> list[float]:
        losses = []
        for step in steps:
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
            with mp.autocast():
                loss = (model(x).float() - y).pow(2).mean()
            mp.backward(loss)
            mp.step()
            losses.append(float(loss.detach()))
        return losses

    mp, model, opt = session()
    train(mp, model, range(3))
    save_checkpoint(tmp_path / "ckpt.pt", model=model, optimizers=[opt], mp=mp)
    straight = train(mp, model, range(3, 6))
    after = [p.detach().clone() for p in model.parameters()]
    mp2, model2, opt2 = session()
    load_checkpoint(tmp_path / "ckpt.pt", model=model2, optimizers=[opt2], mp=mp2)
    assert train(mp2, model2, range(3, 6)) == straight
    for a, b in zip(after, model2.parameters(), strict=True):
        assert torch.equal(a, b.detach())
    assert calls[0] >= 9  # the steps took the native route

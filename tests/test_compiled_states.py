"""The compiled Adam/AdamW route for remainder masters and 8-bit moments.

Oracles: the eager fast path (the same wrapper with ``compile=False``) within fp32 rounding,
the eager quantizer bit for bit, and, for remainders, the masters themselves: a step that
leaves them unchanged must give back every bit, ties included.
"""

from __future__ import annotations

import pytest
import torch

from mixprec import get_plan
from mixprec.compiling import compile_works
from mixprec.optim import KahanOptimizer, LowPrecisionOptimizer, RemainderOptimizer
from mixprec.optim.compiled import use_compiled_route
from mixprec.optim.quant import join_master, split_master
from mixprec.optim.states import BLOCKWISE

pytestmark = pytest.mark.skipif(not compile_works(torch.device("cpu")), reason="torch.compile does not work here")

SHAPES = [(300, 64), (1024,), (17,)]  # the last: a partial 8-bit block (it steps eagerly)


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in SHAPES]


def _grads(params: list[torch.nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 0.1).bfloat16()


def _run(make, compile: bool, steps: int = 6, **adam):
    params = _params()
    opt = make(torch.optim.AdamW(params, **({"lr": 1e-2, "weight_decay": 0.1} | adam)), compile)
    for step in range(steps):
        _grads(params, step)
        opt.step()
    return params, opt


@pytest.mark.parametrize("form", [c.name for c in BLOCKWISE.values()])
def test_the_compiled_block_store_gives_the_eager_encoders_codes_and_scales_bit_for_bit(form) -> None:
    codec = next(c for c in BLOCKWISE.values() if c.name == form)
    tables = codec.tables(torch.device("cpu"))
    store = torch.compile(codec.fused_store, dynamic=False)
    load = torch.compile(codec.fused_load, dynamic=False)
    g = torch.Generator().manual_seed(0)
    for n in (1024, 256, 4096):
        x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 6  # values across the map's decades
        x[::97] = 0.0
        x[300:556] = 0.0  # an all-zero block
        for signed in (True, False):
            value = x if signed else x * x
            codes, scales = torch.empty(n, dtype=codec.dtype), torch.empty(-(-n // 256))
            store(value, codes, scales, signed, tables, None)
            want_codes, want_scales = torch.empty_like(codes), torch.empty_like(scales)
            codec.encode(value, want_codes, want_scales, signed)
            assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)), (n, signed)
            assert torch.equal(scales, want_scales), (n, signed)
            back = codec.decode(codes, scales, signed, None)
            assert torch.equal(load(codes, scales, signed, tables), back), (n, signed)
            before = codes.view(torch.uint8).clone(), scales.clone()  # a step skipped on the device writes nothing
            store(value * 3 + 1, codes, scales, signed, tables, torch.tensor(True))
            assert torch.equal(codes.view(torch.uint8), before[0]) and torch.equal(scales, before[1])


def test_a_compiled_remainder_step_that_changes_nothing_gives_back_every_master_bit_ties_included() -> None:
    params = _params()
    opt = RemainderOptimizer(torch.optim.AdamW(params, lr=0.0, weight_decay=0.0), compile=True)
    g = torch.Generator().manual_seed(1)
    masters = []
    for p in params:  # random fp32 masters; every 50th a tie rounded down (low 17 bits 0x8000), next to it one rounded up
        bits = (torch.randn(p.shape, generator=g) * 3).view(torch.int32)
        bits.view(-1)[::50] = (bits.view(-1)[::50] & ~0x1FFFF) | 0x8000
        bits.view(-1)[1::50] = (bits.view(-1)[1::50] & ~0x1FFFF) | 0x18000
        master = bits.view(torch.float32)
        with torch.no_grad():
            p.copy_(master.to(torch.bfloat16))
        opt._set_master(p, master)
        masters.append(master.clone())
    opt.note_written(params)  # the weights were written here, as the wrapper's own store would
    assert all(opt._ties(p).numel() > 0 for p in params)
    _grads(params, 0)
    opt.step()
    assert "remainder" in str(opt._compiled_layouts)  # it took the compiled route
    for p, master in zip(params, masters, strict=True):
        assert torch.equal(opt.master(p).view(torch.int32), master.view(torch.int32))
        assert torch.equal(p.detach().view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
        weight, rem, ties = split_master(master)
        assert torch.equal(opt._ties(p), ties)
        assert torch.equal(join_master(p.detach(), opt.kinds.get("remainder", p), opt._ties(p)).view(torch.int32),
                           master.view(torch.int32))


@pytest.mark.parametrize("state_dtype", [None, "bf16", "8bit"])
def test_compiled_remainder_steps_equal_the_eager_ones_within_rounding(state_dtype) -> None:
    def make(inner, compile):
        return RemainderOptimizer(inner, state_dtype=state_dtype, compile=compile)

    eager, opt_e = _run(make, False)
    compiled, opt_c = _run(make, True)
    assert opt_c._compiled_layouts and not opt_e._compiled_layouts
    for a, b in zip(eager, compiled, strict=True):
        master_a, master_b = opt_e.master(a), opt_c.master(b)
        assert torch.equal(b.detach().view(torch.int16), master_b.to(torch.bfloat16).view(torch.int16))
        diff = (master_a - master_b).abs()
        if state_dtype is None:  # within fp32 rounding: a few units in the last place over 6 steps
            assert bool((diff <= 1e-6 * master_a.abs() + 1e-6).all())  # (a misread tie: 4e-3 relative)
        else:  # within the moments' own rounding: a step is at most lr = 1e-2
            assert float(diff.max()) < 6e-2 and float((diff > 1e-3).float().mean()) < 0.01, state_dtype
    assert set(opt_e.state_dict()["state"][0]) == set(opt_c.state_dict()["state"][0])


@pytest.mark.parametrize("form", [c.name for c in BLOCKWISE.values()])
@pytest.mark.parametrize("wrapper", [KahanOptimizer, LowPrecisionOptimizer])
def test_compiled_block_coded_steps_equal_the_eager_ones_within_the_quantization(wrapper, form) -> None:
    def make(inner, compile):
        return wrapper(inner, state_dtype=form, compile=compile)

    eager, opt_e = _run(make, False)
    compiled, opt_c = _run(make, True)
    assert opt_c._compiled_layouts and not opt_e._compiled_layouts
    for a, b in zip(eager, compiled, strict=True):
        diff = (a.detach().float() - b.detach().float()).abs()
        assert float(diff.max()) < 0.1 and float((diff > 1e-2).float().mean()) < 0.01
        sa, sb = opt_e.optimizer.state[a], opt_c.optimizer.state[b]
        assert {k: v.dtype for k, v in sa.items()} == {k: v.dtype for k, v in sb.items()}
        codes_differ = (sa["exp_avg_sq"].view(torch.uint8) != sb["exp_avg_sq"].view(torch.uint8)).float().mean()
        assert float(codes_differ) < 0.01
    # a state dict of the compiled route continues on the eager one
    opt_e.load_state_dict(opt_c.state_dict())
    _grads(eager, 9)
    opt_e.step()


def test_a_deferred_clip_scales_the_gradients_on_the_compiled_route_too() -> None:
    def make(inner, compile):
        return RemainderOptimizer(inner, state_dtype="bf16", compile=compile)

    results = []
    for compile in (False, True):
        params = _params()
        opt = make(torch.optim.AdamW(params, lr=1e-2), compile)
        _grads(params, 0)
        opt.scale_grads_later(torch.tensor(1e-3))
        opt.step()
        results.append(opt.optimizer.state[params[0]]["exp_avg"].float())
    assert torch.allclose(results[0], results[1], rtol=1e-2, atol=1e-9)
    assert float(results[1].abs().max()) < 1e-4  # the clip was applied (unclipped: about 1e-2)


def test_auto_compiles_where_the_eager_path_takes_several_passes() -> None:
    big = [torch.zeros(1 << 20, dtype=torch.bfloat16)]
    assert use_compiled_route("auto", "remainder", big, state_dtype=torch.bfloat16)
    assert not use_compiled_route("auto", "remainder", big, state_dtype=torch.uint8)  # measured no faster
    assert not use_compiled_route("auto", "remainder", big, state_dtype=None)  # fused: bit for bit bf16-master
    assert use_compiled_route("auto", "nearest", big, state_dtype=torch.uint8)
    assert not use_compiled_route("auto", "nearest", big, state_dtype=torch.bfloat16)
    assert not use_compiled_route("auto", "remainder", [torch.zeros(10, dtype=torch.bfloat16)],
                                  state_dtype=torch.bfloat16)


def test_the_master_plan_passes_its_compile_setting_and_refuses_it_without_remainders() -> None:
    params = _params()
    plan = get_plan("bf16-master", remainders=True, state_dtype="bf16", optimizer_compile=False)
    opt = plan.wrap_optimizer(torch.optim.AdamW(params), {})
    assert isinstance(opt, RemainderOptimizer) and opt.compile is False
    with pytest.raises(ValueError, match="remainders=True"):
        get_plan("bf16-master", optimizer_compile=True)
    with pytest.raises(ValueError, match="optimizer_compile"):
        get_plan("bf16-master", remainders=True, optimizer_compile="yes")


def test_moments_held_in_another_dtype_are_converted_before_the_compiled_8bit_step() -> None:
    params = _params()
    inner = torch.optim.AdamW(params, lr=1e-2)
    _grads(params, 0)
    inner.step()  # fp32 moments, made before the wrapper
    opt = KahanOptimizer(inner, state_dtype="8bit", compile=True)
    _grads(params, 1)
    opt.step()
    state = inner.state[params[0]]
    assert state["exp_avg"].dtype == torch.uint8 and "exp_avg_absmax" in state
    assert opt._compiled_layouts


def test_the_step_memory_estimate_counts_the_weights_that_step_eagerly(monkeypatch) -> None:
    from mixprec.optim import native
    from mixprec.optim.footprint import low_precision_step_transient

    monkeypatch.setattr(native, "use_native_route", lambda *args, **kwargs: False)  # the compiled route's estimate

    odd = [torch.nn.Parameter(torch.zeros(1000, 1049, dtype=torch.bfloat16))]  # not whole 8-bit blocks
    common = {"fast": True, "fused": True, "chunk_numel": None, "state_dtype": torch.uint8}
    for rounding in ("kahan", "remainder"):
        auto = low_precision_step_transient(torch.optim.AdamW(odd), compile="auto", rounding=rounding, **common)
        eager = low_precision_step_transient(torch.optim.AdamW(odd), compile=False, rounding=rounding, **common)
        assert auto == eager > 0


def test_a_failed_compile_lowers_the_raised_ties_and_the_eager_step_gives_the_same_bits(monkeypatch) -> None:
    import mixprec.optim.compiled as compiled
    import mixprec.optim.routing as routing

    def failing(fn, **kwargs):
        def run(*args, **kw):
            raise torch._dynamo.exc.TorchDynamoException("no compiler")

        return run

    runs = []
    for setting in (False, "auto"):  # the eager reference first, then a compile that fails
        if setting == "auto":
            monkeypatch.setattr(compiled, "_LAYOUTS", set())
            monkeypatch.setattr(compiled, "compiled", failing)
            monkeypatch.setattr(routing, "use_compiled_route", lambda *args, **kwargs: True)
            monkeypatch.setattr(routing, "mark_compile_failed", lambda *args: None)  # keep the compiler usable
        params = _params()
        opt = RemainderOptimizer(torch.optim.AdamW(params, lr=1e-2), compile=setting)
        with torch.no_grad():  # every 40th master with an even weight an exact tie rounded down
            for p in params:
                bits = p.detach().float().view(torch.int32).clone().view(-1)
                bits[::40] |= torch.where((bits[::40] >> 16) & 1 == 0, 0x8000, 0)
                opt._set_master(p, bits.view(p.shape).view(torch.float32))
        opt.note_written(params)
        assert all(opt._ties(p).numel() for p in params)
        _grads(params, 0)
        opt.step()
        assert not opt._compiled_layouts
        runs.append([opt.master(p).view(torch.int32) for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))

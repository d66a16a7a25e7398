"""The multi-tensor fast paths of the low-precision wrappers against the generic per-parameter path.

Reference: the same wrapper with ``fast=False``, which runs torch's own optimizer on fp32
proxies of each parameter. On CPU the fast path performs torch's single-tensor fp32
operations in torch's order and draws the same rounding noise, so every weight,
compensation and state tensor must be bit-identical, step after step, and after
state_dict round trips between the two paths.
"""

from __future__ import annotations

import ast
import copy
import re

import pytest
import torch

from mixprec.optim import (
    KahanOptimizer,
    LowPrecisionOptimizer,
    StochasticRoundingOptimizer,
    routing,
)
from mixprec.optim.fast import fast_kind

SHAPES = [(), (0,), (3,), (5, 7), (2, 3, 4), (40,), (1, 1)]

OPTIMIZERS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
    "adamw-amsgrad": lambda groups: torch.optim.AdamW(groups, lr=1e-2, betas=(0.8, 0.95), amsgrad=True),
    "adam-l2-maximize": lambda groups: torch.optim.Adam(groups, lr=1e-2, weight_decay=0.05, maximize=True),
    "adam-amsgrad-l2": lambda groups: torch.optim.Adam(groups, lr=3e-3, weight_decay=0.01, amsgrad=True, eps=1e-6),
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1),
    "sgd-momentum-wd": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=0.01, dampening=0.1),
    "sgd-nesterov-maximize": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.8, nesterov=True, maximize=True),
}
WRAPPERS = {
    "pure": LowPrecisionOptimizer,
    "kahan": KahanOptimizer,
    "sr": StochasticRoundingOptimizer,
}


@pytest.fixture(autouse=True)
def _fresh_layout_budget(monkeypatch):
    """Each test starts with a new process's budget of compiled layouts (not what earlier tests spent)."""
    import mixprec.optim.compiled as compiled

    monkeypatch.setattr(compiled, "_LAYOUTS", set())


def _params(seed: int, dtypes: tuple[torch.dtype, ...]) -> list[list[torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    groups: list[list[torch.nn.Parameter]] = [[], []]
    for i, shape in enumerate(SHAPES * 2):
        dtype = dtypes[i % len(dtypes)]
        value = torch.randn(shape, generator=gen) * 2
        groups[i % 2].append(torch.nn.Parameter(value.to(dtype)))
    return groups


def _build(opt_name: str, wrapper: str, seed: int, *, fast: bool, dtypes, state_dtype, chunk_numel: int = 64,
           fused: bool = False):
    groups = _params(seed, dtypes)
    inner = OPTIMIZERS[opt_name]([{"params": groups[0]}, {"params": groups[1], "lr": 2e-3}])
    cls = WRAPPERS[wrapper]
    opt = cls(inner, state_dtype=state_dtype, fast=fast, chunk_numel=chunk_numel, fused=fused)
    return [p for g in groups for p in g], opt


def _grads(params, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen).to(p.dtype)
        p.grad = None if (i + step) % 9 == 0 else g  # a parameter without gradient now and then


def _assert_same(params_a, opt_a, params_b, opt_b, label: str) -> None:
    for i, (a, b) in enumerate(zip(params_a, params_b, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{label}: parameter {i} differs"
        sa, sb = opt_a.state.get(a, {}), opt_b.state.get(b, {})
        assert list(sa) == list(sb), f"{label}: state keys of parameter {i}: {list(sa)} vs {list(sb)}"
        for key in sa:
            va, vb = sa[key], sb[key]
            if va is None or vb is None:
                assert va is vb, (label, i, key)
                continue
            assert va.dtype == vb.dtype and torch.equal(va, vb), f"{label}: state {key!r} of parameter {i} differs"
    if isinstance(opt_a, KahanOptimizer):
        for i, (a, b) in enumerate(zip(params_a, params_b, strict=True)):
            ca, cb = opt_a.compensation(a), opt_b.compensation(b)
            assert (ca is None) == (cb is None) or a.numel() == 0, (label, i)
            if ca is not None and cb is not None:
                assert torch.equal(ca, cb), f"{label}: compensation of parameter {i} differs"


def _step(params, opt, step: int) -> None:
    _grads(params, step)
    opt.step()


CASES = [
    (opt_name, wrapper)
    for opt_name in OPTIMIZERS
    for wrapper in WRAPPERS
]


@pytest.mark.parametrize(("opt_name", "wrapper"), CASES)
def test_fast_path_is_bit_identical_to_generic(opt_name, wrapper, monkeypatch):
    import mixprec.optim.routing as routing

    calls = []
    real = routing.fast_step
    monkeypatch.setattr(routing, "fast_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    dtypes = (torch.bfloat16,) if wrapper == "sr" else (torch.bfloat16, torch.float16, torch.float32)
    for seed, state_dtype in ((0, torch.bfloat16), (1, None)):
        pa, fast = _build(opt_name, wrapper, seed, fast=True, dtypes=dtypes, state_dtype=state_dtype)
        pb, generic = _build(opt_name, wrapper, seed, fast=False, dtypes=dtypes, state_dtype=state_dtype)
        assert fast_kind(fast.optimizer, fast.param_groups[0]) is not None
        for step in range(5):
            if step == 3:  # an LR scheduler changes the group's lr: both paths read it
                for o in (fast, generic):
                    o.param_groups[0]["lr"] *= 0.5
            before = len(calls)
            _step(pa, fast, step)
            assert len(calls) > before, "the fast optimizer did not take the fast path"
            before = len(calls)
            _step(pb, generic, step)
            assert len(calls) == before, "the generic optimizer took the fast path"
            _assert_same(pa, fast, pb, generic, f"{opt_name}/{wrapper}/{state_dtype} step {step}")
        # state stays in state_dtype, the step count in fp32
        for p in pa:
            for key, value in fast.state.get(p, {}).items():
                if key == "step":
                    assert value.dtype == torch.float32 and value.shape == ()
                elif value is not None and p.dtype != torch.float32:
                    assert value.dtype == (state_dtype or torch.float32), (key, value.dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units in the last place of ``a``'s dtype (at the larger magnitude)."""
    if a.numel() == 0:
        return 0.0
    mantissa = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[a.dtype]
    a32, b32 = a.float(), b.float()
    scale = torch.maximum(a32.abs(), b32.abs()).clamp_min(torch.finfo(a.dtype).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(scale)) - (mantissa - 1))
    return ((a32 - b32).abs() / ulp).max().item()


FUSED_ULPS = 3


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
@pytest.mark.parametrize("opt_name", ["adamw", "adamw-amsgrad", "adam-l2-maximize", "adam-amsgrad-l2"])
def test_fused_kernel_path_matches_generic_within_rounding(opt_name, wrapper):
    """torch's fused Adam kernels round differently inside fp32: each stored weight and
    moment stays within FUSED_ULPS units in the last place of its dtype of the generic
    path over 5 steps (one ulp per rounding boundary crossed, compounding through the
    moments: measured worst 2 on x86 CPU)."""
    dtypes = (torch.bfloat16,) if wrapper == "sr" else (torch.bfloat16, torch.float16, torch.float32)
    for seed, state_dtype in ((0, torch.bfloat16), (1, None)):
        pa, fast = _build(opt_name, wrapper, seed, fast=True, fused=True, dtypes=dtypes, state_dtype=state_dtype)
        pb, generic = _build(opt_name, wrapper, seed, fast=False, dtypes=dtypes, state_dtype=state_dtype)
        worst = 0.0
        for step in range(5):
            _step(pa, fast, step)
            _step(pb, generic, step)
            for a, b in zip(pa, pb, strict=True):
                worst = max(worst, _ulps(a, b))
                for key, va in fast.state.get(a, {}).items():
                    worst = max(worst, _ulps(va, generic.state[b][key]))
        assert worst <= FUSED_ULPS, f"{opt_name}/{wrapper}/{state_dtype}: {worst} ulps"


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
@pytest.mark.parametrize("opt_name", ["adamw-amsgrad", "sgd-momentum-wd"])
def test_state_dict_round_trips_between_fast_and_generic(opt_name, wrapper):
    dtypes = (torch.bfloat16,)
    pa, a = _build(opt_name, wrapper, 3, fast=True, dtypes=dtypes, state_dtype=torch.bfloat16)
    for step in range(3):
        _step(pa, a, step)
    for src_fast in (True, False):
        # continue from the same checkpoint on the other path and on the same path
        pb, b = _build(opt_name, wrapper, 3, fast=src_fast, dtypes=dtypes, state_dtype=torch.bfloat16)
        pc, c = _build(opt_name, wrapper, 3, fast=not src_fast, dtypes=dtypes, state_dtype=torch.bfloat16)
        with torch.no_grad():
            for x, y, z in zip(pa, pb, pc, strict=True):
                y.copy_(x)
                z.copy_(x)
        sd = copy.deepcopy(a.state_dict())
        b.load_state_dict(sd)
        c.load_state_dict(copy.deepcopy(b.state_dict()))  # saved by one path, loaded by the other
        _assert_same(pb, b, pc, c, "after load")
        for step in range(3, 6):
            _step(pb, b, step)
            _step(pc, c, step)
            _assert_same(pb, b, pc, c, f"{opt_name}/{wrapper} resumed, step {step}")


def test_pieces_cover_each_parameter_in_order_and_chunks_are_bounded():
    from mixprec.optim.fast import chunks

    a, b, c = torch.zeros(10), torch.zeros(3, 3), torch.zeros(2, 5).t()  # c is not contiguous
    out = chunks([a, b, c], lambda p: 0, 4, splittable=lambda p: p.is_contiguous())
    assert all(sum(pc.numel() for pc in chunk) <= 4 for chunk in out[:-1])
    pieces = [pc for chunk in out for pc in chunk]
    assert [(pc.param is a, pc.start, pc.end) for pc in pieces if pc.param is a] == [
        (True, 0, 4), (True, 4, 8), (True, 8, 10)
    ]
    assert [(pc.start, pc.end) for pc in pieces if pc.param is b] == [(0, 4), (4, 8), (8, 9)]
    whole = [pc for pc in pieces if pc.param is c]
    assert len(whole) == 1 and whole[0].whole and whole[0].value is c  # not contiguous: goes alone
    piece = pieces[1]
    piece.value.fill_(1.0)  # a view: writes reach the parameter
    assert a[4:8].eq(1).all() and a[:4].eq(0).all()


def test_chunks_are_bounded_and_large_parameters_are_cut_into_pieces():
    # chunk_numel smaller than every parameter (each element its own piece): same result as one big chunk
    dtypes = (torch.bfloat16,)
    pa, a = _build("adamw", "kahan", 5, fast=True, dtypes=dtypes, state_dtype=torch.bfloat16, chunk_numel=1)
    pb, b = _build("adamw", "kahan", 5, fast=True, dtypes=dtypes, state_dtype=torch.bfloat16, chunk_numel=1 << 20)
    for step in range(3):
        _step(pa, a, step)
        _step(pb, b, step)
    _assert_same(pa, a, pb, b, "chunk_numel=1 vs 2**20")


def test_unsupported_options_take_the_generic_path():
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    for inner in (
        torch.optim.AdamW([w], lr=0.1, capturable=True),
        torch.optim.Adam([w], lr=0.1, differentiable=True),
        torch.optim.RMSprop([w], lr=0.1),
    ):
        assert fast_kind(inner, inner.param_groups[0]) is None
    # and they still train through the generic path
    opt = KahanOptimizer(torch.optim.RMSprop([w], lr=0.01))
    w.grad = torch.ones_like(w)
    opt.step()
    assert (w < 1).all() and opt.state[w]["square_avg"].dtype == torch.bfloat16


def test_scalar_parameter_step_count_is_not_cast_to_the_state_dtype():
    # a 0-d parameter has the same shape as Adam's step counter: the counter must stay fp32
    w = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.bfloat16))
    for fast in (True, False):
        opt = LowPrecisionOptimizer(torch.optim.Adam([w], lr=1e-3), fast=fast)
        for _ in range(300):
            w.grad = torch.tensor(1.0, dtype=torch.bfloat16)
            opt.step()
        step = opt.state[w]["step"]
        assert step.dtype == torch.float32 and step.item() == 300.0, (fast, step)


def test_argument_errors():
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=re.escape("chunk_numel must be a positive int (elements expanded to fp32 at a time) or None (the device's default), got 0")):
        KahanOptimizer(torch.optim.SGD([w], lr=0.1), chunk_numel=0)
    with pytest.raises(TypeError, match=re.escape("fast must be True or False, got 'yes'")):
        KahanOptimizer(torch.optim.SGD([w], lr=0.1), fast="yes")  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_compiled_route_matches_generic_within_rounding(wrapper):
    """``compile=True``: one torch.compile-d loop per parameter (no fp32 copies), within
    FUSED_ULPS of the generic path over 4 steps, state in torch's keys and state_dtype.
    Stochastic rounding draws the same noise on both routes (mixprec.optim.codecs.Noise), so it is
    held to the same bound."""
    pytest.importorskip("torch._inductor")
    dtypes = (torch.bfloat16,)
    groups_a, groups_b = _params(11, dtypes), _params(11, dtypes)

    def make(groups, **kw):
        inner = torch.optim.AdamW([{"params": groups[0][:4]}, {"params": groups[1][:3], "lr": 2e-3}],
                                  lr=1e-2, weight_decay=0.1, amsgrad=True)
        return [p for g in (groups[0][:4], groups[1][:3]) for p in g], WRAPPERS[wrapper](inner, **kw)

    pa, a = make(groups_a, compile=True)
    pb, b = make(groups_b, fast=False)
    worst = 0.0
    for step in range(4):
        _step(pa, a, step)
        _step(pb, b, step)
        for x, y in zip(pa, pb, strict=True):
            worst = max(worst, _ulps(x, y))
            assert list(a.state.get(x, {})) == list(b.state.get(y, {}))
            for key, value in a.state.get(x, {}).items():
                assert value.dtype == b.state[y][key].dtype
                worst = max(worst, _ulps(value, b.state[y][key]))
    assert worst <= FUSED_ULPS, worst


@pytest.mark.slow
def test_compiled_stochastic_rounding_is_unbiased_and_resumes_exactly():
    # Adam's first step moves every weight by lr = 2**-9: 1 - 2**-9 lies halfway between the
    # bf16 neighbours 1 - 2**-8 and 1, so the stored weights split evenly, mean 1 - 2**-9
    def make():
        w = torch.nn.Parameter(torch.ones(100_000, dtype=torch.bfloat16))
        return w, StochasticRoundingOptimizer(torch.optim.Adam([w], lr=2.0**-9), compile=True, seed=3)

    w, opt = make()
    sd = copy.deepcopy(opt.state_dict())
    w.grad = torch.ones_like(w)
    opt.step()
    assert set(w.float().unique().tolist()) == {1.0 - 2.0**-8, 1.0}
    assert abs(w.float().mean().item() - (1.0 - 2.0**-9)) < 2e-5
    first = w.detach().clone()
    # the noise counter is checkpointed: a fresh wrapper loaded from sd rounds identically
    w2, opt2 = make()
    opt2.load_state_dict(sd)
    w2.grad = torch.ones_like(w2)
    opt2.step()
    assert torch.equal(w2, first)


@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, True])
def test_kahan_adam_keeps_updates_below_half_an_ulp(compile):
    # Adam with a constant gradient moves by lr = 2**-12 per step, a quarter of 1.0's
    # half-ulp in bf16: plain rounding never moves the weight, weight + compensation must
    # hold the sum (64 steps: 1 - 2**-6, up to the bf16 rounding of the compensation).
    # The compiled route must not fold the bf16 round trip of the stored weight away.
    w = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    opt = KahanOptimizer(torch.optim.Adam([w], lr=2.0**-12), compile=compile)
    for _ in range(64):
        w.grad = torch.ones_like(w)
        opt.step()
    total = w.float() + opt.compensation(w).float()
    assert (total - (1 - 2.0**-6)).abs().max().item() < 1e-4


# ---------------------------------------------------------------- compile="auto"
def test_compile_setting_is_checked():
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"compile must be True .* got 'yes'"):
        KahanOptimizer(torch.optim.AdamW([w]), compile="yes")  # type: ignore[arg-type]
    from mixprec import get_plan

    with pytest.raises(TypeError, match=r"optimizer_compile=1 .* expected bool or 'auto'"):
        get_plan("bf16-kahan", optimizer_compile=1)
    with pytest.raises(ValueError, match=r"optimizer_compile='always' .* not one of bool or 'auto'"):
        get_plan("bf16-sr", optimizer_compile="always")


def test_auto_compiles_only_whole_steps_of_large_rounding_groups(monkeypatch):
    import mixprec.optim.compiled as compiled

    monkeypatch.setattr(compiled, "compile_works", lambda device, probe=True: True)
    big = [torch.zeros(compiled.AUTO_COMPILE_NUMEL // 2, dtype=torch.bfloat16) for _ in range(2)]
    small = big[:1]
    use = compiled.use_compiled_route
    assert use("auto", "kahan", big) and use("auto", "stochastic", big)
    assert not use("auto", "nearest", big)  # torch's fused kernel is already one pass
    assert not use("auto", "kahan", small)  # compilation would not pay back
    assert not use("auto", "kahan", big, whole_step=False)  # optimizer-in-backward: per parameter
    assert not use(False, "kahan", big) and use(True, "nearest", small)
    monkeypatch.setattr(compiled, "compile_works", lambda device, probe=True: False)
    assert not use("auto", "kahan", big) and use(True, "kahan", big)


@pytest.mark.parametrize("wrapper", ["kahan", "sr"])
def test_auto_falls_back_to_the_eager_fast_path_when_compilation_fails(wrapper, monkeypatch):
    """A compiler that fails under ``compile="auto"``: one warning, nothing half-stepped
    (step counts and the noise counter given back), and from then on the eager fast path,
    bit-identical to ``compile=False``. ``compile=True`` raises instead, state untouched."""
    import mixprec.optim.compiled as compiled

    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise torch._dynamo.exc.TorchDynamoException("no C++ compiler found")

    import mixprec.compiling as compiling

    monkeypatch.setattr(compiling, "_FAILED", set())
    monkeypatch.setattr(compiled, "AUTO_COMPILE_NUMEL", 1)
    monkeypatch.setattr(compiling, "_probe_compiles", lambda device_type: True)
    monkeypatch.setitem(compiling._CACHE, compiled._adam_lists, failing)

    def make(compile):
        groups = _params(5, (torch.bfloat16,))
        inner = torch.optim.AdamW([{"params": groups[0]}, {"params": groups[1], "lr": 2e-3}], lr=1e-2)
        return [p for g in groups for p in g], WRAPPERS[wrapper](inner, compile=compile)

    pa, auto = make("auto")
    pb, eager = make(False)
    with pytest.warns(RuntimeWarning, match="torch.compile is unavailable on cpu"):
        _step(pa, auto, 0)
    _step(pb, eager, 0)
    for step in (1, 2):
        _step(pa, auto, step)
        _step(pb, eager, step)
    assert len(calls) == 1
    _assert_same(pa, auto, pb, eager, "auto after a failed compile")
    if wrapper == "sr":
        assert auto.rounding_state()["counter"] == eager.rounding_state()["counter"]

    monkeypatch.setattr(compiling, "_FAILED", set())
    pc, forced = make(False)

    def every_grad(step):  # one step count across each group: the compiled route's condition
        _grads(pc, step)
        for p in pc:
            if p.grad is None:
                p.grad = torch.ones_like(p)

    every_grad(0)
    forced.step()
    forced.compile = True
    before = copy.deepcopy(forced.state_dict())
    values = [p.detach().clone() for p in pc]
    every_grad(1)
    with pytest.raises(torch._dynamo.exc.TorchDynamoException, match="no C\\+\\+ compiler"):
        forced.step()
    assert all(torch.equal(p, v) for p, v in zip(pc, values, strict=True))
    after = forced.state_dict()["state"]
    for index, state in before["state"].items():
        assert torch.equal(torch.as_tensor(after[index]["step"]), torch.as_tensor(state["step"]))


@pytest.mark.slow
def test_auto_compiles_a_large_kahan_group_and_matches_eager(monkeypatch):
    import mixprec.optim.compiled as compiled
    import mixprec.optim.routing as routing

    pytest.importorskip("torch._inductor")
    from mixprec.compiling import compile_works

    if not compile_works("cpu"):
        pytest.skip("torch.compile does not work on this machine")
    calls = []
    real = routing.compiled_adam_step
    monkeypatch.setattr(routing, "compiled_adam_step", lambda *a, **k: calls.append(1) or real(*a, **k))

    def make(compile):
        w = torch.nn.Parameter(torch.linspace(-1, 1, compiled.AUTO_COMPILE_NUMEL).to(torch.bfloat16))
        return w, KahanOptimizer(torch.optim.AdamW([w], lr=1e-3, weight_decay=0.1), compile=compile)

    (wa, auto), (wb, eager) = make("auto"), make(False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        g = torch.randn(wa.shape, generator=gen).to(torch.bfloat16)
        wa.grad, wb.grad = g.clone(), g.clone()
        auto.step()
        eager.step()
    assert len(calls) == 3
    # weight + compensation (what Kahan represents) agree to the compensation's rounding
    # (the compiled loop may contract the fp32 operations differently)
    total_a = wa.float() + auto.compensation(wa).float()
    total_b = wb.float() + eager.compensation(wb).float()
    assert (total_a - total_b).abs().max().item() < 2e-5
    assert (wa.float() - wb.float()).abs().max().item() <= 2.0**-7  # one bf16 ulp at 1.0


def test_auto_compiles_few_layouts_and_only_uniform_steps():
    """A changing set of parameters with gradients (a mixture of experts) must not compile
    again and again: "auto" compiles at most AUTO_MAX_LAYOUTS layouts per wrapper (known
    ones keep running compiled), and never a group whose parameters have different step
    counts (compile=True neither: its update takes one step count)."""
    from mixprec.optim.compiled import AUTO_MAX_LAYOUTS

    experts = [torch.nn.Parameter(torch.randn(4, i + 1).bfloat16()) for i in range(8)]
    for p in experts:
        p.grad = torch.zeros_like(p)
    opt = KahanOptimizer(torch.optim.AdamW(experts, lr=1e-2))
    group = opt.optimizer.param_groups[0]
    layouts = [experts[i : i + 2] for i in range(AUTO_MAX_LAYOUTS)]
    assert all(routing.compiled_layout_ok(opt, group, ps) for ps in layouts)
    assert not routing.compiled_layout_ok(opt, group, experts[6:8])  # one layout too many: eager
    assert routing.compiled_layout_ok(opt, group, layouts[0])  # a known layout stays compiled
    opt.compile = True
    assert routing.compiled_layout_ok(opt, group, experts[6:8])  # explicit: no per-wrapper budget
    opt.optimizer.state[experts[0]]["step"] = torch.tensor(3.0)
    opt.optimizer.state[experts[1]]["step"] = torch.tensor(2.0)
    assert not routing.compiled_layout_ok(opt, group, layouts[0])  # mixed step counts: eager
    opt.optimizer.state[experts[1]]["step"] = torch.tensor(3.0)
    assert routing.compiled_layout_ok(opt, group, layouts[0])  # equal again: compiled


def test_layouts_of_different_roundings_are_counted_apart():
    """Kahan and stochastic rounding compile different kernels for the same shapes: the
    process budget counts each (dynamo's raised recompile limit must hold every one)."""
    import mixprec.optim.compiled as compiled

    params = [torch.nn.Parameter(torch.randn(4, 3).bfloat16())]
    params[0].grad = torch.zeros_like(params[0])
    for cls in (KahanOptimizer, StochasticRoundingOptimizer):
        opt = cls(torch.optim.AdamW(params, lr=1e-2))
        assert routing.compiled_layout_ok(opt, opt.optimizer.param_groups[0], params)
    assert len(compiled._LAYOUTS) == 2


def _experts_run(steps, monkeypatch, *, resume_at=None, saved_by_0_1_0=False):
    """A mixture of experts under StochasticRoundingOptimizer(compile="auto"), the compiled
    update replaced by its own code run eagerly (same numbers, no compilation time).
    ``saved_by_0_1_0``: the checkpoint's layout keys are rewritten as mixprec 0.1.0 wrote
    them (the layout and four options only)."""
    import mixprec.compiling as compiling
    import mixprec.optim.compiled as compiled

    monkeypatch.setattr(compiled, "AUTO_COMPILE_NUMEL", 1)
    monkeypatch.setattr(compiled, "compile_works", lambda device, probe=True: True)
    monkeypatch.setattr(compiled, "_LAYOUTS", set())  # each run: a fresh process's budget
    monkeypatch.setitem(compiling._CACHE, compiled._adam_lists, compiled._adam_lists)

    def make():
        torch.manual_seed(0)
        experts = [torch.nn.Parameter(torch.randn(64, i + 1).bfloat16()) for i in range(12)]
        return experts, StochasticRoundingOptimizer(torch.optim.AdamW(experts, lr=1e-3), seed=5)

    experts, opt = make()
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        if step == resume_at:
            saved = copy.deepcopy(opt.state_dict())
            if saved_by_0_1_0:
                extra = saved[opt._STATE_KEY]
                extra["compiled_layouts"] = [repr(ast.literal_eval(k)[:5]) for k in extra["compiled_layouts"]]
                assert extra["compiled_layouts"]
            values = [p.detach().clone() for p in experts]
            experts, opt = make()
            with torch.no_grad():
                for p, v in zip(experts, values, strict=True):
                    p.copy_(v)
            opt.load_state_dict(saved)
        pair = step % 6  # six pairs of experts take turns: six layouts, each with one step count
        for i, p in enumerate(experts):
            p.grad = torch.randn(p.shape, generator=gen).bfloat16() if i // 2 == pair else None
        opt.step()
    return [p.detach().clone() for p in experts]


def test_auto_routes_are_checkpointed_so_a_resumed_run_rounds_identically(monkeypatch):
    uninterrupted = _experts_run(24, monkeypatch)  # pairs 0-3 compiled, 4 and 5 eager
    resumed = _experts_run(24, monkeypatch, resume_at=8)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed, strict=True))


def test_layout_keys_saved_by_0_1_0_resume_the_same_routes(monkeypatch):
    """Keys without the rounding, state dtype and device type (mixprec 0.1.0) are upgraded
    on load: without that the four old keys fill the "auto" budget and every layout runs
    eagerly after the resume, with other rounding noise."""
    uninterrupted = _experts_run(24, monkeypatch)
    resumed = _experts_run(24, monkeypatch, resume_at=8, saved_by_0_1_0=True)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed, strict=True))


def test_layout_keys_that_are_not_old_keys_load_unchanged():
    """Keys that are no tuple of five (malformed, unhashable literals, current keys) are
    kept as they are: they match no layout, and never fail the load."""
    from mixprec.optim import StochasticRoundingOptimizer

    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    opt = StochasticRoundingOptimizer(torch.optim.AdamW(model.parameters()), compile="auto")
    saved = opt.state_dict()
    keys = ["{[1]}", "not python", "(1, 2)", repr(("layout", 1, 2, 3, 4, "stochastic", "torch.bfloat16", "cpu"))]
    saved[opt._STATE_KEY]["compiled_layouts"] = keys
    opt.load_state_dict(saved)
    assert opt._compiled_layouts == set(keys)


def test_old_layout_keys_of_parameters_on_several_device_types_are_kept_as_they_are():
    """An old key does not say its device: with one device type it is upgraded to it, with
    several it is left alone rather than guessed."""
    from mixprec.optim import StochasticRoundingOptimizer

    cpu = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    meta = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16, device="meta"))
    opt = StochasticRoundingOptimizer(torch.optim.AdamW([cpu]), compile="auto")
    old = repr(((((4,), "torch.bfloat16", "torch.bfloat16"),), 1, 2, 3, 4))
    assert routing.upgraded_layout(opt, old, [cpu]) == repr((*ast.literal_eval(old), "stochastic", "torch.bfloat16", "cpu"))
    assert routing.upgraded_layout(opt, old, [meta]).endswith("'meta')")
    assert routing.upgraded_layout(opt, old, [cpu, meta]) == old


def test_an_interrupt_while_compiling_leaves_nothing_half_counted(monkeypatch):
    import mixprec.compiling as compiling
    import mixprec.optim.compiled as compiled

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(compiled, "AUTO_COMPILE_NUMEL", 1)
    monkeypatch.setattr(compiled, "compile_works", lambda device, probe=True: True)
    monkeypatch.setitem(compiling._CACHE, compiled._adam_lists, interrupted)
    w = torch.nn.Parameter(torch.randn(16).bfloat16())
    opt = StochasticRoundingOptimizer(torch.optim.AdamW([w], lr=1e-2), seed=1)
    w.grad = torch.ones_like(w)
    before, counter = w.detach().clone(), opt.rounding_state()["counter"]
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert torch.equal(w, before) and float(opt.state[w]["step"]) == 0.0
    assert opt.rounding_state()["counter"] == counter


def test_compiled_sr_noise_of_an_element_does_not_repeat_with_a_short_period():
    """The noise of one element over 5000 steps: a hash of its position and a seed mixed
    from the step counter, not of (counter + position) mod 2**32 (which repeats every
    2**32 / N steps for N elements per step: every 2048 steps for 2**21 elements)."""
    from mixprec.optim.codecs import hash16 as _hash16
    from mixprec.optim.codecs import seed32

    seeds = torch.tensor([seed32(c) for c in range(5000)], dtype=torch.int64)
    noise = _hash16(torch.zeros(5000, dtype=torch.int64) ^ seeds)
    assert noise.unique().numel() > 4500  # 16 random bits: about 4830 distinct of 5000


def test_compiled_sr_update_draws_its_noise_from_the_advancing_counter(monkeypatch):
    """Through the update itself (run eagerly in place of its compiled form): each compiled
    step advances the wrapper's counter by one, the same counter rounds the same way, and
    another counter rounds differently; the rounding is unbiased over many counters."""
    import mixprec.compiling as compiling
    import mixprec.optim.compiled as compiled

    monkeypatch.setattr(compiled, "AUTO_COMPILE_NUMEL", 1)
    monkeypatch.setattr(compiled, "compile_works", lambda device, probe=True: True)
    monkeypatch.setitem(compiling._CACHE, compiled._adam_lists, compiled._adam_lists)

    def one_step(counter: int) -> tuple[torch.Tensor, int]:
        w = torch.nn.Parameter(torch.ones(4096).bfloat16())
        adam = StochasticRoundingOptimizer(torch.optim.Adam([w], lr=1e-3), seed=3)
        state = adam.rounding_state()
        adam.load_rounding_state({**state, "counter": counter})
        w.grad = torch.full_like(w, -1.0)  # Adam's first step moves every weight up by lr
        adam.step()
        return w.detach().float(), adam.rounding_state()["counter"]

    a, after = one_step(10)
    assert after == 11  # one compiled stochastic step, one count
    b, _ = one_step(10)
    c, _ = one_step(11)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # 1 + 1e-3 lies between the bf16 neighbours 1 and 1 + 2**-7: rounded up with p = 0.128
    up = torch.stack([one_step(k)[0] for k in range(20, 28)]).gt(1.0).float().mean().item()
    assert abs(up - 1e-3 / 2**-7) < 0.02, up

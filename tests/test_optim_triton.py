"""The Triton executor of the low-precision wrappers (mixprec.optim.triton_adam), under Triton's interpreter.

Oracles, and how close each result must be:

- the eager fast path (the same wrapper with ``compile=False``), from identical inputs, one step at
  a time (several steps: moments and step counts that are not zero): within fp32 rounding, i.e. each
  stored bf16/fp16 weight and bf16 moment the same or one unit in the last place apart (and at most
  a few percent of the elements apart), each fp32 moment within a few fp32 units in the last place
  (relative), a Kahan pair (weight + compensation) the same value within the compensation's own
  rounding;
- torch's cast, bit for bit, for the round-to-nearest store (ties, subnormals, infinities, NaN,
  overflow), bf16 and fp16;
- the codecs' stochastic-rounding formula, bit for bit, on the kernel's own fp32 results (read back
  exactly as weight + fp32 Kahan compensation): element ``i`` of the ``k``-th tensor of the call
  gets ``hash16((first_k + i) ^ seed32(count))``;
- the kernel itself, bit for bit: a skipped step writes nothing, gradient scales that are powers of
  two give the steps of gradients scaled beforehand, a device-held learning rate the host one's.

Launches and their arguments are counted on the launcher (``triton_adam._launch``). The interpreter
runs a kernel only when Triton was first imported with ``TRITON_INTERPRET=1``; in a process that
imported Triton without it, the kernel tests run in a subprocess with the variable set
(``test_triton_kernels_under_the_interpreter``). Blocks are 128 elements there: every test tensor
spans several programs and the interpreter stays quick.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixprec.optim import (
    KahanOptimizer,
    LowPrecisionOptimizer,
    StochasticRoundingOptimizer,
    codecs,
    rule,
)
from mixprec.optim import triton_adam as TA

HAS_TRITON = importlib.util.find_spec("triton") is not None
IN_SUBPROCESS = os.environ.get("TRITON_INTERPRET") == "1"
SHAPES = [(12, 40), (300,), (5,), (3, 129)]  # 4, 3, 1 and 4 programs of 128 elements


def _interpreting() -> bool:
    if not HAS_TRITON:
        return False
    from mixprec.optim._triton_adam_kernels import interpreting

    return interpreting()


@pytest.fixture
def interpreter(monkeypatch):
    """Skips where the kernel cannot be interpreted here; small blocks where it can."""
    if not HAS_TRITON:
        pytest.skip("Triton is not installed (the 'triton' extra)")
    if not _interpreting():
        pytest.skip("Triton was imported without TRITON_INTERPRET=1: run in a subprocess "
                    "(test_triton_kernels_under_the_interpreter)")
    monkeypatch.setattr(TA, "BLOCK", 128)


def _launches(monkeypatch) -> list[tuple[tuple[int], tuple, dict]]:
    """Records every kernel launch (grid, positional arguments, keyword arguments)."""
    seen: list[tuple[tuple[int], tuple, dict]] = []
    real = TA._launch

    def counted(kernel, grid, *args, **meta):
        seen.append((grid, args, meta))
        real(kernel, grid, *args, **meta)

    monkeypatch.setattr(TA, "_launch", counted)
    return seen


# ------------------------------------------------------------------------------------ comparisons
def _ordered(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bits as integers ordered like its values (+0 and -0 alike)."""
    ints = {2: torch.int16, 4: torch.int32}[t.element_size()]
    bits = t.detach().contiguous().view(ints).to(torch.int64)
    top = 1 << (8 * t.element_size() - 1)
    return torch.where(bits >= 0, bits, -(bits + top))


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many units in the last place of their dtype apart ``a`` and ``b`` are, elementwise."""
    return (_ordered(a) - _ordered(b)).abs()


def _low_within_tier(a: torch.Tensor, b: torch.Tensor, what: str, fraction: float = 0.05) -> None:
    """bf16/fp16: the same or one unit apart, at most ``fraction`` of the elements apart."""
    d = _ulps(a, b)
    assert int(d.max()) <= 1, (what, int(d.max()))
    assert float((d != 0).float().mean()) <= fraction, (what, float((d != 0).float().mean()))


_UNIT = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-23}  # a unit's size, relative


def _close(a: torch.Tensor, b: torch.Tensor, operands: torch.Tensor, what: str, units: int = 1) -> None:
    """Within ``units`` units in the last place of their dtype, plus four fp32 units of the
    magnitude of the operands they were computed from (``operands``: where the result cancelled to
    much less than them, fp32 rounding of the operands is all that is left to compare)."""
    a32, b32 = a.detach().float(), b.detach().float()
    tol = torch.maximum(a32.abs(), b32.abs()) * (units * _UNIT[a.dtype]) + operands * 4 * 2.0**-23 + 1e-38
    bad = (a32 - b32).abs() > tol
    assert not bool(bad.any()), (what, a32[bad][:4].tolist(), b32[bad][:4].tolist())


def _operands(opt, params, l2: float) -> list[dict[str, torch.Tensor]]:
    """Before a step: the magnitudes each moment's update is computed from (the gradient, with L2
    decay's term, its square, the moment itself), and the weight's (with its compensation)."""
    out = []
    for p in params:
        w = p.detach().float()
        if opt.rounding == "kahan" and opt.compensation(p) is not None:
            w = w + opt.compensation(p).float()
        g = (torch.zeros_like(w) if p.grad is None else p.grad.float().abs()) + l2 * w.abs()
        state = opt.optimizer.state.get(p) or {}
        zero = torch.zeros_like(w)
        m = torch.maximum(g, state["exp_avg"].float().abs()) if "exp_avg" in state else g
        v = torch.maximum(g * g, state["exp_avg_sq"].float().abs()) if "exp_avg_sq" in state else g * g
        vmax = torch.maximum(v, state.get("max_exp_avg_sq", zero).float().abs())
        out.append({"exp_avg": m, "exp_avg_sq": v, "max_exp_avg_sq": vmax, "w": w.abs()})
    return out


def _state_within_tier(sa: dict, sb: dict, operands: dict[str, torch.Tensor], what: str) -> None:
    """The moments: fp32 within four units (of themselves or of their operands), bf16 the same or
    one unit apart (ditto), at most a few percent of the elements apart; the same step count."""
    assert sa.keys() == sb.keys(), what
    assert float(sa["step"]) == float(sb["step"]), what
    for key in sa:
        if key != "step":
            assert sa[key].dtype == sb[key].dtype and sa[key].shape == sb[key].shape, (what, key)
            _close(sa[key], sb[key], operands[key], f"{what} {key}", units=4 if sa[key].dtype == torch.float32 else 1)
            if sa[key].dtype != torch.float32:
                assert float((_ulps(sa[key], sb[key]) != 0).float().mean()) <= 0.05, (what, key)


def _update_scale(opt, p, m_operands: torch.Tensor) -> torch.Tensor:
    """After a step of ``p``: the magnitude of the update's operands, step_size * max(|g|, |m|) / denom."""
    h = rule.adam_hyper(opt.optimizer, opt.optimizer.param_groups[0])
    state = opt.optimizer.state[p]
    step_size, bc2_sqrt = rule.bias_corrections(h, float(state["step"]))
    v = state["max_exp_avg_sq" if h.amsgrad else "exp_avg_sq"].float()
    return step_size * m_operands / (v.sqrt() / bc2_sqrt + h.eps)


def _kahan_within_tier(pa, ca, pb, cb, weight: torch.Tensor, update: torch.Tensor, what: str) -> None:
    """The value weight + compensation stands for (an fp32 compensation: the fp32 master exactly):
    the same within four fp32 units of the weight before the step, eight of the update's operands
    (:func:`_update_scale`) and one unit of the compensation's own dtype (where the weights round
    apart, the compensations differ by the unit they moved)."""
    wa, wb = (pa.detach().float() + ca.float()), (pb.detach().float() + cb.float())
    tol = (weight * 4 + update * 8) * 2.0**-23 + torch.maximum(ca.float().abs(), cb.float().abs()) * _UNIT[ca.dtype]
    bad = (wa - wb).abs() > tol + 1e-38
    assert not bool(bad.any()), (what, wa[bad][:4].tolist(), wb[bad][:4].tolist())


# ----------------------------------------------------------------------- models, gradients, steps
def _params(dtype: torch.dtype = torch.bfloat16, shapes=SHAPES, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(params, step: int, dtypes) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p, dtype in zip(params, itertools.cycle(dtypes)):
        p.grad_dtype = None  # (any gradient dtype: fp32 gradients of bf16 weights)
        p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(dtype)


def _call(opt, params, **kw) -> list[torch.Tensor]:
    """The kernel's step of ``params`` (the only group of ``opt``'s inner optimizer)."""
    def comps(p: torch.Tensor) -> torch.Tensor:
        if opt.compensation(p) is None:  # (made at zero, as the wrapper's own step does)
            opt.set_compensation(p, torch.zeros_like(p))
        return opt.compensation(p)

    return TA.triton_adam_step(opt.optimizer, opt.optimizer.param_groups[0], params, state_dtype=opt.state_dtype,
                               rounding=opt.rounding, comps=comps if opt.rounding == "kahan" else None, **kw)


def _same_inputs(oa, a, ob, b) -> None:
    """``b`` and ``ob``'s state (and compensations) set to ``a``'s and ``oa``'s, bit for bit."""
    with torch.no_grad():
        for pa, pb in zip(a, b, strict=True):
            pb.copy_(pa)
            pb.grad_dtype = None
            pb.grad = None if pa.grad is None else pa.grad.clone()
            if oa.optimizer.state.get(pa):
                ob.optimizer.state[pb] = {k: v.clone() for k, v in oa.optimizer.state[pa].items()}
            if oa.rounding == "kahan":
                comp = oa.compensation(pa)
                ob.set_compensation(pb, torch.zeros_like(pb) if comp is None else comp.clone())


CASES = [  # (wrapper, inner, hyperparameters, state dtype, weight dtype, gradient dtypes, compensation dtype)
    pytest.param(LowPrecisionOptimizer, torch.optim.AdamW, {"weight_decay": 0.1}, None, torch.bfloat16,
                 (torch.bfloat16,), None, id="nearest-adamw-fp32-moments-bf16-grads"),
    pytest.param(LowPrecisionOptimizer, torch.optim.Adam, {"weight_decay": 0.1}, torch.bfloat16, torch.bfloat16,
                 (torch.float32,), None, id="nearest-adam-l2-bf16-moments-fp32-grads"),
    pytest.param(LowPrecisionOptimizer, torch.optim.AdamW, {"amsgrad": True, "maximize": True}, None, torch.bfloat16,
                 (torch.float32, torch.bfloat16), None, id="nearest-amsgrad-maximize-no-decay-mixed-grads"),
    pytest.param(KahanOptimizer, torch.optim.AdamW, {"weight_decay": 0.1}, torch.bfloat16, torch.bfloat16,
                 (torch.bfloat16,), None, id="kahan-adamw-bf16-moments"),
    pytest.param(KahanOptimizer, torch.optim.Adam, {"weight_decay": 0.05, "amsgrad": True}, None, torch.bfloat16,
                 (torch.float32,), None, id="kahan-adam-l2-amsgrad-fp32-moments"),
    pytest.param(StochasticRoundingOptimizer, torch.optim.AdamW, {"weight_decay": 0.1}, torch.bfloat16, torch.bfloat16,
                 (torch.bfloat16, torch.float32), None, id="stochastic-adamw-bf16-moments-mixed-grads"),
    pytest.param(StochasticRoundingOptimizer, torch.optim.Adam, {"amsgrad": True, "maximize": True}, None,
                 torch.bfloat16, (torch.float32,), None, id="stochastic-adam-amsgrad-maximize-fp32-moments"),
    pytest.param(LowPrecisionOptimizer, torch.optim.AdamW, {"weight_decay": 0.1}, None, torch.float16,
                 (torch.float16,), None, id="nearest-fp16-weights"),
    pytest.param(KahanOptimizer, torch.optim.Adam, {"weight_decay": 0.1}, torch.bfloat16, torch.float16,
                 (torch.float16, torch.float32), None, id="kahan-fp16-weights-l2"),
    pytest.param(KahanOptimizer, torch.optim.AdamW, {"weight_decay": 0.1}, None, torch.bfloat16, (torch.bfloat16,),
                 torch.float32, id="kahan-fp32-compensation-adamw"),  # weight + compensation: the fp32 master
    pytest.param(KahanOptimizer, torch.optim.Adam, {"weight_decay": 0.1, "amsgrad": True, "maximize": True}, torch.bfloat16,
                 torch.bfloat16, (torch.float32, torch.bfloat16), torch.float32, id="kahan-fp32-compensation-adam-l2-amsgrad"),
]


@pytest.mark.parametrize(("wrapper", "inner", "adam", "state_dtype", "dtype", "grad_dtypes", "comp_dtype"), CASES)
def test_kernel_steps_equal_the_eager_path_within_fp32_rounding(
    interpreter, monkeypatch, wrapper, inner, adam, state_dtype, dtype, grad_dtypes, comp_dtype
) -> None:
    a, b = _params(dtype), _params(dtype)
    hyper = {"lr": 1e-2} | adam
    oa = wrapper(inner(a, **hyper), state_dtype=state_dtype, compile=False)
    ob = wrapper(inner(b, **hyper), state_dtype=state_dtype, compile=False)
    for p in a if comp_dtype is not None else []:
        oa.set_compensation(p, torch.zeros(p.shape, dtype=comp_dtype))
    launches = _launches(monkeypatch)
    l2 = 0.0 if inner is torch.optim.AdamW else adam.get("weight_decay", 0.0)
    for step in range(2):  # (the second from moments and a step count that are not zero)
        _grads(a, step, grad_dtypes)
        _same_inputs(oa, a, ob, b)
        operands = _operands(oa, a, l2)
        count = oa.rounding_state()["counter"] if oa.rounding == "stochastic" else None
        oa.step()
        left = _call(ob, b, noise=None if count is None else codecs.call_noise(count, 0, b))
        assert left == []
        for i, (pa, pb) in enumerate(zip(a, b, strict=True)):
            what = f"step {step} tensor {i} {tuple(pa.shape)}"
            _low_within_tier(pa, pb, what)
            _state_within_tier(oa.optimizer.state[pa], ob.optimizer.state[pb], operands[i], what)
            if oa.rounding == "kahan":
                update = _update_scale(oa, pa, operands[i]["exp_avg"])
                _kahan_within_tier(pa, oa.compensation(pa), pb, ob.compensation(pb), operands[i]["w"], update, what)
    assert len(launches) == 2 * len(set(grad_dtypes))  # one launch per dtype combination and call
    assert all(p._version > 0 for p in b)  # written through raw pointers, and counted


def test_kernel_steps_each_tensor_with_its_own_step_count(interpreter) -> None:
    """Weights that got gradients at different steps (experts) step in one launch, each with its own
    bias corrections (the eager path's per-count chunks); a weight without a gradient is not touched."""
    a, b = _params(), _params()
    oa = LowPrecisionOptimizer(torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1), state_dtype=None, compile=False)
    ob = LowPrecisionOptimizer(torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1), state_dtype=None, compile=False)
    for step in range(3):
        _grads(a, step, (torch.float32,))
        if step == 0:
            a[0].grad = a[2].grad = None
        _same_inputs(oa, a, ob, b)
        operands = _operands(oa, a, 0.0)
        oa.step()
        assert _call(ob, b) == []
        for i, (pa, pb) in enumerate(zip(a, b, strict=True)):
            _low_within_tier(pa, pb, f"step {step} tensor {i}")
            if oa.optimizer.state.get(pa):
                _state_within_tier(oa.optimizer.state[pa], ob.optimizer.state[pb], operands[i], f"step {step} tensor {i}")
            else:
                assert not ob.optimizer.state.get(pb)
    assert [float(ob.optimizer.state[p]["step"]) for p in b] == [2.0, 3.0, 2.0, 3.0]


def _special_values() -> torch.Tensor:
    """fp32 values around every kind of bf16 and fp16 rounding: ties (to even both ways), values
    just off ties, subnormals (fp32, bf16 and fp16), the largest finite values and beyond, inf, NaN."""
    g = torch.Generator().manual_seed(7)
    low = torch.randint(-32768, 32767, (256,), generator=g, dtype=torch.int32)
    ties = ((low << 16) | 0x8000).view(torch.float32)  # halfway between two bf16 values
    near = torch.cat([((low << 16) | 0x7FFF), ((low << 16) | 0x8001)]).view(torch.float32)
    any_bits = torch.randint(-(2**31), 2**31 - 1, (512,), generator=g, dtype=torch.int32).view(torch.float32)
    h = torch.randint(0, 0x7C00, (256,), generator=g, dtype=torch.int32)  # fp16 bits: ties of fp16
    h16 = ((h.to(torch.int16).view(torch.float16).float().view(torch.int32)) | 0x1000).view(torch.float32)
    specials = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, 1.2e-38, 9.2e-41, 6e-8, 3e-8, 6.1e-5, 65504.0,
                             65519.0, 65520.0, 3.3895e38, 3.4e38, -3.4e38, float("inf"), float("-inf"), float("nan"),
                             1.0, 1.00390625, 1.01171875, -2.0 - 2**-8, 2.0**-133])
    values = torch.cat([ties, near, any_bits, h16, specials, -specials])
    return values.reshape(2, -1)  # two tensors of the call: several programs each


#: numpy's warnings under the interpreter, for the NaN, infinities and overflows given on purpose
NONFINITE_ON_PURPOSE = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning", "ignore:overflow encountered:RuntimeWarning"
)


@NONFINITE_ON_PURPOSE
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_round_to_nearest_store_is_torchs_cast_bit_for_bit(interpreter, dtype) -> None:
    """The store of fp32 values the weights cannot hold: a step that changes nothing (lr 0, zero
    gradients) of zero weights (of the values' signs) whose fp32 Kahan compensations hold the values. The weight gets
    torch's cast, the compensation what it dropped (NaN: NaN)."""
    values = _special_values()
    params = [torch.nn.Parameter(torch.zeros(row.shape).copysign(row).to(dtype)) for row in values]  # (-0 + -0 is -0)
    opt = KahanOptimizer(torch.optim.Adam(params, lr=0.0), state_dtype=None, compile=False)
    for p, row in zip(params, values, strict=True):
        p.grad_dtype = None
        p.grad = torch.zeros(p.shape)
        opt.set_compensation(p, row.clone())
    assert _call(opt, params) == []
    for p, row in zip(params, values, strict=True):
        expect = row.to(dtype)
        nan = row.isnan()
        assert bool(p.isnan().eq(nan).all())
        assert torch.equal(p.detach()[~nan].view(torch.int16), expect[~nan].view(torch.int16))
        residual = (row - expect.float())[~nan & row.isfinite()]
        comp = opt.compensation(p)
        assert torch.equal(comp[~nan & row.isfinite()].view(torch.int32), residual.view(torch.int32))


@NONFINITE_ON_PURPOSE
@pytest.mark.parametrize("base", [0, 2**32 - 150], ids=["from-0", "across-2**32"])
def test_kernel_stochastic_store_is_the_codecs_formula_bit_for_bit(interpreter, monkeypatch, base) -> None:
    """The same step stored twice: by stochastic rounding, and by Kahan with an fp32 compensation,
    whose weight + compensation is the kernel's fp32 result exactly. The stochastic store must be
    that value with ``hash16((first + i) ^ seed32(count))`` added to its bits, truncated, with
    ``first`` counted over the call's tensors (over two launches: bf16 and fp32 gradients); NaN
    stays NaN, infinities infinite; past position 2**32 with the high bits folded in (``base``: the
    first tensor's position)."""
    count = 12345
    a, b = _params(), _params()
    hyper = {"lr": 1e-2, "weight_decay": 0.1}
    sr = StochasticRoundingOptimizer(torch.optim.AdamW(a, **hyper), state_dtype=None, compile=False)
    kahan = KahanOptimizer(torch.optim.AdamW(b, **hyper), state_dtype=None, compile=False)
    launches = _launches(monkeypatch)
    for step in range(2):
        _grads(a, step, (torch.bfloat16, torch.float32))
        if step == 1:  # non-finite values: NaN stays NaN, an infinity infinite
            a[1].grad[3], a[2].grad[0], a[3].grad[1, 7] = float("nan"), float("inf"), float("-inf")
            with torch.no_grad():
                a[0][2, 5], a[1][9] = float("inf"), float("-inf")
        _same_inputs(sr, a, kahan, b)
        for p in b:
            kahan.set_compensation(p, torch.zeros(p.shape))  # Kahan loads the weight alone, as SR does
        noise = codecs.call_noise(count + step, 0, a)
        _call(sr, a, noise=codecs.Noise(noise.seed, {k: v + base for k, v in noise.firsts.items()}))
        _call(kahan, b)
        first = base
        for pa, pb in zip(a, b, strict=True):
            exact = torch.where(pb.isinf(), pb.float(), pb.float() + kahan.compensation(pb))  # (inf: inf - inf is NaN)
            noise = codecs.hash16((torch.arange(pa.numel()) + first) ^ codecs.seed32(count + step)).view(pa.shape)
            expect = ((exact.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)
            nan = expect.isnan()  # (NaN: any NaN's bits, as codecs.same_weight counts them)
            assert torch.equal(pa.detach().isnan(), nan), (step, pa.shape)
            assert torch.equal(pa.detach()[~nan].view(torch.int16), expect[~nan].view(torch.int16)), (step, pa.shape)
            first += pa.numel()
    assert a[1].isnan()[3] and a[2].isnan()[0] and a[3].isnan()[1, 7] and a[0][2, 5] == float("inf") and a[1][9] == -float("inf")
    assert len(launches) == 4 * 2


Q8_SHAPES = [(12, 40), (300,), (5,), (3, 129), (2, 700)]  # whole and partial 256-element blocks
Q8_CASES = [
    pytest.param(LowPrecisionOptimizer, torch.optim.AdamW, {"weight_decay": 0.1}, id="nearest-adamw"),
    pytest.param(KahanOptimizer, torch.optim.Adam, {"weight_decay": 0.05, "amsgrad": True}, id="kahan-adam-l2-amsgrad"),
    pytest.param(StochasticRoundingOptimizer, torch.optim.AdamW, {"maximize": True}, id="stochastic-adamw-maximize"),
]


def q8_codes_bit_for_bit(params, grads, amsgrad: bool, launches: list) -> None:
    """With betas (0, 0) the new moments are exactly torch's ``lerp`` of zero to the gradient (the
    gradient, but NaN for an infinite one) and the gradient's square: the same fp32 values on every
    route, so the kernel's 8-bit store must give the eager quantizer's codes and block absmaxes bit
    for bit; a NaN and an infinity are planted in two blocks of the last weight."""
    from mixprec.optim import quant

    opt = LowPrecisionOptimizer(torch.optim.Adam(params, lr=1e-2, betas=(0.0, 0.0), amsgrad=amsgrad),
                                state_dtype="8bit", compile=False)
    grads(params, 0, (torch.float32,))
    last = params[-1].grad.view(-1)
    last[3], last[-5] = float("nan"), float("inf")
    _call(opt, params)
    assert len(launches) == 1
    for p in params:
        g = p.grad.float().reshape(-1)
        state = opt.optimizer.state[p]
        m = torch.zeros_like(g).lerp_(g, 1.0)
        for key, value, signed in (("exp_avg", m, True), ("exp_avg_sq", g * g, False)) + (
                (("max_exp_avg_sq", g * g, False),) if amsgrad else ()):
            codes, absmax = quant.quantize_blockwise(value, signed=signed)
            assert torch.equal(state[key].reshape(-1), codes.reshape(-1)), (key, tuple(p.shape))
            got = state[f"{key}_absmax"]
            assert torch.equal(got.isnan(), absmax.isnan()) and torch.equal(got[~got.isnan()], absmax[~absmax.isnan()])


def q8_steps_within_tier(a, b, grads, wrapper, inner, adam, launches: list) -> None:
    """Three steps against the eager path (its quantizer) from the same inputs each step: the weights
    within the tier, each code the same or one apart where the two fp32 updates round apart next
    to a decision point (at most 2% of them), the block absmaxes within four fp32 units."""
    oa = wrapper(inner(a, lr=1e-2, **adam), state_dtype="8bit", compile=False)
    ob = wrapper(inner(b, lr=1e-2, **adam), state_dtype="8bit", compile=False)
    for step in range(3):
        grads(a, step, (torch.bfloat16,))
        _same_inputs(oa, a, ob, b)
        count = oa.rounding_state()["counter"] if oa.rounding == "stochastic" else None
        oa.step()
        assert _call(ob, b, noise=None if count is None else codecs.call_noise(count, 0, b)) == []
        for i, (pa, pb) in enumerate(zip(a, b, strict=True)):
            what = f"step {step} tensor {i}"
            _low_within_tier(pa, pb, what)
            sa, sb = oa.optimizer.state[pa], ob.optimizer.state[pb]
            assert sa.keys() == sb.keys() and float(sa["step"]) == float(sb["step"]), what
            for key in sa:
                if key.endswith("_absmax"):
                    _close(sa[key], sb[key], sa[key].abs(), f"{what} {key}", units=4)
                elif key != "step":
                    apart = (sa[key].int() - sb[key].int()).abs()
                    assert int(apart.max()) <= 1 and float((apart != 0).float().mean()) <= 0.02, (what, key)
    assert len(launches) == 3


@NONFINITE_ON_PURPOSE
@pytest.mark.parametrize("amsgrad", [False, True])
def test_kernel_8bit_moments_are_the_codecs_codes_bit_for_bit(interpreter, monkeypatch, amsgrad) -> None:
    q8_codes_bit_for_bit(_params(shapes=Q8_SHAPES), _grads, amsgrad, _launches(monkeypatch))


@pytest.mark.parametrize(("wrapper", "inner", "adam"), Q8_CASES)
def test_kernel_8bit_moments_step_as_the_eager_path_within_fp32_rounding(interpreter, monkeypatch, wrapper, inner, adam) -> None:
    a, b = _params(shapes=Q8_SHAPES), _params(shapes=Q8_SHAPES)
    q8_steps_within_tier(a, b, _grads, wrapper, inner, adam, _launches(monkeypatch))


class _Noise:
    """A call's noise as the wrappers give it (codecs.Noise's fields)."""

    def __init__(self, seed: int, firsts: dict[int, int]) -> None:
        self.seed, self.firsts = seed, firsts


def test_kernel_draws_the_calls_noise_when_given_one(interpreter) -> None:
    """With the wrapper's noise (a seed, each weight's first position) the kernel draws exactly that
    noise: the same bits as codecs.call_noise's for the same seed and positions, other bits for
    other positions."""
    copies = [_params() for _ in range(3)]
    opts = [StochasticRoundingOptimizer(torch.optim.Adam(ps, lr=1e-2), state_dtype=None, compile=False)
            for ps in copies]
    _grads(copies[0], 0, (torch.float32,))
    for o, ps in zip(opts[1:], copies[1:], strict=True):
        _same_inputs(opts[0], copies[0], o, ps)
    firsts = list(itertools.accumulate((p.numel() for p in copies[0][:-1]), initial=0))
    _call(opts[0], copies[0], noise=codecs.call_noise(99, 0, copies[0]))
    _call(opts[1], copies[1], noise=_Noise(codecs.seed32(99), {id(p): f for p, f in zip(copies[1], firsts, strict=True)}))
    _call(opts[2], copies[2], noise=_Noise(codecs.seed32(99), {id(p): f + 1 for p, f in zip(copies[2], firsts, strict=True)}))
    for a, b, c in zip(*copies, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        assert not torch.equal(a.view(torch.int16), c.view(torch.int16))  # other positions, other noise


def test_kernel_skip_flag_writes_nothing(interpreter) -> None:
    """skip=1: weights, moments and compensations keep every bit (the step counts advance, as on the
    other routes: mixprec.optim.skipping puts them back); skip=0: the bits of a step without a flag."""
    a, b = _params(), _params()
    oa = KahanOptimizer(torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1, amsgrad=True), compile=False)
    ob = KahanOptimizer(torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, amsgrad=True), compile=False)
    for p in a:
        oa.set_compensation(p, torch.zeros_like(p))
    _grads(a, 0, (torch.float32,))
    _call(oa, a)  # state that is not zero
    _grads(a, 1, (torch.float32,))
    _same_inputs(oa, a, ob, b)
    before = [(p.detach().clone(), oa.compensation(p).clone(), {k: v.clone() for k, v in oa.optimizer.state[p].items()})
              for p in a]
    _call(oa, a, skip=torch.ones(()))
    for p, (w, c, s) in zip(a, before, strict=True):
        assert torch.equal(p.view(torch.int16), w.view(torch.int16))
        assert torch.equal(oa.compensation(p).view(torch.int16), c.view(torch.int16))
        state = oa.optimizer.state[p]
        assert float(state["step"]) == float(s["step"]) + 1
        assert all(torch.equal(state[k], s[k]) for k in s if k != "step")
        state["step"] -= 1  # (as skipping puts it back)
    _call(ob, b, skip=torch.zeros(()))
    _call(oa, a)  # the same inputs, no flag
    for pa, pb, (w, _, _) in zip(a, b, before, strict=True):
        assert torch.equal(pa.view(torch.int16), pb.view(torch.int16))
        assert torch.equal(oa.compensation(pa).view(torch.int16), ob.compensation(pb).view(torch.int16))
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert torch.equal(oa.optimizer.state[pa][key], ob.optimizer.state[pb][key])
        assert not torch.equal(pb.view(torch.int16), w.view(torch.int16))  # updated


def test_kernel_grad_scales_equal_gradients_scaled_before(interpreter) -> None:
    """Deferred clips multiply the gradients in fp32, one after the other: scales 0.5 and 4 give
    the bits of gradients doubled beforehand (exact multiplications)."""
    a, b = _params(), _params()
    oa = LowPrecisionOptimizer(torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1), state_dtype=None, compile=False)
    ob = LowPrecisionOptimizer(torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1), state_dtype=None, compile=False)
    for step in range(2):
        _grads(a, step, (torch.float32,))
        _same_inputs(oa, a, ob, b)
        for p in b:
            p.grad.mul_(2)
        _call(oa, a, grad_scales=[torch.tensor(0.5), torch.tensor(4.0)])
        _call(ob, b)
        for pa, pb in zip(a, b, strict=True):
            assert torch.equal(pa.view(torch.int16), pb.view(torch.int16))
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(oa.optimizer.state[pa][key], ob.optimizer.state[pb][key])


def _layers(n: int) -> list[torch.nn.Parameter]:
    """``n`` equal layers: a weight, its bias and a norm's two vectors (bf16)."""
    g = torch.Generator().manual_seed(n)
    shapes = [(8, 9), (8,), (8,), (8,)] * n
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in shapes]


def test_kernel_launches_do_not_grow_with_the_number_of_tensors(interpreter, monkeypatch) -> None:
    """12 and 24 layers (48 and 96 tensors of four shapes, bf16 and fp32 gradients): the same
    launches, one per dtype combination, whose programs cover every element."""
    launches = _launches(monkeypatch)
    counts = {}
    for n in (12, 24):
        params = _layers(n)
        opt = KahanOptimizer(torch.optim.AdamW(params, lr=1e-2), compile=False)
        for p in params:
            opt.set_compensation(p, torch.zeros_like(p))
        _grads(params, 0, (torch.bfloat16, torch.float32))
        before = [p.detach().clone() for p in params]
        launches.clear()
        assert _call(opt, params) == []
        counts[n] = len(launches)
        assert sum(grid[0] for grid, _, _ in launches) == sum(-(-p.numel() // TA.BLOCK) for p in params)
        assert all(not torch.equal(p, q) for p, q in zip(params, before, strict=True))
    assert counts == {12: 2, 24: 2}


def test_kernel_new_hyperparameters_do_not_change_its_specialisation(interpreter, monkeypatch) -> None:
    """Every launch argument is a tensor (tables and flags; no Python number, which Triton would
    specialise on), and the compile-time constants do not change with the learning rate, the
    step counts or the seed: new values never recompile (checked on the GPU's cache by
    tests/cuda/test_optim_triton_cuda.py)."""
    launches = _launches(monkeypatch)
    params = _params()
    opt = StochasticRoundingOptimizer(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), compile=False)
    for step, lr in enumerate((1e-2, 3e-3, 1e-4, 0.5)):
        opt.optimizer.param_groups[0]["lr"] = lr
        _grads(params, step, (torch.bfloat16,))
        _call(opt, params, noise=codecs.call_noise(5 + step, 0, params))
    assert len(launches) == 4
    assert all(isinstance(x, torch.Tensor) for _, args, _ in launches for x in args)
    assert len({tuple(sorted(meta.items())) for _, _, meta in launches}) == 1
    assert len(TA._TABLES) >= 1 and all(t.dtype == torch.int32 for t in TA._TABLES.values())


def test_kernel_reads_a_device_learning_rate_on_the_device(interpreter, monkeypatch) -> None:
    """A learning rate held in a device tensor is passed to the kernel, never read on the host
    (here a CPU tensor stands for it): the results equal the host one's within fp32 rounding
    (step_size = lr * (1 / bias_correction1) and 1 - lr * weight_decay in fp32)."""
    a, b = _params(), _params()
    oa = KahanOptimizer(torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1), compile=False)
    ob = KahanOptimizer(torch.optim.AdamW(b, lr=torch.tensor(1e-2), weight_decay=0.1), compile=False)
    monkeypatch.setattr(TA, "_lr_on_device", lambda lr: isinstance(lr, torch.Tensor))
    real = rule.scalar_value
    lr = ob.optimizer.param_groups[0]["lr"]

    def no_host_read(value):
        assert value is not lr, "the device learning rate was read on the host"
        return real(value)

    monkeypatch.setattr(rule, "scalar_value", no_host_read)
    launches = _launches(monkeypatch)
    for step, value in enumerate((3e-3, 7e-4)):
        oa.optimizer.param_groups[0]["lr"] = value
        lr.fill_(value)  # (the same tensor: a scheduler's)
        _grads(a, step, (torch.float32,))
        _same_inputs(oa, a, ob, b)
        operands = _operands(oa, a, 0.0)
        _call(oa, a)
        _call(ob, b)
        for i, (pa, pb) in enumerate(zip(a, b, strict=True)):  # (the moments do not depend on lr: the same bits)
            _low_within_tier(pa, pb, "weight")
            update = _update_scale(oa, pa, operands[i]["exp_avg"])
            _kahan_within_tier(pa, oa.compensation(pa), pb, ob.compensation(pb), operands[i]["w"], update, "master")
            sa, sb = oa.optimizer.state[pa], ob.optimizer.state[pb]
            assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert [meta["LR_ON_DEVICE"] for _, _, meta in launches] == [False, True, False, True]


def test_kernel_leaves_what_it_cannot_step_and_conforms_the_rest(interpreter) -> None:
    """A weight whose moments are of another size is left for another route, untouched; moments in
    fp32 under a bf16 wrapper are converted as the other routes do, non-contiguous ones copied."""
    params = _params()
    opt = LowPrecisionOptimizer(torch.optim.Adam(params, lr=1e-2), state_dtype=torch.bfloat16, compile=False)
    _grads(params, 0, (torch.float32,))
    _call(opt, params)
    bad, wide, strided = params[1], params[0], params[3]
    opt.optimizer.state[bad]["exp_avg"] = torch.zeros(3, dtype=torch.bfloat16)
    opt.optimizer.state[wide]["exp_avg_sq"] = opt.optimizer.state[wide]["exp_avg_sq"].float()
    s = opt.optimizer.state[strided]
    s["exp_avg"] = s["exp_avg"].t().contiguous().t()
    kept = bad.detach().clone()
    _grads(params, 1, (torch.float32,))
    assert _call(opt, params) == [bad]
    assert torch.equal(bad, kept) and float(opt.optimizer.state[bad]["step"]) == 1
    assert opt.optimizer.state[wide]["exp_avg_sq"].dtype == torch.bfloat16
    assert s["exp_avg"].is_contiguous() and float(s["step"]) == 2


def test_kernel_takes_plain_weights_of_the_kinds_it_stores(interpreter) -> None:
    w = torch.nn.Parameter(torch.zeros(8, 4, dtype=torch.bfloat16))
    w.grad_dtype = None
    w.grad = torch.zeros(8, 4)
    comp = torch.zeros_like(w)
    assert TA.available("cpu") and TA.takes("nearest", None, w, None) and TA.takes("stochastic", torch.bfloat16, w, None)
    assert TA.takes("kahan", torch.bfloat16, w, comp) and TA.takes("kahan", None, w, comp.float())
    assert not TA.takes("kahan", None, w, None)  # no compensation
    assert not TA.takes("remainder", None, w, comp)  # remainder masters: the compiled route
    assert TA.takes("nearest", torch.uint8, w, None)  # 8-bit moments: here too
    assert not TA.takes("nearest", torch.float8_e4m3fn, w, None)  # fp8 moments: the compiled route
    assert TA.takes_param("kahan", None, w) and not TA.takes_param("remainder", None, w)
    h = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    h.grad = torch.zeros(4, dtype=torch.float16)
    assert TA.takes("kahan", None, h, torch.zeros_like(h)) and not TA.takes("stochastic", None, h, None)
    f = torch.nn.Parameter(torch.zeros(4))
    f.grad = torch.zeros(4)
    assert not TA.takes("nearest", None, f, None)  # fp32 weights: torch's own kernels
    w.grad = torch.zeros(4, 8).t()
    assert not TA.takes("nearest", None, w, None)  # a non-contiguous gradient
    w.grad = None
    assert not TA.takes("nearest", None, w, None)
    t = torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.bfloat16).t())
    t.grad_dtype = None
    t.grad = torch.zeros(8, 4)
    assert not TA.takes("nearest", None, t, None)  # a non-contiguous weight


def test_kernel_refuses_what_it_would_read_wrongly_before_writing_anything(interpreter) -> None:
    """Raw pointers: a weight ``takes()`` refuses is a ValueError, not a wrong read (a non-contiguous
    gradient: before any state is made), as is a Kahan weight without its compensation."""
    params = _params()
    opt = LowPrecisionOptimizer(torch.optim.Adam(params, lr=1e-2), compile=False)
    _grads(params, 0, (torch.float32,))
    params[3].grad = torch.zeros(129, 3).t()
    with pytest.raises(ValueError, match="not one the Triton optimizer kernel takes"):
        _call(opt, params)
    assert not opt.optimizer.state
    kahan = KahanOptimizer(torch.optim.Adam(params[:1], lr=1e-2), compile=False)
    with pytest.raises(ValueError, match="compensation"):
        TA.triton_adam_step(kahan.optimizer, kahan.optimizer.param_groups[0], params[:1], state_dtype=None,
                            rounding="kahan", comps=lambda p: None)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match="remainder"):
        TA.triton_adam_step(opt.optimizer, opt.optimizer.param_groups[0], params, state_dtype=None, rounding="remainder")


@pytest.mark.parametrize("state_dtype", [None, "8bit"])
@pytest.mark.parametrize("wrapper", [LowPrecisionOptimizer, KahanOptimizer, StochasticRoundingOptimizer])
def test_kernel_steps_the_wrappers_where_routing_sends_it(interpreter, monkeypatch, wrapper, state_dtype) -> None:
    """Through the wrappers' own step: with the kernel listed for the device (as on CUDA), ``compile="auto"``
    checks it once (kernel_works: a probe step against the rule) and steps the group with it, a weight it
    does not take (non-contiguous) on the eager path of the same call, the noise the same for both; four
    steps within the tier of the eager route (``compile=False``) from the same start, step 2 skipped as
    there (masked in the kernel, unless an eager Kahan weight or 8-bit moments have the host read the flag). The memory
    estimate plans the kernel's weights as materialising nothing."""
    from mixprec.optim import routing

    monkeypatch.setitem(routing.EXECUTORS, "cpu", ("triton", "compiled", "eager"))
    monkeypatch.setattr(TA, "_WORKS", {})
    launches = _launches(monkeypatch)
    # (8-bit moments on the eager path are stored only after the host read the flag, as Kahan there)
    device_skip = wrapper is not KahanOptimizer and state_dtype is None
    runs = []
    for setting in ("auto", False):
        params = _params()
        params[2] = torch.nn.Parameter(torch.randn(5, 3, generator=torch.Generator().manual_seed(7)).bfloat16().t())  # eager
        opt = wrapper(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True), state_dtype=state_dtype,
                      compile=setting)
        for step in range(4):
            _grads(params, step, (torch.bfloat16,))
            if step == 2:  # (the scaler's decision: an overflow found)
                # (a Kahan weight on the eager path reads the flag: there the whole step is decided on the host)
                assert opt.skips_on_device() == device_skip
                opt.step_skipping(torch.ones(()))
            else:
                opt.step()
        opt.settle()
        runs.append((params, opt))
    assert TA._WORKS[torch.device("cpu")] and len(TA._WORKS) == 1
    # the probe, then one launch per step (one dtype combination per call), masked in the skipped one
    masked = [False, False, False] + ([True] if device_skip else []) + [False]
    assert [meta["HAS_SKIP"] for _, _, meta in launches] == masked
    (pa, oa), (pb, ob) = runs
    for i, (a, b) in enumerate(zip(pa, pb, strict=True)):
        _low_within_tier(a, b, f"weight {i}")
        assert float(oa.optimizer.state[a]["step"]) == float(ob.optimizer.state[b]["step"])
    assert oa.rounding_state() == ob.rounding_state()
    routes = routing.plan(oa.rounding, oa.state_dtype, "auto", pa, predict=True)
    assert [id(p) for p in routes.triton] == [id(p) for p in pa if p.is_contiguous()] and routes.eager == [pa[2]]


def test_the_switch_is_read_as_the_others_are(monkeypatch) -> None:
    monkeypatch.setenv("MIXPREC_TRITON", "0")
    assert not TA.use_triton_route("auto", "kahan", None)
    monkeypatch.setenv("MIXPREC_TRITON", "1")
    assert TA.use_triton_route("auto", "kahan", None) and not TA.use_triton_route(True, "kahan", None)
    assert TA.use_triton_route("auto", "kahan", torch.uint8) and not TA.use_triton_route("auto", "kahan", torch.float8_e4m3fn)
    assert not TA.use_triton_route("auto", "remainder", None)
    monkeypatch.setenv("MIXPREC_TRITON", "maybe")
    with pytest.raises(ValueError, match="MIXPREC_TRITON='maybe' is not understood"):
        TA.use_triton_route("auto", "kahan", None)


def test_cpu_tensors_are_not_taken_without_the_interpreter() -> None:
    if _interpreting():
        pytest.skip("this process interprets the kernel")
    w = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    w.grad_dtype = None
    w.grad = torch.zeros(4)
    assert not TA.available("cpu") and not TA.takes("nearest", None, w, None)
    assert TA.available("cuda") == (HAS_TRITON and torch.cuda.is_available())


@pytest.mark.long
@pytest.mark.skipif(not HAS_TRITON or IN_SUBPROCESS, reason="needs Triton; runs the kernel tests in a subprocess")
def test_triton_kernels_under_the_interpreter() -> None:
    """Where this process cannot interpret the kernel (Triton imported without TRITON_INTERPRET=1),
    the tests above that need it run in a subprocess that can."""
    if _interpreting():
        pytest.skip("this process interprets the kernel: the tests above ran it")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-k", "kernel and not under_the_interpreter", __file__],
        cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True, timeout=600,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "passed" in summary and "failed" not in summary and "skipped" not in summary, summary

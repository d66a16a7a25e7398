"""optim.quant: the fp32 master as bf16 weight + int16 remainder (exact), and 8-bit blockwise moments."""

from __future__ import annotations

import pytest
import torch

from mixprec.optim import quant
from mixprec.optim.quant import (
    blockwise_nbytes,
    dequantize_blockwise,
    dynamic_map,
    join_master,
    quantize_blockwise,
    quantize_blockwise_into,
    split_master,
    split_master_into,
)

# ---------------------------------------------------------------- helpers


def _floats(bits: torch.Tensor) -> torch.Tensor:
    """fp32 tensor with the given bit patterns (int64 values in [0, 2**32))."""
    return ((bits + 2**31) % 2**32 - 2**31).to(torch.int32).view(torch.float32)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Unsigned bit patterns of fp32 ``x`` as int64 in [0, 2**32)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _rne_high(bits: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even bf16 pattern (int64, 0..0xFFFF) of finite fp32 patterns: the textbook integer rule."""
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


def _check_round_trip(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    weight, rem, ties = split_master(master)
    assert weight.dtype == torch.bfloat16 and rem.dtype == torch.int16 and ties.dtype == torch.int64
    assert weight.shape == rem.shape == master.shape and ties.dim() == 1
    assert torch.equal(weight.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))  # bit for bit
    joined = join_master(weight, rem, ties)
    assert joined.dtype == torch.float32 and joined.shape == master.shape
    nan = master.isnan()
    assert torch.equal(joined.isnan(), nan) and torch.equal(weight.isnan(), nan)  # NaN in, NaN out
    assert torch.equal(_bits(joined)[~nan], _bits(master)[~nan])  # everything else exactly
    return weight, rem, ties


# ------------------------------------------------- split / join: exhaustive over low halves

HIGH_HALVES = [
    0x0000, 0x0001, 0x0002, 0x007F, 0x0080, 0x0081,  # +0, subnormals, the carry into the smallest normal
    0x3F80, 0x3F81, 0x3FFF, 0x4000, 0x42F6,  # 1.0 (even), odd, the carry to 2.0, 2.0, 123.0
    0x7F7E, 0x7F7F, 0x7F80, 0x7FC0, 0x7FFF,  # near bf16's max, the carry to inf, inf and NaNs, NaNs
    0x8000, 0x8001, 0x807F, 0x8080,  # -0, negative subnormals, the carry into -smallest normal
    0xBF80, 0xBF81, 0xBFFF, 0xC2F7,  # -1.0, odd, the carry to -2.0, an odd negative normal
    0xFF7E, 0xFF7F, 0xFF80, 0xFFC0, 0xFFFF,  # near -max, the carry to -inf, -inf and NaNs
]


@pytest.mark.parametrize("high", HIGH_HALVES, ids=[f"{h:#06x}" for h in HIGH_HALVES])
def test_every_low_half_round_trips(high):
    bits = (high << 16) + torch.arange(1 << 16, dtype=torch.int64)
    master = _floats(bits)
    weight, rem, ties = _check_round_trip(master)
    low = bits & 0xFFFF
    w = weight.view(torch.int16).to(torch.int64) & 0xFFFF
    finite = master.isfinite()
    # the cast is round-to-nearest-even (the carry past bf16's max gives inf); the remainder is the low half
    assert torch.equal(w[finite], _rne_high(bits)[finite])
    assert torch.equal(rem.to(torch.int64) & 0xFFFF, low)
    # ties rounded down: exactly the low half 0x8000 with an unchanged (even) high half
    expected_ties = torch.nonzero((low == 0x8000) & (w == high)).view(-1)
    assert torch.equal(ties, expected_ties)
    if bool(finite.all()):
        assert ties.numel() == (1 if high % 2 == 0 and high not in (0x7F7F, 0xFF7F) else 0)
    # the relation, on int32 bit patterns: M = (W << 16) + rem, M = (W << 16) + 0x8000 at the ties
    not_nan = ~master.isnan()
    signed_bits = master.view(torch.int32).to(torch.int64)
    rebuilt = weight.view(torch.int16).to(torch.int64) * 65536 + rem.to(torch.int64)
    rebuilt[ties] += 65536
    assert torch.equal(rebuilt[not_nan], signed_bits[not_nan])


def test_tie_rounded_down_is_the_only_collision():
    # 1.0 + half a bf16 unit: the tie rounds down to 1.0 (even); its remainder pattern is the one of
    # 1.0 + 3 half units rounded up to the next even value 1.0 + 2 units (0x3F81 odd rounds up to 0x3F82)
    down, up = _floats(torch.tensor([0x3F808000, 0x3F818000]))
    (w_down, r_down, t_down), (w_up, r_up, t_up) = split_master(down.reshape(1)), split_master(up.reshape(1))
    assert int(r_down) == int(r_up) == -32768
    assert t_down.tolist() == [0] and t_up.tolist() == []
    assert int(w_down.view(torch.int16)) == 0x3F80 and int(w_up.view(torch.int16)) == 0x3F82
    # without the tie list, the default decode (rounded up) is off by one unit of the high half
    assert float(join_master(w_down, r_down, torch.empty(0, dtype=torch.int64))) != float(down)
    assert float(join_master(w_down, r_down, t_down)) == float(down)


def test_fp32_above_bf16_max_casts_to_inf_and_joins_back():
    # fp32 max, -fp32 max, bf16 max + half a unit (a tie, odd: rounds up to inf), just below it
    master = _floats(torch.tensor([0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF]))
    weight, rem, ties = _check_round_trip(master)
    assert weight[:3].isinf().all() and float(weight[3]) == torch.finfo(torch.bfloat16).max
    assert (rem[:3] < 0).all() and ties.numel() == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_masters_round_trip(seed):
    g = torch.Generator().manual_seed(seed)
    n = 1 << 21
    patterns = _floats(torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64))  # every exponent, inf, NaN
    normal = torch.randn(n, generator=g) * 10 ** torch.randint(-30, 30, (n,), generator=g).float()
    ties = normal.clone()
    ties.view(torch.int32).bitwise_and_(-65536).bitwise_or_(0x8000)  # every element an exact tie
    for master in (patterns, normal, ties):
        _check_round_trip(master)
    _, _, tie_list = _check_round_trip(ties)
    assert tie_list.numel() == int(((ties.view(torch.int32) >> 16) % 2 == 0).sum())  # the even ones round down


def test_shapes_and_non_contiguous_masters():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(64, 48, generator=g)
    base.view(torch.int32)[::3].bitwise_and_(-65536).bitwise_or_(0x8000)  # ties at known rows
    for master in (base, base.t(), base.view(8, 8, 48)[:, ::2], torch.tensor(1.0 + 2**-8), torch.empty(0, 3)):
        weight, rem, ties = _check_round_trip(master)
        flat = master.reshape(-1)
        assert torch.equal(_bits(flat[ties]) & 0xFFFF, torch.full_like(ties, 0x8000))  # indices are row-major
    assert split_master(base.t())[2].numel() > 0


def test_in_place_variants_equal_the_functional_ones():
    g = torch.Generator().manual_seed(4)
    master = torch.randn(3, 1000, generator=g)
    master.view(torch.int32)[:, ::7].bitwise_and_(-65536).bitwise_or_(0x8000)
    weight, rem, ties = split_master(master)
    weight_out, rem_out = torch.full_like(weight, 7.0), torch.full_like(rem, 7)
    ties_out = split_master_into(master, weight_out, rem_out)
    assert torch.equal(weight_out.view(torch.int16), weight.view(torch.int16))
    assert torch.equal(rem_out, rem) and torch.equal(ties_out, ties) and ties.numel() > 0
    out = torch.full_like(master, float("nan"))
    assert join_master(weight_out, rem_out, ties_out, out=out) is out
    assert torch.equal(out.view(torch.int32), master.view(torch.int32))


def test_split_and_join_name_the_bad_argument():
    m = torch.randn(4, 4)
    w, r, t = split_master(m)
    cases = [
        (lambda: split_master(m.half()), TypeError,
         r"split_master\(\): master must be torch.float32, got torch.float16; pass a torch.float32 tensor"),
        (lambda: split_master(m.tolist()), TypeError, r"split_master\(\): master must be a torch.Tensor, got list"),
        (lambda: split_master_into(m, w.float(), r), TypeError, r"weight_out must be torch.bfloat16"),
        (lambda: split_master_into(m, w, r.int()), TypeError, r"rem_out must be torch.int16, got torch.int32"),
        (lambda: split_master_into(m, w, r[:2]), ValueError, r"rem_out has shape \(2, 4\), expected \(4, 4\)"),
        (lambda: split_master_into(m, w.t(), r), ValueError, r"weight_out must be contiguous"),
        (lambda: split_master_into(m, w.view(16), r), ValueError, r"weight_out has shape \(16,\), expected \(4, 4\)"),
        (lambda: join_master(w.float(), r, t), TypeError, r"join_master\(\): weight must be torch.bfloat16"),
        (lambda: split_master_into(m, torch.empty(4, 4, dtype=torch.bfloat16, device="meta"), r), ValueError,
         r"weight_out is on meta, expected cpu; move it with .to\('cpu'\)"),
        (lambda: join_master(w, r.view(16), t), ValueError, r"rem has shape \(16,\), expected \(4, 4\)"),
        (lambda: join_master(w, r, t.int()), TypeError, r"ties must be torch.int64, got torch.int32"),
        (lambda: join_master(w, r, t.view(1, -1)), ValueError, r"ties must be the 1-D index tensor split_master"),
        (lambda: join_master(w, r, t, out=torch.empty(4, 4).t()), ValueError, r"out must be contiguous"),
        (lambda: join_master(w, r, t, out=torch.empty(4, 4, dtype=torch.float64)), TypeError, r"out must be torch.fl"),
        (lambda: join_master(w, r, t, out=torch.empty(16)), ValueError, r"out has shape \(16,\), expected \(4, 4\)"),
    ]
    for call, exc, message in cases:
        with pytest.raises(exc, match=message):
            call()


# ---------------------------------------------------------------- the dynamic map


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_structure(signed):
    qmap = dynamic_map(signed)
    assert qmap.dtype == torch.float32 and qmap.shape == (256,)
    assert bool((qmap[1:] > qmap[:-1]).all())  # sorted, no repeats
    assert float(qmap[-1]) == 1.0 and 0.0 in qmap.tolist()
    positive = qmap[(qmap > 0) & (qmap < 1)]
    for i in range(7):  # decade 10**(i-6): 2**i (signed) or 2**(i+1) midpoints of equal steps
        d = 10.0 ** (i - 6)
        in_decade = positive[(positive > 0.1 * d * 0.999) & (positive < d)]
        n = 2**i if signed else 2 ** (i + 1)
        assert in_decade.numel() == n
        expected = d * (0.1 + 0.9 * (torch.arange(n, dtype=torch.float64) + 0.5) / n)
        torch.testing.assert_close(in_decade.double(), expected, rtol=1e-6, atol=0)
    if signed:
        assert int((qmap < 0).sum()) == 127 and float(qmap[0]) == pytest.approx(-0.99296875)
        assert torch.equal(qmap[:127], -positive.flip(0))  # the negatives mirror the positives; no -1.0
    else:
        assert float(qmap[0]) == 0.0 and positive.numel() == 254
    gap = float((qmap[1:] - qmap[:-1]).max())
    assert gap == pytest.approx(0.0140625 if signed else 0.00703125, abs=1e-6)  # fp32 entries


def test_dynamic_map_is_cached_per_signedness_and_device():
    assert dynamic_map(True) is dynamic_map(True, "cpu") is dynamic_map(True, torch.device("cpu"))
    assert dynamic_map(False) is not dynamic_map(True)
    with pytest.raises(TypeError, match="signed must be True or False"):
        dynamic_map(1)  # type: ignore[arg-type]


# ------------------------------------------------------------- blockwise quantization


def _blocky(n: int, block: int, seed: int, signed: bool) -> torch.Tensor:
    """Random values whose magnitude changes from block to block (1e-8 .. 1e4) and within blocks."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = -(-n // block)
    scale = (10 ** (torch.rand(n_blocks, generator=g) * 12 - 8)).repeat_interleave(block)[:n]
    x = torch.randn(n, generator=g) * scale * 10 ** (torch.rand(n, generator=g) * -3)
    return x if signed else x.abs()


def _block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    flat = x.reshape(-1).float()
    pad = -flat.numel() % block
    return torch.cat([flat.abs(), flat.new_zeros(pad)]).view(-1, block).amax(1)


def _half_gap(signed: bool) -> float:
    qmap = dynamic_map(signed)
    return float((qmap[1:] - qmap[:-1]).max()) / 2


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize(("n", "block"), [(3_000_000, 256), (1000, 256), (255, 256), (4097, 64), (37, 1), (0, 256)])
def test_round_trip_error_is_at_most_half_the_largest_gap(signed, n, block):
    x = _blocky(n, block, seed=n + block, signed=signed)
    codes, absmax = quantize_blockwise(x, signed=signed, block=block)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert absmax.dtype == torch.float32 and absmax.shape == (-(-n // block),)
    assert torch.equal(absmax, _block_absmax(x, block))  # the last block may be partial
    y = dequantize_blockwise(codes, absmax, signed=signed, block=block)
    assert y.dtype == torch.float32 and y.shape == x.shape
    scale = absmax.repeat_interleave(block)[:n]
    err = ((x - y).abs() / torch.where(scale > 0, scale, 1.0)).max() if n else torch.tensor(0.0)
    assert float(err) <= _half_gap(signed) + 1e-6  # 1e-6: fp32 rounding of x / absmax and code * absmax
    assert torch.equal(y[x == 0], torch.zeros_like(y[x == 0]))  # zeros stay exact
    assert bool((torch.sign(y) * torch.sign(x) >= 0).all())  # a sign is never flipped (tiny values may become 0)
    big = x.abs() >= 1e-3 * scale
    assert torch.equal(torch.sign(y[big]), torch.sign(x[big]))
    if n:
        first = int(x[:block].abs().argmax())
        if x[first] > 0:
            assert float(y[first]) == float(x[first])  # the largest positive value of a block is the code 1.0


@pytest.mark.parametrize("signed", [True, False])
def test_codes_are_the_nearest_map_entry(signed):
    x = _blocky(5000, 128, seed=11, signed=signed)
    codes, absmax = quantize_blockwise(x, signed=signed, block=128)
    scaled = x / absmax.repeat_interleave(128)[:5000]
    qmap = dynamic_map(signed)
    best = (qmap.view(1, -1) - scaled.view(-1, 1)).abs().min(1).values
    chosen = (qmap[codes.long()] - scaled).abs()
    assert torch.equal(chosen, best)


@pytest.mark.parametrize("signed", [True, False])
def test_a_value_halfway_between_two_entries_takes_the_larger(signed):
    qmap = dynamic_map(signed)
    halfway = (qmap[:-1] + qmap[1:]) / 2  # in fp32, as the quantizer compares
    x = torch.cat([torch.ones(1), halfway])  # absmax 1: x / absmax is x itself
    codes, absmax = quantize_blockwise(x, signed=signed, block=256)
    assert float(absmax) == 1.0 and torch.equal(codes[1:].long(), torch.arange(1, 256))


def test_zero_blocks_and_block_of_one():
    x = torch.zeros(3, 256)
    x[1, 5] = -2.5
    codes, absmax = quantize_blockwise(x, signed=True)
    assert absmax.tolist() == [0.0, 2.5, 0.0]
    y = dequantize_blockwise(codes, absmax, signed=True)
    assert not y.isnan().any() and torch.equal(y[0], x[0]) and torch.equal(y[2], x[2])
    zero_code = dynamic_map(True).tolist().index(0.0)
    assert codes[0].eq(zero_code).all() and codes[2].eq(zero_code).all()  # the code of 0.0, not a NaN's
    assert float(y[1, 5]) == pytest.approx(-2.5 * 0.99296875)  # the signed map's most negative entry
    # block=1: absmax is |x|, so nonnegative values decode exactly; negatives to -0.99296875 |x|
    v = torch.tensor([3.0, 0.0, 1e-30, -7.0, 5e30])
    u_codes, u_absmax = quantize_blockwise(v.abs(), signed=False, block=1)
    assert torch.equal(dequantize_blockwise(u_codes, u_absmax, signed=False, block=1), v.abs())
    s = dequantize_blockwise(*quantize_blockwise(v, signed=True, block=1), signed=True, block=1)
    assert torch.equal(s[v >= 0], v[v >= 0]) and float(s[3]) == pytest.approx(-7.0 * 0.99296875)


def test_unsigned_refuses_negative_values():
    x = torch.rand(1000)
    x[517] = -1e-20
    with pytest.raises(ValueError, match=r"quantize_blockwise_into\(\): signed=False needs x >= 0"):
        quantize_blockwise(x, signed=False)
    quantize_blockwise(torch.tensor([-0.0, 1.0]), signed=False)  # -0.0 is not negative


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_values_give_a_non_finite_absmax(bad):
    x = torch.randn(4, 256)
    x[2, 17] = bad
    for signed, v in ((True, x), (False, x.abs())):
        codes, absmax = quantize_blockwise(v, signed=signed)
        assert not bool(absmax.isfinite().all()) and not bool(absmax[2].isfinite())  # callers can detect it
        assert bool(absmax[[0, 1, 3]].isfinite().all())
        y = dequantize_blockwise(codes, absmax, signed=signed)
        assert not bool(y[2].isfinite().any())  # the whole block decodes to inf / NaN
        assert float(((y[[0, 1, 3]] - v[[0, 1, 3]]).abs() / absmax[[0, 1, 3]].unsqueeze(1)).max()) <= 0.00704


def test_in_place_variants_and_chunking_equal_the_functional_ones(monkeypatch):
    x = _blocky(10_000, 100, seed=5, signed=True).view(100, 100)
    codes, absmax = quantize_blockwise(x, signed=True, block=100)
    codes_out, absmax_out = torch.full_like(codes, 9), torch.full_like(absmax, 9.0)
    assert quantize_blockwise_into(x, codes_out, absmax_out, signed=True, block=100) is None
    assert torch.equal(codes_out, codes) and torch.equal(absmax_out, absmax)
    y = dequantize_blockwise(codes, absmax, signed=True, block=100)
    out = torch.full_like(y, float("nan"))
    assert dequantize_blockwise(codes, absmax, signed=True, block=100, out=out) is out and torch.equal(out, y)
    # a non-contiguous input, a bf16 input (quantized as its fp32 values)
    transposed = quantize_blockwise(x.t(), signed=True, block=100)
    assert all(map(torch.equal, transposed, quantize_blockwise(x.t().contiguous(), signed=True, block=100)))
    xb = x.bfloat16()
    assert all(map(torch.equal, quantize_blockwise(xb, signed=True), quantize_blockwise(xb.float(), signed=True)))
    # several pieces per call (the temporaries are bounded by _CHUNK elements): the same results
    x2 = x.reshape(-1)[:9_999]
    whole = quantize_blockwise(x2, signed=True, block=7)
    monkeypatch.setattr(quant, "_CHUNK", 250)
    assert all(map(torch.equal, quantize_blockwise(x, signed=True, block=100), (codes, absmax)))
    assert torch.equal(dequantize_blockwise(codes, absmax, signed=True, block=100), y)
    assert all(map(torch.equal, quantize_blockwise(x2, signed=True, block=7), whole))
    assert len(quant._spans(9_999, 7)) > 1


def test_quantize_names_the_bad_argument():
    x = torch.rand(300)
    codes, absmax = quantize_blockwise(x, signed=False)
    cases = [
        (lambda: quantize_blockwise(x.int(), signed=True), TypeError,
         r"quantize_blockwise\(\): x must be a floating-point tensor, got torch.int32; pass x.float\(\)"),
        (lambda: quantize_blockwise(x, signed=True, block=0), ValueError, r"block must be a positive int, got 0"),
        (lambda: quantize_blockwise(x, signed=True, block=True), ValueError, r"block must be a positive int, got True"),
        (lambda: quantize_blockwise(x, signed="yes"), TypeError, r"signed must be True or False, got 'yes'"),
        (lambda: quantize_blockwise_into(x, codes.int(), absmax, signed=False), TypeError,
         r"codes_out must be torch.uint8"),
        (lambda: quantize_blockwise_into(x, codes, absmax[:1], signed=False), ValueError,
         r"absmax_out has shape \(1,\), expected \(2,\)"),
        (lambda: quantize_blockwise_into(x, codes[:5], absmax, signed=False), ValueError,
         r"codes_out has shape \(5,\)"),
        (lambda: dequantize_blockwise(codes.int(), absmax, signed=False), TypeError, r"codes must be torch.uint8"),
        (lambda: dequantize_blockwise(codes, absmax.double(), signed=False), TypeError,
         r"absmax must be torch.float32"),
        (lambda: dequantize_blockwise(codes, absmax, signed=False, block=100), ValueError,
         r"absmax has shape \(2,\), expected \(3,\)"),
        (lambda: dequantize_blockwise(codes, absmax, signed=False, out=torch.empty(300).view(3, 100).t()), ValueError,
         r"out has shape \(100, 3\), expected \(300,\)"),
        (lambda: dequantize_blockwise(codes, absmax, signed=False, out=torch.empty(600)[::2]), ValueError,
         r"dequantize_blockwise\(\): out must be contiguous"),
        (lambda: blockwise_nbytes(-1), ValueError, r"numel must be an int >= 0, got -1"),
        (lambda: blockwise_nbytes(10, 0), ValueError, r"block must be a positive int, got 0"),
    ]
    for call, exc, message in cases:
        with pytest.raises(exc, match=message):
            call()


def test_blockwise_nbytes():
    assert blockwise_nbytes(0) == 0
    assert blockwise_nbytes(256) == 256 + 4
    assert blockwise_nbytes(257) == 257 + 8
    assert blockwise_nbytes(1000, 1) == 5000
    codes, absmax = quantize_blockwise(torch.rand(1000), signed=False, block=64)
    assert blockwise_nbytes(1000, 64) == codes.numel() * codes.element_size() + absmax.numel() * absmax.element_size()


# -------------------------------------------------------------- Adam-like long runs


def _run_ema(beta: float, signed: bool, seed: int, steps: int = 200) -> list[float]:
    """Worst per-block relative L2 error of an 8-bit EMA against the fp32 one, after each update."""
    g = torch.Generator().manual_seed(seed)
    n = 256 * 64
    scale = torch.logspace(-4, 0, 64).repeat_interleave(256) * (0.5 + torch.rand(n, generator=g))
    ema32 = torch.zeros(n)
    codes, absmax = quantize_blockwise(ema32, signed=signed)
    worst = []
    for _ in range(steps):
        grad = torch.randn(n, generator=g) * scale
        new = grad if signed else grad * grad
        ema32.mul_(beta).add_(new, alpha=1 - beta)
        ema8 = dequantize_blockwise(codes, absmax, signed=signed).mul_(beta).add_(new, alpha=1 - beta)
        quantize_blockwise_into(ema8, codes, absmax, signed=signed)
        ema8 = dequantize_blockwise(codes, absmax, signed=signed)
        err = (ema8 - ema32).view(-1, 256).norm(dim=1) / ema32.view(-1, 256).norm(dim=1)
        worst.append(float(err.max()))
    if not signed:
        rel = (ema8 - ema32).abs() / ema32
        assert float(rel.mean()) <= 0.10  # about 0.04: a typical element is within a few percent
        assert abs(float(((ema8 - ema32) / ema32).mean())) <= 0.01  # and the rounding is not biased
    return worst


@pytest.mark.parametrize("seed", [0, 1])
def test_8bit_ema_of_squared_gradients_tracks_fp32(seed):
    worst = _run_ema(0.999, signed=False, seed=seed)
    assert max(worst) <= 0.10  # about 0.04 after 200 updates (rounding errors add up: beta2 forgets slowly)


def test_8bit_ema_of_gradients_tracks_fp32():
    assert max(_run_ema(0.9, signed=True, seed=2)) <= 0.10

"""The Triton kernels of the fused fp8 cast (defined only where Triton is installed).

Two kernels, written once and run either compiled for a CUDA GPU (``triton.jit``) or by
Triton's interpreter on CPU tensors (``InterpretedFunction``: how CI checks their logic):

- :func:`_cast_kernel` reads a 2-d tensor once and writes, in the same pass, its fp8 codes
  (row-major), the codes of its transpose (row-major, i.e. the column-major operand the
  backward GEMM takes), the tensor's amax into the layer's pending amax, the dequantisation
  factor (``1 / scale``, NaN where the tensor holds an inf or NaN), the saturation /
  underflow statistics, and optionally the column sums (a bias gradient) or a copy of the
  bias in bf16. The last program to finish (an atomic ticket) folds the per-program partial
  results; every scratch counter it used is reset by it, so the kernel needs no memset.
- :func:`_amax_kernel`: the amax pass of current scaling (and of a delayed-scaling layer's
  first iteration), whose last program turns the amax into the scale, as
  :func:`mixprec.fp8.compute_scale` does (one correctly rounded division, clamps, keeps the
  previous scale for an amax of 0, inf or NaN).

``EXACT`` rounds to fp8 with integer arithmetic on the fp32 bits (round to nearest, ties to
even, subnormals included): bit-identical to torch's cast (the tests check every finite
bf16 value, in both formats, under the interpreter). Without it the kernel converts with
``.to(tl.float8e4nv / tl.float8e5)``: compiled for the GPU, one conversion instruction
(``cvt.rn.satfinite``, round to nearest even; ``tests/cuda/test_fp8_cuda.py`` checks it
against torch's cast on the GPU). The interpreter's own conversion is not usable: under
Triton 3.9 it rounds ties away from zero (336.0 -> 352.0 in E4M3, where torch gives 320.0)
and truncates in the fp8 subnormal range, so the interpreter always takes ``EXACT``.

The interpreter runs a kernel only when Triton itself was imported with
``TRITON_INTERPRET=1`` in the environment (its own library functions, ``tl.max`` and
``tl.sum``, are then interpreted too): :func:`interpreting` checks exactly that.
"""

from __future__ import annotations

from typing import Any

try:
    import triton
    import triton.language as tl
except ImportError:  # importable without Triton (the docs test walks every module); no kernels then
    triton = None

# scratch slots (int32) per quantised tensor kind; all zero between calls
TICKET, AMAX_BITS, SATURATED, ZERO_CODES, NONZERO = range(5)
SCRATCH_SLOTS = 8

MIN_SCALE_BITS = 0x00800000  # 2**-126, the smallest normal fp32
FP32_MAX_BITS = 0x7F7FFFFF


def _cast_kernel(
    X, SCALE, OUT, OUT_T, INV, SCRATCH, PENDING, FLAG, STATS, BIAS, BIAS_OUT, DB_WS, DB_TICKETS, DBIAS,
    M, N, stride_m, stride_n,
    FMT_MAX: tl.constexpr, MANT: tl.constexpr, EXP_BIAS: tl.constexpr, NAN_CODE: tl.constexpr,
    X_BF16: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, UPDATE: tl.constexpr,
    STATS_ON: tl.constexpr, CAST_BIAS: tl.constexpr, DBIAS_ON: tl.constexpr, EXACT: tl.constexpr,
    FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_m = tl.num_programs(0)
    num_n = tl.num_programs(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m = rm < M
    in_n = rn < N
    mask = in_m[:, None] & in_n[None, :]
    offsets = rm[:, None].to(tl.int64) * stride_m + rn[None, :].to(tl.int64) * stride_n
    if X_BF16:  # widened from its bits: exact for every bf16 value (the interpreter's own widening is not)
        raw = tl.load(X + offsets, mask=mask, other=0)
        x = (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(SCALE)
    xbits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    nonfinite = xbits >= 0x7F800000
    y = x * scale
    yc = tl.minimum(tl.maximum(y, -FMT_MAX), FMT_MAX)
    if EXACT:
        b = yc.to(tl.int32, bitcast=True)
        sign = (b >> 31) & 1
        a = b & 0x7FFFFFFF
        e = a >> 23
        full = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
        te = tl.maximum(e, 1) - 127 + EXP_BIAS  # the target's biased exponent (below 1: subnormal)
        shift = tl.minimum((23 - MANT) + tl.maximum(1 - te, 0), 30)
        q = full >> shift
        rem = full & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        up = (rem > half) | ((rem == half) & ((q & 1) == 1))
        code = ((tl.maximum(te, 1) - 1) << MANT) + q + up.to(tl.int32)  # a carry moves into the exponent
        code = code | (sign << 7)
    else:
        code = yc.to(FP8, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True).to(tl.int32)
    code = tl.where(nonfinite, NAN_CODE, code)
    code8 = code.to(tl.uint8)
    if ROWS:
        tl.store(OUT + rm[:, None].to(tl.int64) * N + rn[None, :], code8, mask=mask)
    if COLS:
        tl.store(OUT_T + rn[:, None].to(tl.int64) * M + rm[None, :], tl.trans(code8), mask=tl.trans(mask))
    if CAST_BIAS:  # the bias of a weight (one entry per row), in bf16 for the GEMM's epilogue  # noqa: SIM102 (a constexpr, then a runtime test)
        if pid_n == 0:
            bb = tl.load(BIAS + rm, mask=in_m, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
            rounded = (bb + 0x7FFF + ((bb >> 16) & 1)) >> 16
            is_nan = (bb & 0x7FFFFFFF) > 0x7F800000
            bf = tl.where(is_nan, 0x7FC0, rounded & 0xFFFF)
            tl.store(BIAS_OUT + rm, bf.to(tl.int16), mask=in_m)
    if DBIAS_ON:  # column sums (the bias gradient), folded in a fixed order: deterministic
        tl.store(DB_WS + pid_m.to(tl.int64) * N + rn, tl.sum(x, axis=0), mask=in_n)
        tl.debug_barrier()
        arrived = tl.atomic_add(DB_TICKETS + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == num_m - 1:
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for i in range(0, num_m):
                acc += tl.load(DB_WS + i * N + rn, mask=in_n, other=0.0, cache_modifier=".cg")
            tl.store(DBIAS + rn, acc, mask=in_n)
            tl.atomic_xchg(DB_TICKETS + pid_n, 0)
    tl.atomic_max(SCRATCH + AMAX_BITS, tl.max(tl.where(mask, xbits, 0)), sem="relaxed", scope="gpu")
    if STATS_ON:
        sat = tl.sum((((y > FMT_MAX) | (y < -FMT_MAX)) & mask).to(tl.int32))
        zeros = tl.sum((((code & 0x7F) == 0) & mask).to(tl.int32))
        nonzero = tl.sum(((x != 0) & mask).to(tl.int32))
        tl.atomic_add(SCRATCH + SATURATED, sat, sem="relaxed", scope="gpu")
        tl.atomic_add(SCRATCH + ZERO_CODES, zeros, sem="relaxed", scope="gpu")
        tl.atomic_add(SCRATCH + NONZERO, nonzero, sem="relaxed", scope="gpu")
    tl.debug_barrier()
    ticket = tl.atomic_add(SCRATCH + TICKET, 1, sem="acq_rel", scope="gpu")
    if ticket == num_m * num_n - 1:  # the last program: every other one has added its part
        amax_bits = tl.atomic_xchg(SCRATCH + AMAX_BITS, 0, sem="acq_rel", scope="gpu")
        finite = amax_bits < 0x7F800000
        inv = tl.div_rn(tl.full([], 1.0, tl.float32), scale)
        tl.store(INV, tl.where(finite, inv, float("nan")))
        if UPDATE:
            tl.atomic_max(PENDING, amax_bits, sem="relaxed", scope="gpu")  # (the fp32 amax, as bits)
            tl.store(FLAG, tl.full([], 1, tl.int8), mask=amax_bits >= 0x7F800000)
        if STATS_ON:
            sat = tl.atomic_xchg(SCRATCH + SATURATED, 0, sem="acq_rel", scope="gpu")
            zeros = tl.atomic_xchg(SCRATCH + ZERO_CODES, 0, sem="acq_rel", scope="gpu")
            nonzero = tl.atomic_xchg(SCRATCH + NONZERO, 0, sem="acq_rel", scope="gpu")
            numel = M * N
            flushed = tl.maximum(zeros - (numel - nonzero), 0)
            sat_frac = tl.div_rn(sat.to(tl.float32), tl.maximum(numel, 1).to(tl.float32))
            under = tl.div_rn(flushed.to(tl.float32), tl.maximum(nonzero, 1).to(tl.float32))
            tl.store(STATS, tl.where(finite, sat_frac, 0.0))
            tl.store(STATS + 1, tl.where(finite, under, 0.0))
        tl.atomic_xchg(SCRATCH + TICKET, 0, sem="relaxed", scope="gpu")


def _amax_kernel(
    X, SCRATCH, PREV, SCALE_OUT, M, N, stride_m, stride_n,
    NUMERATOR: tl.constexpr, X_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offsets = rm[:, None].to(tl.int64) * stride_m + rn[None, :].to(tl.int64) * stride_n
    if X_BF16:
        raw = tl.load(X + offsets, mask=mask, other=0)
        x = (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    xbits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tl.atomic_max(SCRATCH + AMAX_BITS, tl.max(tl.where(mask, xbits, 0)), sem="relaxed", scope="gpu")
    tl.debug_barrier()
    ticket = tl.atomic_add(SCRATCH + TICKET, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:
        amax_bits = tl.atomic_xchg(SCRATCH + AMAX_BITS, 0, sem="acq_rel", scope="gpu")
        amax = amax_bits.to(tl.float32, bitcast=True)
        s = tl.div_rn(tl.full([], NUMERATOR, tl.float32), amax)
        s = tl.minimum(tl.maximum(s, tl.full([], MIN_SCALE_BITS, tl.int32).to(tl.float32, bitcast=True)),
                       tl.full([], FP32_MAX_BITS, tl.int32).to(tl.float32, bitcast=True))
        informative = (amax_bits < 0x7F800000) & (amax_bits > 0)
        tl.store(SCALE_OUT, tl.where(informative, s, tl.load(PREV)))
        tl.atomic_xchg(SCRATCH + TICKET, 0, sem="relaxed", scope="gpu")


#: (cast kernel, amax kernel): compiled for the GPU, or run by Triton's interpreter; None without Triton
CAST_KERNEL: Any = None if triton is None else triton.jit(_cast_kernel)
AMAX_KERNEL: Any = None if triton is None else triton.jit(_amax_kernel)


def interpreting() -> bool:
    """Whether these kernels run through Triton's interpreter: ``TRITON_INTERPRET=1`` was set
    when Triton (its library functions) and this module were first imported. Setting it
    later changes nothing: the kernels stay compiled for the GPU (and CPU tensors then take
    the torch implementation of the cast)."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(CAST_KERNEL, InterpretedFunction) and isinstance(tl.max, InterpretedFunction)

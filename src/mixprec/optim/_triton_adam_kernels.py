"""The Triton kernel of the GPU route of the low-precision wrappers: Adam/AdamW over many tensors per launch.

A sanctioned mirror of :mod:`mixprec.optim.rule` (as :file:`native_adam.c` is for the CPU): the
operations of torch's Adam/AdamW in torch's order, on fp32 values, with the stored forms of
:mod:`mixprec.optim.codecs` (round to nearest, Kahan compensation, stochastic rounding with
:func:`~mixprec.optim.codecs.hash16` noise) written as integer arithmetic on the bits. The
launcher is :mod:`mixprec.optim.triton_adam`; it builds the tables read here.

One launch steps every tensor of one (weight, gradient, compensation, moment) dtype combination
(``multi_tensor_apply``'s idea): each program takes ``BLOCK`` elements of one tensor. Which
tensor: ``BLOCKS[program]`` (int32, one entry per program); where in it: the program's index
minus the tensor's first program. Everything else is read from two int64 tables in device
memory, so no launch argument is a Python number (new hyperparameters, seeds or step counts never
recompile):

- ``HDR`` (per call): ``[seed, lerp weight (1 - beta1), beta2, 1 - beta2, eps, decay, weight
  decay, -]``, the floating entries as the bits of fp64 values (read through a float64
  pointer, rounded to fp32 here as torch rounds a Python scalar); ``decay`` is ``1 - lr *
  weight_decay`` (decoupled) or ``weight_decay`` (L2).
- ``TAB`` (per launch): ``TAB[0] = T`` (the number of tensors), then the rows of :data:`ROWS`,
  ``T`` entries each (entry ``k`` of row ``r`` at ``1 + r * T + k``): the data pointers of the
  weights, gradients, moments and compensations, each tensor's numel, its first element's
  position in the call (the noise's), its first program, and its ``step_size`` and
  ``bias_correction2_sqrt`` (fp64 bits; with ``LR_ON_DEVICE``, ``1 / bias_correction1``, the
  learning rate being read from ``LR``); with 8-bit moments the data pointers of their block
  scales (fp32, one per 256 elements).

8-bit moments (``S_KIND == Q8``) are :func:`mixprec.optim.states.q8_load` / ``q8_store``: a code's
map entry times its block's absmax, and back: each 256-element block's absmax (an integer maximum
of the magnitudes' bits, so a NaN wins as in ``torch.amax``), the value divided by it (by 1 for an
all-zero block) and its nearest code from the lookup of its top 16 bits and the decision point
above that code (the tables of :func:`mixprec.optim.states.q8_tables`, ``Q8T``: signed map, lookup,
points, unsigned map, lookup, points: their data pointers, int64).

The bf16 round to nearest even is integer arithmetic on the fp32 bits (NaN kept NaN, as
``0x7FC0``): the same bits compiled for the GPU and under Triton's interpreter, whose own
``.to(tl.bfloat16)`` truncates. bf16 values are widened from their bits (exact); fp16 goes
through Triton's conversions (round to nearest even on both). Divisions and square roots are
the correctly rounded ``div_rn`` / ``sqrt_rn`` (Triton's ``/`` and ``sqrt`` are approximate on
the GPU); the compiled kernel may contract ``a + b * c`` into fused multiply-adds, as torch's
own CUDA kernels do: results within fp32 rounding of the eager path.

The interpreter runs a kernel only when Triton itself was imported with ``TRITON_INTERPRET=1``
(:func:`interpreting`), as for :mod:`mixprec.fp8._triton_kernels`.

>>> ROWS.index("numel") < ROWS.index("step_size")
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    import triton
    import triton.language as tl
except ImportError:  # importable without Triton (the docs test walks every module); no kernel then
    triton = None

#: the rows of a launch's table, in order (see the module's docstring)
ROWS = ("w", "g", "m", "v", "vmax", "comp", "numel", "first", "first_block", "step_size", "bc2_sqrt",
        "m_scale", "v_scale", "vmax_scale")
#: ``HDR``'s entries, in order
HEADER = ("seed", "lerp_weight", "beta2", "one_minus_beta2", "eps", "decay", "weight_decay", "pad")
#: dtype codes of the stored tensors (constexprs of the kernel); Q8: 8-bit blockwise moments
FP32, BF16, FP16, Q8 = 0, 1, 2, 3
#: the stores (``ROUNDING``)
NEAREST, KAHAN, STOCHASTIC = 0, 1, 2
#: weight decay (``WD_MODE``): none, added to the gradient (Adam), decoupled (AdamW)
NO_DECAY, L2_DECAY, DECOUPLED = 0, 1, 2


def _helper(fn: Callable[..., Any]) -> Any:
    """A device function of the kernel (Triton's, resolved by name when the kernel is compiled or
    interpreted); the plain function without Triton."""
    return fn if triton is None else triton.jit(fn)


@_helper
def _entry(TAB, row, T, k, ALIGNED: tl.constexpr):
    """Entry ``k`` of ``row`` of a launch's table (int64)."""
    value = tl.load(TAB + 1 + row * T + k)
    if ALIGNED:  # a data pointer the launcher found 16-byte aligned: vector loads
        value = tl.multiple_of(value, 16)
    return value


@_helper
def _double(TAB, row, T, k):
    """Entry ``k`` of a floating ``row`` (fp64 bits), rounded to fp32."""
    return tl.load((TAB + 1 + row * T + k).to(tl.pointer_type(tl.float64))).to(tl.float32)


@_helper
def _widen(raw, KIND: tl.constexpr):
    """fp32 values of 16-bit ``raw`` bits (int16) holding bf16 (exact: the bits shifted up) or fp16."""
    if KIND == 1:
        return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return raw.to(tl.float16, bitcast=True).to(tl.float32)


@_helper
def _rne_bf16(x):
    """The bits (int16) of fp32 ``x`` rounded to the nearest bf16, ties to even; NaN is 0x7FC0."""
    b = x.to(tl.int32, bitcast=True)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    b = tl.where(nan, 0, b)  # (no carry out of a NaN's bits)
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where(nan, 0x7FC0, rounded).to(tl.int16)


@_helper
def _narrow(x, KIND: tl.constexpr):
    """The bits (int16) of fp32 ``x`` stored as bf16 or fp16, rounded to nearest even."""
    if KIND == 1:
        return _rne_bf16(x)
    return x.to(tl.float16).to(tl.int16, bitcast=True)


@_helper
def _load16or32(TAB, row, T, k, offs, mask, KIND: tl.constexpr, ALIGNED: tl.constexpr):
    """A stored tensor's block as fp32 (fp32 itself, or bf16/fp16 widened from their bits)."""
    address = _entry(TAB, row, T, k, ALIGNED)
    if KIND == 0:
        return tl.load(address.to(tl.pointer_type(tl.float32)) + offs, mask=mask, other=0.0)
    return _widen(tl.load(address.to(tl.pointer_type(tl.int16)) + offs, mask=mask, other=0), KIND)


@_helper
def _store16or32(TAB, row, T, k, offs, mask, x, KIND: tl.constexpr, ALIGNED: tl.constexpr):
    address = _entry(TAB, row, T, k, ALIGNED)
    if KIND == 0:
        tl.store(address.to(tl.pointer_type(tl.float32)) + offs, x, mask=mask)
    else:
        tl.store(address.to(tl.pointer_type(tl.int16)) + offs, _narrow(x, KIND), mask=mask)


@_helper
def _hash16(x):
    """codecs.hash16 of int64 ``x`` (products stay below 2**63), as int64 in [0, 2**16)."""
    x = (x & 0xFFFFFFFF) ^ (((x >> 32) * 0x9E3779B1) & 0xFFFFFFFF)  # codecs.FOLD
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    return x & 0xFFFF


@_helper
def _table(Q8T, j, INT: tl.constexpr):
    """Table ``j`` of the 8-bit tables (``Q8T``: their data pointers): the int32 lookups, else fp32."""
    if INT:
        return tl.load(Q8T + j).to(tl.pointer_type(tl.int32))
    return tl.load(Q8T + j).to(tl.pointer_type(tl.float32))


@_helper
def _load_state(TAB, row, srow, T, k, offs, mask, Q8T, j, S_KIND: tl.constexpr, ALIGNED: tl.constexpr):
    """A moment's block as fp32: a float state widened, 8-bit codes their map entries times their
    block's absmax (states.q8_load)."""
    if S_KIND == 3:
        codes = tl.load(_entry(TAB, row, T, k, ALIGNED).to(tl.pointer_type(tl.uint8)) + offs, mask=mask, other=0)
        scales = _entry(TAB, srow, T, k, False).to(tl.pointer_type(tl.float32))
        return tl.load(_table(Q8T, j, False) + codes.to(tl.int32)) * tl.load(scales + offs // 256, mask=mask, other=0.0)
    return _load16or32(TAB, row, T, k, offs, mask, S_KIND, ALIGNED)


@_helper
def _store_state(TAB, row, srow, T, k, offs, mask, x, start, numel, Q8T, j,
                 S_KIND: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """A moment's new fp32 block stored: a float state narrowed, or 8-bit codes and block absmaxes
    (states.q8_store, the nearest code of each value divided by its block's absmax)."""
    if S_KIND == 3:
        rows = tl.reshape(tl.where(mask, x, 0.0), (BLOCK // 256, 256))
        top = tl.max(rows.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)  # NaN above inf above the finite
        absmax = tl.where(top > 0x7F800000, float("nan"), top.to(tl.float32, bitcast=True))
        scaled = tl.div_rn(rows, tl.where(absmax > 0.0, absmax, 1.0)[:, None])  # an all-zero block: by 1
        first = tl.load(_table(Q8T, j + 1, True) + ((scaled.to(tl.int32, bitcast=True) >> 16) & 0xFFFF))
        codes = first + (scaled >= tl.load(_table(Q8T, j + 2, False) + first)).to(tl.int32)
        out = _entry(TAB, row, T, k, ALIGNED).to(tl.pointer_type(tl.uint8))
        tl.store(out + offs, tl.reshape(codes, (BLOCK,)).to(tl.uint8), mask=mask)
        blocks = start // 256 + tl.arange(0, BLOCK // 256)
        scales = _entry(TAB, srow, T, k, False).to(tl.pointer_type(tl.float32))
        tl.store(scales + blocks, absmax, mask=blocks * 256 < numel)
    else:
        _store16or32(TAB, row, T, k, offs, mask, x, S_KIND, ALIGNED)


def _adam_kernel(
    HDR, TAB, BLOCKS, SKIP, GSCALE, LR, Q8T,
    W_KIND: tl.constexpr, G_KIND: tl.constexpr, C_KIND: tl.constexpr, S_KIND: tl.constexpr,
    ROUNDING: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, WD_MODE: tl.constexpr,
    N_GSCALES: tl.constexpr, HAS_SKIP: tl.constexpr, LR_ON_DEVICE: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if HAS_SKIP:  # a step skipped on the device: every program reads the flag and writes nothing  # noqa: SIM102 (a constexpr, then a runtime test)
        if tl.load(SKIP) != 0:
            return
    pid = tl.program_id(0)
    k = tl.load(BLOCKS + pid).to(tl.int64)  # the tensor of this program
    T = tl.load(TAB)
    numel = tl.load(TAB + 1 + 6 * T + k)
    start = (pid - tl.load(TAB + 1 + 8 * T + k)) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    mask = offs < numel
    hdr = HDR.to(tl.pointer_type(tl.float64))
    lerp_weight = tl.load(hdr + 1).to(tl.float32)
    beta2 = tl.load(hdr + 2).to(tl.float32)
    one_minus_beta2 = tl.load(hdr + 3).to(tl.float32)
    eps = tl.load(hdr + 4).to(tl.float32)
    decay = tl.load(hdr + 5).to(tl.float32)
    step_size = _double(TAB, 9, T, k)
    bc2_sqrt = _double(TAB, 10, T, k)
    if LR_ON_DEVICE:  # the table holds 1 / bias_correction1; lr read here, never on the host
        lr = tl.load(LR).to(tl.float32)
        step_size = lr * step_size
        if WD_MODE == 2:
            decay = 1.0 - lr * tl.load(hdr + 6).to(tl.float32)

    # ---- the stored forms, as fp32 (codecs.fused_load_weight, fused_load_state)
    w = _load16or32(TAB, 0, T, k, offs, mask, W_KIND, ALIGNED)
    if ROUNDING == 1:  # Kahan: the weight plus its compensation
        w = w + _load16or32(TAB, 5, T, k, offs, mask, C_KIND, ALIGNED)
    g = _load16or32(TAB, 1, T, k, offs, mask, G_KIND, ALIGNED)
    for j in tl.static_range(N_GSCALES):  # deferred clips, one multiplication each (the eager order)
        g = g * tl.load(GSCALE + j)
    m = _load_state(TAB, 2, 11, T, k, offs, mask, Q8T, 0, S_KIND, ALIGNED)  # (signed tables 0-2, unsigned 3-5)
    v = _load_state(TAB, 3, 12, T, k, offs, mask, Q8T, 3, S_KIND, ALIGNED)

    # ---- the rule (rule.adam), in torch's order
    if MAXIMIZE:
        g = -g
    if WD_MODE == 2:
        w = w * decay  # param.mul_(1 - lr * weight_decay)
    elif WD_MODE == 1:
        g = g + decay * w  # grad.add(param, alpha=weight_decay)
    # exp_avg.lerp_(grad, 1 - beta1): torch's lerp, by the size of the weight
    m = tl.where(lerp_weight < 0.5, m + lerp_weight * (g - m), g - (g - m) * (1.0 - lerp_weight))
    v = v * beta2 + one_minus_beta2 * g * g  # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    if AMSGRAD:
        vmax = tl.maximum(_load_state(TAB, 4, 13, T, k, offs, mask, Q8T, 3, S_KIND, ALIGNED), v,
                          propagate_nan=tl.PropagateNan.ALL)
        _store_state(TAB, 4, 13, T, k, offs, mask, vmax, start, numel, Q8T, 3, S_KIND, ALIGNED, BLOCK)
        denom = tl.sqrt_rn(vmax)
    else:
        denom = tl.sqrt_rn(v)
    denom = tl.div_rn(denom, bc2_sqrt) + eps
    w = w + (-step_size) * tl.div_rn(m, denom)  # param.addcdiv_(exp_avg, denom, value=-step_size)
    _store_state(TAB, 2, 11, T, k, offs, mask, m, start, numel, Q8T, 0, S_KIND, ALIGNED, BLOCK)
    _store_state(TAB, 3, 12, T, k, offs, mask, v, start, numel, Q8T, 3, S_KIND, ALIGNED, BLOCK)

    # ---- the weight's store (codecs.fused_store_weight)
    w_ptr = _entry(TAB, 0, T, k, ALIGNED).to(tl.pointer_type(tl.int16))
    if ROUNDING == 2:  # 16 bits of hash16((first + i) ^ seed) added below the kept ones, truncated
        noise = _hash16((tl.load(TAB + 1 + 7 * T + k) + offs) ^ tl.load(HDR))
        bits = ((w.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF) + noise) >> 16
        bits = tl.where(w != w, 0x7FC0, bits & 0xFFFF)
        tl.store(w_ptr + offs, bits.to(tl.int32).to(tl.int16), mask=mask)
    else:
        low = _narrow(w, W_KIND)
        tl.store(w_ptr + offs, low, mask=mask)
        if ROUNDING == 1:  # what rounding dropped, in the compensation's dtype
            _store16or32(TAB, 5, T, k, offs, mask, w - _widen(low, W_KIND), C_KIND, ALIGNED)


#: the kernel: compiled for the GPU, or run by Triton's interpreter; None without Triton. No
#: argument is specialised on its alignment (they are all tensors of tables and flags)
ADAM_KERNEL: Any = None if triton is None else triton.jit(
    _adam_kernel, do_not_specialize=["HDR", "TAB", "BLOCKS", "SKIP", "GSCALE", "LR", "Q8T"]
)


def interpreting() -> bool:
    """Whether the kernel runs through Triton's interpreter: ``TRITON_INTERPRET=1`` was set when
    Triton (its library functions) and this module were first imported."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(ADAM_KERNEL, InterpretedFunction) and isinstance(tl.max, InterpretedFunction)

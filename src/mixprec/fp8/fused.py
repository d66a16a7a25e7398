"""The fused fp8 cast: one pass per tensor writes its fp8 codes, their transpose, its amax and statistics.

An fp8 linear layer quantises three tensors per training iteration (input, weight, output
gradient), and its backward GEMMs take the transposed operands in column-major layout.
Eagerly that is an amax pass, a scale computation, a multiply, a clamp, a cast, three
statistics passes and, natively, a ``contiguous()`` copy of each transposed operand: a
dozen or more kernels per tensor. Here it is one kernel per tensor (a second, the amax pass,
only for current scaling and for a delayed-scaling layer's first iteration), with the
scale read from the device, as TransformerEngine's cast-transpose does:

- ``x`` (2-d, any strides) is read once; the kernel writes ``data`` (row-major fp8 codes),
  ``data_t`` (the codes of ``x.T``, row-major), ``inv`` (``1 / scale``; NaN when ``x``
  holds an inf or NaN, so every GEMM result it feeds is NaN, as the eager quantiser's
  all-NaN codes make it), and, in training, folds the amax into the layer's *pending* amax
  (the maximum since the last scale update: :func:`mixprec.fp8.update_scales` turns it
  into history and scales, once per step for all layers), sets the non-finite flag and
  writes the saturation / underflow fractions;
- optionally the column sums of ``x`` (the bias gradient, from the output gradient) and
  a bf16 copy of a weight's bias (for the GEMM's epilogue).

Two implementations of the same contract, chosen by the ``cast`` switch of
:class:`~mixprec.fp8.Fp8Linear`:

- ``"triton"``: the kernels of :mod:`mixprec.fp8._triton_kernels`, compiled for CUDA
  tensors; on CPU tensors Triton's interpreter runs them (slow: for checking their logic);
- ``"compile"``: the same arithmetic as torch ops, through ``torch.compile`` (inductor
  writes its own kernels), eagerly where nothing compiles.

The fp8 codes, ``inv``, amax and statistics equal the eager quantiser's
(:func:`mixprec.fp8.quantize_with_stats`) bit for bit for a finite tensor. A tensor with
an inf or NaN differs only in its codes: its finite elements keep their codes and its
non-finite ones become the NaN code, while ``inv`` is NaN (the eager quantiser makes every
code NaN); what a GEMM computes from either is all NaN. The column sums are an fp32 sum in
a fixed order (deterministic, within fp32 rounding of ``x.sum(0)``).
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.compiling import (
    call_compiled,
    compile_errors,
    compile_works,
    compiled,
    mark_compile_failed,
)
from mixprec.dtypes import Format

__all__ = [
    "FUSED_CASTS",
    "LAUNCHES",
    "CastSlots",
    "fused_cast",
    "fused_scale",
    "triton_available",
]

#: The fused implementations behind ``Fp8Linear(cast=...)`` ("eager" is the unfused quantiser).
FUSED_CASTS: tuple[str, ...] = ("compile", "triton")

#: Fused casts run in this process: "fp8_cast" / "fp8_amax" count launches of the Triton
#: kernels, "fp8_cast_torch" / "fp8_amax_torch" calls of the torch implementation (one
#: compiled kernel each, or eager ops): what the tests count.
LAUNCHES: Counter[str] = Counter()

#: Tile of one Triton program (rows, columns); tests shrink it to run several programs.
#: (Not tuned on a GPU yet: each program ends with a few scalar atomics on the layer's
#: counters, so larger tiles mean fewer of them.)
BLOCK: tuple[int, int] = (64, 64)

#: How the compiled Triton kernel rounds to fp8: False (default) with the GPU's conversion
#: instruction (round to nearest even), True with integer arithmetic on the fp32 bits (the
#: same codes, a few more instructions). Under the interpreter the kernel always takes the
#: integer arithmetic: the interpreter's own conversion does not round to nearest even
#: (see :mod:`mixprec.fp8._triton_kernels`).
EXACT = False

_TRITON_NUMEL_LIMIT = 2**31 - 1  # element counts are int32 in the kernel


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_available(device: torch.device | str) -> bool:
    """Whether the Triton cast runs for tensors on ``device``: CUDA with Triton installed,
    or CPU through Triton's interpreter (``TRITON_INTERPRET=1`` in the environment before
    Triton is first imported; slow: for checking the kernels' logic).

    >>> triton_available("meta")
    False
    """
    device_type = torch.device(device).type
    if device_type not in ("cuda", "cpu") or not _triton_installed():
        return False
    from mixprec.fp8._triton_kernels import interpreting

    return device_type == "cuda" or interpreting()


@dataclass(frozen=True)
class CastSlots:
    """Where one cast records what it saw: views of one layer's buffers for one tensor kind.

    ``pending``: 0-dim fp32, the largest amax since the last scale update (a NaN or inf
    stays: the update records it as 0); ``flag``: 0-dim bool, set when the tensor held an
    inf or NaN; ``stats``: (2,) fp32, saturation and underflow fractions; ``scratch``: (8,)
    int32 counters of the Triton kernel, zero between calls.
    """

    pending: torch.Tensor
    flag: torch.Tensor
    stats: torch.Tensor
    scratch: torch.Tensor


def _fmt_constants(fmt: Format) -> tuple[int, int]:
    """(mantissa bits, exponent bias) of an fp8 format."""
    if fmt.dtype == torch.float8_e4m3fn:
        return 3, 7
    if fmt.dtype == torch.float8_e5m2:
        return 2, 15
    raise ValueError(f"the fused fp8 cast takes E4M3 or E5M2, not {fmt}")


def _empty_u8(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device)


# --------------------------------------------------------------------------- torch implementation


def _torch_cast(
    x: torch.Tensor,
    scale: torch.Tensor,
    pending: torch.Tensor,
    flag: torch.Tensor,
    stats_out: torch.Tensor,
    bias: torch.Tensor | None,
    fmt_max: float,
    dtype: torch.dtype,
    rows: bool,
    cols: bool,
    update: bool,
    stats: bool,
    dbias: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The fused cast as torch ops (compiled by :func:`fused_cast` where torch.compile works)."""
    xf = x.float()
    amax = xf.abs().amax()
    finite = torch.isfinite(amax)
    y = xf * scale
    data = torch.where(torch.isfinite(xf), y.clamp(-fmt_max, fmt_max), float("nan")).to(dtype)
    inv = torch.where(finite, scale.reciprocal(), float("nan"))
    if update:
        pending.copy_(torch.maximum(pending, amax))
        flag.logical_or_(~finite)
        if stats:
            numel = x.numel()
            saturated = (y > fmt_max).sum() + (y < -fmt_max).sum()
            nonzero = (xf != 0).sum()
            flushed = ((data.float() == 0).sum() - (numel - nonzero)).clamp(min=0)
            fractions = torch.stack([saturated / max(numel, 1), flushed / nonzero.clamp(min=1)]).float()
            stats_out.copy_(torch.where(finite, fractions, 0.0))
    data_t = data.t().contiguous() if cols else None
    bias_low = None if bias is None else bias.to(torch.bfloat16)
    column_sums = xf.sum(0) if dbias else None
    return (data if rows else None), data_t, inv, bias_low, column_sums


def _torch_scale(
    x: torch.Tensor, prev: torch.Tensor, numerator: float
) -> torch.Tensor:
    """:func:`mixprec.fp8.compute_scale` of ``x``'s amax, as torch ops."""
    from mixprec.fp8.scaling import FP32_MAX, MIN_SCALE

    amax = x.float().abs().amax()
    scale = torch.clamp(torch.full_like(amax, numerator) / amax, min=MIN_SCALE, max=FP32_MAX)
    return torch.where(torch.isfinite(amax) & (amax > 0), scale, prev)


def _run_torch(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` compiled: on CPU through :func:`call_compiled`, on CUDA with one
    ``torch.compile`` per function (dynamic shapes); eagerly where nothing compiles."""
    x = args[0]
    if x.device.type == "cuda" and type(x) is torch.Tensor and not torch.compiler.is_compiling() \
            and torch._C._len_torch_dispatch_stack() == 0 and compile_works(x.device):
        try:
            return compiled(fn, dynamic=True)(*args)
        except compile_errors() as exc:  # one warning, then eager torch ops on this device type
            mark_compile_failed(x.device, exc)
    return call_compiled(fn, *args)


# --------------------------------------------------------------------------- Triton implementation


def _x_arg(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16), True
    return x, False


def _triton_cast(
    x: torch.Tensor,
    scale: torch.Tensor,
    slots: CastSlots,
    bias: torch.Tensor | None,
    fmt: Format,
    rows: bool,
    cols: bool,
    update: bool,
    stats: bool,
    dbias: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    import triton.language as tl

    from mixprec.fp8._triton_kernels import CAST_KERNEL, interpreting

    m, n = x.shape
    device = x.device
    bm, bn = BLOCK
    grid = (_cdiv(m, bm), _cdiv(n, bn))
    mant, exp_bias = _fmt_constants(fmt)
    data = torch.empty(m, n, dtype=fmt.dtype, device=device) if rows else None
    data_t = torch.empty(n, m, dtype=fmt.dtype, device=device) if cols else None
    inv = torch.empty((), dtype=torch.float32, device=device)
    bias_low = torch.empty(m, dtype=torch.bfloat16, device=device) if bias is not None else None
    workspace = tickets = column_sums = None
    if dbias:
        workspace = torch.empty(grid[0], n, dtype=torch.float32, device=device)
        tickets = _tickets(device, grid[1])
        column_sums = torch.empty(n, dtype=torch.float32, device=device)
    u8 = _empty_u8(device)
    xv, is_bf16 = _x_arg(x)
    CAST_KERNEL[grid](  # type: ignore[index]
        xv, scale, u8 if data is None else data.view(torch.uint8), u8 if data_t is None else data_t.view(torch.uint8),
        inv, slots.scratch, slots.pending.view(torch.int32), slots.flag.view(torch.int8), slots.stats,
        bias if bias is not None else inv, bias_low.view(torch.int16) if bias_low is not None else inv,
        workspace if workspace is not None else inv, tickets if tickets is not None else slots.scratch,
        column_sums if column_sums is not None else inv,
        m, n, x.stride(0), x.stride(1),
        FMT_MAX=float(fmt.max), MANT=mant, EXP_BIAS=exp_bias, NAN_CODE=0x7F,
        X_BF16=is_bf16, ROWS=rows, COLS=cols, UPDATE=update, STATS_ON=stats and update,
        CAST_BIAS=bias is not None, DBIAS_ON=dbias, EXACT=interpreting() or EXACT,
        FP8=tl.float8e4nv if mant == 3 else tl.float8e5, BLOCK_M=bm, BLOCK_N=bn,
    )
    LAUNCHES["fp8_cast"] += 1
    return data, data_t, inv, bias_low, column_sums


_TICKETS: dict[torch.device, torch.Tensor] = {}


def _tickets(device: torch.device, count: int) -> torch.Tensor:
    """``count`` int32 counters of the column sums, zero between calls (the kernel resets
    them): allocated once per device and grown when needed, not zeroed by a kernel per call.
    (Shared by every cast on the device: casts with column sums on two streams at once would
    have to get their own.)"""
    have = _TICKETS.get(device)
    if have is None or have.numel() < count:
        have = _TICKETS[device] = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
    return have[:count]


def _cdiv(a: int, b: int) -> int:  # (triton.cdiv, without importing triton here)
    return -(-a // b)


def _triton_scale(x: torch.Tensor, prev: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor, numerator: float) -> None:
    from mixprec.fp8._triton_kernels import AMAX_KERNEL
    m, n = x.shape
    bm, bn = BLOCK
    xv, is_bf16 = _x_arg(x)
    AMAX_KERNEL[(_cdiv(m, bm), _cdiv(n, bn))](  # type: ignore[index]
        xv, scratch, prev, out, m, n, x.stride(0), x.stride(1),
        NUMERATOR=numerator, X_BF16=is_bf16, BLOCK_M=bm, BLOCK_N=bn,
    )
    LAUNCHES["fp8_amax"] += 1


# --------------------------------------------------------------------------- entry points


def _triton_runs(x: torch.Tensor, backend: str) -> bool:
    """Whether the Triton kernels take ``x``: asked for, a plain tensor (not a fake tensor of a
    memory estimate, no dispatch mode, not inside torch.compile's tracing: there the torch
    implementation runs, into the user's graph), int32-indexable, on a device Triton serves."""
    return (
        backend == "triton"
        and not torch.compiler.is_compiling()
        and type(x) is torch.Tensor
        and torch._C._len_torch_dispatch_stack() == 0
        and x.numel() <= _TRITON_NUMEL_LIMIT
        and triton_available(x.device)
    )


_TRITON_FAILED: dict[str, str] = {}


def _triton_failed(device: torch.device, exc: Exception) -> None:
    """Remember (and say once) that the Triton kernels failed on ``device``'s type: a cast
    that allows it (``fallback=True``, what ``Fp8Linear(cast="auto")`` passes) then runs the
    torch implementation there."""
    if device.type not in _TRITON_FAILED:
        _TRITON_FAILED[device.type] = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"mixprec's Triton fp8 cast failed on {device.type} ({type(exc).__name__}: {str(exc)[:500]}); "
            "Fp8Linear(cast='auto') runs the fused cast as torch ops (cast='compile') from now on in this "
            "process; pass cast='triton' to get the error instead, cast='eager' for the unfused quantiser",
            RuntimeWarning,
            stacklevel=4,
        )


def _check(x: torch.Tensor, backend: str) -> None:
    if backend not in FUSED_CASTS:
        raise ValueError(f"fused fp8 cast {backend!r} is unknown; expected one of {FUSED_CASTS}")
    if x.dim() != 2 or x.numel() == 0:
        raise ValueError(f"the fused fp8 cast takes a non-empty 2-d tensor, got shape {tuple(x.shape)}")


def fused_cast(
    x: torch.Tensor,
    scale: torch.Tensor,
    fmt: Format,
    slots: CastSlots,
    *,
    rows: bool = True,
    cols: bool = False,
    update: bool = True,
    stats: bool = False,
    bias: torch.Tensor | None = None,
    dbias: bool = False,
    backend: str = "compile",
    fallback: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Quantise the 2-d ``x`` with the fp32 0-dim ``scale`` to ``fmt`` in one pass.

    Returns ``(data, data_t, inv, bias_bf16, column_sums)``: the fp8 codes of ``x``
    (``rows``) and of ``x.T`` (``cols``, contiguous), the dequantisation factor, ``bias``
    rounded to bf16 (when given) and the fp32 column sums of ``x`` (``dbias``); what is not
    asked for is None. ``update`` folds the amax into ``slots.pending`` and sets
    ``slots.flag``; ``stats`` (with ``update``) writes ``slots.stats``. ``backend`` is one
    of :data:`FUSED_CASTS`; with ``fallback``, a Triton kernel that fails (to compile, to
    launch) warns once and the torch implementation runs instead, then and afterwards.

    >>> import torch
    >>> from mixprec.dtypes import Format
    >>> slots = CastSlots(torch.zeros(()), torch.zeros((), dtype=torch.bool), torch.zeros(2),
    ...                   torch.zeros(8, dtype=torch.int32))
    >>> x = torch.tensor([[1.0, -3.0], [1000.0, 0.0]])
    >>> data, data_t, inv, _, _ = fused_cast(x, torch.tensor(0.5), Format.E4M3, slots, cols=True, stats=True)
    >>> data.float().tolist(), torch.equal(data_t.float(), data.float().t())
    ([[0.5, -1.5], [448.0, 0.0]], True)
    >>> inv, slots.pending, slots.stats
    (tensor(2.), tensor(1000.), tensor([0.2500, 0.0000]))
    """
    _check(x, backend)
    if _triton_runs(x, backend) and not (fallback and x.device.type in _TRITON_FAILED):
        try:
            return _triton_cast(x, scale, slots, bias, fmt, rows, cols, update, stats, dbias)
        except Exception as exc:  # (a kernel never compiled for this GPU and Triton before)
            if not fallback:
                raise
            _triton_failed(x.device, exc)
    LAUNCHES["fp8_cast_torch"] += 1
    return _run_torch(  # type: ignore[no-any-return]
        _torch_cast, x, scale, slots.pending, slots.flag, slots.stats, bias,
        float(fmt.max), fmt.dtype, rows, cols, update, stats and update, dbias,
    )


def fused_scale(
    x: torch.Tensor,
    prev: torch.Tensor,
    fmt: Format,
    margin: int,
    slots: CastSlots,
    *,
    out: torch.Tensor | None = None,
    backend: str = "compile",
    fallback: bool = False,
) -> torch.Tensor:
    """The scale of current scaling for the 2-d ``x``: ``compute_scale(amax(x), fmt, margin,
    prev)``, from one amax pass whose last program computes the scale on the device.
    Written into ``out`` (a 0-dim fp32 tensor) when given, and returned. ``backend`` and
    ``fallback`` as for :func:`fused_cast`.

    >>> import torch
    >>> from mixprec.dtypes import Format
    >>> slots = CastSlots(torch.zeros(()), torch.zeros((), dtype=torch.bool), torch.zeros(2),
    ...                   torch.zeros(8, dtype=torch.int32))
    >>> fused_scale(torch.tensor([[1.25, -0.5]]), torch.tensor(1.0), Format.E4M3, 0, slots)
    tensor(358.4000)
    """
    _check(x, backend)
    numerator = float(fmt.max) / 2.0**margin
    if out is None:
        out = torch.empty((), dtype=torch.float32, device=x.device)
    if _triton_runs(x, backend) and not (fallback and x.device.type in _TRITON_FAILED):
        try:
            _triton_scale(x, prev, out, slots.scratch, numerator)
            return out
        except Exception as exc:
            if not fallback:
                raise
            _triton_failed(x.device, exc)
    LAUNCHES["fp8_amax_torch"] += 1
    out.copy_(_run_torch(_torch_scale, x, prev, numerator))
    return out

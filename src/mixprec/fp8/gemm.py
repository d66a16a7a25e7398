"""The fp8 GEMM: ``torch._scaled_mm`` on CUDA GPUs that have one, an exact emulation elsewhere.

Both compute ``(a @ b) * inv_scale_a * inv_scale_b`` from fp8 operands with fp32
accumulation. The emulation multiplies the fp8 values themselves with fp32 accumulation:
the product of two fp8 values has at most 8 significant bits, so every product is exact
in fp32 and the only rounding is the fp32 accumulation, as in an fp8 tensor-core GEMM.
The tensor-wise dequantisation scales are applied to the fp32 result, as ``_scaled_mm``
does, so the operands stay the exact fp8 values.

Every E4M3 and E5M2 value is exactly a bf16 value (bf16 has 8 exponent and 8 significant
bits), so on CPUs with bf16 matrix units (AVX512-BF16, AMX) the emulated GEMM runs as an
fp32 GEMM in oneDNN's bf16 math mode (``torch.backends.mkldnn.matmul.fp32_precision =
"bf16"``, set only around that GEMM): oneDNN rounds the operands to bf16, which changes
none of them, multiplies in bf16 and accumulates and returns fp32. The result equals the
plain fp32 GEMM up to the order of the fp32 accumulation, at bf16 GEMM speed.

>>> import torch
>>> a = torch.tensor([[1.0, 2.0]]).to(torch.float8_e4m3fn)
>>> b = torch.tensor([[3.0], [4.0]]).to(torch.float8_e5m2)
>>> scaled_mm(a, b, torch.tensor(0.5), torch.tensor(0.25), torch.float32)
tensor([[1.3750]])
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

from mixprec.compiling import call_compiled
from mixprec.hardware import cpu_bf16_instructions, device_facts, fp8_gemm_capable

__all__ = ["cpu_bf16_gemm_available", "emulated_mm", "native_fp8_available", "scaled_mm", "widen"]

_NATIVE_MULTIPLE = 16  # cuBLASLt fp8: the inner dim and both dims of the second operand


@functools.cache
def _capability_ok(index: int) -> bool:
    return fp8_gemm_capable(torch.cuda.get_device_capability(index))


def native_fp8_available(device: torch.device | str | None = None) -> bool:
    """Whether ``device`` (default: the current CUDA device) runs fp8 GEMMs natively.

    True on NVIDIA GPUs of compute capability 8.9 or newer (Ada, Hopper, Blackwell) with
    a torch that has ``torch._scaled_mm``; False on CPU, older GPUs and ROCm builds.

    >>> native_fp8_available("cpu")
    False
    """
    if not torch.cuda.is_available():
        return False
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.type != "cuda":
        return False
    return _capability_ok(torch.cuda.current_device() if dev.index is None else dev.index)


def _native_shapes_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == b.dtype == torch.float8_e5m2:  # cuBLASLt needs at least one E4M3 operand
        return False
    k, n = b.shape
    return a.shape[1] % _NATIVE_MULTIPLE == 0 and k % _NATIVE_MULTIPLE == 0 and n % _NATIVE_MULTIPLE == 0


@functools.cache
def cpu_bf16_gemm_available() -> bool:
    """Whether fp32 GEMMs on this CPU can run in oneDNN's bf16 math mode, faster than in fp32.

    Three things must hold, and the last two are measured, not read from flags: the CPU
    has bf16 instructions (AVX512-BF16 or AMX on x86; oneDNN's check on ARM), the math
    mode takes effect (torch may route fp32 GEMMs past oneDNN: on some AMD CPUs with
    AVX512-BF16 the mode changes nothing), and a bf16 GEMM is faster than an fp32 one
    here (``ONEDNN_MAX_CPU_ISA=AVX2`` keeps the flags but makes bf16 ~40x slower).

    >>> isinstance(cpu_bf16_gemm_available(), bool)
    True
    """
    mkldnn = getattr(torch.backends, "mkldnn", None)
    if mkldnn is None or not hasattr(mkldnn, "matmul") or not cpu_bf16_instructions():
        return False
    # Measured on real tensors even when first asked inside a fake or dispatch mode (the memory
    # estimator runs a model on fake tensors: a probe there would time nothing and fail to compare).
    with torch.utils._python_dispatch._disable_current_modes():
        return device_facts("cpu").faster(torch.bfloat16) and _bf16_math_takes_effect()


def _bf16_math_takes_effect() -> bool:
    """One 64 x 64 fp32 GEMM in bf16 math mode: True when it rounds its operands to bf16."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 64, generator=gen), torch.randn(64, 64, generator=gen)
    with _bf16_math():
        rounded = x @ y
    exact = (x.bfloat16().double() @ y.bfloat16().double()).float()
    return not torch.equal(rounded, x @ y) and torch.allclose(rounded, exact, rtol=1e-5, atol=1e-4)


@contextlib.contextmanager
def _bf16_math() -> Iterator[None]:
    """fp32 GEMMs inside run on bf16-rounded operands with fp32 accumulation (oneDNN)."""
    matmul = torch.backends.mkldnn.matmul  # type: ignore[attr-defined]
    previous = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = previous


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The fp32 value of each of the 256 codes of an fp8 dtype (inf and NaN codes included)."""
    key = (dtype, device)
    table = _TABLES.get(key)
    if table is None:
        table = torch.arange(256, dtype=torch.uint8, device=device).view(dtype).float()
        if not isinstance(table, FakeTensor):  # a memory estimate traces with fake tensors: never cache those
            _TABLES[key] = table
    return table


def widen(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as fp32, exactly (other dtypes: ``t.float()``).

    On CPU, torch's eager conversion goes element by element; where torch.compile works
    the conversion runs compiled (vectorised, about 4x faster), elsewhere as a lookup in
    the 256-entry table of the format's values (about 3x faster). All give the same
    numbers, NaN and inf codes included. A transposed 2-d view is widened through its
    contiguous base.

    >>> import torch
    >>> q = torch.tensor([[0.5, -448.0], [3.0, 1e-3]]).to(torch.float8_e4m3fn)
    >>> torch.equal(widen(q.t()), q.t().float())
    True
    """
    if t.dtype not in _FP8_DTYPES or t.device.type != "cpu" or t.numel() == 0:
        return t.float()
    if t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous():
        return widen(t.t()).t()
    if not t.is_contiguous():
        return t.float()
    return call_compiled(_to_float, t, eager=_widen_by_table)


def _to_float(t: torch.Tensor) -> torch.Tensor:
    return t.float()


def _widen_by_table(t: torch.Tensor) -> torch.Tensor:
    codes = t.view(torch.uint8).reshape(-1).int()
    return torch.index_select(_table(t.dtype, t.device), 0, codes).view(t.shape)


def _epilogue(acc: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``acc * scale (+ bias)`` in fp32, rounded once to ``out_dtype``; ``bias`` comes already
    in ``out_dtype`` (cast outside: the compiler would fold a cast down and back up away)."""
    out = acc * scale
    if bias is not None:
        out = out + bias
    return out.to(out_dtype)


def _epilogue_in_place(acc: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`_epilogue` eagerly, scaling ``acc`` (the GEMM's own temporary) in place: no
    second fp32 m x n tensor where nothing compiles (memory estimates trace this path)."""
    acc.mul_(scale)
    if bias is not None:
        acc.add_(bias)
    return acc.to(out_dtype)


def emulated_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for fp8 ``a`` and ``b`` with fp32 accumulation and an fp32 result.

    ``a`` or ``b`` may also be given already widened to fp32 (holding fp8 values).

    On CPUs with bf16 GEMMs the multiplication runs in bf16 (exact: the operands are fp8
    values); elsewhere in fp32. Either way each product is exact and only the fp32
    accumulation rounds.

    >>> import torch
    >>> a = torch.tensor([[1.5, -2.0]]).to(torch.float8_e4m3fn)
    >>> emulated_mm(a, a.t())
    tensor([[6.2500]])
    """
    a32, b32 = widen(a), widen(b)
    if a32.device.type == "cpu" and cpu_bf16_gemm_available():
        with _bf16_math():
            return a32 @ b32
    return a32 @ b32


def native_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` row-major and ``b`` column-major, the layouts ``_scaled_mm`` requires (copies only if needed)."""
    return a.contiguous(), b.t().contiguous().t()


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    inv_scale_a: torch.Tensor,
    inv_scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    *,
    native: bool = False,
) -> torch.Tensor:
    """``(a @ b) * inv_scale_a * inv_scale_b (+ bias)`` for fp8 ``a`` (m, k) and ``b`` (k, n).

    ``native=True`` calls ``torch._scaled_mm`` (fp32 accumulation, no fast accumulation)
    when the shapes allow it (k and n multiples of 16); otherwise, and when
    ``native=False``, the exact fp32 emulation runs on the operands' device.
    """
    if native and _native_shapes_ok(a, b):
        a_n, b_n = native_operands(a, b)
        out = torch._scaled_mm(
            a_n,
            b_n,
            inv_scale_a.reshape(()).float(),
            inv_scale_b.reshape(()).float(),
            out_dtype=out_dtype,
            use_fast_accum=False,
        )
        return out if bias is None else out + bias.to(out_dtype)
    acc = emulated_mm(a, b)
    # scale, bias and the cast in one compiled pass on CPU (the same numbers as eager)
    low_bias = None if bias is None else bias.to(out_dtype)
    return call_compiled(_epilogue, acc, inv_scale_a * inv_scale_b, low_bias, out_dtype, eager=_epilogue_in_place)

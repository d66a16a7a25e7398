"""What a device computes fast, measured: the facts ``precision="auto"`` chooses a plan from.

Instruction flags say what a CPU *has*; they do not say what torch does with it. A CPU
with AVX512-BF16 may run fp32 GEMMs outside oneDNN (so oneDNN's bf16 math mode changes
nothing), and ``ONEDNN_MAX_CPU_ISA=AVX2`` (or a hypervisor hiding the flags from oneDNN)
turns a fast bf16 matmul into one a hundred times slower while the flags still read
True. So :func:`device_facts` *times* one small GEMM per dtype (well under a second in
all) next to the device facts, and everything that depends on speed reads the ratio.

>>> facts = device_facts("cpu")
>>> facts.device_type, sorted(facts.gemm_ms)
('cpu', ['bf16', 'fp16', 'fp32'])
>>> facts.speedup(torch.float32)
1.0
"""

from __future__ import annotations

import functools
import os
import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from mixprec.dtypes import dtype_name

__all__ = ["DeviceFacts", "cpu_bf16_instructions", "cpu_name", "device_facts", "fp8_gemm_capable", "gemm_speed"]

_X86 = ("x86_64", "amd64", "i386", "i686", "x86")
_PROBE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CPU_SIZE, _CUDA_SIZE = 256, 2048
_BUDGET_S = 0.1
"""Time spent timing one dtype at most (a dtype that is slow gets fewer rounds, never more time)."""
_ROUNDS = 10


@dataclass(frozen=True)
class DeviceFacts:
    """What one device is and how fast it multiplies in each dtype.

    ``gemm_ms`` maps ``"fp32"``, ``"bf16"``, ``"fp16"`` to the best time of one square
    GEMM of side ``gemm_size`` (absent: the dtype could not run there); ``speedup(dtype)``
    is the fp32 time over that dtype's.
    """

    device_type: str
    name: str
    cuda_capability: tuple[int, int] | None = None
    bf16_supported: bool = True
    bf16_instructions: bool = False
    native_fp8: bool = False
    gemm_size: int = 0
    gemm_ms: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "gemm_ms", MappingProxyType(dict(self.gemm_ms)))

    def speedup(self, dtype: torch.dtype) -> float | None:
        """How many times faster a GEMM runs in ``dtype`` than in fp32 here (None: not measured)."""
        ms, base = self.gemm_ms.get(dtype_name(dtype)), self.gemm_ms.get("fp32")
        if ms is None or base is None or ms <= 0:
            return None
        return base / ms

    def faster(self, dtype: torch.dtype, by: float = 1.0) -> bool:
        """Whether a GEMM in ``dtype`` measured more than ``by`` times fp32's speed here."""
        speedup = self.speedup(dtype)
        return speedup is not None and speedup > by

    def describe(self) -> str:
        """One line: the device and its measured GEMM ratios against fp32."""
        parts = [self.name]
        if self.cuda_capability is not None:
            parts.append(f"compute capability {self.cuda_capability[0]}.{self.cuda_capability[1]}")
        if self.device_type == "cpu":
            parts.append("bf16 instructions" if self.bf16_instructions else "no bf16 instructions")
        if self.native_fp8:
            parts.append("native fp8 GEMMs")
        ratios = [f"{d} {s:.2f}x" for d in ("bf16", "fp16") if (s := self.speedup(_DTYPE[d])) is not None]
        if ratios:
            parts.append(f"{self.gemm_size}-wide GEMM speed vs fp32: " + ", ".join(ratios))
        return "; ".join(parts)


_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_bf16_instructions() -> bool:
    """Whether this CPU has bf16 multiply instructions: AVX512-BF16 or AMX on x86, oneDNN's
    own check elsewhere (ARM). Says nothing of speed: see :func:`device_facts`."""
    mkldnn = getattr(torch.backends, "mkldnn", None)
    if mkldnn is None or not mkldnn.is_available():
        return False
    checker = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        if checker is None or not checker():
            return False
    except RuntimeError:
        return False
    if platform.machine().lower() in _X86:
        native = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
        return any(bool(check()) for check in native if check is not None)
    return True


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    accelerator = getattr(torch, "accelerator", None)
    if device.type != "cpu" and accelerator is not None and hasattr(accelerator, "synchronize"):
        return lambda: accelerator.synchronize(device)
    return lambda: None


def gemm_speed(
    device: torch.device | str, dtypes: tuple[torch.dtype, ...], size: int, *, budget_s: float = _BUDGET_S
) -> dict[str, float]:
    """Milliseconds of one ``size`` x ``size`` GEMM per dtype in ``dtypes`` on ``device``
    (a dtype that does not run there is left out).

    The dtypes take turns, round after round, and each keeps its fastest round: a busy
    machine slows a round down, never speeds one up, and slows all dtypes alike. On CPU
    the probe runs on one thread (a thread that shares its core with another process
    spin-waits and makes any ratio noise). About ``budget_s`` seconds per dtype at most.
    """
    device = torch.device(device)
    sync = _synchronizer(device)
    gen = torch.Generator().manual_seed(0)
    a32, b32 = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
    operands: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    best: dict[str, float] = {}
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        for dtype in dtypes:
            try:
                a, b = a32.to(device=device, dtype=dtype), b32.to(device=device, dtype=dtype)
                start = time.perf_counter()
                torch.mm(a, b)  # warm-up: kernels chosen, caches filled
                sync()
            except (RuntimeError, TypeError, NotImplementedError):
                continue
            operands[dtype_name(dtype)] = (a, b)
            best[dtype_name(dtype)] = time.perf_counter() - start
        spent = dict.fromkeys(operands, 0.0)
        for _ in range(_ROUNDS):
            for name, (a, b) in operands.items():
                if spent[name] > budget_s:
                    continue
                start = time.perf_counter()
                torch.mm(a, b)
                sync()
                elapsed = time.perf_counter() - start
                spent[name] += elapsed
                best[name] = min(best[name], elapsed)
    finally:
        if device.type == "cpu":
            torch.set_num_threads(threads)
    return {name: seconds * 1e3 for name, seconds in best.items()}


def _cuda_facts(device: torch.device) -> dict[str, object]:
    index = torch.cuda.current_device() if device.index is None else device.index
    major, minor = torch.cuda.get_device_capability(index)
    return {
        "name": torch.cuda.get_device_name(index),
        "cuda_capability": (major, minor),
        "bf16_supported": bool(torch.cuda.is_bf16_supported()),
        "bf16_instructions": (major, minor) >= (8, 0),
        "native_fp8": fp8_gemm_capable((major, minor)),
    }


def fp8_gemm_capable(capability: tuple[int, int]) -> bool:
    """Whether a CUDA GPU of compute ``capability`` runs fp8 GEMMs natively under this torch:
    cuBLASLt's fp8 GEMMs from Ada / Hopper (8.9) on, through ``torch._scaled_mm``; never on ROCm."""
    return hasattr(torch, "_scaled_mm") and torch.version.hip is None and tuple(capability) >= (8, 9)


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


@functools.cache
def _facts(device_type: str, index: int | None, isa: str | None) -> DeviceFacts:
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    if device_type == "cuda":
        info: dict[str, object] = _cuda_facts(device)
        size = _CUDA_SIZE
    elif device_type == "cpu":
        info = {"name": cpu_name(), "bf16_instructions": cpu_bf16_instructions()}
        size = _CPU_SIZE
    else:
        info = {"name": device_type}
        size = _CPU_SIZE
    measured = gemm_speed(device, _PROBE_DTYPES, size)
    return DeviceFacts(device_type=device_type, gemm_size=size, gemm_ms=measured, **info)  # type: ignore[arg-type]


def device_facts(device: torch.device | str | None = None) -> DeviceFacts:
    """The facts of ``device`` (default: the current CUDA device where there is one, else
    the CPU), measured once per process (on CPU, on one thread: the ratios are per core).

    >>> device_facts("cpu").name != ""
    True
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "meta":
        raise ValueError("device 'meta' holds no data, so nothing can be timed there; pass the device the model trains on")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: torch.cuda.is_available() is False; pass device='cpu'")
    return _facts(dev.type, dev.index, os.environ.get("ONEDNN_MAX_CPU_ISA"))


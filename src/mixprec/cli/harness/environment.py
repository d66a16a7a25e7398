"""The versions and machine facts recorded in every report."""

from __future__ import annotations

import platform
from typing import Any

import torch

from mixprec.hardware import device_facts

__all__ = ["environment"]


def environment() -> dict[str, Any]:
    """Versions and machine facts that go into every report."""
    import mixprec

    return {
        "mixprec": mixprec.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": _cpu_name(),
        "cpu_capability": _cpu_capability(),
        "cpu_bf16": _cpu_bf16_fast(),
        "cpu_bf16_speedup": device_facts("cpu").speedup(torch.bfloat16),
        "threads": torch.get_num_threads(),
    }


def _cpu_bf16_fast() -> bool:
    """Whether a bf16 GEMM runs faster than an fp32 one on this CPU (measured, not read from flags)."""
    speedup = device_facts("cpu").speedup(torch.bfloat16)
    return speedup is not None and speedup > 1.0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_capability() -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"

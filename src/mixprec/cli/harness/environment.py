"""The versions and machine facts recorded in every report."""

from __future__ import annotations

import platform
from typing import Any

import torch

from mixprec.hardware import cpu_name, device_facts

__all__ = ["environment"]


def environment() -> dict[str, Any]:
    """Versions and machine facts that go into every report."""
    import mixprec

    facts = device_facts("cpu")
    return {
        "mixprec": mixprec.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": cpu_name(),
        "cpu_capability": _cpu_capability(),
        "cpu_bf16": facts.faster(torch.bfloat16),  # measured, not read from flags
        "cpu_bf16_speedup": facts.speedup(torch.bfloat16),
        "threads": torch.get_num_threads(),
    }


def _cpu_capability() -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"

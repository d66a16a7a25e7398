"""Full precision: fp32 everywhere ("fp32", "O0"), optionally with TF32 matmuls on GPUs ("tf32")."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from mixprec.plans.base import Plan

__all__ = ["FullPrecisionPlan"]


class _Tf32Regions:
    """The global TF32 switches, shared by every tf32 region of every thread.

    The first region to enter saves the settings and turns TF32 on; the last to exit
    restores what the first saved. Regions that overlap across threads (A enters, B
    enters, A exits) therefore keep TF32 on until the last one ends, and the
    settings from before the first region come back at the end, whatever the order.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: tuple[str, bool] | None = None

    def enter(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._saved = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
                torch.set_float32_matmul_precision("high")
                torch.backends.cudnn.allow_tf32 = True
            self._depth += 1

    def exit(self) -> None:
        with self._lock:
            if self._depth == 0:
                raise RuntimeError("tf32 region exited more often than entered")
            self._depth -= 1
            if self._depth == 0 and self._saved is not None:
                precision, cudnn = self._saved
                self._saved = None
                torch.set_float32_matmul_precision(precision)
                torch.backends.cudnn.allow_tf32 = cudnn


_TF32 = _Tf32Regions()


@dataclass(frozen=True)
class FullPrecisionPlan(Plan):
    """fp32 weights, compute, grads and optimizer state; no loss scaling.

    ``tf32=True`` lets matmuls and convolutions use TF32 tensor cores where the
    hardware has them (Ampere and later); elsewhere it changes nothing.
    """

    tf32: bool = False

    family: ClassVar[str] = "fp32"
    supports_fsdp: ClassVar[bool] = True
    summary: ClassVar[str] = "fp32 everywhere"

    def tensor_dtypes(self) -> dict[str, str]:
        rows = super().tensor_dtypes()
        if self.tf32:
            rows["compute"] = "fp32 storage, TF32 matmuls/convolutions where supported"
        return rows

    def backward_context(self, device_type: str = "cpu") -> contextlib.AbstractContextManager[Any]:
        # The backward GEMMs (two thirds of the work) run under the same TF32 setting.
        return self.autocast(device_type) if self.tf32 else contextlib.nullcontext()

    def autocast(self, device_type: str = "cpu") -> contextlib.AbstractContextManager[Any]:
        return _tf32_region() if self.tf32 else contextlib.nullcontext()


@contextlib.contextmanager
def _tf32_region() -> Iterator[None]:
    """TF32 matmuls and convolutions on for the region."""
    _TF32.enter()  # reference-counted: overlapping regions in several threads restore correctly
    try:
        yield
    finally:
        _TF32.exit()

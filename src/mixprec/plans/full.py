"""Full precision: fp32 everywhere ("fp32", "O0"), optionally with TF32 matmuls on GPUs ("tf32")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from mixprec.plans.base import Plan

__all__ = ["FullPrecisionPlan"]


@dataclass(frozen=True)
class FullPrecisionPlan(Plan):
    """fp32 weights, compute, grads and optimizer state; no loss scaling.

    ``tf32=True`` lets matmuls and convolutions use TF32 tensor cores where the
    hardware has them (Ampere and later); elsewhere it changes nothing.
    """

    tf32: bool = False

    family: ClassVar[str] = "fp32"
    summary: ClassVar[str] = "fp32 everywhere"

    def tensor_dtypes(self) -> dict[str, str]:
        rows = super().tensor_dtypes()
        if self.tf32:
            rows["compute"] = "fp32 storage, TF32 matmuls/convolutions where supported"
        return rows

    @contextlib.contextmanager
    def autocast(self, device_type: str = "cpu") -> Iterator[None]:
        if not self.tf32:
            yield
            return
        previous = torch.get_float32_matmul_precision()
        previous_cudnn = torch.backends.cudnn.allow_tf32
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(previous)
            torch.backends.cudnn.allow_tf32 = previous_cudnn

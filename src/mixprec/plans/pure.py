"""Pure low precision ("bf16-pure", "fp16-pure", "O3"): every weight, gradient and state in bf16/fp16."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from mixprec.plans.base import Plan, cast_module_

__all__ = ["PurePlan"]


@dataclass(frozen=True)
class PurePlan(Plan):
    """The whole model in low precision, no master weights, no autocast (apex O3).

    Floating inputs of the model are cast to the low dtype by a forward pre-hook
    (installed by the front door). The fastest and smallest plan, and the least
    accurate: updates smaller than half a unit in the last place are lost (see
    "bf16-kahan" for the remedy).
    """

    family: ClassVar[str] = "pure"
    summary: ClassVar[str] = "low precision everything, no master weights"

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.compute_dtype

    @property
    def uses_autocast(self) -> bool:
        return False

    def tensor_dtypes(self) -> dict[str, str]:
        rows = super().tensor_dtypes()
        rows["compute"] = rows["activations"] = rows["weights"] + " (no autocast; model inputs cast)"
        return rows

    def convert_model(self, model: torch.nn.Module) -> dict[torch.Tensor, torch.Tensor]:
        return cast_module_(model, self.compute_dtype)

    @contextlib.contextmanager
    def autocast(self, device_type: str = "cpu") -> Iterator[None]:
        yield

"""Which fp8 format each tensor class uses: "hybrid" (E4M3 forward, E5M2 gradients), "e4m3" or "e5m2".

The format facts themselves (largest finite value, dtype) live in :class:`mixprec.dtypes.Format`;
this enum only pairs them up, as TransformerEngine's ``Format.HYBRID`` does.

>>> from mixprec.fp8 import Fp8Format
>>> Fp8Format.HYBRID.forward.max, Fp8Format.HYBRID.backward.max
(448.0, 57344.0)
>>> Fp8Format("e4m3").backward.max, Fp8Format("e5m2").forward.max
(448.0, 57344.0)
"""

from __future__ import annotations

import enum

from mixprec.dtypes import Format

__all__ = ["TENSOR_KINDS", "Fp8Format"]

#: The three tensors an fp8 linear layer quantises, in the order of its state rows.
TENSOR_KINDS: tuple[str, ...] = ("input", "weight", "grad_output")


class Fp8Format(enum.Enum):
    """A pair of fp8 formats: ``forward`` for inputs and weights, ``backward`` for gradients."""

    HYBRID = "hybrid"
    E4M3 = "e4m3"
    E5M2 = "e5m2"

    @property
    def forward(self) -> Format:
        """Format of activations and weights: E4M3 (precision, max 448), except for "e5m2"."""
        return Format.E5M2 if self is Fp8Format.E5M2 else Format.E4M3

    @property
    def backward(self) -> Format:
        """Format of output gradients: E5M2 (range, max 57344) for "hybrid" and "e5m2", else E4M3."""
        return Format.E4M3 if self is Fp8Format.E4M3 else Format.E5M2

    def for_kind(self, kind: str) -> Format:
        """Format of one tensor kind (``"input"``, ``"weight"`` or ``"grad_output"``)."""
        if kind not in TENSOR_KINDS:
            raise ValueError(f"unknown tensor kind {kind!r}; expected one of {TENSOR_KINDS}")
        return self.backward if kind == "grad_output" else self.forward

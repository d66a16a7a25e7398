"""Result types of the memory diagnostics: bytes by tensor class, estimated and measured."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from mixprec.formatting import format_bytes, format_table

__all__ = ["MEMORY_CLASSES", "PERSISTENT_CLASSES", "STATE_CLASSES", "MemoryEstimate", "MemoryReport"]

MEMORY_CLASSES: tuple[str, ...] = (
    "weights",
    "buffers",
    "grads",
    "master_weights",
    "grad_accumulation",
    "optimizer_state",
    "compensation",
    "activations",
)
#: the training state (everything but the activations)
STATE_CLASSES: tuple[str, ...] = MEMORY_CLASSES[:-1]
#: what lives across steps
PERSISTENT_CLASSES: tuple[str, ...] = ("weights", "buffers", "master_weights", "optimizer_state", "compensation")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes by tensor class for one training step of a model under a plan.

    Attributes:
        plan: the plan's name.
        method: ``"estimated"`` or ``"measured"``.
        bytes: bytes per class (keys: :data:`MEMORY_CLASSES`).
        peak: peak bytes during one step (forward, backward, optimizer step).
        params: number of model parameters.
        notes: caveats (e.g. no batch given, so no activations).
        trainable: number of trainable (``requires_grad``) parameters: a LoRA run trains a
            small part of the model, and its training state is best read per trainable one.
    """

    plan: str
    method: str
    bytes: dict[str, int]
    peak: int
    params: int
    notes: tuple[str, ...] = ()
    trainable: int | None = None  # None: every parameter

    @property
    def persistent(self) -> int:
        """Bytes that live across steps: weights, buffers, masters, optimizer state, compensation."""
        return sum(self.bytes[k] for k in PERSISTENT_CLASSES)

    @property
    def total(self) -> int:
        """Sum of all classes (an upper bound of what coexists; :attr:`peak` is what does)."""
        return sum(self.bytes.values())

    def per_param(self) -> dict[str, float]:
        """Bytes per model parameter by class (activations excluded), with ``total``."""
        n = max(self.params, 1)
        out = {k: self.bytes[k] / n for k in STATE_CLASSES}
        out["total"] = sum(out.values())
        return out

    def per_trainable_param(self) -> dict[str, float]:
        """Bytes per trainable parameter by class (activations excluded), with ``total``: the
        whole model's weights and buffers count too, spread over the parameters that train."""
        n = max(self.params if self.trainable is None else self.trainable, 1)
        out = {k: self.bytes[k] / n for k in STATE_CLASSES}
        out["total"] = sum(out.values())
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan,
            "method": self.method,
            **{k: self.bytes[k] for k in MEMORY_CLASSES},
            "peak": self.peak,
            "params": self.params,
            "trainable": self.params if self.trainable is None else self.trainable,
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        partial = self.trainable is not None and self.trainable != self.params
        divisors = [self.params, *([self.trainable] if partial else [])]

        def row(name: str, value: int) -> list[str]:
            return [name, format_bytes(value), *(f"{value / max(d or 0, 1):.2f}" for d in divisors)]

        rows = [row(k, self.bytes[k]) for k in MEMORY_CLASSES]
        rows.append(row("peak", self.peak))
        title = f"{self.method} memory of plan {self.plan} ({self.params:,} parameters" + (
            f", {self.trainable:,} trainable)" if partial else ")"
        )
        notes = "".join(f"\nnote: {n}" for n in self.notes)
        headers = ["class", "bytes", "bytes/param", *(["bytes/trainable param"] if partial else [])]
        return title + "\n" + format_table(headers, rows) + notes


@dataclass(frozen=True)
class MemoryReport:
    """Estimated and measured memory side by side, one pair per plan; ``str()`` is a table."""

    estimates: dict[str, MemoryEstimate] = field(default_factory=dict)
    measurements: dict[str, MemoryEstimate] = field(default_factory=dict)

    def ratio(self, plan: str, key: str = "peak") -> float:
        """Estimated over measured for ``key`` (a class or ``"peak"``) of ``plan``."""
        est, meas = self.estimates[plan], self.measurements[plan]
        e = est.peak if key == "peak" else est.bytes[key]
        m = meas.peak if key == "peak" else meas.bytes[key]
        if m == 0:
            return 1.0 if e == 0 else math.inf
        return e / m

    def to_dict(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for plan, est in self.estimates.items():
            out[plan] = {"estimated": est.to_dict()}
            if plan in self.measurements:
                out[plan]["measured"] = self.measurements[plan].to_dict()
        return out

    def __str__(self) -> str:
        plans = list(self.estimates)
        header = ["class"]
        for p in plans:
            header += [f"{p} est", f"{p} meas"] if p in self.measurements else [f"{p} est"]
        rows = []
        for key in (*MEMORY_CLASSES, "peak"):
            row = [key]
            for p in plans:
                est = self.estimates[p]
                row.append(format_bytes(est.peak if key == "peak" else est.bytes[key]))
                if p in self.measurements:
                    meas = self.measurements[p]
                    row.append(format_bytes(meas.peak if key == "peak" else meas.bytes[key]))
            rows.append(row)
        return format_table(header, rows)

"""OpPolicy: which ops run in low precision and which in fp32, on top of the default tables.

:class:`OpPolicy` moves ops between the tables, with Paddle's algebra:
effective low = (default ∪ lower_ops) − fp32_ops and effective fp32 =
(default − lower_ops) ∪ fp32_ops.
"""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.dtypes import LOW_PRECISION_DTYPES, dtype_name, parse_dtype
from mixprec.formatting import Text
from mixprec.policy.derived import default_table, table_changes
from mixprec.policy.names import ModuleRule, as_module_rules, as_op_name, as_op_names
from mixprec.policy.registered import registered_ops
from mixprec.policy.tables import TABLES_TORCH_VERSION, OpTable, Precision

__all__ = ["OpPolicy"]


@dataclass(frozen=True)
class OpPolicy:
    """Which ops run in low precision and which in fp32, on top of the default tables.

    Args:
        dtype: the low-precision dtype (``torch.bfloat16`` / ``torch.float16`` or a
            name such as ``"bf16"``).
        lower_ops: op names to run in ``dtype`` (Paddle's ``custom_white_list``).
        fp32_ops: op names to run in float32 (Paddle's ``custom_black_list``).
        fp32_modules: module classes or qualified-name globs whose forward runs with
            autocast off and fp32 inputs ("islands"); applied when a model is prepared
            (:func:`mixprec.islands.apply_fp32_islands`).

    Effective low = (default ∪ lower_ops) − fp32_ops; effective fp32 =
    (default − lower_ops) ∪ fp32_ops. An op in both lists, or a name that neither
    mixprec's tables nor ``torch.ops.aten`` know, raises ``ValueError``.

    >>> import torch
    >>> from mixprec.policy import OpPolicy
    >>> OpPolicy(torch.bfloat16, lower_ops=["softmx"])
    Traceback (most recent call last):
    ...
    ValueError: unknown op name 'softmx' in lower_ops: neither mixprec's autocast tables nor torch.ops.aten know it; did you mean 'softmax', ...
    >>> print(OpPolicy(fp32_ops=["linear"]).explain("cpu").splitlines()[0])
    OpPolicy(dtype=bf16) on cpu: default tables of torch ... (each op run under its autocast on cpu; fallback: pinned to torch 2.13 (v1))
    """

    dtype: torch.dtype = torch.bfloat16
    lower_ops: tuple[str, ...] = ()
    fp32_ops: tuple[str, ...] = ()
    fp32_modules: tuple[ModuleRule, ...] = ()

    def __post_init__(self) -> None:
        try:
            dtype = parse_dtype(self.dtype)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"OpPolicy(dtype={self.dtype!r}): {exc}; pass torch.bfloat16 or torch.float16") from None
        if dtype not in LOW_PRECISION_DTYPES:
            raise ValueError(
                f"OpPolicy dtype must be a low-precision dtype (bf16 or fp16), got "
                f"{dtype_name(dtype)}; for fp32 compute, do not use autocast"
            )
        lower = as_op_names(self.lower_ops, "lower_ops")
        fp32 = as_op_names(self.fp32_ops, "fp32_ops")
        both = [op for op in lower if op in fp32]
        if both:
            names = ", ".join(repr(op) for op in both)
            verb = "is" if len(both) == 1 else "are"
            raise ValueError(
                f"{names} {verb} in both lower_ops and fp32_ops; an op runs in one precision, "
                "so keep each op in one of the lists"
            )
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "lower_ops", lower)
        object.__setattr__(self, "fp32_ops", fp32)
        object.__setattr__(self, "fp32_modules", as_module_rules(self.fp32_modules))

    # -------------------------------------------------------------- queries
    def table(self, device_type: str) -> OpTable:
        """The default table this policy edits on ``device_type``: the pinned one corrected
        by what the running torch's autocast does (:func:`mixprec.policy.default_table`)."""
        return default_table(device_type, self.dtype)

    def precision_of(self, op: str, device_type: str = "cpu") -> Precision | None:
        """The class ``op`` runs in under this policy (None: left to its inputs). An op name
        that neither the tables nor torch know is a ValueError naming close matches."""
        op = as_op_name(op, "precision_of()")
        if op in self.fp32_ops:
            return Precision.FP32
        if op in self.lower_ops:
            return Precision.LOW
        return self.table(device_type).precision_of(op)

    def effective(self, device_type: str = "cpu") -> dict[Precision, frozenset[str]]:
        """The effective op sets: ``{Precision.LOW: ..., Precision.FP32: ..., Precision.PROMOTE: ...}``."""
        table = self.table(device_type)
        lower, fp32 = frozenset(self.lower_ops), frozenset(self.fp32_ops)
        return {
            Precision.LOW: (table.low | lower) - fp32,
            Precision.FP32: (table.fp32 - lower) | fp32,
            Precision.PROMOTE: table.promote - lower - fp32,
        }

    def overrides(self, device_type: str = "cpu") -> dict[str, Precision]:
        """The ops whose class differs from the default table: what mixprec must intercept."""
        table = self.table(device_type)
        out: dict[str, Precision] = {}
        for ops, precision in ((self.lower_ops, Precision.LOW), (self.fp32_ops, Precision.FP32)):
            for op in ops:
                if table.precision_of(op) is not precision:
                    out[op] = precision
        return out

    @property
    def is_default(self) -> bool:
        """True when the policy moves no op (``fp32_modules`` aside)."""
        return not self.lower_ops and not self.fp32_ops

    def replace(self, **changes: Any) -> OpPolicy:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def explain(self, device_type: str | None = None) -> Text:
        """The effective tables on ``device_type`` as a text table (custom entries marked); at
        an interactive prompt it prints as the table.

        ``device_type`` defaults to "cuda" when CUDA is available, else "cpu".
        """
        device = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        table = self.table(device)
        eff = self.effective(device)
        rows: list[tuple[str, str, str]] = []
        labels = {
            Precision.LOW: f"low ({dtype_name(self.dtype)})",
            Precision.FP32: "fp32",
            Precision.PROMOTE: "promote (widest input)",
        }
        defaults = {
            Precision.LOW: table.low,
            Precision.FP32: table.fp32,
            Precision.PROMOTE: table.promote,
        }
        for precision, label in labels.items():
            ops = eff[precision]
            default = sorted(ops & defaults[precision])
            custom = sorted(ops - defaults[precision])
            if default:
                rows.append((label, "default", ", ".join(default)))
            if custom:
                rows.append((label, "custom", ", ".join(custom)))
        listed = frozenset(self.lower_ops) | frozenset(self.fp32_ops)
        lifted = sorted(table.banned & listed)
        if table.banned - set(lifted):
            rows.append(("refused", "default", ", ".join(sorted(table.banned - set(lifted)))))
        if table.unresolved - listed:
            rows.append(("left to torch", "default", ", ".join(sorted(table.unresolved - listed))))
        if self.fp32_modules:
            rules = ", ".join(_rule_name(r) for r in self.fp32_modules)
            rows.append(("fp32 modules", "custom", rules))
        custom_ops = registered_ops()
        if custom_ops:
            text = ", ".join(f"{name}={p.value}" for name, p in sorted(custom_ops.items()))
            rows.append(("registered ops", "custom", text))
        w0 = max(len("precision"), *(len(r[0]) for r in rows))
        w1 = len("default")
        lines = [
            f"OpPolicy(dtype={dtype_name(self.dtype)}) on {device}: default tables {table.source}",
            f"{'precision'.ljust(w0)} | {'source'.ljust(w1)} | ops",
            f"{'-' * w0}-+-{'-' * w1}-+-----",
        ]
        indent = " " * (w0 + w1 + 6)
        for a, b, c in rows:
            wrapped = textwrap.wrap(c, width=max(40, 100 - len(indent))) or [""]
            lines.append(f"{a.ljust(w0)} | {b.ljust(w1)} | {wrapped[0]}")
            lines += [indent + more for more in wrapped[1:]]
        lines.append("other ops run in the dtype of their inputs")
        changes = table_changes(device, self.dtype)
        moved = ", ".join(f"{op} ({a} -> {b})" for op, (a, b) in changes.items()) or "none"
        lines += textwrap.wrap(
            f"differences from the pinned torch {TABLES_TORCH_VERSION} tables on torch "
            f"{torch.__version__}: {moved}",
            width=100,
            subsequent_indent="  ",
        )
        return Text("\n".join(lines))


def _rule_name(rule: ModuleRule) -> str:
    return rule if isinstance(rule, str) else f"{rule.__module__}.{rule.__qualname__}"

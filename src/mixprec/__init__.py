"""mixprec: automatic mixed precision for PyTorch training, done right."""

# First, before torch loads: the mixprec command ends quietly on Ctrl-C while it starts.
from mixprec import startup as _startup  # noqa: F401

# isort: split
from mixprec import distributed, fp8
from mixprec.amp import (
    autocast,
    autocast_backward,
    custom_op_precision,
    register_op,
    unregister_op,
)
from mixprec.checkpoint import load_checkpoint, save_checkpoint
from mixprec.diagnostics import (
    Advice,
    AuditReport,
    ComparisonReport,
    MemoryEstimate,
    MemoryReport,
    OverflowFinding,
    OverflowTracer,
    ScaleHistory,
    advise,
    audit,
    compare,
    estimate_memory,
    measure_memory,
    memory_report,
    trace_overflow,
    training_state_bytes_per_param,
)
from mixprec.dtypes import Format, parse_dtype
from mixprec.islands import apply_fp32_islands, remove_fp32_islands
from mixprec.plans import PLANS, Plan, get_plan, register_plan
from mixprec.policy import OpPolicy, Precision, compare_with_torch
from mixprec.scaling import (
    SCALE_CEILING,
    SCALE_FLOOR,
    ConstantLossScaler,
    DynamicLossScaler,
    LossScaler,
    NoOpScaler,
)
from mixprec.session import MixedPrecision, StepResult
from mixprec.stats import op_stats

__version__ = "0.1.0"

__all__ = [
    "PLANS",
    "SCALE_CEILING",
    "SCALE_FLOOR",
    "Advice",
    "AuditReport",
    "ComparisonReport",
    "ConstantLossScaler",
    "DynamicLossScaler",
    "Format",
    "LossScaler",
    "MemoryEstimate",
    "MemoryReport",
    "MixedPrecision",
    "NoOpScaler",
    "OpPolicy",
    "OverflowFinding",
    "OverflowTracer",
    "Plan",
    "Precision",
    "ScaleHistory",
    "StepResult",
    "__version__",
    "advise",
    "apply_fp32_islands",
    "audit",
    "autocast",
    "autocast_backward",
    "compare",
    "compare_with_torch",
    "custom_op_precision",
    "distributed",
    "estimate_memory",
    "fp8",
    "get_plan",
    "load_checkpoint",
    "measure_memory",
    "memory_report",
    "op_stats",
    "parse_dtype",
    "register_op",
    "register_plan",
    "remove_fp32_islands",
    "save_checkpoint",
    "trace_overflow",
    "training_state_bytes_per_param",
    "unregister_op",
]

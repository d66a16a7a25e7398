"""Numerics diagnostics: where a step overflows, how much headroom each module has, how far a
plan drifts from fp32 and which modules to keep in fp32, what training costs in memory, and
what a loop that does not use mixprec yet risks (:func:`audit`)."""

from mixprec.diagnostics.advisor import Advice, advise
from mixprec.diagnostics.audit import AuditReport, Risk, audit
from mixprec.diagnostics.compare import ComparisonReport, ModuleError, ParamError, compare
from mixprec.diagnostics.headroom import (
    HeadroomMonitor,
    HeadroomReport,
    ModuleHeadroom,
    ScaleHistory,
    headroom,
)
from mixprec.diagnostics.memory import (
    MEMORY_CLASSES,
    MemoryEstimate,
    MemoryReport,
    estimate_memory,
    measure_memory,
    memory_report,
    training_state_bytes_per_param,
)
from mixprec.tracing import OverflowFinding, OverflowTracer, trace_overflow

__all__ = [
    "MEMORY_CLASSES",
    "Advice",
    "AuditReport",
    "ComparisonReport",
    "HeadroomMonitor",
    "HeadroomReport",
    "MemoryEstimate",
    "MemoryReport",
    "ModuleError",
    "ModuleHeadroom",
    "OverflowFinding",
    "OverflowTracer",
    "ParamError",
    "Risk",
    "ScaleHistory",
    "advise",
    "audit",
    "compare",
    "estimate_memory",
    "headroom",
    "measure_memory",
    "memory_report",
    "trace_overflow",
    "training_state_bytes_per_param",
]

"""Op precision policy: autocast op tables as plain data, and custom op lists on top.

PyTorch's autocast keeps its op lists in C++; they cannot be edited, are the same
for fp16 and bf16, and change between releases. mixprec keeps them here as data,
pinned to one PyTorch release (:data:`TABLES_TORCH_VERSION`, :data:`TABLES_VERSION`),
so an upgrade cannot change what mixprec documents and tests without a test
noticing (:func:`compare_with_torch` reports the differences).

Each op name is an aten op name without overload ("linear", "softmax", "mm") and
falls in one of three classes, as in PyTorch:

- ``low``: floating inputs are cast to the autocast dtype (bf16 / fp16);
- ``fp32``: floating inputs are cast to float32;
- ``promote``: floating inputs are cast to the widest floating input type.

Ops in no table run in whatever dtype their inputs have. float64 and non-floating
tensors are never cast.

:class:`OpPolicy` moves ops between the tables, with Paddle's algebra:
effective low = (default ∪ lower_ops) − fp32_ops and effective fp32 =
(default − lower_ops) ∪ fp32_ops.

The package, by responsibility: :mod:`~mixprec.policy.tables` (the pinned tables,
:class:`Precision`), :mod:`~mixprec.policy.names` (validating op names and module
rules), :mod:`~mixprec.policy.op_policy` (:class:`OpPolicy`),
:mod:`~mixprec.policy.registered` (the record of user ops declared with
:func:`mixprec.register_op`) and :mod:`~mixprec.policy.compare` (the tables against
the installed torch).

>>> import torch
>>> from mixprec.policy import OpPolicy, default_table
>>> default_table("cpu", torch.bfloat16).precision_of("linear")
<Precision.LOW: 'low'>
>>> policy = OpPolicy(torch.bfloat16, lower_ops=["softmax"], fp32_ops=["linear"])
>>> policy.precision_of("linear", "cpu"), policy.precision_of("softmax", "cpu")
(<Precision.FP32: 'fp32'>, <Precision.LOW: 'low'>)
>>> sorted(policy.overrides("cpu"))
['linear', 'softmax']
"""

from mixprec.policy.compare import TableDiff, compare_with_torch, torch_autocast_ops
from mixprec.policy.names import (
    ModuleRule,
    as_module_rules,
    as_op_names,
    known_op_names,
    normalize_op_name,
)
from mixprec.policy.op_policy import OpPolicy
from mixprec.policy.registered import record_registered_op, registered_ops
from mixprec.policy.tables import (
    DEVICE_TYPES,
    OP_ALIASES,
    TABLES_TORCH_VERSION,
    TABLES_VERSION,
    OpTable,
    Precision,
    default_table,
)

__all__ = [
    "DEVICE_TYPES",
    "OP_ALIASES",
    "TABLES_TORCH_VERSION",
    "TABLES_VERSION",
    "ModuleRule",
    "OpPolicy",
    "OpTable",
    "Precision",
    "TableDiff",
    "as_module_rules",
    "as_op_names",
    "compare_with_torch",
    "default_table",
    "known_op_names",
    "normalize_op_name",
    "record_registered_op",
    "registered_ops",
    "torch_autocast_ops",
]

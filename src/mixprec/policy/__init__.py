"""Op precision policy: autocast op tables as plain data, and custom op lists on top.

PyTorch's autocast keeps its op lists in C++; they cannot be edited, are the same
for fp16 and bf16, and change between releases. mixprec keeps them here as data,
pinned to one PyTorch release (:data:`TABLES_TORCH_VERSION`, :data:`TABLES_VERSION`:
:func:`pinned_table`), and corrects them by what the running torch does
(:func:`default_table`, :func:`torch_table`): the running torch's autocast ops are read
from its dispatcher and their classes found by running each op (:mod:`mixprec.amp`
installs that probe). :func:`table_changes` names the ops where the running torch
differs from the pinned tables, :func:`compare_with_torch` the membership differences.

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
:class:`Precision`), :mod:`~mixprec.policy.derived` (the default tables: the pinned
ones corrected by the running torch), :mod:`~mixprec.policy.names` (validating op
names and module rules), :mod:`~mixprec.policy.op_policy` (:class:`OpPolicy`),
:mod:`~mixprec.policy.registered` (the record of user ops declared with
:func:`mixprec.register_op`) and :mod:`~mixprec.policy.compare` (the pinned tables'
membership against the installed torch's registrations).

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
from mixprec.policy.derived import (
    TableSource,
    clear_torch_tables,
    corrected_table,
    default_table,
    set_torch_table_source,
    table_changes,
    torch_table,
    torch_table_source,
)
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
    pinned_table,
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
    "TableSource",
    "as_module_rules",
    "as_op_names",
    "clear_torch_tables",
    "compare_with_torch",
    "corrected_table",
    "default_table",
    "known_op_names",
    "normalize_op_name",
    "pinned_table",
    "record_registered_op",
    "registered_ops",
    "set_torch_table_source",
    "table_changes",
    "torch_autocast_ops",
    "torch_table",
    "torch_table_source",
]

"""The autocast engine (``mixprec.amp``): ``torch.autocast`` plus custom op lists.

:class:`autocast` takes ``torch.autocast``'s arguments and an op policy. Without
custom ops it *is* ``torch.autocast`` (same dtypes, same values, nothing added per
op). With custom ops, a ``TorchFunctionMode`` intercepts only the ops whose class
the policy changes: it casts their floating inputs explicitly and runs them with
autocast off, so PyTorch's C++ lists cannot cast them back. The casts happen above
autograd, so backward returns each input's gradient in that input's dtype.

How the rest of autocast's machinery sees custom ops:

- The policy mode only acts while autocast is on for the op's device with the
  policy's dtype. It is harmless elsewhere, so it can stay entered around
  ``backward()``: :class:`autocast_backward` does that, so the forward that
  activation checkpointing recomputes during backward (under the autocast state
  ``torch.utils.checkpoint`` restores) follows the same policy. Both checkpoint
  flavours (``use_reentrant=True`` and ``False``) are covered.
- The innermost ``mixprec.autocast`` decides the op lists of its region: a nested
  region with other custom ops, with none, with another dtype or with
  ``enabled=False`` shadows the outer lists until it exits.
- ``torch.compile`` traces the mode: compiled and eager code run the same ops in
  the same dtypes, with no graph break added.
- Ops are matched by the name Python code calls them by (``torch.softmax``,
  ``F.softmax`` and ``Tensor.softmax`` are all "softmax"; ``a @ b`` is "matmul").
  Ops that a composite calls from C++, or that a Python-level torch function
  (such as ``F.multi_head_attention_forward``) calls internally, are not seen;
  list the composite itself or use an fp32 island (:mod:`mixprec.islands`).

The package, by responsibility: :mod:`~mixprec.amp.casting` (how one op's inputs
are cast), :mod:`~mixprec.amp.mode` (the ``TorchFunctionMode`` that applies a
policy), :mod:`~mixprec.amp.backward` (re-entering autograd with the mode on the
stack), :mod:`~mixprec.amp.context` (:class:`autocast`, :class:`autocast_backward`),
:mod:`~mixprec.amp.ops` (:func:`register_op` for user ops), and
:mod:`~mixprec.amp.probe` with :mod:`~mixprec.amp.samples` (what the running torch's
autocast does with each table op, found by running it: the classes of
:func:`mixprec.policy.default_table`).

>>> import torch
>>> from mixprec.amp import autocast
>>> lin = torch.nn.Linear(4, 4)
>>> x = torch.randn(2, 4)
>>> with autocast(torch.bfloat16, device_type="cpu", fp32_ops=["linear"]):
...     y = lin(x)
...     z = torch.softmax(y, -1)
>>> y.dtype, z.dtype
(torch.float32, torch.float32)
>>> with autocast(torch.bfloat16, device_type="cpu", lower_ops=["softmax"]):
...     z = torch.softmax(lin(x), -1)
>>> z.dtype
torch.bfloat16
"""

from mixprec.amp.context import autocast, autocast_backward
from mixprec.amp.ops import custom_op_precision, register_op, unregister_op
from mixprec.amp.probe import probe_table
from mixprec.policy import registered_ops, set_torch_table_source, torch_table_source

if torch_table_source() is None:  # the default tables' classes come from running each op (on first use)
    set_torch_table_source(probe_table)

__all__ = [
    "autocast",
    "autocast_backward",
    "custom_op_precision",
    "register_op",
    "registered_ops",
    "unregister_op",
]

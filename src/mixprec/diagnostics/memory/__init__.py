"""Training memory by tensor class, estimated and measured, for a model under each plan.

Tensor classes (:data:`MEMORY_CLASSES`):

- ``weights``, ``buffers``: the model's parameters and buffers, in the plan's dtypes;
- ``grads``: the model's ``.grad`` tensors held until the optimizer step (the
  master-weight plans keep them in the model's low-precision ``.grad`` too);
- ``master_weights``: fp32 copies kept by the optimizer (master-weight plans);
- ``grad_accumulation``: fp32 gradient buffers of the masters that outlive a step (none:
  master-weight plans gather the fp32 gradients at step time and free them after it,
  so they count among the step's temporaries);
- ``optimizer_state``: moments etc. (AdamW: two per parameter plus a step counter);
- ``compensation``: Kahan compensation buffers (``bf16-kahan``);
- ``activations``: what one forward keeps alive for backward (saved tensors, the
  autocast copies of the weights, the output and the loss).

:func:`estimate_memory` computes them without running the model (fake tensors and
traced passes, :mod:`~mixprec.diagnostics.memory.estimate`). The optimizer reports its
own state and step temporaries: a mixprec wrapper through its public hooks
(:meth:`~mixprec.optim.WrappedOptimizer.state_bytes`,
:meth:`~mixprec.optim.WrappedOptimizer.step_transient_bytes`), so the wrapper of a new
plan is estimated without changes here; a plain torch optimizer is sized generically
(:mod:`mixprec.optim.footprint`).

:func:`measure_memory` runs real training steps through
:class:`~mixprec.MixedPrecision` and accounts every live tensor storage
(:mod:`~mixprec.diagnostics.memory.measure`); it works on any device, including CPUs,
which have no allocator high-water mark. :func:`memory_report` puts both side by side.

>>> import torch
>>> from mixprec.diagnostics import estimate_memory
>>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256))
>>> est = estimate_memory(model, "bf16-master", optimizer="adamw")
>>> est.bytes["master_weights"] == 256 * 256 * 4 + 256 * 4  # the Linear's masters; the LayerNorm stays fp32
True
>>> {k: round(v, 2) for k, v in est.per_param().items() if v}
{'weights': 2.02, 'grads': 2.02, 'master_weights': 3.97, 'optimizer_state': 8.0, 'total': 16.0}
"""

from mixprec.diagnostics.memory.estimate import estimate_memory
from mixprec.diagnostics.memory.measure import measure_memory
from mixprec.diagnostics.memory.report import memory_report
from mixprec.diagnostics.memory.results import MEMORY_CLASSES, MemoryEstimate, MemoryReport
from mixprec.diagnostics.memory.state import training_state_bytes_per_param

__all__ = [
    "MEMORY_CLASSES",
    "MemoryEstimate",
    "MemoryReport",
    "estimate_memory",
    "measure_memory",
    "memory_report",
    "training_state_bytes_per_param",
]

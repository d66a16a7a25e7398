"""torch.distributed glue: DDP with reduce-dtype comm hooks, FSDP2 policies, sharded gradients, data.

The skip decision is already cross-rank: :class:`mixprec.MixedPrecision` all-reduces
(MAX) one ``[non-finite loss, overflow]`` flag over its ``process_group`` (default: the
default group when more than one rank runs), and under an fp8 plan it all-reduces the
fp8 amaxes at every step. This package adds:

- DDP: ``mp.prepare(model, opt, ddp=True)`` or :func:`wrap_ddp`, with gradients reduced
  in ``plan.reduce_dtype`` (:class:`GradReduceHook`, byte counters in :func:`reduce_stats`);
- FSDP2: :func:`fsdp_policy`, :func:`fully_shard_model`, and DTensor-aware gradient norms;
- data: :func:`distributed_loader` and the resumable :func:`epoch_batches`.

>>> from mixprec.distributed import fsdp_policy, is_distributed
>>> is_distributed()
False
>>> fsdp_policy("bf16-mixed").param_dtype is None
True

See docs/distributed.md for torchrun commands (single node, multi-node, restarts).
"""

from mixprec.distributed.comm import GradReduceHook, ReduceStats, run_hook
from mixprec.distributed.data import (
    ResumableDistributedSampler,
    StepBatch,
    distributed_loader,
    epoch_batches,
)
from mixprec.distributed.ddp import check_prewrapped, is_ddp, plan_for_ddp, reduce_stats, wrap_ddp
from mixprec.distributed.frontdoor import ddp_arguments, plan_for_model
from mixprec.distributed.fsdp import (
    ShardedPlan,
    fsdp_policy,
    fully_shard_model,
    has_dtensor,
    has_fsdp,
    is_fsdp,
    local_tensor,
    sharded_plan,
    total_grad_norm,
)
from mixprec.process_groups import (
    all_reduce_max,
    is_distributed,
    rank,
    resolve_group,
    world_size,
)

__all__ = [
    "GradReduceHook",
    "ReduceStats",
    "ResumableDistributedSampler",
    "ShardedPlan",
    "StepBatch",
    "all_reduce_max",
    "check_prewrapped",
    "ddp_arguments",
    "distributed_loader",
    "epoch_batches",
    "fsdp_policy",
    "fully_shard_model",
    "has_dtensor",
    "has_fsdp",
    "is_ddp",
    "is_distributed",
    "is_fsdp",
    "local_tensor",
    "plan_for_ddp",
    "plan_for_model",
    "rank",
    "reduce_stats",
    "resolve_group",
    "run_hook",
    "sharded_plan",
    "total_grad_norm",
    "world_size",
    "wrap_ddp",
]

"""Which process group a collective runs over, and the facts about it (also :mod:`mixprec.distributed`).

``process_group=None`` means the default group when torch.distributed is initialised
with more than one rank, and no communication otherwise (the rule the loss scalers
and :class:`mixprec.MixedPrecision` follow too).

>>> from mixprec.process_groups import is_distributed, resolve_group
>>> is_distributed(), resolve_group(None)
(False, None)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_reduce_max", "check_group", "is_distributed", "rank", "resolve_group", "world_size"]


_AVAILABLE = dist.is_available()  # fixed by how torch was built


def is_distributed() -> bool:
    """True when torch.distributed is initialised with more than one rank."""
    return _AVAILABLE and dist.is_initialized() and dist.get_world_size() > 1


def check_group(process_group: Any, what: str = "process_group") -> Any:
    """``process_group`` itself if it is None or a torch.distributed ProcessGroup; else a
    TypeError naming the value and the fix (refused where it is given, not at the first
    collective mid-training)."""
    if process_group is None or (_AVAILABLE and isinstance(process_group, dist.ProcessGroup)):
        return process_group
    raise TypeError(
        f"{what} must be a torch.distributed.ProcessGroup or None, got {process_group!r} "
        f"({type(process_group).__name__}); pass None (the default group when torch.distributed runs "
        "more than one rank) or a group object, e.g. torch.distributed.group.WORLD or torch.distributed.new_group(...)"
    )


def resolve_group(process_group: Any = None) -> Any:
    """``process_group`` itself, or the default group when distributed, or None (no sync)."""
    if process_group is not None:
        return process_group
    return dist.group.WORLD if is_distributed() else None


def world_size(process_group: Any = None) -> int:
    """Ranks in ``process_group`` (1 when torch.distributed is not initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size(process_group))


def rank(process_group: Any = None) -> int:
    """This process's rank in ``process_group`` (0 when torch.distributed is not initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return int(dist.get_rank(process_group))


def all_reduce_max(flag: torch.Tensor, process_group: Any = None) -> torch.Tensor:
    """MAX all-reduce ``flag`` in place over the resolved group (a no-op without one); returns it.

    >>> import torch
    >>> all_reduce_max(torch.tensor([0.0, 1.0]))
    tensor([0., 1.])
    """
    group = resolve_group(process_group)
    if group is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag

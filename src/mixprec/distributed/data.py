"""Data loading across ranks: each rank a disjoint shard, a new shuffle every epoch, resumable mid-epoch.

``DistributedSampler`` shuffles with ``seed + epoch``; a loop that never calls
``sampler.set_epoch(epoch)`` sees the same order every epoch. :func:`epoch_batches`
calls it for you, and starts part-way into an epoch after a restart, so a resumed run
sees exactly the batches an uninterrupted one would.

>>> import torch
>>> from torch.utils.data import TensorDataset
>>> from mixprec.distributed import distributed_loader, epoch_batches
>>> data = TensorDataset(torch.arange(12.0))
>>> loader = distributed_loader(data, 4, num_replicas=2, rank=0, seed=0)
>>> len(loader)  # 6 examples per rank, batches of 4, the rest dropped
1
>>> [(s.step, s.epoch) for s, _ in zip(epoch_batches(loader, start_step=3), range(2))]
[(3, 3), (4, 4)]
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from typing import Any, NamedTuple

from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = ["ResumableDistributedSampler", "StepBatch", "distributed_loader", "epoch_batches"]


def _check_int(call: str, name: str, value: object, fix: str) -> None:
    """TypeError unless ``value`` is an int (bool excluded), naming it and the fix; here rather
    than inside the first iteration (a shuffle seed of 1.5 fails in ``manual_seed``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{call}: {name} must be an int, got {value!r} ({type(value).__name__}); pass e.g. {fix}")


def _check_bool(call: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(
            f"{call}: {name} must be True or False, got {value!r} ({type(value).__name__}); "
            f"pass {name}=True or {name}=False"
        )


class ResumableDistributedSampler(DistributedSampler):  # type: ignore[type-arg]
    """A ``DistributedSampler`` that can begin an epoch after its first ``start`` indices."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.start = 0

    def set_start(self, start: int) -> None:
        """Skip the first ``start`` indices of this rank's share in the coming epoch(s)."""
        _check_int("set_start()", "start", start, "set_start(0)")
        if start < 0 or start > super().__len__():
            raise ValueError(f"start must be in [0, {super().__len__()}], got {start}")
        self.start = start

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.start :])

    def __len__(self) -> int:
        return super().__len__() - self.start


def distributed_loader(
    dataset: Dataset[Any],
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    num_replicas: int | None = None,
    rank: int | None = None,
    **loader_kwargs: Any,
) -> DataLoader[Any]:
    """A DataLoader over this rank's shard of ``dataset`` (a :class:`ResumableDistributedSampler`).

    Args:
        dataset: a map-style dataset.
        batch_size: examples per batch on each rank (the global batch is ``world_size`` times it).
        shuffle: reshuffle every epoch, from ``seed + epoch`` (the same order on every rank).
        seed: shuffle seed; equal on all ranks.
        drop_last: drop the tail so every rank gets the same number of full batches (DDP
            ranks must run the same number of steps); False pads the shards by repeating
            examples and keeps a last partial batch.
        num_replicas, rank: default to the world size and this rank of the default group.
        **loader_kwargs: passed to ``DataLoader`` (``num_workers``, ``pin_memory``, ...).

    Call ``loader.sampler.set_epoch(epoch)`` before each epoch, or iterate with
    :func:`epoch_batches`, which does it and resumes mid-epoch.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    call = "distributed_loader()"
    _check_int(call, "seed", seed, "seed=0 (the same on every rank)")
    _check_bool(call, "shuffle", shuffle)
    _check_bool(call, "drop_last", drop_last)
    if num_replicas is not None:
        _check_int(call, "num_replicas", num_replicas, "num_replicas=None (the world size)")
        if num_replicas < 1:
            raise ValueError(
                f"{call}: num_replicas must be >= 1, got {num_replicas!r}; pass num_replicas=None (the world size)"
            )
    if rank is not None:
        _check_int(call, "rank", rank, "rank=None (this process's rank)")
    if "sampler" in loader_kwargs or "shuffle" in loader_kwargs or "batch_sampler" in loader_kwargs:
        raise ValueError("distributed_loader() builds the sampler itself; pass shuffle= and seed=, not sampler=")
    sampler = ResumableDistributedSampler(
        dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kwargs)


class StepBatch(NamedTuple):
    """One batch from :func:`epoch_batches`: the global step it is for, its epoch, and the data."""

    step: int
    epoch: int
    batch: Any


def epoch_batches(loader: DataLoader[Any], *, start_step: int = 0) -> Iterator[StepBatch]:
    """Batches of ``loader`` forever, epoch after epoch, starting at global step ``start_step``.

    Calls ``set_epoch`` on the sampler before every epoch and, when ``start_step`` falls
    inside an epoch, skips that epoch's first batches without loading them. The loader
    must come from :func:`distributed_loader` (or use a :class:`ResumableDistributedSampler`).
    Its arguments are checked when it is called, before the first batch is asked for.
    """
    sampler = getattr(loader, "sampler", None)
    if not isinstance(loader, DataLoader) or not isinstance(sampler, ResumableDistributedSampler):
        got = f"a {type(sampler).__name__}" if isinstance(loader, DataLoader) else f"{loader!r} ({type(loader).__name__})"
        raise TypeError(
            f"epoch_batches() needs a loader made by distributed_loader() (a ResumableDistributedSampler), got {got}"
        )
    _check_int("epoch_batches()", "start_step", start_step, "start_step=0 (or the global step to resume at)")
    if start_step < 0:
        raise ValueError(
            f"epoch_batches(): start_step must be >= 0, got {start_step}; pass 0 or the global step to resume at"
        )
    batch_size = loader.batch_size
    if batch_size is None:
        raise TypeError("epoch_batches() needs a loader with a batch_size (not a batch_sampler)")
    return _batches(loader, sampler, batch_size, int(start_step))


def _batches(
    loader: DataLoader[Any], sampler: ResumableDistributedSampler, batch_size: int, start_step: int
) -> Iterator[StepBatch]:
    sampler.set_start(0)
    per_epoch = len(loader)
    if per_epoch == 0:
        raise ValueError(
            f"each rank's shard has {len(sampler)} examples, fewer than one batch of {batch_size}; "
            "use a smaller batch_size or more data"
        )
    epoch, skip = divmod(start_step, per_epoch)
    step = start_step
    while True:
        sampler.set_epoch(epoch)
        sampler.set_start(skip * batch_size)
        for batch in loader:
            yield StepBatch(step, epoch, batch)
            step += 1
        skip = 0
        epoch += 1

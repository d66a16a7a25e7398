"""Helpers to run a function on several gloo ranks on this machine (file rendezvous, no ports)."""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, init_file: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        # Free DDP reducers and pending work while the group is alive, then leave together.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Success: skip interpreter finalisation, where torch/gloo C++ destructors of objects
    # kept alive by reference cycles can abort a worker after its test passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; fails if any rank raises."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(
            _entry, args=(world_size, init_file, fn, args), nprocs=world_size, join=True, start_method="spawn"
        )

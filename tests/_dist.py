"""Helpers to run a function on several gloo ranks on this machine (file rendezvous, no ports)."""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
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


def whole(obj: Any) -> Any:
    """``obj`` (a state dict) with every tensor a copy and every DTensor gathered whole. (A copy:
    optimizers step their counters in place.) Collective where it gathers: call it on every rank."""
    if isinstance(obj, torch.Tensor):
        return (obj.full_tensor() if hasattr(obj, "full_tensor") else obj).detach().clone()
    if isinstance(obj, dict):
        return {k: whole(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [whole(v) for v in obj]
    return obj


def assert_same(got: Any, want: Any, where: str) -> None:
    """``got`` equals ``want`` exactly: the same keys, tensors of the same dtype and bits."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(map(str, got)) == sorted(map(str, want)), (where, list(got), list(want))
        for key, value in want.items():
            assert_same(got[key], value, f"{where}/{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}/{i}")
    else:
        assert got == want or (got != got and want != want), (where, got, want)

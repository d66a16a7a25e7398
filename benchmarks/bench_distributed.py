"""Data-parallel step time and gradient bytes: 2 ranks, fp32 vs bf16 gradient reduction.

Two gloo processes on this machine (CPU) each run the same training step users run
(``MixedPrecision.prepare(..., ddp=True)``, autocast, backward, step) for every row,
rows interleaved repeat by repeat so machine noise hits all of them alike; the median
step time is reported with the bytes each rank handed to the reduction per step
(counted in the communication hook) and the ratios to the fp32-reduce row of the same
plan. A row with torch's own DDP all-reduce (no hook) is the baseline for the hook's
overhead.

    python benchmarks/bench_distributed.py                # prints a Markdown table
    python benchmarks/bench_distributed.py --size tiny    # quicker

On one machine the "network" is loopback memory copies, so halving the bytes buys
little time here; across nodes the wire is the bottleneck and the byte ratio is what
carries over. On GPUs run it under torchrun with NCCL instead (see docs/distributed.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROWS: tuple[tuple[str, str, str], ...] = (
    # (label, plan, reduce dtype); reduce "torch" = DistributedDataParallel's own all-reduce
    ("bf16-mixed, torch DDP all-reduce (fp32)", "bf16-mixed", "torch"),
    ("bf16-mixed, reduce fp32", "bf16-mixed", "fp32"),
    ("bf16-mixed, reduce bf16", "bf16-mixed", "bf16"),
    ("bf16-master, reduce fp32", "bf16-master", "fp32"),
    ("bf16-master, reduce bf16", "bf16-master", "bf16"),
)


def _make_row(task_name: str, size: str, plan_name: str, reduce: str) -> tuple[Any, ...]:
    from torch.nn.parallel import DistributedDataParallel

    from mixprec import MixedPrecision, get_plan, parse_dtype
    from mixprec.cli.models import build_task

    task = build_task(task_name, size=size, seed=0)
    opt = torch.optim.AdamW(task.model.parameters(), lr=1e-3)
    if reduce == "torch":  # a model the user wrapped: allowed for plans that keep fp32 weights
        mpx = MixedPrecision(plan_name)
        model, opt, criterion = mpx.prepare(DistributedDataParallel(task.model), opt, criterion=task.criterion)
    else:
        mpx = MixedPrecision(get_plan(plan_name, reduce_dtype=parse_dtype(reduce)))
        model, opt, criterion = mpx.prepare(task.model, opt, criterion=task.criterion, ddp=True)
    return task, mpx, model, criterion


def _worker(rank: int, world: int, init_file: str, args: argparse.Namespace, out_file: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from mixprec.distributed import reduce_stats

    rows = [_make_row(args.task, args.size, plan, reduce) for _, plan, reduce in ROWS]
    gen = torch.Generator().manual_seed(1000 + rank)
    times: list[list[float]] = [[] for _ in rows]

    def step(i: int) -> float:
        task, mpx, model, criterion = rows[i]
        x, y = task.batch(args.batch_size, gen)
        dist.barrier()
        start = time.perf_counter()
        with mpx.autocast():
            loss = criterion(model(x), y)
        mpx.backward(loss)
        mpx.step()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        for i in range(len(rows)):
            step(i)
    stats_before = [reduce_stats(r[2]).as_dict() if ROWS[i][2] != "torch" else None for i, r in enumerate(rows)]
    for rep in range(args.steps):
        order = range(len(rows)) if rep % 2 == 0 else reversed(range(len(rows)))
        for i in order:
            times[i].append(step(i))
    result = []
    for i, row in enumerate(rows):
        before = stats_before[i]
        entry: dict[str, Any] = {"median_s": statistics.median(times[i])}
        if before is not None:
            after = reduce_stats(row[2]).as_dict()
            entry["payload"] = (after["payload_bytes"] - before["payload_bytes"]) / args.steps
            entry["wire"] = (after["wire_bytes"] - before["wire_bytes"]) / args.steps
        else:
            params = sum(p.numel() for p in row[2].parameters() if p.requires_grad)
            entry["payload"] = params * 4  # torch reduces the fp32 gradients as they are
            entry["wire"] = None
        result.append(entry)
    if rank == 0:
        torch.save(result, out_file)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="mlp")
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--batch-size", type=int, default=64, help="examples per rank per step")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "result.pt")
        mp.start_processes(
            _worker, args=(world, os.path.join(tmp, "rendezvous"), args, out_file),
            nprocs=world, join=True, start_method="spawn",
        )
        result = torch.load(out_file, weights_only=True)

    print(f"# Distributed data parallel: {world} gloo ranks on CPU, task {args.task}-{args.size}, "
          f"batch {args.batch_size} per rank, median of {args.steps} steps\n")
    print("| row | step time (ms) | bytes reduced / step / rank | wire bytes / step / rank | "
          "bytes vs fp32 reduce | time vs fp32 reduce |")
    print("|---|---:|---:|---:|---:|---:|")
    baseline: dict[str, dict[str, Any]] = {}
    for (_label, plan, reduce), entry in zip(ROWS, result, strict=True):
        if reduce == "fp32":
            baseline[plan] = entry
    for (label, plan, _reduce), entry in zip(ROWS, result, strict=True):
        base = baseline[plan]
        wire = "n/a" if entry["wire"] is None else f"{entry['wire']:,.0f}"
        print(f"| {label} | {entry['median_s'] * 1e3:.2f} | {entry['payload']:,.0f} | {wire} | "
              f"{entry['payload'] / base['payload']:.2f}x | {entry['median_s'] / base['median_s']:.2f}x |")
    print(f"\ncommand: python benchmarks/bench_distributed.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    print(f"torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

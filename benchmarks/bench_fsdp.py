"""Sharded training (FSDP2): per-rank training-state bytes and step time, plan by plan.

Each row trains the same task on ``--world`` ranks (gloo on CPU; NCCL with one GPU per
rank), sharded by ``mixprec.distributed.fully_shard_model``, and on one process unsharded
(the bytes reference). Reported per row:

- the median step time (forward, backward, optimizer step) on the ranks, and its ratio to
  the baselines, PyTorch's own bf16 FSDP2 (``MixedPrecisionPolicy(param_dtype=bf16)``, fp32
  shards, plain ``torch.optim.AdamW``: no mixprec), without autocast (everything bf16, as
  the pure plans) and under ``torch.autocast`` (fp32 for the ops autocast keeps in fp32, as
  the mixed, master, Kahan and SR plans), all rows interleaved step by step;
- training-state bytes per parameter of the whole model (weights, gradients, masters,
  Kahan compensation, optimizer state; counted from storages after a step,
  ``mixprec.diagnostics.training_state_bytes_per_param``) held by one rank, and by one
  unsharded process, and their ratio (``1/world`` when everything is sharded).

    python benchmarks/bench_fsdp.py                       # CPU, 2 gloo ranks, Markdown table
    python benchmarks/bench_fsdp.py --model gpt --size small --steps 20
    torchrun is not needed: the script spawns its ranks (on GPUs: --world <= GPU count)
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

BASELINE = "torch FSDP2 bf16"
BASELINE_AUTOCAST = "torch FSDP2 bf16 + torch.autocast"
BASELINES = (BASELINE, BASELINE_AUTOCAST)
PLANS = ("bf16-mixed", "bf16-master", "bf16-pure", "bf16-kahan", "bf16-sr")


def _device(rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(row: str, args: argparse.Namespace, device: torch.device, *, shard: bool) -> tuple[Any, ...]:
    from mixprec import MixedPrecision
    from mixprec.cli.models import build_task
    from mixprec.distributed import fully_shard_model

    task = build_task(args.model, size=args.size, seed=0)
    model = task.model.to(device)
    blocks = getattr(model, "blocks", None)
    units = (type(blocks[0]),) if blocks is not None and len(blocks) else ()
    if row in BASELINES:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for module in reversed(list(model.modules())):
            if module is not model and units and isinstance(module, units):
                fully_shard(module, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        return task, row, model, opt, task.criterion
    session = MixedPrecision(row)
    if shard:
        model = fully_shard_model(model, session.plan, units=units)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    model, opt, criterion = session.prepare(model, opt, criterion=task.criterion)
    return task, session, model, opt, criterion


def _step(task: Any, session: Any, model: Any, opt: Any, criterion: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    if isinstance(session, str):  # a baseline: torch alone
        if session == BASELINE_AUTOCAST:
            with torch.autocast(x.device.type, dtype=torch.bfloat16):
                loss = criterion(model(x), y)
        else:
            loss = criterion(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return
    with session.autocast():
        loss = criterion(model(x), y)
    session.backward(loss)
    session.step()


def _bytes(model: Any, opt: Any) -> float:
    from mixprec.diagnostics import training_state_bytes_per_param

    return float(training_state_bytes_per_param(model, opt)["total"])


def _rank(rank: int, world: int, init_file: str, args: argparse.Namespace, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    device = _device(rank)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{init_file}",
                           rank=rank, world_size=world)
    rows = [*BASELINES, *args.plans]
    runs = {row: _build(row, args, device, shard=True) for row in rows}
    per_rank = args.batch // world
    times: dict[str, list[float]] = {row: [] for row in rows}
    for step in range(args.warmup + args.steps):
        x, y = runs[rows[0]][0].batch(args.batch, torch.Generator().manual_seed(step))
        x, y = x[rank * per_rank : (rank + 1) * per_rank].to(device), y[rank * per_rank : (rank + 1) * per_rank].to(device)
        for row in rows:  # interleaved: machine noise hits every row alike
            dist.barrier()
            _sync(device)
            start = time.perf_counter()
            _step(*runs[row], x, y)
            _sync(device)
            if step >= args.warmup:
                times[row].append(time.perf_counter() - start)
    result = {row: {"ms": 1e3 * statistics.median(times[row])} for row in rows}
    for row in args.plans:
        _, _, model, opt, _ = runs[row]
        result[row]["bytes"] = _bytes(model, opt)
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


def _one_process_bytes(args: argparse.Namespace) -> dict[str, float]:
    device = _device(0)
    out = {}
    for row in args.plans:
        task, session, model, opt, criterion = _build(row, args, device, shard=False)
        x, y = task.batch(args.batch, torch.Generator().manual_seed(0))
        _step(task, session, model, opt, criterion, x.to(device), y.to(device))
        out[row] = _bytes(model, opt)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--size", default="small")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="global batch, split across the ranks")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--plans", default=",".join(PLANS))
    args = parser.parse_args(argv)
    args.plans = [p for p in args.plans.split(",") if p]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.start_processes(_rank, args=(args.world, os.path.join(tmp, "rdzv"), args, out), nprocs=args.world,
                           join=True, start_method="spawn")
        result = torch.load(out, weights_only=True)
    single = _one_process_bytes(args)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"`python benchmarks/bench_fsdp.py {' '.join(sys.argv[1:] if argv is None else argv)}` "
          f"({args.model}-{args.size}, {args.world} ranks, {device}, torch {torch.__version__}, global batch "
          f"{args.batch}, medians of {args.steps} steps)\n")
    print("| row | step ms | vs torch FSDP2 bf16 | vs + torch.autocast | state B/param, one process | per rank | "
          "per rank / one process |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base, auto = result[BASELINE]["ms"], result[BASELINE_AUTOCAST]["ms"]
    for row in BASELINES:
        ms = result[row]["ms"]
        print(f"| {row} (no mixprec) | {ms:.1f} | {ms / base:.2f}x | {ms / auto:.2f}x | - | - | - |")
    for row in args.plans:
        ms, per = result[row]["ms"], result[row]["bytes"]
        print(f"| {row} | {ms:.1f} | {ms / base:.2f}x | {ms / auto:.2f}x | {single[row]:.2f} | {per:.2f} | "
              f"{per / single[row]:.3f} |")


if __name__ == "__main__":
    main()

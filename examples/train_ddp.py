"""Data-parallel mixed-precision training with periodic atomic checkpoints and resume-from-latest.

Single node, two processes (gloo on CPU, NCCL on GPUs)::

    torchrun --nproc_per_node=2 examples/train_ddp.py --plan bf16-mixed --reduce-dtype bf16

Elastic: restart every worker from the latest checkpoint if one dies (here rank 1 kills
itself at step 7 of the first attempt, to show it)::

    torchrun --nproc_per_node=2 --max-restarts=1 examples/train_ddp.py --kill-at-step 7

Multi-node (run on every node, node_rank 0..nnodes-1, the endpoint on node 0)::

    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$NODE_RANK \\
        --rdzv-backend=c10d --rdzv-endpoint=$HEAD_NODE:29500 --rdzv-id=job42 \\
        examples/train_ddp.py --ckpt-dir /shared/ckpt

Every optimizer step consumes ``--grad-accum`` micro-batches of ``--batch-size`` examples
per rank from a fixed synthetic dataset (``mixprec.cli.models``, nothing downloaded), sharded
by ``mixprec.distributed.distributed_loader``. Rank 0 writes a checkpoint every
``--ckpt-every`` steps (atomic: temp file, fsync, rename) and keeps the last ``--keep``.
A (re)started run loads the latest one, continues from the step after it, and, because
the data order, the model state, the optimizer (with fp32 masters) and the loss scaler
all come back exactly, ends with the parameters of an uninterrupted run, bit for bit.
The training loop draws no random numbers after building the model (the data order comes
from the sampler's seed and epoch), so the checkpoints need no per-rank RNG state.
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import re
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from mixprec import MixedPrecision, get_plan, load_checkpoint, parse_dtype, save_checkpoint
from mixprec.cli.models import build_task
from mixprec.distributed import distributed_loader, epoch_batches, reduce_stats

_CKPT = re.compile(r"ckpt-(\d+)\.pt$")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="mlp", help="built-in task (mixprec.cli.models.TASKS)")
    p.add_argument("--size", default="tiny", choices=("tiny", "small"))
    p.add_argument("--plan", default="bf16-mixed", help="precision plan name")
    p.add_argument("--reduce-dtype", default="fp32", help="gradient all-reduce dtype: fp32, bf16 or fp16")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps in total")
    p.add_argument("--batch-size", type=int, default=16, help="examples per micro-batch per rank")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dataset-size", type=int, default=512, help="examples in the synthetic dataset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default=None, help="checkpoint folder (default: no checkpoints)")
    p.add_argument("--ckpt-every", type=int, default=5, help="steps between checkpoints")
    p.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    p.add_argument("--out", default=None, help="write the final training state here (rank 0)")
    p.add_argument("--kill-at-step", type=int, default=None,
                   help="on the first attempt, rank --kill-rank SIGKILLs itself before this step (restart demo)")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--log-every", type=int, default=5)
    return p.parse_args(argv)


def latest_checkpoint(folder: str | None) -> str | None:
    """The checkpoint with the highest step in ``folder`` (None if there is none)."""
    if folder is None:
        return None
    found = [(int(m.group(1)), path) for path in glob.glob(os.path.join(folder, "ckpt-*.pt"))
             if (m := _CKPT.search(path))]
    return max(found)[1] if found else None


def prune(folder: str, keep: int) -> None:
    found = sorted((int(m.group(1)), path) for path in glob.glob(os.path.join(folder, "ckpt-*.pt"))
                   if (m := _CKPT.search(path)))
    for _, path in found[:-keep]:
        os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    try:
        train(args, device)
        # The DDP model, its reducer and comm hook lived in train(): collect them (and any
        # reference cycles) while the process group is still alive, then leave together.
        # Destroying the group first lets their destructors run against a dead group at
        # interpreter exit, which can abort the process after a successful run.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def train(args: argparse.Namespace, device: torch.device) -> None:
    """The training loop: resume from the latest checkpoint, train, checkpoint periodically."""
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    task = build_task(args.task, size=args.size, seed=args.seed)
    data = TensorDataset(*task.batch(args.dataset_size, torch.Generator().manual_seed(args.seed)))
    loader = distributed_loader(data, args.batch_size, seed=args.seed)

    plan = get_plan(args.plan, reduce_dtype=parse_dtype(args.reduce_dtype))
    mp = MixedPrecision(plan, grad_accum_steps=args.grad_accum)
    model = task.model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, opt, criterion = mp.prepare(model, opt, criterion=task.criterion, ddp=True)

    start = 0
    latest = latest_checkpoint(args.ckpt_dir)
    if latest is not None:
        extra = load_checkpoint(latest, model=model, optimizers=[opt], mp=mp, rng=False)
        start = int(extra["step"])
    if rank == 0:
        print(f"[attempt {attempt}] world {world}, plan {mp.plan.name}, reduce {args.reduce_dtype}, "
              f"start at step {start}" + (f" (resumed from {os.path.basename(latest)})" if latest else ""),
              flush=True)

    step, t0 = start, time.perf_counter()
    batches = epoch_batches(loader, start_step=start * args.grad_accum)
    while step < args.steps:
        if args.kill_at_step == step and rank == args.kill_rank and attempt == 0:
            print(f"[attempt {attempt}] rank {rank}: killing myself before step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        for _ in range(args.grad_accum):
            _, epoch, (x, y) = next(batches)
            with mp.autocast():
                loss = criterion(model(x.to(device)), y.to(device))
            mp.backward(loss)
            result = mp.step()
        step += 1
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            print(f"step {step:4d}  epoch {epoch}  loss {loss.item():.4f}  scale {result.scale:g}  "
                  f"grad_norm {result.grad_norm:.4f}  {'stepped' if result.stepped else result.skip_reason}",
                  flush=True)
        if args.ckpt_dir is not None and step % args.ckpt_every == 0:
            if rank == 0:
                os.makedirs(args.ckpt_dir, exist_ok=True)
                save_checkpoint(os.path.join(args.ckpt_dir, f"ckpt-{step:06d}.pt"), model=model,
                                optimizers=[opt], mp=mp, extra={"step": step}, rng=False)
                prune(args.ckpt_dir, args.keep)
            dist.barrier()

    stats = reduce_stats(model)
    if rank == 0:
        elapsed = time.perf_counter() - t0
        print(f"done: {args.steps - start} steps in {elapsed:.2f}s; gradients reduced in {args.reduce_dtype}: "
              f"{stats.calls} bucket reductions, {stats.payload_bytes} bytes", flush=True)
        if args.out is not None:
            save_checkpoint(args.out, model=model, optimizers=[opt], mp=mp, extra={"step": step}, rng=False)


if __name__ == "__main__":
    sys.exit(main())

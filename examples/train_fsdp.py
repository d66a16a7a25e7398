"""Sharded mixed-precision training (FSDP2, or HSDP across nodes) with sharded checkpoints.

One node, two processes (gloo on CPU, NCCL on GPUs), each holding half of every weight::

    torchrun --nproc_per_node=2 examples/train_fsdp.py --plan bf16-kahan

Across nodes, HSDP: every node a replica, its ranks sharding the model (run on every node,
the endpoint on node 0)::

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=$HEAD_NODE:29500 \\
        --rdzv-id=job42 examples/train_fsdp.py --plan bf16-kahan --replicas 2 --ckpt /shared/ckpt.pt

Every plan but fp8 runs sharded: ``*-mixed`` and ``*-master`` keep fp32 shards (the masters),
``*-pure``, ``*-kahan`` and ``bf16-sr`` keep their bf16/fp16 weights as the shards and step
them with mixprec's optimizer wrappers. ``--ckpt`` saves every ``--ckpt-every`` steps (each
rank its part, switched in together) and a restarted run resumes from it bit for bit.
The data is a fixed synthetic task (``mixprec.cli.models``, nothing downloaded); each rank
takes its slice of every global batch.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from mixprec import MixedPrecision, get_plan, load_checkpoint, save_checkpoint
from mixprec.cli.models import build_task
from mixprec.distributed import fully_shard_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="bf16-kahan")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch (split across ranks)")
    parser.add_argument("--replicas", type=int, default=1, help="HSDP: replica groups (each shards the model)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ckpt", default=None, help="checkpoint path, on a filesystem every rank sees")
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--out", default=None, help="rank 0 writes the gathered weights and losses here")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    train(args, torch.device("cuda") if cuda else torch.device("cpu"))
    # the sharded model and optimizer are gone with train()'s frame: free what they left while the
    # group is alive, then leave together (destroyed first, the group can abort a rank at exit)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.replicas:
        raise SystemExit(f"--replicas {args.replicas} does not divide the world size {world}")
    mesh = init_device_mesh(device.type, (args.replicas, world // args.replicas), mesh_dim_names=("replicate", "shard"))
    if args.replicas == 1:
        mesh = mesh["shard"]

    task = build_task(args.model, size=args.size, seed=0)
    plan = get_plan(args.plan)
    mp = MixedPrecision(plan, clip_grad_norm=1.0)
    model = fully_shard_model(task.model.to(device), plan, mesh=mesh, units=_units(task.model))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, opt, criterion = mp.prepare(model, opt, criterion=task.criterion)

    start = 0
    if args.ckpt and os.path.exists(args.ckpt):
        start = int(load_checkpoint(args.ckpt, model=model, optimizers=[opt], mp=mp)["step"])
        if rank == 0:
            print(f"resumed from {args.ckpt} at step {start}", flush=True)
    per_rank = args.batch_size // world
    losses = []
    for step in range(start, args.steps):
        x, y = task.batch(args.batch_size, torch.Generator().manual_seed(100 + step))
        x, y = x[rank * per_rank : (rank + 1) * per_rank].to(device), y[rank * per_rank : (rank + 1) * per_rank].to(device)
        with mp.autocast():
            loss = criterion(model(x), y)
        mp.backward(loss)
        result = mp.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {losses[-1]:.4f} ({'stepped' if result.stepped else result.skip_reason})", flush=True)
        if args.ckpt and (step + 1) % args.ckpt_every == 0:
            save_checkpoint(args.ckpt, model=model, optimizers=[opt], mp=mp, extra={"step": step + 1})
    weights = {n: p.full_tensor().detach().cpu() for n, p in model.named_parameters()}
    if rank == 0 and args.out:
        torch.save({"weights": weights, "losses": losses, "world": world}, args.out)


def _units(model: torch.nn.Module) -> tuple[type[torch.nn.Module], ...]:
    blocks = getattr(model, "blocks", None)
    return (type(blocks[0]),) if blocks is not None and len(blocks) else ()


if __name__ == "__main__":
    main()

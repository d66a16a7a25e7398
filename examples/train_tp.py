"""Tensor parallelism (and TP x FSDP2, "2-D") under a precision plan, with a sharded checkpoint.

Two processes (gloo on CPU, NCCL on GPUs), each holding half of every attention head set and
half of the MLP (``parallelize_module`` with column/row-parallel Linears)::

    torchrun --nproc_per_node=2 examples/train_tp.py --plan bf16-master

2-D: TP on the mesh's ``"tp"`` dimension inside FSDP2 on its ``"dp"`` dimension (4 processes
as 2 x 2; ``--dp 1`` or ``--dp`` equal to the world size give the degenerate meshes)::

    torchrun --nproc_per_node=4 examples/train_tp.py --plan bf16-kahan --dp 2

The order that works: ``parallelize_module`` first (it replaces each parallelised parameter
by a DTensor), then ``fully_shard_model`` for 2-D, then the optimizer over the model's
parameters, then ``mp.prepare``. Every plan but fp8-mixed runs: the casts keep each DTensor's
local shard in the parameter's dtype, masters follow the shards, and the skip decision, the
loss scale and the gradient norm are agreed over the whole mesh by device all-reduces (no
host read per step with a fused optimizer). ``--ckpt`` saves every rank's part at the end and
a restarted run with the same layout resumes from it bit for bit. The data is synthetic.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from mixprec import MixedPrecision, load_checkpoint, save_checkpoint
from mixprec.distributed import fully_shard_model

WIDTH, HEADS, SEQ = 64, 4, 16


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm(x)
        # -1: the heads this rank holds (all of them without TP)
        q, k, v = (f(h).view(b, t, -1, WIDTH // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(a.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def build(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(layers) for m in (Attention(), MLP())))


def tp_plan(model: nn.Sequential) -> dict[str, object]:
    """Column-parallel q, k, v and up; row-parallel o and down (Megatron's split)."""
    plan: dict[str, object] = {}
    for i, block in enumerate(model):
        if isinstance(block, Attention):
            plan.update({f"{i}.q": ColwiseParallel(), f"{i}.k": ColwiseParallel(), f"{i}.v": ColwiseParallel(),
                         f"{i}.o": RowwiseParallel()})
        else:
            plan.update({f"{i}.up": ColwiseParallel(), f"{i}.down": RowwiseParallel()})
    return plan


def fused_adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """Fused AdamW (it skips a step from a device flag: no host read). torch's fused kernels take
    DTensors or plain tensors, not both in one call: under TP alone the replicated LayerNorms are
    plain parameters, so they get a group of their own."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if hasattr(p, "to_local")]},
              {"params": [p for p in params if not hasattr(p, "to_local")]}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, weight_decay=0.01, fused=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="bf16-master")
    parser.add_argument("--dp", type=int, default=0, help="2-D: the FSDP2 (data-parallel) size; 0: TP alone")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (split across the dp ranks)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ckpt", default=None, help="checkpoint path, on a filesystem every rank sees")
    parser.add_argument("--out", default=None, help="rank 0 writes the whole weights and the losses here")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    train(args, torch.device("cuda") if cuda else torch.device("cpu"))
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = args.dp or 1
    if world % dp:
        raise SystemExit(f"--dp {dp} does not divide the world size {world}")
    mesh = init_device_mesh(device.type, (dp, world // dp), mesh_dim_names=("dp", "tp"))
    mp = MixedPrecision(args.plan, clip_grad_norm=1.0)
    model = parallelize_module(build(args.layers).to(device), mesh["tp"], tp_plan(build(args.layers)))
    if args.dp:  # 2-D: each block its own FSDP2 unit over the "dp" dimension
        model = fully_shard_model(model, mp.plan, mesh=mesh["dp"], units=(Attention, MLP))
    model, opt = mp.prepare(model, fused_adamw(model, args.lr))

    start = 0
    if args.ckpt and os.path.exists(args.ckpt):
        start = int(load_checkpoint(args.ckpt, model=model, optimizers=[opt], mp=mp)["step"])
        if rank == 0:
            print(f"resumed from {args.ckpt} at step {start}", flush=True)
    dp_rank, per_rank = mesh["dp"].get_local_rank(), args.batch_size // dp
    losses = []
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(args.batch_size, SEQ, WIDTH, generator=g), 0.5 * torch.randn(args.batch_size, SEQ, WIDTH, generator=g)
        part = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        x, y = x[part].to(device), y[part].to(device)
        with mp.autocast():
            loss = F.mse_loss(model(x).float(), y)
        mp.backward(loss)
        result = mp.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)  # (a host read: this example's logging, not mixprec's step)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {losses[-1]:.4f} ({'stepped' if result.stepped else result.skip_reason})", flush=True)
    if args.ckpt:
        save_checkpoint(args.ckpt, model=model, optimizers=[opt], mp=mp, extra={"step": args.steps})
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
               for n, p in model.named_parameters()}
    if rank == 0 and args.out:
        torch.save({"weights": weights, "losses": losses}, args.out)


if __name__ == "__main__":
    main()

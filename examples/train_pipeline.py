"""Pipeline parallelism (``torch.distributed.pipelining``) under a precision plan.

Each process runs one stage (a slice of the blocks); the schedule (1F1B or GPipe) runs every
micro-batch's forward and backward inside ``schedule.step``; only the last stage has a loss::

    torchrun --nproc_per_node=2 examples/train_pipeline.py --plan fp16-mixed --schedule 1f1b

What a stage does with mixprec:

- the last stage gives the schedule ``mp.stage_loss(loss_fn)``: the loss times the loss scale,
  which the schedule backpropagates through every stage;
- every stage runs ``schedule.step`` inside ``mp.autocast()`` and ``mp.backward_context()``,
  then calls ``mp.stage_backward_done(stage, losses)`` (the losses on the last stage only) and
  ``mp.step()``: the skip decision (an inf on any stage skips every stage), the loss scale and
  the gradient norm (clipping uses the whole model's norm) are agreed over the stages by device
  all-reduces;
- each stage saves and loads its own checkpoint (``--ckpt``: one file per stage).

Every plan but fp8-mixed runs (fp8's amax all-reduce would mix different stages' layers).
The data is synthetic; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from mixprec import MixedPrecision, load_checkpoint, save_checkpoint

WIDTH, SEQ = 64, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="bf16-mixed")
    parser.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    parser.add_argument("--blocks", type=int, default=4, help="blocks in all, split evenly over the stages")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ckpt", default=None, help="checkpoint path prefix (each stage writes <prefix>.stage<k>)")
    parser.add_argument("--out", default=None,
                        help="each stage writes its weights (the last stage its scaled losses too) to <out>.stage<k>")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    train(args, torch.device(f"cuda:{torch.cuda.current_device()}") if cuda else torch.device("cpu"))
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.blocks % world:
        raise SystemExit(f"--blocks {args.blocks} does not split over {world} stages")
    torch.manual_seed(0)
    blocks = [Block() for _ in range(args.blocks)]
    per_stage = args.blocks // world
    module = nn.Sequential(*blocks[rank * per_stage:(rank + 1) * per_stage]).to(device)

    mp = MixedPrecision(args.plan, clip_grad_norm=1.0)
    module, opt = mp.prepare(module, torch.optim.AdamW(module.parameters(), lr=args.lr, fused=True))
    micro = args.batch_size // args.micro_batches
    dtype = next(module.parameters()).dtype if rank else torch.float32  # what the stage before sends
    stage = PipelineStage(module, rank, world, device, input_args=(torch.empty(micro, SEQ, WIDTH, dtype=dtype, device=device),))
    schedule_class = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    schedule = schedule_class(stage, n_microbatches=args.micro_batches, loss_fn=mp.stage_loss(loss_fn))

    path = f"{args.ckpt}.stage{rank}" if args.ckpt else None
    start = 0
    if path and os.path.exists(path):
        start = int(load_checkpoint(path, model=module, optimizers=[opt], mp=mp)["step"])
        if rank == 0:
            print(f"resumed from {args.ckpt}.stage* at step {start}", flush=True)
    losses = []
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(args.batch_size, SEQ, WIDTH, generator=g), 0.5 * torch.randn(args.batch_size, SEQ, WIDTH, generator=g)
        step_losses: list[torch.Tensor] = []
        log = stage.is_last and (step % 5 == 0 or step == args.steps - 1)
        # the schedule's losses are scaled: divided by the scale they were made with (a host read,
        # on logging steps only: this example's, not mixprec's step)
        scale = float(mp.scaler.get_scale()) if log and mp.scaler.is_enabled() else 1.0
        with mp.autocast(), mp.backward_context():
            if stage.is_first:
                schedule.step(x.to(device))
            elif stage.is_last:
                schedule.step(target=y.to(device), losses=step_losses)
            else:
                schedule.step()
        mp.stage_backward_done(stage, step_losses if stage.is_last else None)
        result = mp.step()
        if stage.is_last:
            losses.append(torch.stack([v.detach().float() for v in step_losses]).mean())
        if log:
            print(f"step {step}: loss {float(losses[-1]) / scale:.4f} "
                  f"({'stepped' if result.stepped else result.skip_reason})", flush=True)
    if path:
        save_checkpoint(path, model=module, optimizers=[opt], mp=mp, extra={"step": args.steps})
    if args.out:
        torch.save({"weights": {n: p.detach().float().cpu() for n, p in module.state_dict().items()},
                    "losses": [float(v) for v in losses]}, f"{args.out}.stage{rank}")


if __name__ == "__main__":
    main()

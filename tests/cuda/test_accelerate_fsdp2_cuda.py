"""Accelerate's FSDP2 plugin under mixprec on GPUs (one rank per GPU present, NCCL), where
Accelerate itself runs FSDP: the plans train and ``save_state`` / ``load_state`` resume bit for
bit. (On CPU the same path runs with Accelerate's state set to FSDP: tests/integrations.)"""

from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]
pytest.importorskip("accelerate")

PLANS = ("bf16-master", "bf16-kahan", "bf16-sr", "fp16-pure")
STEPS = 6


def _run(plan: str, out: str) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import FullyShardedDataParallelPlugin

    from mixprec import MixedPrecision
    from mixprec.cli.models import build_task
    from mixprec.integrations.accelerate import prepare

    def session():
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        task = build_task("mlp", size="small", seed=0)
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=[type(task.model.blocks[0]).__name__])
        acc = Accelerator(fsdp_plugin=plugin)
        assert acc.is_fsdp2, acc.distributed_type
        model = task.model  # left on the CPU, as the Trainer leaves it: mixprec shards it onto the GPU
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = prepare(acc, MixedPrecision(plan), model, opt)
        return acc, task, model, opt

    def train(acc, task, model, opt, steps: range) -> list[float]:
        losses = []
        per = 32 // acc.num_processes
        for step in steps:
            x, y = task.batch(32, torch.Generator().manual_seed(step))
            r = acc.process_index
            x, y = x[r * per : (r + 1) * per].to(acc.device), y[r * per : (r + 1) * per].to(acc.device)
            loss = task.criterion(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        return losses

    acc, task, model, opt = session()
    train(acc, task, model, opt, range(3))
    acc.save_state(os.path.join(out, plan))
    straight = train(acc, task, model, opt, range(3, STEPS))
    weights = {n: p.full_tensor().float().cpu() for n, p in model.named_parameters()}
    acc, task, model, opt = session()
    acc.load_state(os.path.join(out, plan))
    resumed = train(acc, task, model, opt, range(3, STEPS))
    same = all(torch.equal(p.full_tensor().float().cpu(), weights[n]) for n, p in model.named_parameters())
    return {"straight": straight, "resumed": resumed, "same": same,
            "sharded": type(next(model.parameters())).__name__}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    results = {plan: _run(plan, out) for plan in PLANS}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def test_accelerates_fsdp2_plugin_runs_the_plans_on_gpus_and_resumes_bit_for_bit():
    world = torch.cuda.device_count()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, port, tmp), nprocs=world, join=True, start_method="spawn")
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=True) for r in range(world)]
    for plan in PLANS:
        for run in ranks:
            assert run[plan]["sharded"] == "DTensor", plan
            assert run[plan]["resumed"] == run[plan]["straight"], plan
            assert run[plan]["same"], plan

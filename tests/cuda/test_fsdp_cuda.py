"""FSDP2 on a GPU with NCCL (one rank per GPU present): the plans without masters, bf16-master and fp8-mixed
(native fp8 GEMMs on the gathered weights where the GPU has them), and sharded checkpoints.

With one GPU the mesh has one rank: the all-gathers and reduce-scatters are NCCL's own
copies, and the run must equal the unsharded one on the same GPU within the plan's
tolerance; with more GPUs, ranks must agree. Sharded checkpoints resume bit for bit.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

PLANS = ("bf16-pure", "fp16-pure", "bf16-kahan", "bf16-sr", "bf16-master", "fp8-mixed")
STEPS = 6


def _train(plan_name: str, rank: int, world: int, *, shard: bool, ckpt: str | None = None) -> dict:
    from mixprec import MixedPrecision, get_plan, load_checkpoint, save_checkpoint
    from mixprec.cli.models import build_task
    from mixprec.distributed import fully_shard_model

    device = torch.device("cuda", rank)
    task = build_task("mlp", size="small", seed=0)
    plan = get_plan(plan_name)
    model = task.model.to(device)
    if plan.family in ("pure", "lowbit"):
        plan.convert_model(model)

    def session():
        m = MixedPrecision(plan, clip_grad_norm=1.0)
        net = fully_shard_model(model, plan, units=(type(model.blocks[0]),)) if shard else model
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
        net, opt, criterion = m.prepare(net, opt, criterion=task.criterion)
        return m, net, opt, criterion

    m, net, opt, criterion = session()
    losses = []
    per = 32 // world
    for step in range(STEPS):
        x, y = task.batch(32, torch.Generator().manual_seed(step))
        x, y = x[rank * per : (rank + 1) * per].to(device), y[rank * per : (rank + 1) * per].to(device)
        with m.autocast():
            loss = criterion(net(x), y)
        m.backward(loss)
        m.step()
        losses.append(float(loss))
        if ckpt is not None and step == 2:
            save_checkpoint(ckpt, model=net, optimizers=[opt], mp=m)
    full = {n: (p.full_tensor() if shard else p).detach().float().cpu() for n, p in net.named_parameters()}
    out = {"losses": losses, "params": full}
    if ckpt is not None:
        load_checkpoint(ckpt, model=net, optimizers=[opt], mp=m)
        resumed = []
        for step in range(3, STEPS):
            x, y = task.batch(32, torch.Generator().manual_seed(step))
            x, y = x[rank * per : (rank + 1) * per].to(device), y[rank * per : (rank + 1) * per].to(device)
            with m.autocast():
                loss = criterion(net(x), y)
            m.backward(loss)
            m.step()
            resumed.append(float(loss))
        out["resumed"] = resumed
        out["resumed_params"] = {n: p.full_tensor().detach().float().cpu() for n, p in net.named_parameters()}
    return out


def _worker(rank: int, world: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {name: _train(name, rank, world, shard=True, ckpt=os.path.join(out, f"{name}.pt")) for name in PLANS}
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_plans_without_masters_sharded_on_cuda_match_unsharded_and_resume_bit_for_bit():
    world = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "rdzv"), tmp), nprocs=world, join=True,
                           start_method="spawn")
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=True) for r in range(world)]
    for name in PLANS:
        runs = [r[name] for r in ranks]
        for run in runs[1:]:
            assert all(torch.equal(run["params"][k], runs[0]["params"][k]) for k in run["params"]), name
        # resumed at step 3 from the sharded checkpoint: the same losses and weights
        assert runs[0]["resumed"] == runs[0]["losses"][3:], name
        assert all(torch.equal(runs[0]["resumed_params"][k], runs[0]["params"][k]) for k in runs[0]["params"]), name
        reference = _train(name, 0, 1, shard=False)
        for k, ref in reference["params"].items():
            diff = (runs[0]["params"][k] - ref).abs()
            bound = 2e-3 + STEPS * 2.0**-8 * ref.abs() if name == "bf16-sr" else 1e-3 + 2.0**-7 * ref.abs()
            assert bool((diff <= bound).all()), (name, k, float(diff.max()))

"""Run by torchrun from test_lightning_model_parallel.py: Fabric with ModelParallelStrategy in
Fabric's documented order (the model set up alone, sharded by the strategy's parallelize_fn;
the optimizer built over the sharded parameters afterwards) through mixprec's ``setup`` and
``setup_optimizers``, and Fabric's own sharded checkpoint (``fabric.save`` / ``fabric.load``:
torch.distributed.checkpoint with get_optimizer_state_dict). 5 steps, save, 5 steps; load, the
same 5 steps again. Writes the losses and weights to ``<out>/rank<r>.pt``.

Usage: torchrun --nproc_per_node 2 fabric_sharded_checkpoint.py PLAN OUT [MOMENTUM]
(MOMENTUM: SGD's momentum, 0 by default; with it the optimizer holds state of its own, and a
LayerNorm, kept in fp32 by the plans, joins the model)
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402
from lightning.fabric.strategies import ModelParallelStrategy  # noqa: E402

from mixprec.distributed import fully_shard_model  # noqa: E402
from mixprec.integrations.lightning import MixprecPrecision, setup, setup_optimizers  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from lightning_model_parallel import MICRO, data, net  # noqa: E402


def main() -> None:
    plan, out = sys.argv[1:3]
    momentum = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0

    def parallelize(model: torch.nn.Module, device_mesh) -> torch.nn.Module:
        return fully_shard_model(model, plan, mesh=device_mesh["data_parallel"], units=(torch.nn.Linear,))

    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[MixprecPrecision(plan)])
    fabric.launch()
    module = net()
    if momentum:
        module.append(torch.nn.LayerNorm(4))
    model = setup(fabric, module)
    opt = setup_optimizers(fabric, torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum))
    x, y = data()
    rank = fabric.global_rank

    def run(steps: range) -> list[float]:
        losses = []
        for step in steps:
            rows = torch.arange(step * 2 * MICRO, (step + 1) * 2 * MICRO)[rank::2]
            loss = (model(x[rows]).float() - y[rows]).pow(2).mean()
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        return losses

    def weights() -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach().clone() for n, p in model.module.named_parameters()}

    first = run(range(5))
    state = {"model": model, "optimizer": opt}
    fabric.save(os.path.join(out, "ckpt"), state)
    straight, after = run(range(5, 10)), weights()
    if momentum:  # as a new run would have it: no optimizer state until the load creates it
        opt.optimizer.state.clear()
        assert not opt.optimizer.state
    fabric.load(os.path.join(out, "ckpt"), state)
    resumed = run(range(5, 10))
    torch.save({"first": first, "straight": straight, "resumed": resumed, "after": after, "resumed_weights": weights()},
               os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()

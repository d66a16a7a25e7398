"""Run by torchrun from test_lightning_model_parallel.py: Fabric with ModelParallelStrategy in
Fabric's documented order (model set up alone, sharded by the strategy's parallelize_fn; the
optimizer built over the sharded parameters afterwards), through mixprec's ``setup`` and
``setup_optimizers``; 10 steps on 2 gloo ranks. Writes each rank's losses and final full
parameters to ``<out>/rank<r>.pt``.

Usage: torchrun --nproc_per_node 2 fabric_model_parallel.py PLAN OUT
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
from lightning_model_parallel import MICRO, STEPS, data, net  # noqa: E402


def main() -> None:
    plan, out = sys.argv[1:3]

    def parallelize(model: torch.nn.Module, device_mesh) -> torch.nn.Module:
        return fully_shard_model(model, plan, mesh=device_mesh["data_parallel"], units=(torch.nn.Linear,))

    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[MixprecPrecision(plan)])
    fabric.launch()
    model = setup(fabric, net())
    opt = setup_optimizers(fabric, torch.optim.SGD(model.parameters(), lr=0.05))
    x, y = data()
    rank = fabric.global_rank
    losses = []
    for step in range(STEPS):
        rows = torch.arange(step * 2 * MICRO, (step + 1) * 2 * MICRO)[rank::2]
        loss = (model(x[rows]).float() - y[rows]).pow(2).mean()
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    params = {n: p.full_tensor().detach().clone() for n, p in model.module.named_parameters()}
    torch.save({"losses": losses, "params": params}, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()

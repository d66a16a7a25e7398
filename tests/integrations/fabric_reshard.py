"""Run by torchrun from test_lightning_sharded_plans.py: Fabric's sharded checkpoint
(``fabric.save`` / ``fabric.load``, torch.distributed.checkpoint underneath) saved by one number
of ranks and loaded by another. For each plan: ``save`` trains 5 steps and saves; ``load`` loads
into a fresh run on this world size. Each writes the state it holds then, whole (every DTensor
gathered; stochastic rounding's per-shard noise left out), and ``load`` the losses of 3 more steps.

Usage: torchrun --nproc_per_node N fabric_reshard.py save|load CKPTS OUT (the checkpoints in the folder CKPTS;
each rank's result in ``OUT/rank<r>.pt``)
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

from tests._dist import whole  # noqa: E402

PLANS = ("bf16-kahan", "bf16-sr", "bf16-master")


def one(plan: str, mode: str, ckpts: str, world: int) -> dict:
    """Save (after 5 steps) or load ``plan``'s checkpoint on ``world`` ranks; the state then, whole."""

    def parallelize(model: torch.nn.Module, device_mesh) -> torch.nn.Module:
        return fully_shard_model(model, plan, mesh=device_mesh["data_parallel"], units=(torch.nn.Linear,))

    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=world, tensor_parallel_size=1)
    plugin = MixprecPrecision(plan)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, plugins=[plugin])
    fabric.launch()
    module = net()
    module.append(torch.nn.LayerNorm(4))  # an fp32 layer (bf16 plans keep norms in fp32)
    model = setup(fabric, module)
    opt = setup_optimizers(fabric, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    x, y = data()
    rank = fabric.global_rank
    ckpt = os.path.join(ckpts, plan)

    def train(steps: range) -> list[float]:
        losses = []
        for step in steps:
            rows = torch.arange(step * 2 * MICRO, (step + 1) * 2 * MICRO)[rank::world]
            loss = (model(x[rows]).float() - y[rows]).pow(2).mean()
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        return losses

    if mode == "save":
        train(range(5))
        fabric.save(ckpt, {"model": model, "optimizer": opt, "mixprec": plugin.state_dict()})
    else:
        state = {"model": model, "optimizer": opt, "mixprec": None}
        fabric.load(ckpt, state)
        plugin.load_state_dict(state["mixprec"])
    result = {"model": whole(model.module.state_dict()), "optimizer": whole(opt.optimizer.state_dict()),
              "mixprec": whole(plugin.state_dict())}
    if mode == "load":
        result["next"] = train(range(5, 8))
    return result


def main() -> None:
    mode, ckpts, out = sys.argv[1:4]
    world = int(os.environ["WORLD_SIZE"])
    results = {plan: one(plan, mode, ckpts, world) for plan in PLANS}
    torch.save(results, os.path.join(out, f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    main()

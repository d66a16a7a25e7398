"""Run by torchrun from test_fabric_model_parallel.py: Fabric's joint setup (mixprec's
``setup(fabric, model, optimizer)``, the optimizer built before the model was sharded) under a
ModelParallelStrategy whose parallelize_fn shards the model, against Fabric's documented order
(``setup(fabric, model)``, then the optimizer over the sharded parameters through
``setup_optimizers``), every cell in one launch on 2 gloo ranks:

- ``joint PLAN`` / ``separate PLAN``: the two orders, sharded by ``fully_shard_model``; a model
  with an fp32 LayerNorm, SGD with momentum and two param groups (the weights, then the biases
  at another learning rate: neither in the model's order), 10 steps;
- ``joint fully_shard`` / ``separate fully_shard``: bf16-mixed, sharded by plain ``fully_shard``
  (the issue's reproduction);
- ``joint stepped``: the optimizer stepped once before setup (momentum buffers of the unsharded
  parameters): refused;
- ``fabric.setup``: Fabric's own ``fabric.setup(model, optimizer)`` with the plugin (mixprec
  never sees the optimizer): refused at its first step.

Writes ``{cell: result}`` (losses, full weights, the groups' learning rates; or ``{"error": ...}``)
to ``<out>/rank<r>.pt``.

Usage: torchrun --nproc_per_node 2 fabric_joint_setup.py OUT
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable

import torch

warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402
from lightning.fabric.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from mixprec.distributed import fully_shard_model  # noqa: E402
from mixprec.integrations.lightning import MixprecPrecision, setup, setup_optimizers  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from lightning_model_parallel import MICRO, STEPS, data, net  # noqa: E402

PLANS = ("bf16-mixed", "bf16-master", "bf16-kahan", "bf16-sr")


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    return torch.optim.SGD([
        {"params": [p for n, p in named if n.endswith("weight")]},
        {"params": [p for n, p in named if n.endswith("bias")], "lr": 0.02},
    ], lr=0.05, momentum=0.9)


def run(plan: str, order: str, shard: str = "mixprec") -> dict:
    """10 steps after ``order`` ("joint", "separate", "stepped": joint with an optimizer that already
    stepped, "fabric": Fabric's own joint fabric.setup) with ``shard`` ("mixprec": fully_shard_model,
    "fully_shard": plain fully_shard) as the parallelize_fn."""

    def parallelize(model: torch.nn.Module, device_mesh) -> torch.nn.Module:
        mesh = device_mesh["data_parallel"]
        if shard == "mixprec":
            return fully_shard_model(model, plan, mesh=mesh, units=(torch.nn.Linear,))
        for layer in (*(m for m in model if isinstance(m, torch.nn.Linear)), model):
            fully_shard(layer, mesh=mesh)
        return model

    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=1)
    plugin = MixprecPrecision(plan)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
    fabric.launch()
    module = net()
    module.append(torch.nn.LayerNorm(4))
    x, y = data()
    rank = fabric.global_rank
    try:
        if order == "separate":
            model = setup(fabric, module)
            opt = setup_optimizers(fabric, _optimizer(model))
        else:
            opt = _optimizer(module)
            if order == "stepped":
                module(x[:2]).sum().backward()
                opt.step()
                opt.zero_grad()
            model, opt = fabric.setup(module, opt) if order == "fabric" else setup(fabric, module, opt)
        losses = []
        for step in range(STEPS):
            rows = torch.arange(step * 2 * MICRO, (step + 1) * 2 * MICRO)[rank::2]
            loss = (model(x[rows]).float() - y[rows]).pow(2).mean()
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {"losses": losses, "lrs": [g["lr"] for g in opt.param_groups],
            "weights": {n: p.full_tensor().detach().clone() for n, p in model.module.named_parameters()}}


def cells() -> dict[str, Callable[[], dict]]:
    out: dict[str, Callable[[], dict]] = {}
    for plan in PLANS:
        for order in ("joint", "separate"):
            out[f"{order} {plan}"] = lambda plan=plan, order=order: run(plan, order)
    out["joint fully_shard"] = lambda: run("bf16-mixed", "joint", "fully_shard")
    out["separate fully_shard"] = lambda: run("bf16-mixed", "separate", "fully_shard")
    out["joint stepped"] = lambda: run("bf16-master", "stepped")
    out["fabric.setup"] = lambda: run("bf16-mixed", "fabric")
    return out


def main() -> None:
    results = {name: cell() for name, cell in cells().items()}
    torch.save(results, os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    main()

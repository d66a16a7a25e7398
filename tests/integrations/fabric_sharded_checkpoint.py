"""Run by torchrun from test_fabric_model_parallel.py (and its ``run`` by
lightning_sharded_plans.py): Fabric with ModelParallelStrategy in Fabric's documented order
(the model set up alone, sharded by the strategy's parallelize_fn; the optimizer built over the
sharded parameters afterwards) through mixprec's ``setup`` and ``setup_optimizers``, and
Fabric's own sharded checkpoint (``fabric.save`` / ``fabric.load``: torch.distributed.checkpoint
with get_optimizer_state_dict, the plugin's state, with the loss scale, as metadata beside them). 5 steps, save, 5 steps; load,
the same 5 steps again. Writes the losses, weights, skipped steps and loss scales to
``<out>/rank<r>.pt``.

Usage: torchrun --nproc_per_node 2 fabric_sharded_checkpoint.py PLAN OUT [MOMENTUM [INF_STEP]]
(MOMENTUM: SGD's momentum, 0 by default; with it the optimizer holds state of its own, and a
LayerNorm, kept in fp32 by the plans with fp32 norm layers, joins the model. INF_STEP: after that
step's backward, in the run that goes on and in the resumed one, rank 1 plants an inf in its own
shard of the first weight's gradient; the other rank's shards stay finite)
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


def _graphs() -> int:
    """How many frames torch.compile has compiled in this process so far."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def run(plan: str, ckpt: str, momentum: float = 0.0, inf_step: int = -1, compile: bool = False) -> dict:
    """Train, save at ``ckpt`` after 5 steps, go on; load and train the last 5 steps again.
    ``compile``: the sharded model is compiled in place (``nn.Module.compile``) in the parallelize_fn."""

    def parallelize(model: torch.nn.Module, device_mesh) -> torch.nn.Module:
        model = fully_shard_model(model, plan, mesh=device_mesh["data_parallel"], units=(torch.nn.Linear,))
        if compile:
            model.compile()
        return model

    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=1)
    plugin = MixprecPrecision(plan)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
    fabric.launch()
    module = net()
    if momentum:
        module.append(torch.nn.LayerNorm(4))
    model = setup(fabric, module)
    opt = setup_optimizers(fabric, torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum))
    x, y = data()
    rank = fabric.global_rank
    skipped: list[bool] = []
    scales: list[float] = []

    def train(steps: range) -> list[float]:
        losses = []
        for step in steps:
            rows = torch.arange(step * 2 * MICRO, (step + 1) * 2 * MICRO)[rank::2]
            loss = (model(x[rows]).float() - y[rows]).pow(2).mean()
            fabric.backward(loss)
            if step == inf_step and rank == 1:  # this rank's own shard only
                model.module[0].weight.grad.to_local().view(-1)[0] = float("inf")
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
            assert plugin.last_result is not None
            skipped.append(bool(plugin.last_result.skipped))
            scales.append(float(plugin.mp.scaler.get_scale()))
        return losses

    def weights() -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach().clone() for n, p in model.module.named_parameters()}

    first = train(range(5))
    fabric.save(ckpt, {"model": model, "optimizer": opt, "mixprec": plugin.state_dict()})
    straight, after = train(range(5, 10)), weights()
    if momentum:  # as a new run would have it: no optimizer state until the load creates it
        opt.optimizer.state.clear()
        assert not opt.optimizer.state
    state = {"model": model, "optimizer": opt, "mixprec": None}
    fabric.load(ckpt, state)
    plugin.load_state_dict(state["mixprec"])  # the loss scale and step counters
    resumed = train(range(5, 10))
    return {"first": first, "straight": straight, "resumed": resumed, "after": after, "resumed_weights": weights(),
            "layers": sorted({type(m).__name__ for m in model.module.modules()}),
            "graphs": _graphs(),
            "skipped": skipped, "scales": scales}


def main() -> None:
    plan, out = sys.argv[1:3]
    momentum = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    inf_step = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    result = run(plan, os.path.join(out, "ckpt"), momentum, inf_step)
    torch.save(result, os.path.join(out, f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    main()

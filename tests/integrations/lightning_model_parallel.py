"""Run by torchrun from test_lightning_model_parallel.py (and its ``fit`` by
lightning_sharded_plans.py): Lightning's ModelParallelStrategy with the documented
``configure_model`` pattern (``fully_shard(self.net...)`` inside the module), the mixprec
plugin, 10 steps on 2 gloo ranks. Writes each rank's losses, final full parameters, or the
error it raised, to ``<out>/rank<r>.pt``.

Usage: torchrun --nproc_per_node 2 lightning_model_parallel.py PLAN POLICY OUT [INF_STEP]
(POLICY: "policy" passes mp_policy=fsdp_policy(PLAN) to fully_shard, "none" passes nothing,
"mixprec" shards with mixprec.distributed.fully_shard_model(self.net, PLAN, mesh=...)).
INF_STEP: after that step's backward, rank 1 plants an inf in its own shard of the first
weight's gradient (the other rank's shards stay finite); each rank also records, per step,
whether mixprec skipped it and the loss scale after it.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from mixprec.distributed import fsdp_policy, fully_shard_model  # noqa: E402
from mixprec.integrations.lightning import MixprecPrecision  # noqa: E402

STEPS, MICRO = 10, 4


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(STEPS * 2 * MICRO, 16, generator=g), torch.randn(STEPS * 2 * MICRO, 4, generator=g)


class Sharded(L.LightningModule):
    def __init__(self, policy: dict, inf_step: int = -1, root: bool = False) -> None:
        super().__init__()
        self.net = net()
        self.policy = policy
        self.inf_step = inf_step
        self.root = root  # the LightningModule itself the FSDP root, not self.net
        self.losses: list[float] = []
        self.skipped: list[bool] = []
        self.scales: list[float] = []

    def on_after_backward(self) -> None:
        if self.global_step == self.inf_step and self.global_rank == 1:  # one rank's own shard only
            grad = self.net[0].weight.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = float("inf")

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        plugin = self.trainer.precision_plugin
        self.skipped.append(bool(plugin.last_result.skipped))
        self.scales.append(float(plugin.mp.scaler.get_scale()))

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        if "plan" in self.policy:  # the plans without masters: mixprec converts, then shards
            fully_shard_model(self if self.root else self.net, self.policy["plan"], mesh=mesh, units=(torch.nn.Linear,))
            return
        for layer in (self.net[0], self.net[2], self if self.root else self.net):
            fully_shard(layer, mesh=mesh, **self.policy)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.net(x).float() - y).pow(2).mean()
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(plan: str, policy_arg: str, inf_step: int = -1, root: bool = False) -> dict:
    """One run of the Trainer; its losses, skips, scales and full parameters (or the error it raised).
    ``root``: the LightningModule itself is sharded as the FSDP root (Lightning's other pattern)."""
    policy = ({"mp_policy": fsdp_policy(plan)} if policy_arg == "policy" else
              {"plan": plan} if policy_arg == "mixprec" else {})
    x, y = data()
    rank = int(os.environ["RANK"])
    # rank r gets rows r, r + 2, ... of each global batch of 2 * MICRO (a DistributedSampler's split)
    mine = torch.arange(x.shape[0]).view(STEPS, 2 * MICRO)[:, rank::2].reshape(-1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[mine], y[mine]), batch_size=MICRO)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        plugins=[MixprecPrecision(plan)], max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )
    module = Sharded(policy, inf_step, root)
    try:
        trainer.fit(module, loader)
    except ValueError as exc:
        return {"error": str(exc)}
    return {
        "losses": module.losses,
        "skipped": module.skipped,
        "scales": module.scales,
        "params": {n: p.full_tensor().detach().clone() for n, p in module.net.named_parameters()},
        "layers": sorted({type(m).__name__ for m in module.net.modules()}),
    }


def main() -> None:
    plan, policy_arg, out = sys.argv[1:4]
    inf_step = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    result = fit(plan, policy_arg, inf_step)
    torch.save(result, os.path.join(out, f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    main()

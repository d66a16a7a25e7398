"""Run by torchrun from test_lightning_model_parallel.py (and its ``resume`` by
lightning_sharded_plans.py): the Lightning Trainer's own sharded checkpoint under
ModelParallelStrategy (the documented ``configure_model`` sharding) with the mixprec plugin.
Two epochs of 5 steps, a checkpoint at the end of the first (what ModelCheckpoint does); then a
new Trainer and module resume from it (``fit(ckpt_path=...)``) and train the second epoch
again. Writes each rank's losses and final full weights of both runs, or the error it raised,
to ``<out>/rank<r>.pt``.

Usage: torchrun --nproc_per_node 2 lightning_trainer_checkpoint.py PLAN POLICY OUT
(POLICY as in lightning_model_parallel.py: "policy" or "mixprec")
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

from mixprec.distributed import fsdp_policy  # noqa: E402
from mixprec.integrations.lightning import MixprecPrecision  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from lightning_model_parallel import MICRO, Sharded, data  # noqa: E402

EPOCH = 5  # steps per epoch


class WithMomentum(Sharded):
    """Optimizer state of its own to resume (momentum buffers, sharded like the weights), and a
    LayerNorm, which the plans but pure ones keep in fp32 (its state is the inner optimizer's own)."""

    def __init__(self, policy: dict) -> None:
        super().__init__(policy)
        self.net.append(torch.nn.LayerNorm(4))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class SaveAtEpochEnd(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


def _trainer(plan: str, callbacks: list) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        plugins=[MixprecPrecision(plan)], max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False, callbacks=callbacks,
    )


def resume(plan: str, policy_arg: str, ckpt: str) -> dict:
    """The run that goes on and the run resumed from ``ckpt`` (written at the first epoch's end):
    their second-epoch losses, final weights and loss-scaler states (or the error raised)."""
    policy = {"mp_policy": fsdp_policy(plan)} if policy_arg == "policy" else {"plan": plan}
    x, y = data()
    rank = int(os.environ["RANK"])
    # an epoch: the first EPOCH global batches, rank r taking rows r, r + 2, ... of each
    mine = torch.arange(EPOCH * 2 * MICRO).view(EPOCH, 2 * MICRO)[:, rank::2].reshape(-1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[mine], y[mine]), batch_size=MICRO)

    def weights(module: Sharded) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach().clone() for n, p in module.net.named_parameters()}

    try:
        straight = WithMomentum(policy)
        first = _trainer(plan, [SaveAtEpochEnd(ckpt)])
        first.fit(straight, loader)
        resumed = WithMomentum(policy)
        second = _trainer(plan, [])
        second.fit(resumed, loader, ckpt_path=ckpt)
        return {
            "straight": straight.losses[EPOCH:], "resumed": resumed.losses,
            "after": weights(straight), "resumed_weights": weights(resumed),
            "scaler": [t.precision_plugin.mp.scaler.state_dict() for t in (first, second)],
        }
    except Exception as exc:  # reported to the test, which shows it
        return {"error": f"{type(exc).__name__}: {exc}"}


def main() -> None:
    plan, policy_arg, out = sys.argv[1:4]
    result = resume(plan, policy_arg, os.path.join(out, "ckpt"))
    torch.save(result, os.path.join(out, f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    main()

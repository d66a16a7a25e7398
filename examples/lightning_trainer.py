"""A mixprec plan in the Lightning Trainer and in Fabric.

    python examples/lightning_trainer.py              # fp16-mixed
    python examples/lightning_trainer.py bf16-master  # any plan name

Runs in seconds on a CPU with a small generated regression task.
"""

from __future__ import annotations

import sys
import warnings

import lightning as L
import torch

from mixprec.integrations.lightning import MixprecPrecision, setup


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                                       torch.nn.Linear(64, 1))
        self.grad_norms: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def on_before_optimizer_step(self, optimizer):
        # true gradients here (unscaled, in the fp32 masters under master plans)
        grads = [p.grad.float().norm() for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.grad_norms.append(float(torch.linalg.vector_norm(torch.stack(grads))))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(n: int = 512) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = x[:, :1] * 2 - x[:, 1:2]
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def main(plan: str = "fp16-mixed") -> None:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model, plugin = Regressor(), MixprecPrecision(plan)
    trainer = L.Trainer(plugins=[plugin], accelerator="cpu", max_epochs=2, gradient_clip_val=1.0,
                        accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data())
    mp = plugin.mp
    print(f"Trainer, plan {mp.plan.name}: {mp.optimizer_steps} steps, {mp.scaler.skipped_steps} skipped, "
          f"lr {trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]:.2e}, "
          f"last true grad norm {model.grad_norms[-1]:.4f}")

    # Fabric: setup() wraps the optimizer for the plan before Fabric sees it.
    fabric = L.Fabric(plugins=[MixprecPrecision(plan)], accelerator="cpu", devices=1)
    net = Regressor().net
    net, opt = setup(fabric, net, torch.optim.AdamW(net.parameters(), lr=3e-3))
    for x, y in data():
        loss = torch.nn.functional.mse_loss(net(x).float(), y)
        fabric.backward(loss)
        fabric._precision.clip_grad_norm_(opt, 1.0)
        opt.step()
        opt.zero_grad()
    print(f"Fabric, plan {plan}: final loss {loss.item():.4f}, "
          f"{fabric._precision.mp.optimizer_steps} steps")


if __name__ == "__main__":
    main(*sys.argv[1:2])

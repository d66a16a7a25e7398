"""A mixprec plan under an Accelerate loop with gradient accumulation, clipping, save/load_state.

    python examples/accelerate_loop.py               # fp16-mixed
    python examples/accelerate_loop.py bf16-master   # any plan name

Runs in seconds on a CPU.
"""

from __future__ import annotations

import sys
import tempfile

import torch
from accelerate import Accelerator

from mixprec import MixedPrecision
from mixprec.integrations.accelerate import prepare


def main(plan: str = "fp16-mixed") -> None:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)  # mixed_precision stays "no"
    mp = MixedPrecision(plan)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                                torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1] * 2 - x[:, 1:2]), batch_size=16)

    # mixprec converts the model and wraps the optimizer, then Accelerate prepares them
    model, opt, sched, loader = prepare(accelerator, mp, model, opt, sched, loader)
    for i, (xb, yb) in enumerate(loader):
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(xb).float(), yb)  # forward runs under the plan
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)  # the true norm
            opt.step()  # mixprec's step at accumulation boundaries only
            sched.step()  # held on skipped steps
            opt.zero_grad()
        if i == 31:
            ckpt = tempfile.mkdtemp(prefix="mixprec-accelerate-")
            accelerator.save_state(ckpt)  # includes mixprec's loss scale and counters
    print(f"plan {mp.plan.name}: {len(loader)} micro-batches -> {mp.optimizer_steps} optimizer steps, "
          f"{mp.scaler.skipped_steps} skipped, loss {loss.item():.4f}, last grad norm {float(norm):.4f}, "
          f"lr {sched.get_last_lr()[0]:.2e}")
    accelerator.load_state(ckpt)
    print(f"loaded the step-8 state back: optimizer steps {mp.optimizer_steps}")


if __name__ == "__main__":
    main(*sys.argv[1:2])

"""Train a tiny GPT-2 with transformers.Trainer under a mixprec plan, save, resume.

    python examples/hf_trainer.py                 # fp16-mixed: loss scaling, also on CPU
    python examples/hf_trainer.py bf16-master     # any plan name

Runs in seconds on a CPU: the model and the data are generated, nothing is downloaded.
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers.utils import logging as hf_logging

from mixprec.integrations.transformers import MixprecTrainer


def main(plan: str = "fp16-mixed") -> None:
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                       bos_token_id=0, eos_token_id=0))
    tokens = torch.randint(0, 64, (80, 8))
    dataset = [{"input_ids": t, "labels": t} for t in tokens]
    out = tempfile.mkdtemp(prefix="mixprec-hf-")
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=10,
        learning_rate=1e-3, max_grad_norm=1.0, logging_steps=5, save_steps=5, report_to=[], use_cpu=True,
        disable_tqdm=True,
    )
    trainer = MixprecTrainer(model=model, args=args, train_dataset=dataset, precision=plan)
    trainer.train()
    mp = trainer.mp
    print(f"plan {mp.plan.name}: {mp.optimizer_steps} optimizer steps, {mp.scaler.skipped_steps} skipped, "
          f"loss scale {mp.scaler.get_scale():g}")
    for row in trainer.state.log_history:
        if "loss" in row:
            print(f"  step {row['step']:>2}  loss {row['loss']:.4f}  grad_norm {row['grad_norm']:.4f}")

    # A new trainer resumes from the step-5 checkpoint: model, optimizer (fp32 masters),
    # scheduler, RNG and mixprec's loss scale and counters.
    args.max_steps = 10
    resumed = MixprecTrainer(model=GPT2LMHeadModel(model.config), args=args, train_dataset=dataset, precision=plan)
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-5"))
    same = all(torch.equal(a, b) for a, b in zip(resumed.model.state_dict().values(),
                                                  trainer.model.state_dict().values(), strict=True))
    print(f"resumed from checkpoint-5: final weights identical to the uninterrupted run: {same}")


if __name__ == "__main__":
    main(*sys.argv[1:2])

"""Run by torchrun from test_trainer_fsdp2.py: MixprecTrainer with ``fsdp=`` and
``fsdp_config={"fsdp_version": 2}`` on 2 gloo ranks. The Trainer's Accelerator runs FSDP only on
GPUs; so that its FSDP2 path runs here, each Accelerator created with an FSDP plugin gets its state
set to FSDP, as Accelerate sets it on GPUs. For each plan: 10 steps with a checkpoint at step 5
(the Trainer's own: a full state dict, or torch.distributed.checkpoint's shards), then a new Trainer
resumed from it; writes the losses and gathered weights of both to ``<out>/rank<r>.pt``.

Usage: torchrun --nproc_per_node 2 trainer_fsdp2.py CKPT OUT
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings

import torch

warnings.filterwarnings("ignore")

import accelerate  # noqa: E402
from transformers import GPT2LMHeadModel, TrainingArguments  # noqa: E402

from mixprec.integrations.transformers import MixprecTrainer  # noqa: E402
from tests.integrations._common import run_fsdp  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from transformers_load_sharded import rows  # noqa: E402

#: (plan, the checkpoint's state_dict_type): the Trainer's default keeps the full optimizer state in one
#: file written by rank 0, the sharded one each rank's part (stochastic rounding's noise is a call
#: count every rank shares: either keeps it)
RUNS = (("bf16-master", "FULL_STATE_DICT"), ("bf16-kahan", "FULL_STATE_DICT"), ("bf16-kahan", "SHARDED_STATE_DICT"),
        ("bf16-sr", "FULL_STATE_DICT"))
STEPS, PER_RANK = 10, 4

def _run_fsdp_as_on_gpus() -> None:
    """Every Accelerator made with an FSDP plugin from now on, in this process, runs FSDP."""
    init = accelerate.Accelerator.__init__

    def as_on_gpus(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None:
            run_fsdp(self, plugin)

    accelerate.Accelerator.__init__ = as_on_gpus


def train(ckpt: str, plan: str, kind: str, out: str, resume: str | None = None) -> dict:
    model = GPT2LMHeadModel.from_pretrained(ckpt)
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=PER_RANK, max_steps=STEPS, report_to=[], use_cpu=True,
        save_strategy="steps", save_steps=5, disable_tqdm=True, max_grad_norm=1.0, learning_rate=1e-3,
        logging_steps=1, dataloader_drop_last=True, train_sampling_strategy="sequential",
        fsdp="full_shard",
        fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"], "state_dict_type": kind},
    )
    # (the Trainer's own AdamW: under FSDP it builds the optimizer itself, over the sharded model)
    trainer = MixprecTrainer(model=model, args=args, train_dataset=rows(), precision=plan)
    trainer.train(resume_from_checkpoint=resume)
    return {
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "params": {n: p.full_tensor().detach().float().clone() for n, p in trainer.model.named_parameters()},
        "sharded": type(next(trainer.model.parameters())).__name__,
        "dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
    }


def main() -> None:
    ckpt, out = sys.argv[1:3]
    _run_fsdp_as_on_gpus()
    results = {}
    for plan, kind in RUNS:
        folder = os.path.join(out, f"{plan}-{kind}")
        straight = train(ckpt, plan, kind, folder)
        resumed = train(ckpt, plan, kind, folder + "-resumed", resume=os.path.join(folder, "checkpoint-5"))
        results[f"{plan} {kind}"] = {"straight": straight, "resumed": resumed}
    # a checkpoint without mixprec.pt (a plain Trainer's) under a plan without masters: refused
    plain = os.path.join(out, "plain-checkpoint")
    if int(os.environ["RANK"]) == 0:
        shutil.copytree(os.path.join(out, "bf16-kahan-FULL_STATE_DICT", "checkpoint-5"), plain)
        os.remove(os.path.join(plain, "mixprec.pt"))
    torch.distributed.barrier()
    try:
        train(ckpt, "bf16-kahan", "FULL_STATE_DICT", os.path.join(out, "plain-resumed"), resume=plain)
        results["plain checkpoint"] = "resumed"
    except ValueError as exc:
        results["plain checkpoint"] = str(exc)
    torch.save(results, os.path.join(out, f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    main()

"""Run by torchrun from test_transformers_sharded.py: transformers' load-time sharding
(``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))``) with MixprecTrainer,
for a mixed plan (fp32 load), a master plan (``fsdp_mixed_precision=True``: bf16 gathers) and a
Kahan plan (loaded in bf16: the weights are the shards). 4 steps on 2 gloo ranks each; writes
each rank's gathered parameters and losses to ``<out>/rank<r>.pt``.

Usage: torchrun --nproc_per_node 2 transformers_load_sharded.py CKPT OUT
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")

from transformers import DistributedConfig, GPT2LMHeadModel, TrainingArguments  # noqa: E402

from mixprec.integrations.transformers import MixprecTrainer  # noqa: E402

#: plan -> how it is loaded
LOADS = {
    "bf16-mixed": {},
    "bf16-master": {"fsdp_mixed_precision": True},
    "bf16-kahan": {"dtype": torch.bfloat16},
}
STEPS, PER_RANK = 4, 4


def rows() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": r, "labels": r} for r in torch.randint(0, 32, (STEPS * PER_RANK * 2, 8), generator=g)]


def train(model: torch.nn.Module, plan: str, out: str, per_device: int, data: list) -> list[float]:
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=per_device, max_steps=STEPS, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, max_grad_norm=1.0,
                             learning_rate=1e-2, logging_steps=1, dataloader_drop_last=True,
                             train_sampling_strategy="sequential")
    # SGD: an update proportional to the gradient, so rounding apart the runs stay close (Adam's
    # first steps move every weight by ~lr whatever the gradient's size, flipping with its sign)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    trainer = MixprecTrainer(model=model, args=args, train_dataset=data, precision=plan, optimizers=(opt, None))
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main() -> None:
    ckpt, out = sys.argv[1:3]
    rank = int(os.environ["RANK"])
    results = {}
    for plan, load in LOADS.items():
        dtype = load.get("dtype")
        config = DistributedConfig(fsdp_size=2, fsdp_mixed_precision=bool(load.get("fsdp_mixed_precision")))
        model = GPT2LMHeadModel.from_pretrained(ckpt, distributed_config=config, **({"dtype": dtype} if dtype else {}))
        losses = train(model, plan, out, PER_RANK, rows())
        results[plan] = {
            "losses": losses,
            "params": {n: p.full_tensor().detach().float().clone() for n, p in model.named_parameters()},
        }
    # saving through the Trainer would keep rank 0's shard of the optimizer alone: refused (by transformers)
    model = GPT2LMHeadModel.from_pretrained(ckpt, distributed_config=DistributedConfig(fsdp_size=2))
    args = TrainingArguments(output_dir=out, save_strategy="steps", use_cpu=True, report_to=[])
    try:
        MixprecTrainer(model=model, args=args, train_dataset=rows(), precision="bf16-mixed")
        results["trainer save"] = "accepted"
    except ValueError as exc:
        results["trainer save"] = str(exc)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()

"""Run by torchrun from test_transformers_sharded.py: transformers' load-time sharding
(``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))``) with MixprecTrainer,
for the mixed plans (fp32 load), a master plan (``fsdp_mixed_precision=True``: bf16 gathers) and
the plans without masters (loaded in their dtype: the weights are the shards). STEPS steps on 2
gloo ranks each; under the fp16 plans rank 1 plants an inf in its own shard of a gradient at
INF_STEP. Writes each rank's gathered parameters, losses, skipped steps and loss scales to
``<out>/rank<r>.pt``, with what MixprecTrainer said of a Trainer that would save and of
``fp16-master`` (load-time sharding gathers no fp16).

Usage: torchrun --nproc_per_node 2 transformers_load_sharded.py CKPT OUT
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")

from transformers import DistributedConfig, GPT2LMHeadModel, TrainerCallback, TrainingArguments  # noqa: E402

from mixprec.integrations.transformers import MixprecTrainer  # noqa: E402

#: plan -> how it is loaded
LOADS = {
    "bf16-mixed": {},
    "bf16-master": {"fsdp_mixed_precision": True},
    "bf16-kahan": {"dtype": torch.bfloat16},
    "bf16-sr": {"dtype": torch.bfloat16},
    "bf16-pure": {"dtype": torch.bfloat16},
    "fp16-mixed": {},
    "fp16-pure": {"dtype": torch.float16},
}
STEPS, PER_RANK = 10, 4
#: the step whose gradient overflows under the fp16 plans (on one rank when sharded)
INF_STEP = 3


def rows() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": r, "labels": r} for r in torch.randint(0, 32, (STEPS * PER_RANK * 2, 8), generator=g)]


def load(ckpt: str, plan: str, sharded: bool) -> torch.nn.Module:
    how = LOADS[plan]
    kwargs: dict = {"dtype": how["dtype"]} if "dtype" in how else {}
    if sharded:
        kwargs["distributed_config"] = DistributedConfig(fsdp_size=2, fsdp_mixed_precision=bool(how.get("fsdp_mixed_precision")))
    return GPT2LMHeadModel.from_pretrained(ckpt, **kwargs)


class Overflowing(MixprecTrainer):
    """After the backward of step ``inf_step``, an inf in the first element of this rank's
    shard of the token embedding's gradient (rank 1 only when the model is sharded); records
    whether each step was skipped and the loss scale after it."""

    def __init__(self, *args, inf_step: int = -1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.inf_step = inf_step
        self.skipped: list[bool] = []
        self.scales: list[float] = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        sharded = torch.distributed.is_initialized()
        if self.state.global_step == self.inf_step and (not sharded or torch.distributed.get_rank() == 1):
            grad = self.model.transformer.wte.weight.grad
            grad = grad.to_local() if hasattr(grad, "to_local") else grad
            grad.view(-1)[0] = float("inf")
        return loss

    def optimizer_step_done(self) -> None:
        self.skipped.append(bool(self.mp.last_step_skipped))
        self.scales.append(float(self.mp.scaler.get_scale()))


def train(model: torch.nn.Module, plan: str, out: str, per_device: int, data: list) -> dict:
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=per_device, max_steps=STEPS, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, max_grad_norm=1.0,
                             learning_rate=1e-2, logging_steps=1, dataloader_drop_last=True,
                             train_sampling_strategy="sequential")
    # SGD: an update proportional to the gradient, so rounding apart the runs stay close (Adam's
    # first steps move every weight by ~lr whatever the gradient's size, flipping with its sign)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    inf_step = INF_STEP if plan.startswith("fp16") else -1
    trainer = Overflowing(model=model, args=args, train_dataset=data, precision=plan, optimizers=(opt, None),
                          inf_step=inf_step)

    class Record(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            trainer.optimizer_step_done()

    trainer.add_callback(Record())
    trainer.train()
    return {
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "skipped": trainer.skipped,
        "scales": trainer.scales,
    }


def main() -> None:
    ckpt, out = sys.argv[1:3]
    rank = int(os.environ["RANK"])
    results = {}
    for plan in LOADS:
        model = load(ckpt, plan, sharded=True)
        results[plan] = train(model, plan, out, PER_RANK, rows())
        results[plan]["params"] = {n: p.full_tensor().detach().float().clone() for n, p in model.named_parameters()}
    # saving through the Trainer would keep rank 0's shard of the optimizer alone: refused (by transformers)
    model = GPT2LMHeadModel.from_pretrained(ckpt, distributed_config=DistributedConfig(fsdp_size=2))
    args = TrainingArguments(output_dir=out, save_strategy="steps", use_cpu=True, report_to=[])
    try:
        MixprecTrainer(model=model, args=args, train_dataset=rows(), precision="bf16-mixed")
        results["trainer save"] = "accepted"
    except ValueError as exc:
        results["trainer save"] = str(exc)
    # fp16-master: load-time sharding all-gathers in fp32 or (fsdp_mixed_precision=True) bf16, never fp16
    for mixed in (False, True):
        model = GPT2LMHeadModel.from_pretrained(
            ckpt, distributed_config=DistributedConfig(fsdp_size=2, fsdp_mixed_precision=mixed))
        try:
            MixprecTrainer(model=model, args=TrainingArguments(output_dir=out, save_strategy="no", use_cpu=True,
                                                               report_to=[]),
                           train_dataset=rows(), precision="fp16-master")
            results[f"fp16-master gathers bf16={mixed}"] = "accepted"
        except ValueError as exc:
            results[f"fp16-master gathers bf16={mixed}"] = str(exc)
    # fp8-mixed: its fp8 layers are swapped in before sharding, which load-time sharding has done already
    model = GPT2LMHeadModel.from_pretrained(ckpt, distributed_config=DistributedConfig(fsdp_size=2))
    try:
        MixprecTrainer(model=model, args=TrainingArguments(output_dir=out, save_strategy="no", use_cpu=True,
                                                           report_to=[]),
                       train_dataset=rows(), precision="fp8-mixed")
        results["fp8-mixed"] = "accepted"
    except ValueError as exc:
        results["fp8-mixed"] = str(exc)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()

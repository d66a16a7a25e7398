"""MixprecTrainer (transformers.Trainer) against mixprec's own loop on a tiny GPT-2."""

from __future__ import annotations

import contextlib
import copy
import importlib
import re
import sys
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from torch.utils.checkpoint import CheckpointError
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

from mixprec import DynamicLossScaler, MixedPrecision
from mixprec.integrations.transformers import MIXPREC_STATE_NAME, MixprecTrainer
from tests.integrations._common import (
    assert_close_losses,
    assert_same_params,
    make_optimizer,
    make_plan,
    reference_run,
)

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::UserWarning")]
hf_logging.set_verbosity_error()

BATCH, SEQ, VOCAB = 2, 8, 64


def gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM",
    )
    return GPT2LMHeadModel(config)


def token_batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(n)]


def lm_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


class RecordingTrainer(MixprecTrainer):
    """Sequential batches, the per-micro-batch mean loss recorded (and not normalised by token count)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model_accepts_loss_kwargs = False
        self.recorded: list[float] = []

    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.recorded.append((loss[0] if return_outputs else loss).item())
        return loss


def hf_run(model, batches, precision, tmp_path, *, gas=1, clip=0.5, max_steps=None, own_optimizer=True,
           resume=None, save_steps=None, callbacks=(), fused=False, **args):
    rows = [{"input_ids": r, "labels": r} for b in batches for r in b]
    steps = max_steps if max_steps is not None else len(batches) // gas
    targs = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=BATCH, gradient_accumulation_steps=gas,
        max_steps=steps, max_grad_norm=clip or 0.0, report_to=[], use_cpu=True, logging_steps=1, disable_tqdm=True,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, seed=0,
        dataloader_num_workers=0, **args,
    )
    optimizers = make_optimizer(model, lr=1e-3, fused=fused) if own_optimizer else (None, None)
    trainer = RecordingTrainer(model=model, args=targs, train_dataset=rows, precision=precision, optimizers=optimizers,
                               callbacks=list(callbacks))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=resume)
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    return {
        "losses": trainer.recorded, "norms": [h["grad_norm"] for h in logs], "mp": trainer.mp, "trainer": trainer,
        "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "lr": trainer.lr_scheduler.get_last_lr()[0],
    }


def reference(model, batches, precision, *, gas=1, clip=0.5):
    return reference_run(model, batches, lm_loss, precision, grad_accum_steps=gas, clip=clip,
                         opt_factory=lambda m: make_optimizer(m, lr=1e-3))


def check_same(got, want):
    assert_close_losses(got["losses"], want["losses"], exact=True)
    assert got["mp"].optimizer_steps == want["mp"].optimizer_steps
    # the logged grad_norm is mixprec's true norm, before clipping
    assert got["norms"] == [r.grad_norm for r in want["results"]]
    assert got["lr"] == want["lr"]
    assert_same_params(got["params"], want["params"])


FAST_PLANS = ["fp16-mixed", "bf16-master", "custom"]
SLOW_PLANS = ["fp32", "bf16-mixed", "fp16-master", "bf16-kahan", "bf16-sr"]


@pytest.mark.parametrize(
    "plan", FAST_PLANS + [pytest.param(p, marks=pytest.mark.slow) for p in SLOW_PLANS]
)
def test_same_losses_as_mixprec_loop(tmp_path, plan):
    model, data = gpt2(), token_batches(20)
    want = reference(model, data, make_plan(plan))
    got = hf_run(copy.deepcopy(model), data, make_plan(plan), tmp_path)
    check_same(got, want)


def test_fp16_overflow_skips_steps_and_holds_the_scheduler(tmp_path):
    model, data = gpt2(), token_batches(20)

    def session():
        return MixedPrecision("fp16-mixed", scaler=DynamicLossScaler(init_scale=2.0**24))

    # no clipping (max_grad_norm=0): the logged grad_norm is still mixprec's true norm
    want = reference(model, data, session(), clip=None)
    got = hf_run(copy.deepcopy(model), data, session(), tmp_path, clip=None)
    assert torch.equal(torch.tensor(got["norms"]).nan_to_num(), torch.tensor([r.grad_norm for r in want["results"]]).nan_to_num())
    skipped = got["mp"].scaler.skipped_steps
    assert skipped >= 3, "the forced overflow did not happen"
    steps = got["mp"].optimizer_steps
    assert steps == 20 - skipped
    assert got["lr"] == pytest.approx(1e-3 / (1.0 + 0.1 * steps), rel=1e-12)
    assert_close_losses(got["losses"], want["losses"], exact=True)
    assert_same_params(got["params"], want["params"])


class PlantInf(TrainerCallback):
    """An inf in the first weight's gradient, made in the backward of step ``at`` (1-based)."""

    def __init__(self, at: int) -> None:
        self.at, self.hook = at, None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.at - 1:
            def inf(grad):
                grad = grad.clone()
                grad.view(-1)[0] = float("inf")
                return grad
            self.hook = next(model.parameters()).register_hook(inf)

    def on_step_end(self, args, state, control, **kwargs):
        if self.hook is not None:
            self.hook.remove()
            self.hook = None


@pytest.mark.parametrize("plan", ["fp16-mixed", "bf16-mixed"])
def test_steady_steps_read_nothing_back_in_the_optimizer_step_and_the_held_scheduler(tmp_path, monkeypatch, plan):
    """With a fused AdamW (it masks a skipped update on the device): ``optimizer.step()``, the Trainer's own ``accelerator.optimizer_step_was_skipped`` right before
    it steps the scheduler, and that step wait for nothing on the device: no device value is read,
    and the skip decision's host copy is read one step late, never in the step that made it
    (``tests._syncs.LateReads``), also on the step a planted fp16 overflow skips. The scheduler
    holds on that step (put back one step late). (The Trainer's loop reads the loss itself: outside
    these guards.)"""
    from accelerate import Accelerator

    from mixprec.integrations.accelerate import MixprecAcceleratedOptimizer
    from mixprec.integrations.schedules import HeldSchedules
    from tests._syncs import LateReads

    late = LateReads(monkeypatch)
    monkeypatch.setattr(MixprecAcceleratedOptimizer, "step", late.wrap(MixprecAcceleratedOptimizer.step, new_step=True))
    asked = Accelerator.optimizer_step_was_skipped
    monkeypatch.setattr(Accelerator, "optimizer_step_was_skipped", property(late.wrap(asked.fget)))
    monkeypatch.setattr(HeldSchedules, "step", late.wrap(HeldSchedules.step))
    plants = (PlantInf(6),) if plan == "fp16-mixed" else ()
    got = hf_run(gpt2(), token_batches(10), plan, tmp_path, clip=None, callbacks=plants, fused=True)
    assert late.step == 10 and late.calls == 30
    assert got["mp"].scaler.skipped_steps == (plan == "fp16-mixed")
    steps = got["mp"].optimizer_steps
    assert steps == 10 - got["mp"].scaler.skipped_steps
    assert got["lr"] == pytest.approx(1e-3 / (1.0 + 0.1 * steps), rel=1e-12)  # held on the skip
    optimizer = got["trainer"].optimizer
    assert optimizer.param_groups[0]["lr"] == got["lr"]  # settled at the end of train()


def test_a_checkpoint_right_after_a_skipped_step_resumes_with_the_held_scheduler(tmp_path):
    """fp16: the step a checkpoint follows overflows. The scheduler, stepped at once and put back
    one step late, is put back before the optimizer and the scheduler are saved, so they agree,
    and the resumed run is the uninterrupted one, bit for bit."""
    model, data = gpt2(), token_batches(12)
    full = hf_run(copy.deepcopy(model), data, "fp16-mixed", tmp_path / "full", save_steps=6, callbacks=(PlantInf(6),))
    assert full["mp"].scaler.skipped_steps == 1
    ckpt = tmp_path / "full" / "checkpoint-6"
    assert torch.load(ckpt / "scheduler.pt", weights_only=False)["last_epoch"] == 5  # held
    saved = torch.load(ckpt / "optimizer.pt", weights_only=False)
    assert saved["param_groups"][0]["lr"] == pytest.approx(1e-3 / (1.0 + 0.1 * 5), rel=1e-12)  # the optimizer agrees
    resumed = hf_run(gpt2(), data, "fp16-mixed", tmp_path / "resumed", resume=str(ckpt), callbacks=(PlantInf(6),))
    assert resumed["mp"].optimizer_steps == full["mp"].optimizer_steps == 11
    assert resumed["lr"] == full["lr"]
    assert_close_losses(resumed["losses"], full["losses"][6:], exact=True)
    assert_same_params(resumed["params"], full["params"])


def test_gradient_accumulation_matches_and_accumulates_in_fp32(tmp_path):
    model, data = gpt2(), token_batches(24)
    want = reference(model, data, "bf16-master", gas=2)
    got = hf_run(copy.deepcopy(model), data, "bf16-master", tmp_path, gas=2)
    assert got["mp"].optimizer_steps == 12
    check_same(got, want)


def test_custom_op_list_with_gradient_checkpointing(tmp_path, monkeypatch):
    model, data = gpt2(), token_batches(20)
    want = reference(model, data, make_plan("custom"))
    got = hf_run(copy.deepcopy(model), data, make_plan("custom"), tmp_path, activation_checkpointing=True)
    check_same(got, want)
    # without the plan's backward policy, recomputation runs torch's default op lists
    monkeypatch.setattr(MixedPrecision, "backward_context", lambda self: contextlib.nullcontext())
    with pytest.raises(CheckpointError, match="different metadata"):
        hf_run(copy.deepcopy(model), data[:2], make_plan("custom"), tmp_path, activation_checkpointing=True)


@pytest.mark.parametrize(
    "plan", ["fp16-mixed", pytest.param("bf16-master", marks=pytest.mark.slow),
             pytest.param("bf16-sr", marks=pytest.mark.slow)]
)
def test_resume_from_checkpoint_is_bit_identical(tmp_path, plan):
    model, data = gpt2(), token_batches(20)
    full = hf_run(copy.deepcopy(model), data, make_plan(plan), tmp_path / "full", save_steps=10)
    ckpt = tmp_path / "full" / "checkpoint-10"
    assert (ckpt / MIXPREC_STATE_NAME).is_file()
    resumed = hf_run(gpt2(), data, make_plan(plan), tmp_path / "resumed", resume=str(ckpt))
    assert resumed["mp"].optimizer_steps == full["mp"].optimizer_steps
    assert resumed["mp"].scaler.get_scale() == full["mp"].scaler.get_scale()
    assert_close_losses(resumed["losses"], full["losses"][10:], exact=True)
    assert_same_params(resumed["params"], full["params"])


def test_trainer_created_optimizer_is_wrapped_for_the_plan(tmp_path):
    got = hf_run(gpt2(), token_batches(4), "fp16-master", tmp_path, own_optimizer=False)
    from mixprec.optim import MasterWeightOptimizer

    assert isinstance(got["trainer"].optimizer.optimizer, MasterWeightOptimizer)
    assert got["mp"].optimizer_steps + got["mp"].scaler.skipped_steps == 4
    assert got["trainer"].model.transformer.h[0].attn.c_attn.weight.dtype == torch.float16


def test_training_arguments_precision_flags_conflict(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=re.escape(
        "TrainingArguments(bf16=True) and MixprecTrainer(precision='fp16-mixed') would both run the precision; "
        "drop bf16=True (the plan decides the dtypes)"
    )):
        MixprecTrainer(model=gpt2(), args=args, precision="fp16-mixed")


def test_trainer_fsdp_is_refused_not_run_as_ddp(tmp_path, monkeypatch):
    """The Trainer's fsdp= used to run DDP on CPU under MixprecTrainer, without a word."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")  # (TrainingArguments(fsdp=...) sets it: restored after)
    args = TrainingArguments(output_dir=str(tmp_path), fsdp=True, use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=re.escape("TrainingArguments(fsdp=...) asks the Trainer for FSDP")):
        MixprecTrainer(model=gpt2(), args=args, precision="bf16-mixed")


def test_missing_framework_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "mixprec.integrations.transformers", raising=False)
    with pytest.raises(ImportError, match=re.escape("pip install mixprec[transformers]")):
        importlib.import_module("mixprec.integrations.transformers")

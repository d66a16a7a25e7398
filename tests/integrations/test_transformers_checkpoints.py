"""MixprecTrainer's checkpoints: resuming what a plain Trainer or another plan wrote, the fp32
export it saves for ``from_pretrained``, and fp32 predictions."""

from __future__ import annotations

import inspect
import json
import re
import shutil
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file
from transformers import GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

from mixprec import get_plan
from mixprec.integrations.transformers import MIXPREC_STATE_NAME, MixprecTrainer
from mixprec.optim import KahanOptimizer, LowPrecisionOptimizer, MasterWeightOptimizer
from tests.integrations.test_transformers import BATCH, gpt2, token_batches

pytestmark = [pytest.mark.integration]
hf_logging.set_verbosity_error()

LOW = (torch.float16, torch.bfloat16)


def rows(n_batches: int) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": r, "labels": r} for b in token_batches(n_batches) for r in b]


def targs(out, *, max_steps, save_steps=None, **kw) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
        max_steps=max_steps, report_to=[], use_cpu=True, logging_steps=1, disable_tqdm=True, seed=0,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, dataloader_num_workers=0,
        learning_rate=1e-3, **kw,
    )


def held(opt, param):
    """The tensor ``opt`` keeps state under for a model parameter (its master under master plans)."""
    master = opt.master_of(param) if isinstance(opt, MasterWeightOptimizer) else None
    return param if master is None else master


class AtTrainBegin(TrainerCallback):
    """What the resumed trainer holds right after the checkpoint was loaded (before any step)."""

    def __init__(self):
        self.trainer = None
        self.seen = None

    def on_train_begin(self, args, state, control, **kwargs):
        mp = self.trainer.mp
        opt = mp.optimizers[0]
        model = self.trainer.model
        named = dict(model.named_parameters())
        self.seen = {
            "params": {k: p.detach().clone() for k, p in named.items()},
            "masters": {k: m.detach().clone() for k, p in named.items()
                        if isinstance(opt, MasterWeightOptimizer) and (m := opt.master_of(p)) is not None},
            "comp": {k: c.detach().clone() for k, p in named.items()
                     if isinstance(opt, KahanOptimizer) and (c := opt.compensation(p)) is not None},
            "state": {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in opt.state[q].items()}
                      for k, p in named.items() if (q := held(opt, p)) in opt.state},
            "lr": self.trainer.lr_scheduler.get_last_lr()[0],
            "scale": mp.scaler.get_scale(),
        }


def mixprec_trainer(out, precision, *, max_steps, resume=None, save_steps=None, n_batches=8, **kw):
    cb = AtTrainBegin()
    trainer = MixprecTrainer(model=gpt2(), args=targs(out, max_steps=max_steps, save_steps=save_steps),
                             train_dataset=rows(n_batches), precision=precision, callbacks=[cb], **kw)
    cb.trainer = trainer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=resume)
    mixprec_warnings = [str(w.message) for w in caught if "mixprec" in str(w.message) or MIXPREC_STATE_NAME in str(w.message)]
    return trainer, cb.seen, mixprec_warnings


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory):
    """A plain transformers.Trainer in fp32 (AdamW state, fp32 weights), saved after 2 of 4 steps."""
    out = tmp_path_factory.mktemp("plain")
    trainer = Trainer(model=gpt2(), args=targs(out, max_steps=4, save_steps=2), train_dataset=rows(8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    ckpt = out / "checkpoint-2"
    assert not (ckpt / MIXPREC_STATE_NAME).exists()
    optimizer_state = torch.load(ckpt / "optimizer.pt", weights_only=True)
    weights = load_file(str(ckpt / "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in weights.values())
    name_of = {id(p): n for n, p in trainer.model.named_parameters()}
    order = [name_of[id(p)] for group in trainer.optimizer.param_groups for p in group["params"]]
    return ckpt, weights, optimizer_state, {name: index for index, name in enumerate(order)}


ALL_PLANS = ["fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-pure", "fp16-pure",
             "bf16-kahan", "bf16-sr"]
FAST = {"bf16-master", "fp16-master", "bf16-kahan", "fp16-mixed"}


# -------------------------------------------------------------- A: resume what mixprec did not write
@pytest.mark.parametrize("plan", [p if p in FAST else pytest.param(p, marks=pytest.mark.slow) for p in ALL_PLANS])
def test_resume_from_a_plain_trainer_checkpoint(tmp_path, plain_checkpoint, plan):
    ckpt, weights, optimizer_state, plain_index = plain_checkpoint
    trainer, seen, caught = mixprec_trainer(tmp_path, plan, max_steps=4, resume=str(ckpt))
    opt = trainer.mp.optimizers[0]
    extra = {
        MasterWeightOptimizer: ", fp32 master weights from its weights (exactly where they are fp32)",
        KahanOptimizer: ", Kahan compensation from its weights (their fp32 residual where they are fp32)",
    }.get(type(opt), "")
    assert caught == [
        f"checkpoint {str(ckpt)!r} has no {MIXPREC_STATE_NAME} (a plain Trainer's, or saved with "
        f"save_only_model=True): resuming under plan {plan!r} with a fresh loss scale and step counters, "
        f"the optimizer state of its optimizer.pt (into {type(opt).__name__}){extra}"
    ]
    # the model holds the checkpoint's weights (rounded where the plan keeps them low)
    names = list(seen["params"])
    for name in names:
        p, v = seen["params"][name], weights[name]
        assert torch.equal(p, v.to(p.dtype)), name
    low = [n for n in names if seen["params"][n].dtype in LOW]
    assert bool(low) == (plan not in ("fp32", "bf16-mixed", "fp16-mixed"))
    if isinstance(opt, MasterWeightOptimizer):  # masters are the fp32 checkpoint values, exactly
        assert sorted(seen["masters"]) == sorted(low)
        for name in low:
            assert torch.equal(seen["masters"][name], weights[name]), name
        assert any(not torch.equal(weights[n], seen["params"][n].float()) for n in low)  # rounding mattered
    if isinstance(opt, KahanOptimizer):  # weight + compensation stands for the fp32 value
        for name in low:
            p = seen["params"][name]
            assert torch.equal(seen["comp"][name], (weights[name] - p.float()).to(p.dtype)), name
    # the optimizer state continues: Adam's moments and step counts (in the plan's state dtype)
    state_dtype = getattr(opt, "state_dtype", None) or torch.float32
    for name in names:
        saved = optimizer_state["state"][plain_index[name]]
        now = seen["state"][name]
        assert float(now["step"]) == float(saved["step"]) == 2.0
        for key in ("exp_avg", "exp_avg_sq"):
            want = saved[key].to(state_dtype) if name in low and isinstance(opt, LowPrecisionOptimizer) else saved[key]
            assert now[key].dtype == want.dtype and torch.equal(now[key], want), (name, key)
    assert seen["lr"] == pytest.approx(1e-3 * (4 - 2) / 4)  # the linear schedule continues at step 2
    assert trainer.mp.optimizer_steps + trainer.mp.scaler.skipped_steps == 2
    assert trainer.state.global_step == 4


def test_resume_from_a_plain_fp16_checkpoint_with_a_torch_scaler(tmp_path, plain_checkpoint):
    """A plain Trainer with fp16=True (on a GPU) also writes scaler.pt: there is no Accelerate scaler to load it into."""
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(plain_checkpoint[0], ckpt)
    torch.save(torch.amp.GradScaler("cpu", init_scale=1024.0).state_dict(), ckpt / "scaler.pt")
    trainer, seen, caught = mixprec_trainer(tmp_path / "run", "fp16-mixed", max_steps=3, resume=str(ckpt))
    assert len(caught) == 1 and "fresh loss scale" in caught[0]
    assert seen["scale"] == 2.0**16
    assert trainer.state.global_step == 3


def test_resume_from_a_save_only_model_checkpoint_starts_the_masters_from_its_fp32_weights(tmp_path):
    """save_only_model=True writes the weights (the fp32 export) but no optimizer.pt nor mixprec.pt."""
    args = targs(tmp_path / "full", max_steps=2, save_steps=2, save_only_model=True)
    first = MixprecTrainer(model=gpt2(), args=args, train_dataset=rows(8), precision="bf16-master")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first.train()
    ckpt = tmp_path / "full" / "checkpoint-2"
    assert not (ckpt / "optimizer.pt").exists() and not (ckpt / MIXPREC_STATE_NAME).exists()
    weights = load_file(str(ckpt / "model.safetensors"))
    trainer, seen, caught = mixprec_trainer(tmp_path / "resumed", "bf16-master", max_steps=3, resume=str(ckpt))
    assert caught == [
        f"checkpoint {str(ckpt)!r} has no {MIXPREC_STATE_NAME} (a plain Trainer's, or saved with "
        "save_only_model=True): resuming under plan 'bf16-master' with a fresh loss scale and step counters, "
        "a fresh optimizer state (it has no optimizer.pt), fp32 master weights from its weights (exactly where "
        "they are fp32)"
    ]
    opt = first.mp.optimizers[0]
    for name, p in first.model.named_parameters():  # the masters the first run ended with, exactly
        master = opt.master_of(p)
        want = p.detach() if master is None else master.detach()
        assert torch.equal(weights[name], want), name
        got = seen["masters"].get(name, seen["params"][name])
        assert torch.equal(got, want), name
    assert seen["state"] == {}


@pytest.fixture(scope="module")
def plan_checkpoints(tmp_path_factory):
    made = {}

    def make(plan):
        if plan not in made:
            out = tmp_path_factory.mktemp(plan)
            trainer, _, _ = mixprec_trainer(out, plan, max_steps=2, save_steps=2)
            made[plan] = str(out / "checkpoint-2")
        return made[plan]

    return make


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [("fp16-master", "bf16-kahan"), ("bf16-kahan", "fp16-master"), ("bf16-master", "fp16-master"),
     pytest.param("bf16-sr", "bf16-kahan", marks=pytest.mark.slow),
     pytest.param("fp16-mixed", "bf16-master", marks=pytest.mark.slow),
     pytest.param("bf16-master", "bf16-mixed", marks=pytest.mark.slow)],
)
def test_resuming_under_another_plan_names_both_plans(tmp_path, plan_checkpoints, saved, resumed):
    ckpt = plan_checkpoints(saved)
    ours, theirs = get_plan(resumed).fingerprint(), get_plan(saved).fingerprint()
    diffs = ", ".join(f"{k}: saved {theirs[k]!r} vs now {v!r}" for k, v in ours.items() if theirs[k] != v)
    message = (
        f"checkpoint {ckpt!r} was saved under plan {saved!r}, but this MixprecTrainer runs plan {resumed!r} "
        f"({diffs}). Resuming would silently change numerics. Resume it with MixprecTrainer(precision={saved!r}); "
        f"to convert on purpose, start from its weights (from_pretrained({ckpt!r})) under {resumed!r} without "
        "resume_from_checkpoint (a fresh optimizer, loss scale and learning-rate schedule)"
    )
    cb = AtTrainBegin()
    trainer = MixprecTrainer(model=gpt2(), args=targs(tmp_path, max_steps=4), train_dataset=rows(8),
                             precision=resumed, callbacks=[cb])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            trainer.train(resume_from_checkpoint=ckpt)
    assert cb.seen is None and trainer.mp.optimizer_steps == 0


# ------------------------------------------------------------------- B: what MixprecTrainer saves
@pytest.mark.parametrize("plan", ["bf16-master", "fp16-master", pytest.param("bf16-kahan", marks=pytest.mark.slow)])
def test_save_model_writes_the_fp32_masters_for_from_pretrained(tmp_path, plan):
    trainer, _, _ = mixprec_trainer(tmp_path / "run", plan, max_steps=3)
    export = trainer.mp.export_fp32_state_dict()
    live_dtype = trainer.model.config.dtype
    trainer.save_model(str(tmp_path / "saved"))
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["dtype"] == "float32"
    assert trainer.model.config.dtype == live_dtype  # the live model's config is left as it was
    reloaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"))  # plain: no dtype argument
    opt = trainer.mp.optimizers[0]
    for name, p in trainer.model.named_parameters():
        got = dict(reloaded.named_parameters())[name]
        assert got.dtype == torch.float32, name
        master = opt.master_of(p) if isinstance(opt, MasterWeightOptimizer) else None
        want = master if master is not None else p.detach().float()
        assert torch.equal(got, want), name
        assert torch.equal(got, export[name]), name
    # the norm layers (kept fp32 by the plan) are not rounded on the way
    assert torch.equal(reloaded.transformer.ln_f.weight, trainer.model.transformer.ln_f.weight)


def test_save_fp32_false_writes_the_models_own_tensors(tmp_path):
    trainer, _, _ = mixprec_trainer(tmp_path / "run", "bf16-master", max_steps=1, save_fp32=False)
    trainer.save_model(str(tmp_path / "saved"))
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert saved["transformer.h.0.attn.c_attn.weight"].dtype == torch.bfloat16
    assert saved["transformer.ln_f.weight"].dtype == torch.float32
    with pytest.raises(TypeError, match=re.escape("save_fp32 must be True or False, got 'yes'")):
        MixprecTrainer(model=gpt2(), args=targs(tmp_path, max_steps=1), precision="bf16-master", save_fp32="yes")


def test_checkpoints_hold_the_masters_and_resume_bit_identically(tmp_path):
    full, _, _ = mixprec_trainer(tmp_path / "full", "fp16-master", max_steps=4, save_steps=2)
    ckpt = tmp_path / "full" / "checkpoint-2"
    weights = load_file(str(ckpt / "model.safetensors"))
    masters = torch.load(ckpt / "optimizer.pt", weights_only=True)["mixprec_master_weights"]
    assert all(v.dtype == torch.float32 for v in weights.values())
    assert any(any(torch.equal(w, m) for m in masters) for w in weights.values() if w.dim() == 2)
    resumed, seen, caught = mixprec_trainer(tmp_path / "resumed", "fp16-master", max_steps=4, resume=str(ckpt))
    assert caught == []
    for name, p in full.model.named_parameters():
        assert torch.equal(p, dict(resumed.model.named_parameters())[name]), name


def test_best_model_at_end_exports_the_best_checkpoints_masters(tmp_path):
    # on random tokens the eval loss rises: the best is the earlier checkpoint, and the reload changes the weights
    args = targs(tmp_path, max_steps=4, save_steps=2, eval_strategy="steps", eval_steps=2,
                 load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=False)
    trainer = MixprecTrainer(model=gpt2(), args=args, train_dataset=rows(8), eval_dataset=rows(1),
                             precision="bf16-master")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    best = load_file(f"{trainer.state.best_model_checkpoint}/model.safetensors")
    last = load_file(str(tmp_path / "checkpoint-4" / "model.safetensors"))
    export = trainer.mp.export_fp32_state_dict()
    assert any(not torch.equal(best[name], last[name]) for name in best)
    for name in best:
        assert torch.equal(export[name], best[name]), name
    trainer.save_model(str(tmp_path / "final"))
    final = GPT2LMHeadModel.from_pretrained(str(tmp_path / "final"))
    for name, p in final.named_parameters():
        assert torch.equal(p, best[name]), name


# --------------------------------------------------------------------------------- predict
@pytest.mark.parametrize("plan", ["fp16-master", "bf16-master", "fp16-mixed",
                                  pytest.param("bf16-pure", marks=pytest.mark.slow)])
def test_predict_returns_fp32_under_every_plan(tmp_path, plan):
    trainer = MixprecTrainer(model=gpt2(), args=targs(tmp_path, max_steps=1), precision=plan)
    data = rows(2)
    out = trainer.predict(data)
    logits = out.predictions[0] if isinstance(out.predictions, tuple) else out.predictions
    assert logits.dtype.name == "float32"
    with torch.no_grad(), trainer.mp.autocast():
        want = trainer.model(input_ids=torch.stack([r["input_ids"] for r in data[:BATCH]])).logits
    assert want.dtype in LOW  # what the model computes, which a plain Trainer would return as is
    assert torch.equal(torch.from_numpy(logits[:BATCH]), want.float())


def test_trainer_methods_mixprec_overrides_exist():
    """The private Trainer methods MixprecTrainer overrides or calls, with the arguments it passes."""
    for name, args in (("_save", ("output_dir",)), ("_load_optimizer_and_scheduler", ("checkpoint",)),
                       ("_load_from_checkpoint", ("checkpoint",)), ("prediction_step", ("m", {}, False))):
        method = getattr(Trainer, name, None)
        assert callable(method), f"transformers.Trainer.{name} no longer exists; MixprecTrainer relies on it"
        inspect.signature(method).bind(None, *args)

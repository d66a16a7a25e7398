"""LoRA (peft) on a GPT-2 loaded in fp16, bf16 and fp32, under the plans users pick for it: the
frozen base stays as loaded, only the adapters carry masters, compensation and optimizer state,
and the memory tools say so per trainable parameter. Own loop and MixprecTrainer."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers.utils import logging as hf_logging

from mixprec import MixedPrecision, get_plan
from mixprec.diagnostics import estimate_memory, training_state_bytes_per_param
from mixprec.integrations.transformers import MixprecTrainer

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::UserWarning")]
hf_logging.set_verbosity_error()

PLANS = ["bf16-mixed", "fp16-mixed", "bf16-master", "bf16-kahan"]
LOADS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
VOCAB, STEPS = 64, 4
# a frozen base the plan would have to round (fp16 or fp32 to bf16 weights): refused, it has no master
LOSSY = {(plan, load) for plan in ("bf16-master", "bf16-kahan") for load in ("fp16", "fp32")}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0,
                        eos_token_id=0, loss_type="ForCausalLM", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    GPT2LMHeadModel(config).save_pretrained(path)
    return str(path)


def lora(checkpoint: str, load: str):
    base = GPT2LMHeadModel.from_pretrained(checkpoint, dtype=LOADS[load])
    return get_peft_model(base, LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0))


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))


def frozen(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def assert_frozen_as_loaded(model, loaded: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        if name in loaded:
            assert torch.equal(p.detach().float(), loaded[name].float()), name  # every bit of the value
            if "ln_" not in name:  # norm layers may be widened to fp32 (exactly); the weights keep their dtype
                assert p.dtype == loaded[name].dtype, (name, p.dtype, loaded[name].dtype)


@pytest.mark.parametrize("load", list(LOADS))
@pytest.mark.parametrize("plan", PLANS)
def test_lora_trains_the_adapters_and_leaves_the_frozen_base_as_loaded(checkpoint, plan, load):
    model = lora(checkpoint, load)
    loaded = frozen(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    mp = MixedPrecision(plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # every parameter, as peft users often write it
    converted = (plan, load) in LOSSY
    if converted:
        with pytest.raises(ValueError, match="convert_frozen=True"):
            mp.prepare(model, opt)
        assert_frozen_as_loaded(model, loaded)  # refused before anything was cast
        mp = MixedPrecision(get_plan(plan, convert_frozen=True))  # the conversion asked for: it trains
        with pytest.warns(UserWarning, match=r"rounds \d+ frozen"):
            model, opt = mp.prepare(model, opt)
    else:
        model, opt = mp.prepare(model, opt)
    ids, losses = batch(), []
    for _ in range(STEPS):
        with mp.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        mp.backward(loss)
        assert mp.step(zero_grad=False).stepped  # (gradients kept: the bytes below count them)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    if not converted:
        assert_frozen_as_loaded(model, loaded)
    per = training_state_bytes_per_param(model, opt, per="trainable")
    # only the adapters have optimizer state (AdamW: 8 bytes, 4 in bf16-kahan's bf16, plus step
    # counters), masters (4) and compensation (2); the base's weights are spread over the trainable ones
    moments = 4 if plan == "bf16-kahan" else 8
    assert moments <= per["optimizer_state"] < moments + 0.1, per
    assert per["master_weights"] == (4 if plan == "bf16-master" else 0), per
    assert per["compensation"] == (2 if plan == "bf16-kahan" else 0), per
    assert per["grads"] == (2 if plan in ("bf16-master", "bf16-kahan") else 4), per
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert per["weights"] == pytest.approx(weights / trainable)
    estimate = estimate_memory(lora(checkpoint, load), mp.plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    assert estimate.trainable == trainable
    assert estimate.per_trainable_param()["optimizer_state"] == pytest.approx(per["optimizer_state"])
    assert estimate.per_trainable_param()["master_weights"] == pytest.approx(per["master_weights"])


def test_a_lossy_conversion_asked_for_warns_once_naming_the_parameters(checkpoint):
    model = lora(checkpoint, "fp16")
    mp = MixedPrecision(get_plan("bf16-master", convert_frozen=True))
    with pytest.warns(UserWarning, match=r"rounds \d+ frozen fp16 parameter\(s\) to bf16 .*transformer\.wte\.weight"):
        model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert {p.dtype for n, p in model.named_parameters() if not p.requires_grad and "ln_" not in n} == {torch.bfloat16}


def test_a_frozen_parameter_unfrozen_later_gets_its_master_then(checkpoint):
    """Progressive unfreezing: no master while frozen; requires_grad_() gives it one at the next
    step, from its weight, and from then on it trains through the master."""
    model = lora(checkpoint, "bf16")
    mp = MixedPrecision("bf16-master")
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    head = model.base_model.model.transformer.h[1].mlp.c_fc.weight
    assert opt.master_of(head) is None
    before = head.detach().clone()
    head.requires_grad_(True)
    ids = batch()
    with mp.autocast():
        loss = model(input_ids=ids, labels=ids).loss
    mp.backward(loss)
    assert mp.step().stepped
    master = opt.master_of(head)
    assert master is not None and master.dtype == torch.float32
    assert not torch.equal(head.detach(), before)
    assert torch.equal(master.detach().to(torch.bfloat16), head.detach())


@pytest.mark.parametrize("load", list(LOADS))
@pytest.mark.parametrize("plan", PLANS)
def test_lora_under_mixprec_trainer_keeps_the_base_and_fp16_bases_need_no_special_case(checkpoint, plan, load, tmp_path):
    """Also an fp16 base under fp16-mixed: never "Attempting to unscale FP16 gradients"."""
    model = lora(checkpoint, load)
    loaded = frozen(model)
    if (plan, load) in LOSSY:
        with pytest.raises(ValueError, match="convert_frozen=True"):
            MixprecTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]),
                           train_dataset=[], precision=plan).train()
        assert_frozen_as_loaded(model, loaded)
        return
    rows = [{"input_ids": r, "labels": r} for r in torch.cat([batch()] * 4)]
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=STEPS, max_grad_norm=1.0, report_to=[],
        use_cpu=True, learning_rate=1e-2, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = MixprecTrainer(model=model, args=args, train_dataset=rows, precision=plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert trainer.mp.optimizer_steps == STEPS
    assert_frozen_as_loaded(trainer.model, loaded)
    per = training_state_bytes_per_param(trainer.model, trainer.optimizer, per="trainable")
    assert per["master_weights"] == (4 if plan == "bf16-master" else 0), per


def test_a_checkpoint_records_which_parameters_had_masters(checkpoint, tmp_path):
    """Unfrozen during training, a layer's master joins the others in parameter order: a resume
    where it is trainable from the start gets every master back in its place; a resume where it
    is still frozen is refused, saying why."""
    from mixprec import load_checkpoint, save_checkpoint

    def run(unfreeze_at: int | None, steps: int):
        model = lora(checkpoint, "bf16")
        layer = model.base_model.model.transformer.h[0].mlp.c_fc
        if unfreeze_at == 0:
            layer.requires_grad_(True)
        mp = MixedPrecision("bf16-master")
        model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        ids = batch()
        for step in range(steps):
            if step == unfreeze_at:
                layer.requires_grad_(True)
            with mp.autocast():
                loss = model(input_ids=ids, labels=ids).loss
            mp.backward(loss)
            mp.step()
        return model, opt, mp, layer

    model, opt, mp, layer = run(unfreeze_at=1, steps=3)
    save_checkpoint(tmp_path / "c.pt", model=model, optimizers=[opt], mp=mp)
    model2, opt2, mp2, layer2 = run(unfreeze_at=0, steps=0)
    load_checkpoint(tmp_path / "c.pt", model=model2, optimizers=[opt2], mp=mp2)
    for p, q in ((layer.weight, layer2.weight), (layer.bias, layer2.bias)):
        assert torch.equal(opt.master_of(p), opt2.master_of(q))
    for (_, a), (_, b) in zip(opt._pairs, opt2._pairs, strict=True):
        assert torch.equal(a, b)
    model3, opt3, mp3, _ = run(unfreeze_at=None, steps=0)
    with pytest.raises(ValueError, match="frozen differently"):
        load_checkpoint(tmp_path / "c.pt", model=model3, optimizers=[opt3], mp=mp3)


@pytest.mark.parametrize("plan", ["fp32", "tf32"])
def test_plans_without_autocast_widen_a_half_precision_base_and_train(checkpoint, plan):
    model = lora(checkpoint, "bf16")
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    ids = batch()
    with mp.autocast():
        loss = model(input_ids=ids, labels=ids).loss
    mp.backward(loss)
    assert mp.step().stepped

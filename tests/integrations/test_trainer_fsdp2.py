"""MixprecTrainer with the Trainer's own FSDP2 (``fsdp=``, ``fsdp_config={"fsdp_version": 2}``) on
2 gloo ranks (trainer_fsdp2.py, one torchrun launch): mixprec shards the model with the plan's
policy when the Trainer prepares it, every plan trains as one process, and the Trainer's own
checkpoint resumes bit for bit. The Trainer's Accelerator shards only on GPUs: the script sets
its state to FSDP as Accelerate does there."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GPT2LMHeadModel, TrainingArguments

from mixprec.integrations.transformers import MixprecTrainer
from tests.integrations._common import torchrun
from tests.integrations.test_transformers_sharded import _checkpoint
from tests.integrations.trainer_fsdp2 import PER_RANK, RUNS, STEPS
from tests.integrations.transformers_load_sharded import rows

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

SCRIPT = Path(__file__).with_name("trainer_fsdp2.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict, dict]:
    tmp_path = tmp_path_factory.mktemp("trainer-fsdp2")
    _checkpoint(tmp_path / "ckpt")
    a, b = torchrun(SCRIPT, [str(tmp_path / "ckpt")], tmp_path / "run")
    return tmp_path, a, b


def _one_process(ckpt: Path, plan: str, out: Path) -> dict[str, torch.Tensor]:
    """MixprecTrainer without FSDP on the global batch (the two ranks' rows, in the same order)."""
    model = GPT2LMHeadModel.from_pretrained(ckpt)
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2 * PER_RANK, max_steps=STEPS, report_to=[], use_cpu=True,
        save_strategy="no", disable_tqdm=True, max_grad_norm=1.0, learning_rate=1e-3, dataloader_drop_last=True,
        train_sampling_strategy="sequential",
    )
    with warnings.catch_warnings(), mock.patch.dict(os.environ, {"ACCELERATE_USE_FSDP": "false"}):
        warnings.simplefilter("ignore")
        MixprecTrainer(model=model, args=args, train_dataset=rows(), precision=plan).train()
    return {n: p.detach().float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("cell", [f"{plan} {kind}" for plan, kind in RUNS])
def test_the_trainers_fsdp2_trains_every_plan_and_resumes_bit_for_bit(run, cell):
    tmp_path, a, b = run
    plan = cell.split()[0]
    straight, resumed = a[cell]["straight"], a[cell]["resumed"]
    assert straight["sharded"] == "DTensor"  # sharded by FSDP2
    low = plan != "bf16-master"  # bf16 weights as the shards (fp32 norm layers); fp32 shards are the masters
    assert straight["dtypes"] == (["torch.bfloat16", "torch.float32"] if low else ["torch.float32"])
    for name, w in straight["params"].items():
        assert torch.equal(w, b[cell]["straight"]["params"][name]), name  # one model on both ranks
        assert torch.equal(resumed["params"][name], w), name  # resumed from checkpoint-5: bit for bit
    assert len(straight["losses"]) == STEPS and resumed["losses"][-5:] == straight["losses"][5:]
    if cell in ("bf16-master FULL_STATE_DICT", "bf16-kahan SHARDED_STATE_DICT"):
        want = _one_process(tmp_path / "ckpt", plan, tmp_path / f"one-{plan}")
        for name, ref in want.items():  # the ranks' half batches: rounding apart
            torch.testing.assert_close(straight["params"][name], ref, rtol=3e-2, atol=3e-3,
                                       msg=lambda m, name=name: f"{cell} {name}: {m}")


def test_a_plain_trainers_fsdp2_checkpoint_is_refused_under_a_plan_without_masters(run):
    """Its sharded optimizer state has no compensation or noise for the plan's optimizer (before: the
    optimizer and the learning-rate schedule started afresh, with a warning naming the optimizer only)."""
    _, a, b = run
    for rank in (a, b):
        assert "has no mixprec.pt" in rank["plain checkpoint"] and "under FSDP2" in rank["plain checkpoint"]

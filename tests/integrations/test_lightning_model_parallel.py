"""Lightning's ModelParallelStrategy with the documented configure_model pattern (FSDP2 applied
inside the LightningModule), 2 gloo ranks under torchrun, against one process on the whole batch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from tests.integrations._common import torchrun as _torchrun

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("lightning_model_parallel.py")


def _run(plan: str, policy: str, out: Path, inf_step: int | None = None) -> list[dict]:
    return _torchrun(SCRIPT, [plan, policy], out, [] if inf_step is None else [str(inf_step)])


def _one_process(plan: str, inf_step: int = -1, momentum: float = 0.0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """mixprec's own loop on the whole global batch (the mean of the two ranks' losses); an inf
    planted in the first weight's gradient after backward at ``inf_step``; SGD with ``momentum``."""
    sys.path.insert(0, str(SCRIPT.parent))
    from lightning_model_parallel import MICRO, STEPS, data, net

    from mixprec import MixedPrecision

    model = net()
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum))
    x, y = data()
    losses = []
    for step in range(STEPS):
        xs, ys = x[step * 2 * MICRO : (step + 1) * 2 * MICRO], y[step * 2 * MICRO : (step + 1) * 2 * MICRO]
        with mp.autocast():
            loss = (model(xs).float() - ys).pow(2).mean()
        mp.backward(loss)
        if step == inf_step:
            model[0].weight.grad.view(-1)[0] = float("inf")
        mp.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().float().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("plan", ["bf16-mixed", "bf16-master"])
def test_configure_model_sharding_trains_as_one_process(tmp_path, plan):
    ranks = _run(plan, "policy", tmp_path / "run")
    assert all("error" not in r for r in ranks), [r.get("error") for r in ranks]
    a, b = ranks
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name  # one model on both ranks
    losses, params = _one_process(plan)
    both = [(x + y) / 2 for x, y in zip(a["losses"], b["losses"], strict=True)]
    assert both == pytest.approx(losses, rel=2e-2)
    for name, ref in params.items():  # bf16 compute on half batches vs the whole: rounding apart
        torch.testing.assert_close(a["params"][name].float(), ref, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("plan", ["fp16-mixed", "fp16-master"])
def test_an_overflow_on_one_rank_skips_the_step_on_both_under_an_fp16_plan(tmp_path, plan):
    """fp16 under Lightning's configure_model sharding: an inf in one rank's own gradient shard
    (the other rank's are finite) skips that step on both ranks, halves the scale on both, and
    the run then trains as one process that skipped the same step."""
    inf_step = 3
    ranks = _run(plan, "policy", tmp_path / "run", inf_step)
    assert all("error" not in r for r in ranks), [r.get("error") for r in ranks]
    a, b = ranks
    assert a["skipped"] == b["skipped"] == [step == inf_step for step in range(10)]
    assert a["scales"] == b["scales"]
    assert a["scales"][inf_step] == a["scales"][inf_step - 1] / 2
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name
    losses, params = _one_process(plan, inf_step)
    both = [(x + y) / 2 for x, y in zip(a["losses"], b["losses"], strict=True)]
    assert both == pytest.approx(losses, rel=2e-2)
    for name, ref in params.items():
        torch.testing.assert_close(a["params"][name].float(), ref, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("plan", ["bf16-kahan"])  # (bf16-sr, bf16-pure, fp16-pure: test_lightning_sharded_plans.py)
def test_configure_model_sharding_with_fully_shard_model_trains_the_plans_without_masters(tmp_path, plan):
    """bf16 weights as the shards, stepped by mixprec's Kahan wrapper inside Lightning."""
    ranks = _run(plan, "mixprec", tmp_path / "run")
    assert all("error" not in r for r in ranks), [r.get("error") for r in ranks]
    a, b = ranks
    for name in a["params"]:
        assert a["params"][name].dtype == torch.bfloat16
        assert torch.equal(a["params"][name], b["params"][name]), name
    losses, params = _one_process(plan)
    both = [(x + y) / 2 for x, y in zip(a["losses"], b["losses"], strict=True)]
    assert both == pytest.approx(losses, rel=2e-2)
    for name, ref in params.items():
        torch.testing.assert_close(a["params"][name].float(), ref, rtol=2e-2, atol=2e-3)


def test_configure_model_sharding_without_the_gather_dtype_is_refused_under_a_master_plan(tmp_path):
    """Before: the master plan did not see FSDP inside the LightningModule (it failed in Lightning's
    model.to() or ran fp32). Now: the missing param_dtype is named, with the fix."""
    for result in _run("bf16-master", "none", tmp_path / "run"):
        assert "fp32: no param_dtype" in result.get("error", ""), result
        assert "fsdp_policy" in result["error"]


@pytest.mark.parametrize(("plan", "policy"), [("bf16-master", "policy"), ("bf16-kahan", "mixprec"),
                                              ("bf16-sr", "mixprec"), ("fp16-mixed", "policy")])
def test_the_trainers_sharded_checkpoint_resumes_bit_for_bit(tmp_path, plan, policy):
    """The Lightning Trainer's own checkpoint under ModelParallelStrategy (torch.distributed.checkpoint
    underneath, saved at an epoch's end as ModelCheckpoint does): a new Trainer resuming from it
    trains the second epoch to the same losses and weights, bit for bit, as the run that went on."""
    ranks = _torchrun(SCRIPT.with_name("lightning_trainer_checkpoint.py"), [plan, policy], tmp_path / "run")
    assert all("error" not in r for r in ranks), [r.get("error") for r in ranks]
    a, b = ranks
    for rank in (a, b):
        assert len(rank["resumed"]) == 5
        assert rank["resumed"] == rank["straight"], plan
        for name, w in rank["after"].items():
            assert torch.equal(rank["resumed_weights"][name], w), (plan, name)
        assert str(rank["scaler"][0]) == str(rank["scaler"][1])  # the loss scaler's counters too
    for name in a["after"]:
        assert torch.equal(a["after"][name], b["after"][name]), name

"""The plans without masters (bf16-sr, bf16-pure, fp16-pure), and fp16-master in Fabric, under
Lightning's ModelParallelStrategy on 2 gloo ranks, against one process on the whole batch: the
Trainer's documented ``configure_model`` sharding through ``fully_shard_model``, the Trainer's own
sharded checkpoint, and Fabric's documented order with ``fabric.save`` / ``fabric.load``. Every
cell runs in one torchrun launch (lightning_sharded_plans.py); the tests read its results."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from tests._dist import assert_same
from tests.integrations.lightning_sharded_plans import FABRIC_INF_STEP, INF_STEP
from tests.integrations.test_lightning_model_parallel import _one_process, _torchrun

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("lightning_sharded_plans.py")
STEPS = 10
LOW = {"bf16-sr": torch.bfloat16, "bf16-pure": torch.bfloat16, "fp16-pure": torch.float16}


@pytest.fixture(scope="module")
def cells(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """Each cell's result on rank 0 and rank 1."""
    a, b = _torchrun(SCRIPT, [], tmp_path_factory.mktemp("sharded-plans") / "run")
    return {name: (a[name], b[name]) for name in a}


def _like_one_process(plan: str, losses: tuple[list[float], list[float]], params: dict[str, torch.Tensor],
                      inf_step: int = -1) -> None:
    """The mean of the two ranks' losses and rank 0's gathered parameters against mixprec's own
    loop on the whole batch (the ranks average their half-batch gradients in fp32 before the
    low-precision update, one process computes them on the whole batch: rounding apart)."""
    want_losses, want = _one_process(plan, inf_step)
    both = [(x + y) / 2 for x, y in zip(*losses, strict=True)]
    assert both == pytest.approx(want_losses, rel=2e-2), plan
    for name, ref in want.items():
        got = params[name].float()
        if plan == "bf16-sr":  # other rounding noise than one process: a bf16 ulp (2^-8 relative) per step
            diff = (got - ref).abs()  # at most (as in the Fabric test); measured: 0.56 of this bound
            assert bool((diff <= 2e-3 + STEPS * 2.0**-8 * ref.abs()).all()), (name, float(diff.max()))
        else:  # the bound of the other plans; measured: bf16-pure 0.25 of it (round to nearest, no
            # compensation: an update below half an ulp is lost on both sides alike), fp16 0.04
            torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-3, msg=lambda m, name=name: f"{plan} {name}: {m}")


@pytest.mark.parametrize("plan", ["bf16-sr", "bf16-pure", "fp16-pure"])
def test_configure_model_sharding_with_fully_shard_model_trains_the_plans_without_masters(cells, plan):
    """The low-precision weights are the shards (fully_shard_model converts, then shards, inside
    configure_model), stepped by the plan's optimizer wrapper on each rank's local shard."""
    a, b = cells[f"fit {plan}"]
    assert "error" not in a and "error" not in b, (a.get("error"), b.get("error"))
    assert len(a["losses"]) == STEPS and a["skipped"] == b["skipped"] == [False] * STEPS
    for name in a["params"]:
        assert a["params"][name].dtype == LOW[plan], name
        assert torch.equal(a["params"][name], b["params"][name]), name  # one model on both ranks
    _like_one_process(plan, (a["losses"], b["losses"]), a["params"])


def test_an_overflow_on_one_rank_skips_the_step_on_both_under_fp16_pure(cells):
    """An inf in rank 1's own fp16 gradient shard (rank 0's are finite) skips that step on both
    ranks and halves the scale on both; the run then trains as one process that skipped it."""
    a, b = cells["fit fp16-pure inf"]
    assert "error" not in a and "error" not in b, (a.get("error"), b.get("error"))
    assert a["skipped"] == b["skipped"] == [step == INF_STEP for step in range(STEPS)]
    assert a["scales"] == b["scales"]
    assert a["scales"][INF_STEP] == a["scales"][INF_STEP - 1] / 2
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name
    _like_one_process("fp16-pure", (a["losses"], b["losses"]), a["params"], INF_STEP)


@pytest.mark.parametrize("plan", ["bf16-pure", "fp16-pure"])
def test_the_trainers_sharded_checkpoint_resumes_the_pure_plans_bit_for_bit(cells, plan):
    """The Trainer's own checkpoint (torch.distributed.checkpoint), saved at the first epoch's
    end, with SGD momentum and a LayerNorm (low precision too under a pure plan): a new Trainer
    resuming from it trains the second epoch to the same losses, weights and loss scaler."""
    a, b = cells[f"resume {plan}"]
    assert "error" not in a and "error" not in b, (a.get("error"), b.get("error"))
    for rank in (a, b):
        assert len(rank["resumed"]) == 5
        assert rank["resumed"] == rank["straight"], plan
        for name, w in rank["after"].items():
            assert w.dtype == LOW[plan], name
            assert torch.equal(rank["resumed_weights"][name], w), (plan, name)
        assert str(rank["scaler"][0]) == str(rank["scaler"][1])
    for name in a["after"]:
        assert torch.equal(a["after"][name], b["after"][name]), name


@pytest.mark.parametrize("plan", ["bf16-pure", "fp16-pure", "fp16-master"])
def test_fabric_documented_order_trains_as_one_process_and_resumes_bit_for_bit(cells, plan):
    """Fabric's order under ModelParallelStrategy (the model sharded in setup, then the optimizer
    over its shards) for 10 steps against one process; fabric.save after 5 and fabric.load with
    the plugin's state beside the model and optimizer resume bit for bit. Under the fp16 plans
    an inf in rank 1's own gradient shard at step 7, after the save, skips that step on both
    ranks, in the run that went on and in the resumed one (the loss scale restored: without it
    the resumed run would start at the halved scale and halve it again)."""
    a, b = cells[f"fabric {plan}"]
    inf_step = FABRIC_INF_STEP if plan.startswith("fp16") else -1
    for rank in (a, b):
        assert rank["resumed"] == rank["straight"], plan
        for name, w in rank["after"].items():
            assert torch.equal(rank["resumed_weights"][name], w), (plan, name)
        # 10 steps, then the last 5 again after the load
        assert rank["skipped"] == [step == inf_step for step in [*range(STEPS), *range(5, STEPS)]]
        assert rank["scales"][STEPS:] == rank["scales"][5:STEPS]
        if inf_step >= 0:
            assert rank["scales"][inf_step] == rank["scales"][inf_step - 1] / 2
    assert a["scales"] == b["scales"]
    for name in a["after"]:
        assert torch.equal(a["after"][name], b["after"][name]), name
    _like_one_process(plan, (a["first"] + a["straight"], b["first"] + b["straight"]), a["after"], inf_step)


def test_fp8_mixed_through_configure_model_and_fabric_trains_as_one_process_and_resumes_bit_for_bit(cells):
    """fp8-mixed sharded by fully_shard_model (the eligible Linear layers swapped for fp8 layers
    first) inside configure_model and in Fabric's parallelize_fn: one model on both ranks, close
    to one process, and Fabric's sharded checkpoint (the fp8 layers' amax histories are buffers
    of the model's state) resumes bit for bit."""
    for cell in ("fit fp8-mixed", "fabric fp8-mixed"):
        a, b = cells[cell]
        assert "error" not in a and "error" not in b, (a.get("error"), b.get("error"))
        assert "FSDPFp8Linear" in a["layers"], (cell, a["layers"])  # (the 64 -> 4 head is not eligible: kept)
        params = a["params"] if "params" in a else a["after"]
        for name in params:
            assert torch.equal(params[name], (b["params"] if "params" in b else b["after"])[name]), (cell, name)
        losses = (a["losses"], b["losses"]) if "losses" in a else (a["first"] + a["straight"], b["first"] + b["straight"])
        want_losses, want = _one_process("fp8-mixed")
        both = [(x + y) / 2 for x, y in zip(*losses, strict=True)]
        assert both == pytest.approx(want_losses, rel=2e-2), cell
        for name, ref in want.items():
            # fp8 quantises each rank's half-batch output gradients (E5M2: 2 mantissa bits) with the
            # MAX-reduced amax, one process the whole batch's: the bound of the DDP tests for fp8
            assert (params[name].float() - ref).abs().max().item() <= 1e-2, (cell, name)
    a, b = cells["fabric fp8-mixed"]
    for rank in (a, b):
        assert rank["resumed"] == rank["straight"]
        for name, w in rank["after"].items():
            assert torch.equal(rank["resumed_weights"][name], w), name


@pytest.mark.parametrize("cell", ["root bf16-master", "root fp16-master inf", "root bf16-kahan", "root fp16-pure inf"])
def test_the_lightning_module_itself_as_the_fsdp_root_trains_as_one_process(cells, cell):
    """Lightning's other sharding pattern: configure_model shards the LightningModule itself as the
    root (fully_shard(self, mp_policy=fsdp_policy(plan)) for a master plan, fully_shard_model(self,
    plan) for a plan without masters). Under fp16 an inf in rank 1's own gradient shard skips the
    step on both ranks and halves the scale on both."""
    plan = cell.split()[1]
    inf_step = INF_STEP if cell.endswith("inf") else -1
    a, b = cells[cell]
    assert "error" not in a and "error" not in b, (a.get("error"), b.get("error"))
    assert a["skipped"] == b["skipped"] == [step == inf_step for step in range(STEPS)]
    assert a["scales"] == b["scales"]
    if inf_step >= 0:
        assert a["scales"][inf_step] == a["scales"][inf_step - 1] / 2
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name
    _like_one_process(plan, (a["losses"], b["losses"]), a["params"], inf_step)


def test_a_model_compiled_in_fabrics_parallelize_fn_trains_as_the_eager_one(cells):
    """torch.compile over the FSDP2 shards (nn.Module.compile in the parallelize_fn, after
    fully_shard_model) under bf16-kahan: the same losses and weights as the eager run, and its
    sharded checkpoint resumes bit for bit."""
    for eager, compiled in zip(cells["fabric bf16-kahan"], cells["fabric bf16-kahan compiled"], strict=True):
        assert compiled["graphs"] > eager["graphs"], (compiled["graphs"], eager["graphs"])  # it did compile
        assert compiled["first"] + compiled["straight"] == pytest.approx(eager["first"] + eager["straight"], rel=1e-6)
        assert compiled["resumed"] == compiled["straight"]
        for name, w in eager["after"].items():
            assert torch.equal(compiled["after"][name], w), name
            assert torch.equal(compiled["resumed_weights"][name], compiled["after"][name]), name


@pytest.mark.long
def test_fabrics_sharded_checkpoint_loads_on_another_number_of_ranks(tmp_path):
    """fabric.save on 2 ranks, fabric.load on 1 (torch.distributed.checkpoint reshards the DTensors,
    the Kahan compensation among them): the weights, SGD momentum, compensation and loss scaler
    are exactly the saved ones, and training goes on."""
    script = SCRIPT.with_name("fabric_reshard.py")
    saved, _ = _torchrun(script, ["save", str(tmp_path)], tmp_path / "save")
    (loaded,) = _torchrun(script, ["load", str(tmp_path)], tmp_path / "load", ranks=1)
    for plan, want in saved.items():
        got = loaded[plan]
        assert_same({k: got[k] for k in want}, want, plan)
        assert len(got["next"]) == 3 and all(loss == loss for loss in got["next"]), plan
    assert "compensation" in str(saved["bf16-kahan"]["optimizer"]), "the Kahan compensation was compared"

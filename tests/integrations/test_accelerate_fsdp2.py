"""Accelerate's FSDP2 plugin under mixprec on 2 gloo ranks (accelerate_fsdp2.py, one torchrun
launch): ``mixprec.integrations.accelerate.prepare`` shards the model with the plan's policy and
Accelerate keeps it; every plan trains as one process, an inf on one rank skips the step on both,
and Accelerate's own ``save_state`` / ``load_state`` (torch.distributed.checkpoint) resume bit for
bit. Accelerate shards only on GPUs: the script sets its state to FSDP as Accelerate does there
(the GPU run itself is in tests/cuda)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("lightning")  # (the tiny task and the torchrun helper are shared with its tests)

from tests.integrations.accelerate_fsdp2 import INF_STEP, PLANS
from tests.integrations.test_lightning_model_parallel import _one_process, _torchrun

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("accelerate_fsdp2.py")
STEPS = 10
WEIGHTS = {"bf16-kahan": "torch.bfloat16", "bf16-sr": "torch.bfloat16", "bf16-pure": "torch.bfloat16",
           "fp16-pure": "torch.float16"}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[dict, dict]:
    a, b = _torchrun(SCRIPT, [], tmp_path_factory.mktemp("accelerate-fsdp2") / "run")
    return a, b


@pytest.mark.parametrize("plan", PLANS)
def test_every_plan_trains_sharded_through_accelerate_as_one_process_and_resumes_bit_for_bit(ranks, plan):
    a, b = (r[plan] for r in ranks)
    inf_step = INF_STEP if plan.startswith("fp16") else -1
    assert a["sharded"] == "DTensor"  # the parameters are FSDP2 shards (two of them empty on rank 1: save_state works)
    assert a["dtypes"] == [WEIGHTS.get(plan, "torch.float32")]  # the plan's shards (fp32 = the masters)
    assert a["skipped"][:STEPS] == b["skipped"][:STEPS] == [step == inf_step for step in range(STEPS)]
    assert a["scales"] == b["scales"]
    if inf_step >= 0:
        assert a["scales"][inf_step] == a["scales"][inf_step - 1] / 2
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name  # one model on both ranks
    # Accelerate's save_state after 5 steps, load_state into a new run: the last 5 steps again, bit for bit
    for rank in (a, b):
        assert rank["resumed"] == rank["losses"][5:], plan
        assert rank["resumed_scales"] == rank["scales"][5:STEPS], plan
        for name, w in rank["params"].items():
            assert torch.equal(rank["resumed_params"][name], w), (plan, name)
    want_losses, want = _one_process(plan, inf_step, momentum=0.9)
    both = [(x + y) / 2 for x, y in zip(a["losses"], b["losses"], strict=True)]
    assert both == pytest.approx(want_losses, rel=2e-2), plan
    for name, ref in want.items():
        got = a["params"][name].float()
        if plan == "bf16-sr":  # other rounding noise than one process: a bf16 ulp (2^-8 relative) per step
            assert bool(((got - ref).abs() <= 2e-3 + STEPS * 2.0**-8 * ref.abs()).all()), name
        elif plan == "fp8-mixed":  # fp8 gradients of half batches (2 mantissa bits): the DDP tests' bound
            assert (got - ref).abs().max().item() <= 1e-2, name
        else:
            torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-3, msg=lambda m, name=name: f"{plan} {name}: {m}")


def test_what_the_fsdp2_plugin_asks_that_mixprec_does_not_take_is_refused_with_the_fix(ranks):
    found = ranks[0]["refusals"]
    assert "activation_checkpointing=True) wraps the layers after mixprec has sharded them" in found[
        "activation_checkpointing"]
    assert "fsdp_version=1: mixprec runs its plans on FSDP2 shards only" in found["fsdp_version"]
    assert "--fsdp_cpu_ram_efficient_loading false" in found["cpu_ram_efficient_loading"]
    assert "one optimizer per model" in found["two optimizers"]
    assert "name the plan" in found["auto"]
    assert "in one prepare() call" in found["model alone"]
    assert "Accelerate ignores an FSDP plugin on this device and runs DDP instead" in found["ddp instead"]

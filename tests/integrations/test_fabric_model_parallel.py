"""Lightning Fabric under a sharding strategy (FSDP2 applied by the strategy): mixprec's joint
setup, the documented order and the sharded checkpoint, 2 gloo ranks under torchrun, against one
process on the whole batch. (The Trainer's side: test_lightning_model_parallel.py.)"""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("lightning")

from tests.integrations._common import torchrun as _torchrun
from tests.integrations.test_lightning_model_parallel import SCRIPT, _one_process

pytestmark = [pytest.mark.integration, pytest.mark.distributed, pytest.mark.slow]


def test_fabric_joint_setup_under_a_sharding_strategy_trains_as_the_documented_order_bit_for_bit(tmp_path):
    """setup(fabric, model, opt) with the optimizer built before the strategy sharded the model:
    its param groups are re-bound to the shards (by name), and 10 steps give the losses, weights
    and learning rates of the documented order (setup(fabric, model), then setup_optimizers over
    the sharded parameters), bit for bit. Before: refused at setup; before that, the optimizer
    kept the pre-shard parameters and nothing trained, without a word. An optimizer that already
    holds state for the unsharded parameters, and Fabric's own fabric.setup(model, opt) (mixprec
    never sees the optimizer), are refused, naming the fix."""
    sys.path.insert(0, str(SCRIPT.parent))
    from fabric_joint_setup import PLANS

    a, b = _torchrun(SCRIPT.with_name("fabric_joint_setup.py"), [], tmp_path / "run")
    for cell in (*PLANS, "fully_shard"):
        for rank in (a, b):
            joint, separate = rank[f"joint {cell}"], rank[f"separate {cell}"]
            assert "error" not in joint and "error" not in separate, (cell, joint.get("error"), separate.get("error"))
            assert joint["losses"] == separate["losses"], cell
            assert joint["losses"][-1] < 0.8 * joint["losses"][0], (cell, joint["losses"])  # it trains
            assert joint["lrs"] == separate["lrs"] == [0.05, 0.02], cell
            assert joint["weights"].keys() == separate["weights"].keys()
            for name, w in separate["weights"].items():
                assert torch.equal(joint["weights"][name], w), (cell, name)
        for name, w in a[f"joint {cell}"]["weights"].items():
            assert torch.equal(b[f"joint {cell}"]["weights"][name], w), (cell, name)  # one model on both ranks
    for rank in (a, b):
        stepped = rank["joint stepped"].get("error", "")
        assert stepped.startswith("setup(): the optimizer SGD already holds state"), stepped
        assert "setup_optimizers(fabric, opt)" in stepped
        own = rank["fabric.setup"].get("error", "")
        assert "was not prepared by mixprec" in own and "setup(fabric, model, *optimizers)" in own, own


def test_the_joint_setup_rebinds_by_name_then_by_position_and_refuses_what_is_ambiguous():
    """The re-binding alone, in one process (a copy stands for the sharded model: new parameter
    objects): by name, whatever the groups' order; by position where the parallelize_fn wrapped the
    model (other names, the same parameters in the same order and shapes); refused otherwise."""
    import copy

    from mixprec.integrations.lightning import _Binding

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))

    def opt(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD([{"params": [m[2].weight, m[0].bias]}, {"params": [m[0].weight, m[2].bias], "lr": 0.5}],
                               lr=0.1)

    m = model()
    o = opt(m)
    compiled, sharded = torch.nn.Module(), copy.deepcopy(m)
    compiled.add_module("_orig_mod", m)  # as torch.compile's wrapper names it: no part of the name
    _Binding(compiled, (o,), "ModelParallelStrategy").rebind(sharded)
    assert [[id(p) for p in g["params"]] for g in o.param_groups] == [
        [id(sharded[2].weight), id(sharded[0].bias)], [id(sharded[0].weight), id(sharded[2].bias)]]
    assert [g["lr"] for g in o.param_groups] == [0.1, 0.5]

    m = model()
    o = opt(m)
    wrapped = torch.nn.Sequential(copy.deepcopy(m))  # "0.0.weight" for "0.weight"
    _Binding(m, (o,), "ModelParallelStrategy").rebind(wrapped)
    assert o.param_groups[0]["params"][0] is wrapped[0][2].weight

    m = model()
    o = opt(m)
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2, bias=False))
    with pytest.raises(RuntimeError, match="cannot be re-bound to the sharded parameters unambiguously"):
        _Binding(m, (o,), "ModelParallelStrategy").rebind(other)
    assert o.param_groups[0]["params"][0] is m[2].weight  # left as it was

    o = torch.optim.SGD([*model().parameters()], lr=0.1)
    with pytest.raises(RuntimeError, match="are not parameters of the model being set up"):
        _Binding(m, (o,), "ModelParallelStrategy")


@pytest.mark.parametrize("plan", ["bf16-master", "bf16-kahan", "bf16-sr"])
def test_fabric_documented_order_trains_as_one_process_and_its_sharded_checkpoint_resumes_bit_for_bit(tmp_path, plan):
    """Fabric's own order under a sharding strategy: setup(fabric, model) (sharded by the strategy),
    then the optimizer over the sharded parameters through setup_optimizers(fabric, opt); 10 steps
    against one process. And fabric.save / fabric.load (torch.distributed.checkpoint, which keeps
    only the optimizer's 'state' and 'param_groups': the wrapper's compensation and per-shard noise
    travel in its first param group) resume bit for bit."""
    a, b = _torchrun(SCRIPT.with_name("fabric_sharded_checkpoint.py"), [plan], tmp_path / "run")
    for rank in (a, b):
        assert rank["resumed"] == rank["straight"], plan
        for name, w in rank["after"].items():
            assert torch.equal(rank["resumed_weights"][name], w), (plan, name)
    for name in a["after"]:
        assert torch.equal(a["after"][name], b["after"][name]), name
    losses, params = _one_process(plan)
    both = [(x + y) / 2 for x, y in zip(a["first"] + a["straight"], b["first"] + b["straight"], strict=True)]
    assert both == pytest.approx(losses, rel=2e-2)
    for name, ref in params.items():
        if plan == "bf16-sr":  # other rounding noise than one process: a bf16 ulp per step at most
            diff = (a["after"][name].float() - ref).abs()
            assert bool((diff <= 2e-3 + 10 * 2.0**-8 * ref.abs()).all()), (name, float(diff.max()))
        else:
            torch.testing.assert_close(a["after"][name].float(), ref, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("plan", ["bf16-kahan", "bf16-sr"])
def test_fabric_sharded_checkpoint_resumes_momentum_and_fp32_layers_bit_for_bit(tmp_path, plan):
    """fabric.save / fabric.load with SGD momentum and an fp32 LayerNorm: the optimizer's own state
    (created on load by torch.distributed.checkpoint's zero step) comes back too."""
    a, b = _torchrun(SCRIPT.with_name("fabric_sharded_checkpoint.py"), [plan], tmp_path / "run", ["0.9"])
    for rank in (a, b):
        assert rank["resumed"] == rank["straight"], plan
        for name, w in rank["after"].items():
            assert torch.equal(rank["resumed_weights"][name], w), (plan, name)

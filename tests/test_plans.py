"""Plan registry, overrides, explain(), and model conversion."""

from __future__ import annotations

import re

import pytest
import torch

from mixprec import ConstantLossScaler, DynamicLossScaler, NoOpScaler, get_plan
from mixprec.plans import ALIASES, PLANS

DESIGN_PLANS = (
    "fp32", "tf32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master",
    "bf16-pure", "fp16-pure", "bf16-kahan", "bf16-sr", "fp8-mixed",
)


def test_canonical_names_and_aliases():
    assert set(DESIGN_PLANS) <= set(PLANS)
    for name in PLANS:
        assert get_plan(name).name == name
    expected = {
        "O0": "fp32", "O1": "fp16-mixed", "O2": "fp16-master", "O3": "fp16-pure",
        "fp16": "fp16-mixed", "bf16": "bf16-mixed", "fp16_naive": "fp16-master", "fp8": "fp8-mixed",
    }
    for alias, canonical in expected.items():
        assert ALIASES[alias] == canonical
        assert get_plan(alias).name == canonical
    assert get_plan("o2").name == "fp16-master"


def test_unknown_plan_names_close_matches_and_lists_valid():
    with pytest.raises(ValueError, match=re.escape("unknown precision plan 'bf16-mixd'. Did you mean 'bf16-mixed'")) as e:
        get_plan("bf16-mixd")
    assert "Valid plans: fp32, tf32, bf16-mixed" in str(e.value)


@pytest.mark.parametrize(
    ("name", "scaler_type"),
    [
        ("fp16-mixed", DynamicLossScaler), ("fp16-master", DynamicLossScaler), ("fp16-pure", DynamicLossScaler),
        ("bf16-mixed", NoOpScaler), ("bf16-master", NoOpScaler), ("bf16-kahan", NoOpScaler),
        ("fp32", NoOpScaler), ("fp8-mixed", NoOpScaler),
    ],
)
def test_scaler_per_plan(name, scaler_type):
    assert type(get_plan(name).make_scaler()) is scaler_type


def test_scaling_overrides_like_apex_and_paddle():
    constant = get_plan("O2", loss_scale=128)
    assert isinstance(constant.make_scaler(), ConstantLossScaler) and constant.make_scaler().get_scale() == 128.0
    tuned = get_plan("fp16-mixed", init_scale=1024.0, growth_interval=100, hysteresis=2)
    scaler = tuned.make_scaler()
    assert scaler.get_scale() == 1024.0 and scaler.get_growth_interval() == 100 and scaler.hysteresis == 2
    assert get_plan("bf16-mixed", loss_scale="dynamic").scaling.kind == "dynamic"  # explicit opt-in
    with pytest.raises(ValueError, match=re.escape("pass loss_scale='dynamic' as well to opt in")):
        get_plan("bf16-mixed", init_scale=1024.0)
    with pytest.raises(ValueError, match=re.escape("unknown override(s) ['opt_level'] for plan 'fp16-mixed'")):
        get_plan("fp16-mixed", opt_level="O2")
    with pytest.raises(ValueError, match=re.escape("growth_factor must be a finite number > 1, got 0.5")):
        get_plan("fp16-mixed", growth_factor=0.5)
    with pytest.raises(ValueError, match=re.escape("loss_scale must be 'dynamic', a number")):
        get_plan("fp16-mixed", loss_scale="huge")


def test_plans_are_frozen():
    plan = get_plan("bf16-mixed")
    with pytest.raises(AttributeError):
        plan.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize("name", DESIGN_PLANS)
def test_explain_covers_every_tensor_class(name):
    text = get_plan(name).explain()
    for row in ("weights", "compute", "activations", "grads", "grad accumulation", "master weights",
                "optimizer state", "all-reduce", "loss scaling"):
        assert re.search(rf"^  {row} +\S", text, re.M), (row, text)


def test_explain_values():
    rows = get_plan("bf16-master").tensor_dtypes()
    assert rows["weights"].startswith("bf16") and rows["master weights"] == "fp32"
    assert rows["grad accumulation"] == "fp32" and rows["optimizer state"] == "fp32"
    rows = get_plan("bf16-kahan").tensor_dtypes()
    assert rows["weights"] == "bf16 (norm layers fp32)" and rows["optimizer state"].startswith("bf16")
    assert get_plan("fp32").tensor_dtypes()["compute"] == "fp32"


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.ln = torch.nn.LayerNorm(4)
        self.fc = torch.nn.Linear(4, 2)
        self.register_buffer("table", torch.arange(5, dtype=torch.int64))


def test_master_plan_keeps_norms_fp32_and_integer_buffers():
    net = _Net()
    originals = get_plan("bf16-master").convert_model(net)
    assert net.conv.weight.dtype == torch.bfloat16 and net.fc.bias.dtype == torch.bfloat16
    assert net.bn.weight.dtype == torch.float32 and net.bn.running_var.dtype == torch.float32
    assert net.ln.weight.dtype == torch.float32
    assert net.bn.num_batches_tracked.dtype == torch.int64 and net.table.dtype == torch.int64
    assert set(originals) == {net.conv.weight, net.conv.bias, net.fc.weight, net.fc.bias}


def test_half_model_is_handled_not_rejected():
    net = _Net().half()
    get_plan("fp16-master").convert_model(net)
    assert net.bn.weight.dtype == torch.float32 and net.fc.weight.dtype == torch.float16
    net = _Net().half()
    get_plan("bf16-mixed").convert_model(net)  # mixed plans train fp32 weights
    assert all(p.dtype == torch.float32 for p in net.parameters())


def test_pure_plan_casts_everything():
    net = _Net()
    get_plan("bf16-pure").convert_model(net)
    assert all(p.dtype == torch.bfloat16 for p in net.parameters())
    assert net.bn.num_batches_tracked.dtype == torch.int64

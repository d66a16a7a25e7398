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


# --------------------------------------------------------------- override checks
def test_fp16_compute_on_an_unscaled_plan_needs_an_explicit_loss_scale() -> None:
    msg = (
        "compute_dtype=torch.float16 on plan 'bf16-mixed', which has no loss scaling: fp16 gradients "
        "underflow without it. Use get_plan('fp16-mixed'), or pass loss_scale='dynamic' "
        "(or a constant, or loss_scale=None to run fp16 unscaled on purpose)"
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        get_plan("bf16-mixed", compute_dtype=torch.float16)
    with pytest.raises(ValueError, match=re.escape("Use get_plan('fp16-master')")):
        get_plan("bf16-master", compute_dtype="fp16")
    scaled = get_plan("bf16-mixed", compute_dtype="fp16", loss_scale="dynamic", lower_ops=["softmax"])
    assert scaled.compute_dtype == torch.float16 and scaled.scaling.kind == "dynamic"
    assert scaled.policy is not None and scaled.policy.dtype == torch.float16  # the policy follows the override
    assert get_plan("bf16-mixed", compute_dtype=torch.float16, loss_scale=None).scaling.kind == "none"
    assert get_plan("fp16-mixed", compute_dtype=torch.bfloat16).compute_dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("plan", "overrides", "error", "message"),
    [
        ("bf16-mixed", {"compute_dtype": torch.int8}, ValueError,
         "override compute_dtype=int8 for plan 'bf16-mixed' is not a floating dtype mixprec computes in"),
        ("bf16-mixed", {"compute_dtype": 16}, TypeError,
         "override compute_dtype=16 for plan 'bf16-mixed' must be a torch.dtype or a dtype name"),
        ("bf16-mixed", {"compute_dtype": torch.float32}, ValueError,
         "compute_dtype=torch.float32 is not a compute dtype for plan 'bf16-mixed' (expected torch.bfloat16 or "
         "torch.float16); use get_plan('fp32') for fp32 compute"),
        ("fp32", {"compute_dtype": torch.bfloat16}, ValueError,
         "compute_dtype=torch.bfloat16 is not a compute dtype for plan 'fp32' (expected torch.float32)"),
        ("bf16-mixed", {"reduce_dtype": torch.int32}, ValueError, "override reduce_dtype=int32 for plan 'bf16-mixed'"),
        ("bf16-mixed", {"policy": "x"}, TypeError,
         "override policy='x' for plan 'bf16-mixed' has the wrong type str; expected OpPolicy or None"),
        ("fp16-master", {"accumulate_grads_in_fp32_hooks": "yes"}, TypeError,
         "override accumulate_grads_in_fp32_hooks='yes' for plan 'fp16-master' has the wrong type str; expected bool"),
        ("tf32", {"tf32": 1}, TypeError, "override tf32=1 for plan 'tf32' has the wrong type int; expected bool"),
        ("bf16-kahan", {"rounding": "nearest"}, ValueError,
         "override rounding='nearest' for plan 'bf16-kahan' is not one of 'kahan' or 'stochastic'"),
        ("bf16-sr", {"seed": 1.5}, TypeError, "override seed=1.5 for plan 'bf16-sr' has the wrong type float; expected int"),
        ("bf16-pure", {"state_dtype": torch.int8}, ValueError, "override state_dtype=int8 for plan 'bf16-pure'"),
        ("bf16-mixed", {"nosuch": 1}, ValueError, "unknown override(s) ['nosuch'] for plan 'bf16-mixed'"),
        ("fp16-mixed", {"loss_scale": float("inf")}, ValueError,
         "loss_scale=inf: a constant loss scale must be a finite number in [2**-126, "),
        ("fp32", {"loss_scale": 1.2588846498201833e-107}, ValueError,  # found by test_get_plan_fuzz
         "loss_scale=1.2588846498201833e-107: a constant loss scale must be a finite number in [2**-126, "),
        ("fp16-mixed", {"loss_scale": True}, TypeError,
         "loss_scale must be 'dynamic', a number (constant scale) or None, got True"),
        ("bf16-mixed", {"fp32_modules": 3}, TypeError, "fp32_modules takes a sequence of nn.Module classes"),
    ],
)
def test_bad_overrides_are_refused_naming_the_override(plan, overrides, error, message) -> None:
    with pytest.raises(error, match=re.escape(message)):
        get_plan(plan, **overrides)


def test_pure_plan_state_dtype_none_is_accepted() -> None:
    assert get_plan("bf16-pure", state_dtype=None).state_dtype is None
    assert get_plan("fp16-pure", state_dtype="fp32").state_dtype == torch.float32


def test_tf32_regions_overlapping_across_threads_restore_the_original_setting() -> None:
    import threading

    plan = get_plan("tf32")
    original = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    seen: dict[str, str] = {}
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def region_a() -> None:
        with plan.autocast():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def region_b() -> None:
        a_in.wait(5)
        with plan.autocast():
            b_in.set()
            a_out.wait(5)
            seen["b after a left"] = torch.get_float32_matmul_precision()
            with plan.autocast():  # nested in the same thread
                pass
            seen["b after nested"] = torch.get_float32_matmul_precision()

    try:
        threads = [threading.Thread(target=region_a), threading.Thread(target=region_b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert seen == {"b after a left": "high", "b after nested": "high"}
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(original)

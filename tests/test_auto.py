"""``precision="auto"``: the plan chosen for each kind of hardware (facts injected), its
explanation, the session and checkpoint paths, and the measured facts of this machine."""

from __future__ import annotations

import re

import pytest
import torch

from mixprec import MixedPrecision, get_plan
from mixprec.hardware import DeviceFacts, device_facts, gemm_speed
from mixprec.plans import auto as auto_module
from mixprec.plans.auto import MIN_SPEEDUP, choose_plan, fp8_share


def _facts(device_type: str = "cpu", *, bf16: float, fp16: float, **info: object) -> DeviceFacts:
    """Facts whose bf16 / fp16 GEMMs run ``bf16`` / ``fp16`` times as fast as fp32."""
    ms = {"fp32": 1.0, "bf16": 1.0 / bf16, "fp16": 1.0 / fp16}
    return DeviceFacts(device_type=device_type, name=str(info.pop("name", "test device")), gemm_size=256,
                       gemm_ms=ms, **info)  # type: ignore[arg-type]


HARDWARE = {
    # CPUs: AMX / AVX512-BF16 (bf16 several times fp32), AVX2 only (bf16 emulated, ~40x slower), ARM with bf16
    "cpu-amx": (_facts(bf16=5.0, fp16=0.02, bf16_instructions=True), "bf16-mixed"),
    "cpu-avx512-bf16": (_facts(bf16=2.2, fp16=0.02, bf16_instructions=True), "bf16-mixed"),
    "cpu-avx2": (_facts(bf16=0.025, fp16=0.01), "fp32"),
    "cpu-flags-but-slow": (_facts(bf16=0.9, fp16=0.01, bf16_instructions=True), "fp32"),
    "arm-bf16": (_facts(bf16=1.8, fp16=1.5, bf16_instructions=True), "bf16-mixed"),
    # GPUs: V100 / T4 (fp16 tensor cores, no bf16), A100 (bf16), H100 (bf16 + native fp8)
    "v100": (_facts("cuda", bf16=0.5, fp16=7.0, cuda_capability=(7, 0), bf16_supported=False), "fp16-mixed"),
    "t4": (_facts("cuda", bf16=1.0, fp16=6.0, cuda_capability=(7, 5), bf16_supported=True), "fp16-mixed"),
    "a100": (_facts("cuda", bf16=8.0, fp16=8.0, cuda_capability=(8, 0), bf16_instructions=True), "bf16-mixed"),
    "h100": (_facts("cuda", bf16=8.7, fp16=8.5, cuda_capability=(9, 0), bf16_instructions=True, native_fp8=True),
             "bf16-mixed"),
}


@pytest.mark.parametrize("hardware", list(HARDWARE))
def test_auto_chooses_the_plan_each_kind_of_hardware_runs_fast(hardware: str) -> None:
    facts, expected = HARDWARE[hardware]
    choice = choose_plan(facts)
    assert choice.plan == expected
    text = choice.text()
    assert text.startswith(f"auto chose {expected}: ")
    assert f"{facts.speedup(torch.bfloat16):.2f}x" in text  # the measured ratio is quoted
    assert facts.name in text
    if expected == "fp32":
        assert "'bf16-kahan'" in text and "memory" in text  # what still pays there, by name
    if facts.native_fp8:
        assert "fp8-mixed not chosen" in text


def test_auto_chooses_fp8_only_for_wide_linear_layers_on_gpus_with_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    facts, _ = HARDWARE["h100"]
    wide = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(8, 2))
    narrow = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    assert choose_plan(facts, wide).plan == "bf16-mixed"  # no width measured to pay yet
    monkeypatch.setattr(auto_module, "FP8_MIN_WIDTH", 64)
    assert fp8_share(wide, 64) == pytest.approx(2 * 64 * 64 / (2 * 64 * 64 + 16))
    assert choose_plan(facts, wide).plan == "fp8-mixed"
    assert "auto chose fp8-mixed over bf16-mixed" in choose_plan(facts, wide).text()
    assert choose_plan(facts, narrow).plan == "bf16-mixed"
    assert "only 0% of the model's Linear weights" in choose_plan(facts, narrow).text()
    assert choose_plan(facts).plan == "bf16-mixed"  # no model: nothing to judge the widths by
    assert choose_plan(HARDWARE["a100"][0], wide).plan == "bf16-mixed"  # no native fp8


def test_min_speedup_is_the_threshold() -> None:
    assert choose_plan(_facts(bf16=MIN_SPEEDUP, fp16=0.1)).plan == "bf16-mixed"
    assert choose_plan(_facts(bf16=MIN_SPEEDUP * 0.99, fp16=0.1)).plan == "fp32"


def _inject(monkeypatch: pytest.MonkeyPatch, facts: DeviceFacts) -> None:
    from mixprec import hardware

    monkeypatch.setattr(hardware, "device_facts", lambda device=None: facts)


@pytest.mark.parametrize("hardware", ["cpu-avx512-bf16", "cpu-avx2"])
def test_get_plan_auto_returns_the_chosen_plan_with_its_reason(monkeypatch: pytest.MonkeyPatch, hardware: str) -> None:
    facts, expected = HARDWARE[hardware]
    _inject(monkeypatch, facts)
    plan = get_plan("auto")
    assert plan.name == expected and plan == get_plan(expected)  # the reason is not part of the plan's identity
    assert plan.auto_reason == choose_plan(facts).text()
    explained = plan.explain()
    assert explained.startswith(f"plan {expected}: ")
    assert "why (precision='auto'):" in explained and f"auto chose {expected}" in explained
    assert get_plan("AUTO").name == expected
    assert get_plan(expected).auto_reason is None and "why" not in get_plan(expected).explain()


def test_get_plan_auto_takes_overrides_and_refuses_device_for_named_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    _inject(monkeypatch, HARDWARE["cpu-avx512-bf16"][0])
    assert get_plan("auto", fp32_ops=["gelu"]).policy is not None
    with pytest.raises(ValueError, match=r"device= and model= are for get_plan\('auto'\)"):
        get_plan("bf16-mixed", device="cpu")
    with pytest.raises(TypeError, match=r"needs an nn\.Module, got str"):
        get_plan("auto", model="gpt2")


@pytest.mark.parametrize(("hardware", "override", "error"), [
    ("cpu-avx2", {"lower_ops": ["softmax"]}, ValueError),  # fp32: no autocast for op lists to act on
    ("cpu-avx512-bf16", {"init_scale": 1024}, ValueError),
    ("cpu-avx512-bf16", {"state_dtype": "8bit"}, ValueError),
    ("cpu-avx512-bf16", {"convert_frozen": "often"}, TypeError),
])
def test_an_override_auto_cannot_take_names_the_plan_auto_chose_and_the_way(monkeypatch, hardware, override, error):
    """Before: 'plan fp32 ...' without a word that auto chose fp32, nor of naming the plan."""
    facts, chosen = HARDWARE[hardware]
    _inject(monkeypatch, facts)
    key = next(iter(override))
    with pytest.raises(error, match=re.escape(f"get_plan('auto', {key}=...): auto chose {chosen} on this device, and "
                                              "there: ") + r".*Name the plan the overrides are for instead of 'auto'"):
        get_plan("auto", **override)


def test_auto_on_a_meta_model_names_get_plan_with_the_device(monkeypatch) -> None:
    """Before: MixedPrecision('auto') said 'pass the device', and with device= it said 'drop device='."""
    _inject(monkeypatch, HARDWARE["cpu-avx512-bf16"][0])
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    for kwargs in ({}, {"device": "cpu"}):
        mp = MixedPrecision("auto", **kwargs)
        with pytest.raises(ValueError, match=re.escape(
            "the model's parameters are on 'meta' (not materialized yet). Choose the plan for that device first and "
            "prepare the meta model with it: MixedPrecision(get_plan('auto', device='cpu', model=model))"
        )):
            mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    mp = MixedPrecision(get_plan("auto", device="cpu", model=model))  # the way named works
    model, _ = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert mp.plan.name == "bf16-mixed" and model.weight.device.type == "meta"
    with pytest.raises(ValueError, match=re.escape("Prepare the meta model without device=")):
        MixedPrecision("bf16-mixed", device="cpu").prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_auto_cannot_be_registered_as_a_plan_name() -> None:
    from mixprec.plans import register_plan

    with pytest.raises(ValueError, match=r"'auto' is taken"):
        register_plan("auto", lambda: get_plan("fp32"))


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("meta", "device 'meta' holds no data, so nothing can be timed there; pass the device the model trains on"),
        ("tpu", "get_plan('auto', device='tpu'): "),
        (3.5, "get_plan('auto', device=3.5): "),
    ],
)
def test_auto_refuses_a_device_it_cannot_measure(device: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        get_plan("auto", device=device)


def test_auto_on_a_missing_cuda_device_says_so() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=re.escape("torch.cuda.is_available() is False; pass device='cpu'")):
        get_plan("auto", device="cuda")


@pytest.mark.parametrize("hardware", ["cpu-avx512-bf16", "cpu-avx2"])
def test_auto_session_records_the_chosen_plan_and_a_resume_elsewhere_says_it_changed(
    monkeypatch: pytest.MonkeyPatch, hardware: str
) -> None:
    facts, expected = HARDWARE[hardware]
    _inject(monkeypatch, facts)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    mp = MixedPrecision("auto")
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    with mp.autocast():
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    mp.backward(loss)
    assert mp.step().stepped
    sd = mp.state_dict()
    assert sd["plan"] == expected == mp.plan.name

    # the same hardware resumes; a named plan equal to the chosen one resumes too
    again = MixedPrecision("auto")
    again.load_state_dict(sd)
    MixedPrecision(expected).load_state_dict(sd)

    # other hardware: "auto" chooses another plan, and the load says so and how to keep the saved one
    other = "cpu-avx2" if hardware == "cpu-avx512-bf16" else "cpu-avx512-bf16"
    _inject(monkeypatch, HARDWARE[other][0])
    elsewhere = MixedPrecision("auto")
    if elsewhere.plan.fingerprint() != get_plan(expected).fingerprint():
        expected_message = f"chosen by precision='auto' on this hardware; to keep the checkpoint's plan, name it: precision='{expected}'"
        with pytest.raises(ValueError, match=re.escape(expected_message)):
            elsewhere.load_state_dict(sd)


def test_auto_session_chooses_again_with_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    facts, _ = HARDWARE["h100"]
    _inject(monkeypatch, facts)
    monkeypatch.setattr(auto_module, "FP8_MIN_WIDTH", 16)
    mp = MixedPrecision("auto")
    assert mp.plan.name == "bf16-mixed"  # no model yet
    chosen = {}
    import mixprec.session as session_module

    real = session_module.prepare_model

    def spy(model, plan, **kwargs):  # the conversion itself would need a GPU with fp8: record the plan only
        chosen["plan"] = plan.name
        return real(model, get_plan("bf16-mixed"), **kwargs)

    monkeypatch.setattr(session_module, "prepare_model", spy)
    mp.prepare_model(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)))
    assert chosen["plan"] == "fp8-mixed"


def test_this_machines_facts_are_measured_quickly_and_consistently() -> None:
    import time

    from mixprec.hardware import _facts

    _facts.cache_clear()
    start = time.perf_counter()
    facts = device_facts("cpu")
    assert time.perf_counter() - start < 5.0  # "sub-second" on any machine we know; generous for a busy one
    assert facts.device_type == "cpu" and facts.speedup(torch.float32) == 1.0
    assert {"fp32", "bf16"} <= set(facts.gemm_ms) and all(ms > 0 for ms in facts.gemm_ms.values())
    assert device_facts("cpu") is facts  # measured once
    assert torch.get_num_threads() == 1  # the probe's one thread is given back (conftest sets 1)
    plan = get_plan("auto", device="cpu")
    assert plan.name in ("bf16-mixed", "fp32")
    assert (plan.name == "bf16-mixed") is ((facts.speedup(torch.bfloat16) or 0) >= MIN_SPEEDUP)


def test_gemm_speed_leaves_out_dtypes_that_do_not_run_and_restores_threads() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = gemm_speed("cpu", (torch.float32, torch.int8), 32, budget_s=0.01)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert set(out) == {"fp32"} or set(out) == {"fp32", "int8"}  # int8 mm runs on some builds


def _ranks_disagree(rank: int, world_size: int) -> None:
    from mixprec import hardware

    # rank 0 measures fast bf16, rank 1 slow: two plans would train two different models under DDP
    facts = HARDWARE["cpu-avx512-bf16" if rank == 0 else "cpu-avx2"][0]
    hardware.device_facts = lambda device=None: facts  # this process only
    mp = MixedPrecision("auto")
    assert mp.plan.name == "bf16-mixed", (rank, mp.plan.name)
    assert ("as rank 0 chose" in (mp.plan.auto_reason or "")) is (rank == 1)
    model = torch.nn.Linear(4, 4)
    mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))  # chosen again there: still rank 0's
    assert mp.plan.name == "bf16-mixed" and mp.state_dict()["plan"] == "bf16-mixed"


@pytest.mark.distributed
def test_under_torch_distributed_every_rank_takes_rank_0s_choice() -> None:
    from tests._dist import run_ranks

    run_ranks(_ranks_disagree, 2)

"""The fp8 pay-off table: predictions, fp8-mixed's filter, precision="auto" and explain(),
each from a table injected here (no table is measured for a CPU, and none is shipped for a
GPU kind until it is measured there)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import mixprec.plans.auto as auto_module
from mixprec import MixedPrecision, get_plan
from mixprec.fp8 import Fp8Linear, PayoffRow, PayoffTable, fp8_layers, model_payoff, table_for
from mixprec.fp8 import payoff as payoff_module
from mixprec.hardware import DeviceFacts
from mixprec.plans.auto import FP8_MIN_GAIN, choose_plan

TABLE = PayoffTable(
    kind="sm90",
    device="test GPU",
    source="injected by tests/test_fp8_payoff.py",
    rows=(
        PayoffRow(8192, 16, 16, 0.4, kernels=9),
        PayoffRow(8192, 64, 64, 0.9, kernels=9),
        PayoffRow(8192, 256, 256, 1.5, kernels=9),
    ),
)

H100 = DeviceFacts("cuda", "test H100", cuda_capability=(9, 0), bf16_instructions=True, native_fp8=True,
                   gemm_size=256, gemm_ms={"fp32": 1.0, "bf16": 0.115, "fp16": 0.118})


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64), nn.Linear(64, 64), nn.Linear(64, 10))


@pytest.fixture
def tables(monkeypatch):
    """A clean registry: the tests put in it the tables they mean."""
    registry: dict[str, PayoffTable | None] = {}
    monkeypatch.setattr(payoff_module, "TABLES", registry)
    return registry


def test_prediction_is_the_nearest_measured_shape():
    assert TABLE.predict(8192, 256, 256).speedup == 1.5
    assert TABLE.predict(4096, 300, 200).shape == (8192, 256, 256)
    assert TABLE.predict(8192, 16, 10).speedup == 0.4  # below every measured shape: the smallest, no extrapolation
    assert TABLE.predict(8192, 4096, 4096).speedup == 1.5  # above: the largest


def test_a_table_round_trips_through_json_and_bad_ones_say_what_is_expected(tmp_path):
    data = json.loads(json.dumps(TABLE.to_json()))
    assert PayoffTable.from_json(data) == TABLE
    with pytest.raises(ValueError, match=r"expected .*'rows'"):
        PayoffTable.from_json({"kind": "sm90"})
    with pytest.raises(ValueError, match="positive, finite speedup"):
        PayoffTable("sm90", "x", "y", (PayoffRow(1, 1, 1, float("nan")),))
    with pytest.raises(ValueError, match="at least one measured shape"):
        PayoffTable("sm90", "x", "y", ())


def test_no_table_is_shipped_for_a_kind_not_measured():
    assert payoff_module.load_table("sm00") is None
    assert table_for("cpu") is None


def test_model_payoff_counts_gemm_work_of_layers_that_pay():
    result = model_payoff(_model(), TABLE, 8192)
    total = 256 * 256 + 256 * 64 + 64 * 64 + 64 * 10
    assert result.share == pytest.approx(256 * 256 / total)
    assert result.speedup == pytest.approx(total / (256 * 256 / 1.5 + total - 256 * 256))
    assert sorted(result.predictions) == ["0", "2", "3"]  # the 10-wide head is never fp8


def test_fp8_mixed_converts_only_the_layers_the_table_predicts_to_pay(tables):
    tables["cpu"] = TABLE  # (injected for the CPU: the filter reads the table of the model's device)
    plan = get_plan("fp8-mixed")
    model = _model()
    model, _ = MixedPrecision(plan).prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert list(fp8_layers(model)) == ["0"]
    text = plan.explain()
    assert "fp8 layers of the prepared model:" in text
    assert "0  fp8: predicted 1.50x of bf16 at (M, K, N) = (8192, 256, 256)" in text
    assert "2  bf16: predicted 0.90x of bf16 at (M, K, N) = (8192, 256, 64), below min_payoff=1" in text
    assert "3  bf16: predicted 0.90x" in text and "nearest measured (8192, 64, 64) on sm90" in text
    assert "4  bf16: not eligible" in text
    assert list(plan.layer_choices) == ["0", "2", "3", "4"]
    every = get_plan("fp8-mixed", min_payoff=None)
    assert list(fp8_layers(MixedPrecision(every).prepare(_model()))) == ["0", "2", "3"]
    lower = get_plan("fp8-mixed", min_payoff=0.8)
    assert list(fp8_layers(MixedPrecision(lower).prepare(_model()))) == ["0", "2", "3"]


def test_without_a_table_every_eligible_layer_is_converted_and_explain_says_why(tables):
    plan = get_plan("fp8-mixed")
    model = MixedPrecision(plan).prepare(_model())
    assert list(fp8_layers(model)) == ["0", "2", "3"]
    assert "no measured pay-off table for a CPU (fp8 is emulated there)" in plan.explain()
    assert "every eligible layer" in plan.explain()


def test_fp8_mixed_layers_keep_the_users_filter_and_islands(tables):
    tables["cpu"] = TABLE
    plan = get_plan("fp8-mixed", min_payoff=None, module_filter=lambda name, m: name != "3")
    MixedPrecision(plan).prepare(_model())
    assert plan.layer_choices["3"] == "bf16: module_filter kept it"
    assert plan.layer_choices["0"].startswith("fp8")


def test_fp8_plan_options_are_checked():
    with pytest.raises(ValueError, match="min_payoff=-1"):
        get_plan("fp8-mixed", min_payoff=-1.0)
    with pytest.raises(ValueError, match="tokens=0"):
        get_plan("fp8-mixed", tokens=0)
    with pytest.raises(ValueError, match="cast='fast'"):
        get_plan("fp8-mixed", cast="fast")
    plan = get_plan("fp8-mixed", cast="eager")
    assert plan.cast == "eager" and "eager quantiser" in plan.explain()


def test_auto_picks_fp8_where_enough_gemm_time_pays(tables):
    tables["sm90"] = TABLE
    wide = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(16, 16))
    narrow = nn.Sequential(nn.Linear(64, 64), nn.Linear(16, 16))
    choice = choose_plan(H100, wide)
    assert choice.plan == "fp8-mixed"
    assert "2 of 3 eligible Linear layers" in choice.text() and "injected by tests" in choice.text()
    choice = choose_plan(H100, narrow)
    assert choice.plan == "bf16-mixed"
    assert "fp8-mixed not chosen: 0 of 2 eligible Linear layers" in choice.text()
    assert f"below the {FP8_MIN_GAIN}x that pays" in choice.text()
    assert choose_plan(H100).plan == "bf16-mixed"  # no model: nothing to predict
    assert "no model given" in choose_plan(H100).text()


def test_auto_gain_threshold(tables, monkeypatch):
    tables["sm90"] = PayoffTable("sm90", "test GPU", "a test", (PayoffRow(8192, 256, 256, 1.05),))
    model = nn.Sequential(nn.Linear(256, 256))
    assert choose_plan(H100, model).plan == "bf16-mixed"  # 1.05x < FP8_MIN_GAIN
    monkeypatch.setattr(auto_module, "FP8_MIN_GAIN", 1.05)
    assert choose_plan(H100, model).plan == "fp8-mixed"


def test_auto_without_a_table_follows_fp8_min_width(tables):
    choice = choose_plan(H100, nn.Sequential(nn.Linear(256, 256)))
    assert choice.plan == "bf16-mixed" and "no pay-off table for sm90" in choice.text()


def test_a_table_on_disk_is_found_by_kind(tmp_path, monkeypatch, tables):
    """load_table reads mixprec/fp8/payoff_<kind>.json (what the benchmark's --table writes)."""
    import importlib.resources

    (tmp_path / "payoff_sm99.json").write_text(json.dumps(TABLE.to_json() | {"kind": "sm99"}))
    monkeypatch.setattr(importlib.resources, "files", lambda package: tmp_path)
    payoff_module.load_table.cache_clear()
    try:
        assert payoff_module.table_of_kind("sm99").kind == "sm99"
    finally:
        payoff_module.load_table.cache_clear()


def test_fp8_linear_from_the_plan_folds_once_per_step():
    plan = get_plan("fp8-mixed", cast="compile")
    model = MixedPrecision(plan).prepare(_model())
    assert all(isinstance(m, Fp8Linear) and m.scale_update == "step" and m.cast == "compile"
               for m in fp8_layers(model).values())


def _bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_fp8_shapes.py"
    spec = importlib.util.spec_from_file_location("bench_fp8_shapes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shapes_benchmark_runs_and_its_table_loads(tmp_path, monkeypatch, capsys):
    """A smoke run on CPU (times mean nothing there), and the table it would write on a GPU
    (the GPU kind and name faked) loads as a PayoffTable."""
    bench = _bench()
    out = tmp_path / "rows.json"
    assert bench.main(["--device", "cpu", "--shapes", "32,32,16", "--repeats", "1", "--warmup", "0",
                       "--casts", "eager", "--json", str(out), "--table", str(tmp_path / "t.json")]) == 0
    text = capsys.readouterr().out
    assert "| 32 | 32 | 16 |" in text and "not written (no native fp8 GEMMs on cpu" in text
    rows = json.loads(out.read_text())
    assert rows[0]["m"] == 32 and rows[0]["speedup[fp8[eager]]"] > 0
    monkeypatch.setattr(bench, "gpu_kind", lambda device: "sm90")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a faked GPU")
    table = bench.table(rows, "eager", torch.device("cpu"), ["--shapes", "32,32,16"])
    assert PayoffTable.from_json(json.loads(json.dumps(table.to_json()))) == table
    assert table.kind == "sm90" and table.rows[0].k == 32 and "cast=eager" in table.source

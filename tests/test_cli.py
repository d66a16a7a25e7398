"""The ``mixprec`` command end to end, with tiny settings: demo, bench, explain, memory, bad input."""

from __future__ import annotations

import collections
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec.cli import COMMAND_MODULES, commands, main
from mixprec.cli.harness import max_batch_for
from mixprec.plans import PLANS, get_plan

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# Factories for --model module:factory (imported by the CLI as tests.test_cli:NAME).
def tiny_classifier() -> nn.Module:
    """A plain module: the CLI makes synthetic data from --input-shape and --num-classes."""
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def tiny_task(seed: int) -> tuple[nn.Module, object, nn.Module]:
    """The (model, batch_fn, criterion) form, seeded."""

    def batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch_size, 4, generator=generator)
        return x, (x.sum(dim=1) > 0).long()

    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), batch, nn.CrossEntropyLoss()


NOT_CALLABLE = 3


def broken_factory() -> nn.Module:
    raise RuntimeError("no weights here")


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# ------------------------------------------------------------------ basics
def test_registry_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert [c.name for c in commands()] == list(COMMAND_MODULES) == ["demo", "bench", "explain", "memory", "inspect", "audit"]
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("mixprec 0.1.0 (torch ")
    assert main([]) == 2
    assert "demo" in capsys.readouterr().err


def test_explain_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "O2"]) == 0
    out = capsys.readouterr().out
    assert out == "O2 is an alias of fp16-master\n" + get_plan("fp16-master").explain() + "\n"
    assert main(["explain"]) == 0
    listing = capsys.readouterr().out
    assert all(f"| {name} " in listing for name in PLANS)
    assert "O2=fp16-master" in listing


# -------------------------------------------------------------------- demo
def _fast_bf16_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's choices as on a CPU with AMX / AVX512-BF16 (the facts injected, so the test
    does not depend on this machine's CPU)."""
    from mixprec import hardware

    facts = hardware.DeviceFacts("cpu", "test cpu", bf16_instructions=True, gemm_size=256,
                                 gemm_ms={"fp32": 1.0, "bf16": 0.4, "fp16": 50.0})
    monkeypatch.setattr(hardware, "device_facts", lambda device=None: facts)
    import mixprec.cli.demo as demo_module

    monkeypatch.setattr(demo_module, "device_facts", lambda device=None: facts)


def test_demo_writes_table_report_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _fast_bf16_cpu(monkeypatch)
    out = tmp_path / "report"
    code = main(["demo", "--quiet", "--size", "tiny", "--steps", "4", "--batch-size", "8",
                 "--eval-batch-size", "16", "--out", str(out)])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "| plan " in stdout and "speedup vs fp32" in stdout and "final loss scale" in stdout
    for plan in ("fp32", "bf16-mixed", "bf16-master", "bf16-kahan"):
        assert f"| {plan} " in stdout
    report = (out / "report.md").read_text()
    assert report.startswith("# mixprec demo: cnn-tiny")
    for png in ("loss.png", "accuracy.png", "loss_scale.png", "step_time.png"):
        assert f"]({png})" in report
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
    data = json.loads((out / "results.json").read_text())
    assert [p["plan"] for p in data["plans"]] == ["fp32", "bf16-mixed", "bf16-master", "bf16-kahan", "fp16-mixed",
                                                  "fp16-mixed"]
    assert [p["label"] for p in data["plans"]][-2:] == ["fp16-mixed", "fp16-mixed hysteresis=2"]
    for p in data["plans"]:
        assert len(p["losses"]) == len(p["scales"]) == len(p["times_s"]) == 4
        assert p["eval_steps"] == [0, 1, 2, 3, 4]  # every steps//15 steps, at least every step
        assert 0.0 <= p["eval_accuracies"][-1] <= 1.0
        assert p["state_bytes_per_param"]["total"] > 0
    assert data["plans"][0]["speedup_vs_fp32"] == 1.0
    # a CPU whose bf16 GEMMs are slower than fp32 is named in the output and the report, never silently
    # this machine's facts (the test injects the demo's)
    from mixprec.cli.harness.environment import device_facts

    speedup = device_facts("cpu").speedup(torch.bfloat16)
    assert data["environment"]["cpu_bf16_speedup"] == speedup and data["settings"]["device"] == "cpu"
    warned = not (speedup is not None and speedup > 1.0)
    assert data["environment"]["cpu_bf16"] is not warned
    assert ("slower than fp32 ones" in stdout) is warned and ("slower than fp32 ones" in report) is warned


@pytest.mark.parametrize(
    ("cpu_bf16", "device", "plans", "warned"),
    [
        (False, "cpu", ["fp32", "bf16-mixed"], True),
        (False, "cpu", ["fp32", "torch-autocast"], True),
        (False, "cpu", ["fp32", "fp16-mixed"], False),  # no bf16 row
        (True, "cpu", ["fp32", "bf16-kahan"], False),
        (False, "cuda", ["fp32", "bf16-mixed"], False),
        (None, "cpu", ["fp32", "bf16-mixed"], False),  # a report from before the fact was recorded
        (False, "cpu", ["fp32", "my-own-plan"], False),  # a Plan built outside the registry: no crash
    ],
)
def test_bf16_speed_note(cpu_bf16: bool | None, device: str, plans: list[str], warned: bool) -> None:
    from mixprec.cli.report import bf16_speed_note

    environment = {} if cpu_bf16 is None else {"cpu_bf16": cpu_bf16}
    note = bf16_speed_note(environment, {"device": device}, plans)
    assert (note is not None) is warned
    if note is not None:
        assert "AVX512-BF16 or AMX" in note


def test_demo_on_a_cpu_where_bf16_is_slow_shows_what_still_pays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mixprec import hardware
    from mixprec.cli import demo as demo_module

    slow = hardware.DeviceFacts("cpu", "test cpu", gemm_size=256, gemm_ms={"fp32": 1.0, "bf16": 40.0, "fp16": 90.0})
    monkeypatch.setattr(hardware, "device_facts", lambda device=None: slow)
    monkeypatch.setattr(demo_module, "device_facts", lambda device=None: slow)
    out = tmp_path / "report"
    assert main(["demo", "--model", "mlp", "--steps", "3", "--no-plots", "--no-fp16", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "precision='auto' picks fp32 on this machine: bf16 GEMMs run at 0.03x" in stdout
    assert "its speed needs bf16 hardware" in stdout
    data = json.loads((out / "results.json").read_text())
    assert [p["plan"] for p in data["plans"]] == list(demo_module.SLOW_BF16_PLANS)
    assert data["settings"]["auto"]["plan"] == "fp32"
    report = (out / "report.md").read_text()
    assert "precision='auto' picks **fp32** here" in report and "'bf16-kahan'" in report


def test_demo_time_budget_cuts_steps_but_not_below_the_floor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mixprec.cli.harness.demo import MIN_BUDGET_STEPS

    assert MIN_BUDGET_STEPS == 20
    _fast_bf16_cpu(monkeypatch)
    out = tmp_path / "report"
    # a budget far below what 40 steps take: the run stops at the floor the harness keeps
    assert main(["demo", "--model", "mlp", "--plans", "bf16-mixed", "--steps", "40", "--time-budget", "0.001",
                 "--no-plots", "--no-fp16", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    data = json.loads((out / "results.json").read_text())
    settings = data["settings"]
    assert settings["steps"] == 20 and settings["steps_requested"] == 40  # cut to the floor
    assert all(len(p["losses"]) == 20 for p in data["plans"])
    assert data["plans"][0]["eval_steps"][-4:] == [5, 10, 15, 20]  # fewer evaluations once the budget cut
    assert "fitted 20 of 40 steps" in stdout
    assert "fitted 20 of the 40 steps" in (out / "report.md").read_text()
    # --time-budget 0: every step
    assert main(["demo", "--quiet", "--model", "mlp", "--plans", "bf16-mixed", "--steps", "25", "--time-budget", "0",
                 "--no-plots", "--no-fp16", "--out", str(out)]) == 0
    assert json.loads((out / "results.json").read_text())["settings"]["steps"] == 25
    assert main(["demo", "--time-budget", "-1", "--out", str(out)]) == 2
    assert "--time-budget must be a finite number of seconds >= 0" in capsys.readouterr().err


def test_demo_and_bench_take_auto_as_a_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _fast_bf16_cpu(monkeypatch)
    out = tmp_path / "report"
    assert main(["demo", "--quiet", "--model", "mlp", "--plans", "auto", "--steps", "2", "--no-plots", "--no-fp16",
                 "--out", str(out)]) == 0
    assert [p["plan"] for p in json.loads((out / "results.json").read_text())["plans"]] == ["fp32", "bf16-mixed"]


def test_demo_is_deterministic_and_adds_fp32(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--quiet", "--seed", "3", "demo", "--model", "mlp", "--plans", "bf16-mixed,fp16-mixed", "--steps", "3",
            "--no-plots", "--no-fp16"]
    runs = []
    for name in ("a", "b"):
        assert main([*args, "--out", str(tmp_path / name)]) == 0
        runs.append(json.loads((tmp_path / name / "results.json").read_text()))
    capsys.readouterr()
    assert not list((tmp_path / "a").glob("*.png"))
    a, b = runs
    assert [p["plan"] for p in a["plans"]] == ["fp32", "bf16-mixed", "fp16-mixed"]
    for pa, pb in zip(a["plans"], b["plans"], strict=True):
        assert pa["losses"] == pb["losses"] and pa["eval_losses"] == pb["eval_losses"]
    # fp32 and bf16 plans do not scale; fp16-mixed starts at torch's 2**16.
    assert a["plans"][1]["scales"] == [1.0] * 3
    assert a["plans"][2]["scales"][0] in (2.0**16, 2.0**15)


def test_demo_with_a_plain_module_factory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--quiet", "--model", "tests.test_cli:tiny_classifier", "--input-shape", "8",
                 "--num-classes", "3", "--plans", "bf16-mixed", "--steps", "3", "--out", str(tmp_path), "--no-plots",
                 "--no-fp16"])
    assert code == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["workload"] == "tiny_classifier"
    assert data["chance"] == pytest.approx(1 / 3)
    assert all(p["eval_accuracies"][-1] is not None for p in data["plans"])
    capsys.readouterr()


def _changes(scales: list[float]) -> tuple[int, int]:
    """(growths, backoffs) in a scale history."""
    pairs = list(itertools.pairwise(scales))
    return sum(b > a for a, b in pairs), sum(b < a for a, b in pairs)


def test_demo_fp16_runs_show_growth_backoff_and_skips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The default demo trains two fp16-mixed runs whose scale visibly grows, backs off and skips steps."""
    code = main(["demo", "--quiet", "--plans", "fp32", "--steps", "30", "--batch-size", "16",
                 "--eval-batch-size", "16", "--out", str(tmp_path), "--no-plots"])
    assert code == 0
    capsys.readouterr()
    data = json.loads((tmp_path / "results.json").read_text())
    runs = {p["label"]: p for p in data["plans"]}
    assert list(runs) == ["fp32", "fp16-mixed", "fp16-mixed hysteresis=2"]
    for label in ("fp16-mixed", "fp16-mixed hysteresis=2"):
        scales, skipped = runs[label]["scales"], runs[label]["skipped"]
        growths, backoffs = _changes([2.0**24, *scales])
        assert growths >= 1 and backoffs >= 1, (label, scales)
        assert any(skipped), label
    # hysteresis 2: the first overflow is skipped without a backoff.
    first = runs["fp16-mixed hysteresis=2"]
    assert first["skipped"][0] and first["scales"][0] == 2.0**24
    assert runs["fp16-mixed"]["scales"][0] == 2.0**23
    assert "fp16-mixed hysteresis=2:" in (tmp_path / "report.md").read_text()


# ------------------------------------------------------------------- bench
def test_bench_writes_json_and_markdown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js, md = tmp_path / "out" / "bench.json", tmp_path / "bench.md"
    code = main(["bench", "--quiet", "--model", "mlp", "tests.test_cli:tiny_task", "--size", "tiny",
                 "--plans", "bf16-mixed", "bf16-kahan", "--repeats", "2", "--warmup", "1",
                 "--memory-budget", "64MiB", "--json", str(js), "--markdown", str(md)])
    assert code == 0
    stdout = capsys.readouterr().out
    assert md.read_text() in stdout and "max batch @ 64.00 MiB" in stdout
    data = json.loads(js.read_text())
    assert data["format"] == "mixprec.bench/1"
    assert data["command"].startswith("mixprec bench")
    assert data["settings"]["memory_budget_bytes"] == 64 * 2**20
    rows = data["rows"]
    assert [(r["model"], r["plan"]) for r in rows] == [
        (m, p) for m in ("mlp-tiny", "tiny_task") for p in ("fp32", "torch-autocast", "bf16-mixed", "bf16-kahan")
    ]
    keys = {"model", "plan", "label", "batch", "params", "step_time_s", "min_step_time_s", "times_s", "speedup_vs_fp32",
            "speedup_vs_autocast", "peak_memory_bytes", "peak_ratio_vs_fp32", "state_bytes_per_param",
            "state_ratio_vs_fp32", "estimated_peak_bytes", "peak_bytes_per_sample", "max_batch", "final_loss",
            "skipped"}
    for r in rows:
        assert keys <= set(r)
        assert len(r["times_s"]) == 2 and r["step_time_s"] >= r["min_step_time_s"] == min(r["times_s"]) > 0
        if r["plan"] == "torch-autocast":  # the memory tools run MixedPrecision, not the plain loop
            assert r["peak_memory_bytes"] is None and r["max_batch"] is None
        else:
            assert r["peak_memory_bytes"] > 0 and r["estimated_peak_bytes"] > 0
            assert isinstance(r["max_batch"], int) and r["max_batch"] > 0
    by = {(r["model"], r["plan"]): r for r in rows}
    assert by["mlp-tiny", "bf16-kahan"]["peak_ratio_vs_fp32"] < 1.0
    assert by["mlp-tiny", "fp32"]["speedup_vs_fp32"] == 1.0
    assert by["mlp-tiny", "torch-autocast"]["speedup_vs_autocast"] == 1.0
    assert by["mlp-tiny", "torch-autocast"]["label"] == "torch.autocast (bf16)"
    # AdamW: fp32 4 + 4 + 8 bytes; Kahan: bf16 weight, grad, compensation and two moments.
    assert by["mlp-tiny", "fp32"]["state_bytes_per_param"]["total"] == pytest.approx(16.0, abs=0.2)
    assert by["mlp-tiny", "bf16-kahan"]["state_bytes_per_param"]["total"] == pytest.approx(10.0, abs=0.2)


def test_max_batch_from_two_points() -> None:
    # peak = 1 GiB fixed + 10 MiB per sample; a 2 GiB budget leaves room for 102 samples.
    peaks = [2**30 + 8 * 10 * 2**20, 2**30 + 16 * 10 * 2**20]
    assert max_batch_for(2 * 2**30, [8, 16], peaks) == (102, float(2**30), 10.0 * 2**20)
    assert max_batch_for(2**29, [8, 16], peaks)[0] == 0


# ------------------------------------------------------------------ memory
def test_memory_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js = tmp_path / "memory.json"
    assert main(["memory", "--model", "mlp", "--size", "tiny", "--plans", "fp32", "bf16-master", "bf16-kahan",
                 "--batch-size", "8", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mlp-tiny: ") and "| plan " in out and "| activations |" in out
    rows = {r["plan"]: r for r in json.loads(js.read_text())["rows"]}
    assert list(rows) == ["fp32", "bf16-master", "bf16-kahan"]
    assert rows["fp32"]["bytes_per_param"] == pytest.approx(16.0, abs=0.2)
    assert rows["bf16-kahan"]["bytes_per_param"] == pytest.approx(10.0, abs=0.2)
    assert rows["bf16-master"]["master_weights"] > 0 and rows["fp32"]["master_weights"] == 0
    assert 0 < rows["bf16-master"]["activations"] < rows["fp32"]["activations"]
    assert main(["memory", "--model", "mlp", "--size", "tiny", "--plans", "bf16"]) == 0
    assert "activations not included" in capsys.readouterr().out


# ------------------------------------------------------------ bad arguments
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["demo", "--plans", "bf17-mixed"], "mixprec demo: error: unknown precision plan 'bf17-mixed'."),
        (["demo", "--model", "resnet"], "mixprec demo: error: unknown model 'resnet'; built-in models are gpt, cnn"),
        (["bench", "--model", "no_such_module_xyz:make"],
         "mixprec bench: error: --model 'no_such_module_xyz:make': cannot import 'no_such_module_xyz': "
         "ModuleNotFoundError: No module named 'no_such_module_xyz'"),
        (["demo", "--model", "tests.test_cli:missing"],
         "mixprec demo: error: --model 'tests.test_cli:missing': module 'tests.test_cli' has no attribute 'missing'"),
        (["demo", "--model", "tests.test_cli:NOT_CALLABLE"],
         "mixprec demo: error: --model 'tests.test_cli:NOT_CALLABLE': 'NOT_CALLABLE' is a int, not a callable factory"),
        (["demo", "--model", "tests.test_cli:", "--steps", "1"],
         "mixprec demo: error: --model 'tests.test_cli:': expected a built-in name or module:factory"),
        (["memory", "--model", "tests.test_cli:tiny_classifier"],
         "mixprec memory: error: --model 'tests.test_cli:tiny_classifier' returned a plain nn.Module: pass "
         "--input-shape and --num-classes"),
        (["memory", "--model", "tests.test_cli:broken_factory"],
         "mixprec memory: error: --model 'tests.test_cli:broken_factory': the factory raised RuntimeError: "
         "no weights here"),
        (["bench", "--memory-budget", "lots"], "mixprec bench: error: cannot read 'lots' as a memory size"),
        (["explain", "fp64"], "mixprec explain: error: unknown precision plan 'fp64'."),
    ],
)
def test_bad_arguments_exit_with_one_line(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert _error_line(capsys).startswith(expected)


def test_unwritable_outputs_fail_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert main(["demo", "--out", str(blocker / "report")]) == 2
    assert _error_line(capsys).startswith(f"mixprec demo: error: cannot write the report folder '{blocker / 'report'}': ")
    assert main(["bench", "--json", str(blocker / "x.json")]) == 2
    assert _error_line(capsys).startswith("mixprec bench: error: cannot write the JSON file ")


def test_console_script_error_has_no_traceback() -> None:
    script = Path(sys.executable).with_name("mixprec")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "mixprec.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, "demo", "--plans", "nope"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("mixprec demo: error: unknown precision plan 'nope'.")


@pytest.mark.parametrize("module", ["mixprec", "mixprec.cli"])
def test_python_dash_m_runs_the_command(module: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", module, "explain", "bf16-mixed"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("plan bf16-mixed:")


# ------------------------------------------------------- robustness of the runs
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["demo", "--lr", "inf"],
         "mixprec demo: error: argument --lr: expected a finite positive number, got 'inf' (see mixprec demo --help)"),
        (["demo", "--lr", "nan"], "mixprec demo: error: argument --lr: expected a finite positive number, got 'nan'"),
        (["demo", "--lr", "-1"], "mixprec demo: error: argument --lr: expected a finite positive number, got '-1'"),
        (["demo", "--seed", str(2**70)],
         f"mixprec demo: error: argument --seed: must be at most 2**63-1 = {2**63 - 1}, got {2**70}"),
        (["--seed", str(2**64), "explain", "fp32"], "mixprec: error: argument --seed: must be at most 2**63-1"),
        (["demo", "--steps", "0"], "mixprec demo: error: argument --steps: expected a positive integer, got '0'"),
    ],
)
def test_out_of_range_options_exit_2_with_one_line(argv: list[str], expected: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert _error_line(capsys).startswith(expected)


def test_a_diverging_run_fails_with_one_line_and_status_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--quiet", "--model", "mlp", "--size", "tiny", "--plans", "bf16-mixed", "--steps", "52",
                 "--batch-size", "4", "--lr", "1e30", "--no-plots", "--out", str(tmp_path / "r")])
    assert code == 1
    line = _error_line(capsys)
    assert line.startswith("mixprec demo: failed: 50 consecutive steps were skipped because the loss itself was inf/NaN")
    assert line.endswith("(MIXPREC_TRACEBACK=1 shows where)")


def test_an_interrupted_run_leaves_the_previous_report_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import mixprec.cli.report

    out = tmp_path / "report"
    base = ["demo", "--quiet", "--model", "mlp", "--size", "tiny", "--plans", "bf16-mixed", "--steps", "2",
            "--batch-size", "4", "--out", str(out)]
    assert main(["--seed", "1", *base]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == sorted(["report.md", "results.json", "loss.png", "accuracy.png", "loss_scale.png",
                                     "step_time.png"])

    def interrupted(*args: object, **kwargs: object) -> str:  # Ctrl-C after the plots were drawn
        raise KeyboardInterrupt

    monkeypatch.setattr(mixprec.cli.report, "demo_markdown", interrupted)
    assert main(["--seed", "2", *base]) == 130
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no new plot beside the old report
    monkeypatch.undo()
    capsys.readouterr()

    assert main(["--seed", "2", *base, "--no-plots"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "results.json"]  # old plots gone
    assert "--seed 2" in (out / "report.md").read_text()


def _default_sigint() -> None:
    """In the child: Ctrl-C at its default, whatever the runner inherited (a job started in the
    background by a shell ignores SIGINT, and Python then keeps ignoring it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for(predicate: Callable[[], bool], proc: subprocess.Popen[str], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"never saw {what} (exit status {proc.returncode}): {err[-2000:]}")
        time.sleep(0.01)


def _maps(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""


@pytest.mark.skipif(not hasattr(signal, "SIGINT") or not Path("/proc/self/maps").exists(),
                    reason="needs POSIX signals and /proc/PID/maps to see torch loading")
@pytest.mark.parametrize("module", ["mixprec", "mixprec.cli"])
def test_ctrl_c_while_the_command_loads_torch_is_one_line_and_status_130(tmp_path: Path, module: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", module, "demo", "--out", str(tmp_path / "report")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=_default_sigint)
    # torch's shared library is mapped at the start of `import torch`, seconds before the
    # command's own code runs: the signal lands while mixprec is still being imported
    _wait_for(lambda: "libtorch" in _maps(proc.pid), proc, "torch loading")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err in ("mixprec: interrupted\n", "mixprec demo: interrupted\n"), err  # no traceback
    assert not (tmp_path / "report").exists()


_SLOW_PUBLISH = """
import sys, time, types
from mixprec.cli import demo, main
demo.train_side_by_side = lambda *args, **kwargs: types.SimpleNamespace(settings={"steps": 1})

def slow_report(result, staging, command, plots=True):
    (staging / "report.md").write_text("half-written")
    print("writing", flush=True)
    time.sleep(120)
    return []

demo.write_demo_report = slow_report
sys.exit(main(["demo", "--quiet", "--no-fp16", "--plans", "fp32", "--steps", "1", "--out", sys.argv[1]]))
"""


@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or sys.platform == "win32", reason="needs POSIX SIGTERM")
def test_sigterm_while_the_report_is_written_removes_the_staging_folder(tmp_path: Path) -> None:
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.md").write_text("the previous report")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_PUBLISH, str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_default_sigint)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the report is being written (or the process ended)
    assert line == "writing\n", proc.communicate()[1]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert err == "mixprec demo: terminated\n"
    assert [p.name for p in out.iterdir()] == ["report.md"]  # no .mixprec-partial-* folder left
    assert (out / "report.md").read_text() == "the previous report"


# ------------------------------------------------------------- CLI polish
@pytest.mark.parametrize("command", [None, *COMMAND_MODULES])
def test_help_is_plain_text(command: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    """No reStructuredText markup (double back-quotes, :func: roles) in any --help."""
    with pytest.raises(SystemExit):
        main(["--help"] if command is None else [command, "--help"])
    text = capsys.readouterr().out
    assert "usage: mixprec" in text
    assert "``" not in text
    assert not re.search(r":[a-z]+:`", text), text


def test_explain_says_when_it_resolved_an_alias(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "O2"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "O2 is an alias of fp16-master"
    assert main(["explain", "bf16-true"]) == 0  # Lightning: bf16 model, no autocast, no loss scaling
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "bf16-true is an alias of bf16-pure"
    plan = get_plan("bf16-true")
    assert (plan.name, plan.uses_autocast, plan.scaling.kind) == ("bf16-pure", False, "none")
    assert main(["explain", "bf16-master"]) == 0
    assert capsys.readouterr().out.startswith("plan bf16-master")


def test_lightning_16_true_is_refused_naming_the_closest_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """Lightning's '16-true' has no loss scaling; fp16-pure has: not an alias, a clear error."""
    assert main(["explain", "16-true"]) == 2
    line = _error_line(capsys)
    assert line.startswith("mixprec explain: error: plan '16-true': Lightning's '16-true' (the model in fp16, no autocast, "
                           "no loss scaling) has no mixprec plan")
    assert "The closest plan is 'fp16-pure'" in line and "loss_scale=None" in line
    with pytest.raises(ValueError, match="closest plan is 'fp16-pure'"):
        get_plan("16-true")


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("nope", "mixprec demo: error: --device 'nope': not a device name torch knows; use cpu, cuda or cuda:N"),
        ("meta", "mixprec demo: error: --device 'meta': mixprec's commands run on cpu or cuda"),
        pytest.param("cuda", "mixprec demo: error: --device 'cuda': CUDA is not available here",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
        pytest.param("cuda:99", "mixprec demo: error: --device 'cuda:99': this machine has",
                     marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ],
)
def test_device_errors_name_the_value(device: str, expected: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device", device, "demo", "--steps", "1", "--out", str(tmp_path)]) == 2
    assert _error_line(capsys).startswith(expected)
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_device_option_trains_there(device: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--quiet", "--device", device, "--model", "mlp", "--plans", "bf16-mixed", "--steps", "3",
            "--no-plots", "--out", str(tmp_path)]
    assert main(args) == 0
    capsys.readouterr()
    data = json.loads((tmp_path / "results.json").read_text())
    assert all(len(p["losses"]) == 3 for p in data["plans"])
    cpu = tmp_path / "cpu"
    assert main([*args[:3], "cpu", *args[4:-1], str(cpu)]) == 0
    capsys.readouterr()
    ref = json.loads((cpu / "results.json").read_text())
    for a, b in zip(data["plans"], ref["plans"], strict=True):  # same weights, same batches
        assert a["losses"][0] == pytest.approx(b["losses"][0], rel=1e-2)


def test_progress_is_one_line_per_plan_when_not_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Piped (pytest captures stderr: not a TTY), no bar redraws, one line per plan."""
    assert main(["demo", "--model", "mlp", "--plans", "bf16-mixed", "--steps", "3", "--no-plots",
                 "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b[" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 4, err  # fp32, bf16-mixed and the two fp16 runs
    assert lines[0].startswith("fp32") and ": 3 steps, median step" in lines[0]
    assert lines[-1].startswith("fp16-mixed hysteresis=2: 3 steps")
    assert main(["bench", "--model", "mlp", "--plans", "bf16-mixed", "--repeats", "1", "--warmup", "1",
                 "--memory-budget", "none"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    assert [line.split(":")[0] for line in err.strip().splitlines()] == ["bench"] * 3  # fp32, torch.autocast, plan


class _Features(dict):  # a model-output-like dict subclass with an attribute of its own
    pass


def test_on_device_moves_nested_batches_keeping_their_types() -> None:
    """Batches of any nesting (namedtuples, dict subclasses) reach the device with their structure."""
    from mixprec.cli.common import on_device
    from mixprec.cli.harness import Workload

    pair = collections.namedtuple("pair", "x mask")

    class NestedTask:
        model = nn.Linear(2, 2)
        criterion = nn.MSELoss()
        chance = None

        def batch(self, batch_size: int, generator: torch.Generator) -> tuple[object, object]:
            features = _Features(tokens=torch.randn(batch_size, 2, generator=generator), lengths=[batch_size])
            features.source = "synthetic"
            return pair(features, torch.ones(batch_size, dtype=torch.bool)), torch.zeros(batch_size, 2)

        def eval_batch(self, batch_size: int = 256) -> tuple[object, object]:
            return self.batch(batch_size, torch.Generator().manual_seed(0))

    workload = Workload(name="nested", make=lambda seed: NestedTask())  # type: ignore[arg-type,return-value]
    task = on_device(workload, torch.device("meta")).make(0)  # any non-CPU device takes the moving path
    assert task.model.weight.device.type == "meta"
    for inputs, targets in (task.batch(3, torch.Generator().manual_seed(1)), task.eval_batch(4)):
        assert type(inputs) is pair and type(inputs.x) is _Features and inputs.x.source == "synthetic"
        assert inputs.x["tokens"].device.type == "meta" and inputs.mask.device.type == "meta"
        assert inputs.mask.dtype == torch.bool and inputs.x["lengths"] == [inputs.mask.shape[0]]
        assert targets.device.type == "meta"


def test_audit_names_the_risks_of_a_pure_bf16_loop_and_strict_fails_on_them(capsys):
    assert main(["audit", "--weights", "bf16", "--strict"]) == 1
    out = capsys.readouterr().out
    assert "risk [pure_low_precision]" in out and "proposal: bf16-kahan" in out
    assert main(["audit", "--autocast", "fp16", "--scaler", "torch", "--strict"]) == 0
    assert "no precision risk found" in capsys.readouterr().out

"""``mixprec inspect``: the error table, headroom, advice, report.md and the plot."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec.cli import COMMAND_MODULES, main


class Cancel(nn.Module):
    """``(x + 1000) - 1000``: exact in fp32, ruins bf16 (its spacing at 1000 is 4)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + 1000) - 1000


# Factory for --model module:factory (imported by the CLI as tests.test_cli_inspect:NAME).
def planted_task(seed: int) -> tuple[nn.Module, object, nn.Module]:
    """A small classifier with one precision-sensitive layer, ``cancel``."""

    def batch(batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch_size, 8, generator=generator)
        return x, (x.sum(dim=1) > 0).long()

    model = nn.Sequential(OrderedDict([("fc1", nn.Linear(8, 16)), ("cancel", Cancel()), ("fc2", nn.Linear(16, 2))]))
    return model, batch, nn.CrossEntropyLoss()


def test_registered() -> None:
    assert "inspect" in COMMAND_MODULES


def test_inspect_tiny_cnn_writes_table_report_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "inspect"
    assert main(["inspect", "--model", "cnn", "--size", "tiny", "--batch-size", "4", "--top", "5",
                 "--threads", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "plan bf16-mixed vs fp32" in text
    assert "Modules by error (worst 5 of 29)" in text
    assert "| module" in text and "fwd own err" in text and "grad dB" in text
    # Which five modules rank worst depends on the CPU's bf16 kernels (oneDNN accumulates
    # differently with and without bf16 instructions): only the count and the order are fixed.
    ranked = text.split("Modules by error", 1)[1].split("\n\n", 1)[0].splitlines()[3:]
    assert len(ranked) == 5 and all(row.startswith("| ") for row in ranked)
    assert "Conv2d" in text  # the tiny CNN's error sits in its convolutions, whichever rank first
    assert "Headroom (tightest 5 of 29)" in text and "fp16 gradient underflow at loss scale 65536" in text
    report = (out / "report.md").read_text(encoding="utf-8")
    assert report.startswith("# mixprec inspect")
    assert "Conv2d" in report and "![SQNR per module](sqnr.png)" in report
    assert (out / "sqnr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_advise_names_the_planted_layer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "advise"
    assert main(["inspect", "--model", "tests.test_cli_inspect:planted_task", "--batch-size", "32", "--advise",
                 "--no-plots", "--threads", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    ranked = text.split("Modules by error", 1)[1].split("\n")
    assert ranked[3].startswith("| cancel "), text  # worst first, under the header and the rule
    assert "+ fp32 island 'cancel'" in text
    assert "result: within tolerance" in text and "of parameters" in text
    assert "fp32_modules=['cancel']" in text
    assert "fp32 island 'cancel'" in (out / "report.md").read_text(encoding="utf-8")
    assert not (out / "sqnr.png").exists()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--plan", "bf17"], "mixprec inspect: error: unknown precision plan 'bf17'. Did you mean "),
        (["--model", "tests.test_cli_inspect:nope"],
         "mixprec inspect: error: --model 'tests.test_cli_inspect:nope': module 'tests.test_cli_inspect' has no "
         "attribute 'nope'"),
    ],
)
def test_bad_arguments_exit_with_one_line(
    argv: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", *argv, "--out", str(tmp_path / "x")]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith(expected)
    assert captured.out == ""


def test_unwritable_out_fails_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("", encoding="utf-8")
    assert main(["inspect", "--model", "mlp", "--out", str(blocker / "report")]) == 2
    assert capsys.readouterr().err.startswith("mixprec inspect: error: cannot write the report folder ")


@pytest.mark.parametrize(
    ("plan", "islands"),
    [("bf16-mixed", ["cancel.proj"]), ("fp16-mixed", ["overflow.proj", "cancel.proj"])],
)
def test_advise_on_the_builtin_fragile_model(
    plan: str, islands: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The built-in ``fragile`` model: the advisor finds its real problems (bf16 cancellation,
    fp16 overflow) and the islands it proposes bring the plan within tolerance."""
    from mixprec.cli.models import build_task
    from mixprec.diagnostics import compare
    from mixprec.plans import get_plan

    assert main(["inspect", "--model", "fragile", "--plan", plan, "--advise", "--no-plots",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    advice = out.split("Advice: fp32 islands", 1)[1]
    assert "within tolerance;" in advice and "NOT within" not in advice
    assert f"use: get_plan({plan!r}, fp32_modules={islands!r})" in advice
    assert f"use: get_plan({plan!r}, fp32_modules={islands!r})" in (tmp_path / "report.md").read_text()
    # Independently: the plan as given is far from fp32, the plan with the islands is close.
    task = build_task("fragile", size="tiny", seed=0)
    batch = task.batch(16, torch.Generator().manual_seed(0))
    before = compare(task.model, batch, plan, criterion=task.criterion)
    after = compare(task.model, batch, get_plan(plan, fp32_modules=islands), criterion=task.criterion)
    assert not before.grad_rel_err < 0.1
    assert after.loss_rel_err < 0.1 and after.grad_rel_err < 0.1

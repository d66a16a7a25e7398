"""Training-step time of a small GPT with fp8 linear layers vs ``torch.autocast`` bf16.

Both variants train copies of the same model on the same batches in one process; the
repeats are interleaved (A B, B A, A B, ...) and the median step time of each is reported,
with the ratio to the bf16 baseline. The fp8 variant converts every eligible
``nn.Linear`` with :func:`mixprec.fp8.convert_to_fp8` and runs the rest of the model under
the same bf16 autocast (what the "fp8-mixed" plan does). This is a benchmark, not a test:
it prints a Markdown table and the command that produced it, and never fails on time.

Usage::

    python benchmarks/bench_fp8.py                      # small GPT, emulated fp8, CPU
    python benchmarks/bench_fp8.py --fp32-gemm-row      # also the fp32-math emulation, for comparison
    python benchmarks/bench_fp8.py --size tiny --repeats 5
    python benchmarks/bench_fp8.py --device cuda --fp8-gemm auto   # native fp8 on sm_89+
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import shlex
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

import mixprec.fp8.gemm as fp8_gemm
from mixprec import fp8
from mixprec.cli.models import build_task


@dataclass(frozen=True)
class Variant:
    """One row of the table: whether autocast runs, and whether (how) linears go fp8."""

    name: str
    autocast: bool
    fp8: bool = False
    track_stats: bool = True
    fp32_gemm: bool = False  # emulate in fp32 math even where the CPU has bf16 GEMMs

    def convert(self, model: nn.Module, args: argparse.Namespace) -> nn.Module:
        if not self.fp8:
            return model
        recipe: fp8.Fp8Recipe = (
            fp8.DelayedScaling(amax_history_len=args.amax_history_len)
            if args.recipe == "delayed"
            else fp8.CurrentScaling()
        )
        emulate = True if args.fp8_gemm == "emulated" else None
        return fp8.convert_to_fp8(model, recipe, emulate=emulate, track_stats=self.track_stats)


BASELINE = "bf16-mixed (bf16 autocast)"


def _variants(args: argparse.Namespace) -> list[Variant]:
    gemm = "emulated" if args.fp8_gemm == "emulated" else "auto"
    rows = [
        Variant(BASELINE, autocast=True),
        Variant(f"fp8-mixed: fp8 {args.recipe}, {gemm} GEMM, + bf16 autocast", autocast=True, fp8=True),
    ]
    if not args.no_stats_row:
        name = f"fp8-mixed: fp8 {args.recipe}, {gemm} GEMM, track_stats=False, + bf16 autocast"
        rows.append(Variant(name, autocast=True, fp8=True, track_stats=False))
    if args.fp32_gemm_row:
        name = f"fp8-mixed: fp8 {args.recipe}, emulated GEMM in fp32 math, + bf16 autocast"
        rows.append(Variant(name, autocast=True, fp8=True, fp32_gemm=True))
    if args.with_fp32:
        rows.insert(0, Variant("fp32", autocast=False))
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runner:
    """A model, its optimizer and one training step, as users run it."""

    @contextlib.contextmanager
    def _gemm_math(self):  # type: ignore[no-untyped-def]
        """For the fp32-math row: the emulation as it ran before it used bf16 GEMMs."""
        if not self.variant.fp32_gemm:
            yield
            return
        real = fp8_gemm.cpu_bf16_gemm_available
        fp8_gemm.cpu_bf16_gemm_available = lambda: False  # type: ignore[assignment]
        try:
            yield
        finally:
            fp8_gemm.cpu_bf16_gemm_available = real

    def __init__(self, variant: Variant, model: nn.Module, criterion: nn.Module, device: torch.device,
                 args: argparse.Namespace) -> None:
        self.variant = variant
        self.model = variant.convert(model, args).to(device)
        self.criterion = criterion
        self.device = device
        self.autocast = variant.autocast
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.times: list[float] = []
        self.loss = float("nan")

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        _sync(self.device)
        start = time.perf_counter()
        with self._gemm_math():
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                loss = self.criterion(self.model(inputs), targets)
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        _sync(self.device)
        elapsed = time.perf_counter() - start
        self.loss = loss.item()
        return elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="gpt", help="mixprec.cli.models task (default: gpt)")
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--batch-size", type=int, default=None, help="default: the task's own")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    parser.add_argument("--recipe", default="delayed", choices=["delayed", "current"])
    parser.add_argument("--amax-history-len", type=int, default=16)
    parser.add_argument(
        "--fp8-gemm",
        default="emulated",
        choices=["emulated", "auto"],
        help="emulated: always emulate; auto: native torch._scaled_mm where the GPU has it",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for CPU runs")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--with-fp32", action="store_true", help="add an fp32 row")
    parser.add_argument(
        "--no-stats-row", action="store_true", help="drop the fp8 row without saturation/underflow stats"
    )
    parser.add_argument(
        "--fp32-gemm-row", action="store_true",
        help="add an fp8 row whose emulated GEMMs run in fp32 math even where the CPU has bf16 GEMMs",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    task = build_task(args.task, size=args.size, seed=args.seed)
    batch_size = args.batch_size or task.default_batch_size
    runners = [
        Runner(v, copy.deepcopy(task.model), task.criterion, device, args) for v in _variants(args)
    ]
    fp8_runner = next(r for r in runners if r.variant.fp8)
    converted = len(fp8.fp8_layers(fp8_runner.model))
    linears = sum(isinstance(m, nn.Linear) for m in fp8_runner.model.modules())

    generator = torch.Generator().manual_seed(args.seed)
    for i in range(args.warmup + args.repeats):
        inputs, targets = (t.to(device) for t in task.batch(batch_size, generator))
        order = runners if i % 2 == 0 else runners[::-1]  # interleave, alternating who goes first
        for runner in order:
            elapsed = runner.step(inputs, targets)
            if i >= args.warmup:
                runner.times.append(elapsed)

    base = statistics.median(next(r for r in runners if r.variant.name == BASELINE).times)
    gemm = "native where available" if args.fp8_gemm == "auto" else "emulated"
    where = "native" if fp8.native_fp8_available(device) and args.fp8_gemm == "auto" else "emulated"
    print(f"## fp8 vs bf16 autocast: {args.task}/{args.size}, batch {batch_size}, {device}")
    print()
    print(f"- command: `{shlex.join([sys.executable.rsplit('/', 1)[-1], *sys.argv])}`")
    print(f"- torch {torch.__version__}, threads {torch.get_num_threads()}, fp8 GEMM: {gemm} (this run: {where}"
          f"; CPU bf16 GEMMs for the emulation: {fp8.cpu_bf16_gemm_available()})")
    print(f"- {converted} of {linears} nn.Linear layers in fp8; {args.warmup} warm-up + "
          f"{args.repeats} interleaved timed steps per variant; median")
    print()
    print("| variant | median step (ms) | min (ms) | step time vs bf16-mixed | speed vs bf16-mixed | loss after last step |")
    print("|---|---:|---:|---:|---:|---:|")
    for runner in runners:
        med = statistics.median(runner.times)
        print(
            f"| {runner.variant.name} | {med * 1e3:.1f} | {min(runner.times) * 1e3:.1f} | "
            f"{med / base:.2f}x | {base / med:.2f}x | {runner.loss:.4f} |"
        )


if __name__ == "__main__":
    main()

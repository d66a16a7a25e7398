"""Where fp8 linear layers pay: one ``nn.Linear`` forward + backward, bf16 autocast against
mixprec's fp8 layer, over a sweep of square widths (the table ``precision="auto"`` reads).

Each width ``d`` times ``Linear(d, d)`` on ``tokens`` x ``d`` inputs, forward and backward:

- ``bf16``: ``torch.autocast(dtype=torch.bfloat16)`` around the fp32 layer (what bf16-mixed runs);
- ``fp8``: :func:`mixprec.fp8.convert_to_fp8` with ``DelayedScaling`` and ``track_stats=False``,
  under the same autocast (what fp8-mixed runs, minus the diagnostics);
- ``fp8+stats``: the same with the default ``track_stats=True``.

Times are medians over ``--repeats`` after warm-up (CUDA events on a GPU). The ratio
column is bf16 time over fp8 time (> 1: fp8 faster). Without native fp8 GEMMs the fp8
layer is emulated (exact, slower): the sweep still runs, as a smoke test.

Usage::

    python benchmarks/bench_fp8_shapes.py                  # CUDA: widths 512..8192, 8192 tokens
    python benchmarks/bench_fp8_shapes.py --device cpu --widths 64 128 --tokens 256 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from mixprec.fp8 import DelayedScaling, convert_to_fp8, native_fp8_available


def _timer(device: torch.device) -> Callable[[Callable[[], None], int], float]:
    def run(fn: Callable[[], None], repeats: int) -> float:
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return run


def _step(layer: nn.Module, x: torch.Tensor, device: torch.device) -> Callable[[], None]:
    def fn() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = layer(x)
        y.float().sum().backward()
        layer.zero_grad(set_to_none=True)

    return fn


def sweep(widths: list[int], tokens: int, repeats: int, warmup: int, device: torch.device) -> list[dict[str, float]]:
    timer = _timer(device)
    rows = []
    for d in widths:
        torch.manual_seed(0)
        x = torch.randn(tokens, d, device=device, requires_grad=True)
        row: dict[str, float] = {"width": d, "tokens": tokens}
        for variant in ("bf16", "fp8", "fp8+stats"):
            layer: nn.Module = nn.Linear(d, d, device=device)
            if variant != "bf16":
                layer = convert_to_fp8(nn.Sequential(layer), DelayedScaling(), track_stats=variant == "fp8+stats")
            fn = _step(layer, x, device)
            for _ in range(warmup):
                fn()
            row[variant] = timer(fn, repeats)
        row["bf16/fp8"] = row["bf16"] / row["fp8"]
        row["bf16/fp8+stats"] = row["bf16"] / row["fp8+stats"]
        rows.append(row)
        print(f"  d={d}: bf16 {row['bf16']:.3f} ms, fp8 {row['fp8']:.3f} ms, fp8+stats {row['fp8+stats']:.3f} ms",
              flush=True)
    return rows


def markdown(rows: list[dict[str, float]], device: torch.device, argv: list[str]) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    native = native_fp8_available(device)
    lines = [
        f"fp8 linear layer vs bf16 autocast, forward + backward, {rows[0]['tokens']} tokens; device: {name}; "
        f"native fp8 GEMMs: {native}; torch {torch.__version__}",
        "",
        "| width | bf16 (ms) | fp8 (ms) | fp8 + stats (ms) | bf16/fp8 | bf16/(fp8 + stats) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {int(r['width'])} | {r['bf16']:.3f} | {r['fp8']:.3f} | {r['fp8+stats']:.3f} | "
                     f"{r['bf16/fp8']:.2f}x | {r['bf16/fp8+stats']:.2f}x |")
    lines += ["", "command: `python benchmarks/bench_fp8_shapes.py " + shlex.join(argv) + "`"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        return 0
    rows = sweep(args.widths, args.tokens, args.repeats, args.warmup, device)
    print(markdown(rows, device, argv))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

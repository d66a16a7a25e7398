"""Where fp8 linear layers pay: one ``nn.Linear`` training step, bf16 autocast against
mixprec's fp8 layer as the fp8-mixed plan runs it, by GEMM shape (M, K, N): the pay-off
table that fp8-mixed's filter and ``precision="auto"`` read.

Each shape times ``Linear(K, N)`` on an ``M x K`` input that needs its gradient, forward
and backward:

- ``bf16``: ``torch.autocast(dtype=torch.bfloat16)`` around the fp32 layer (what bf16-mixed runs);
- ``fp8`` (one per ``--casts``): :class:`mixprec.fp8.Fp8Linear` with ``DelayedScaling``
  and the plan's default statistics (``track_stats=True``) under the same autocast, its
  amaxes folded once per step (``scale_update="step"`` and :func:`mixprec.fp8.update_scales`
  after each backward, as the plan does). ``auto`` is the plan's default (the fused cast
  where the native fp8 GEMM runs), ``eager`` the unfused quantiser.

Times are medians over ``--repeats`` after warm-up (CUDA events on a GPU). ``speedup`` is
bf16 time over fp8 time (> 1: fp8 faster). ``kernels`` is the number of GPU kernels one
fp8 step launches (from ``torch.profiler``; ``_scaled_mm`` calls among them in brackets).
Without native fp8 GEMMs the fp8 layer is emulated (exact, slower): the sweep still runs,
as a smoke test, and no table is written.

``--table FILE`` writes the measured table of the first cast in ``--casts`` in the
package's format (:class:`mixprec.fp8.PayoffTable`); copied to
``src/mixprec/fp8/payoff_<kind>.json`` (``kind``: ``sm90`` for compute capability 9.0) it
becomes what fp8-mixed's filter reads on that GPU kind.

Usage::

    python benchmarks/bench_fp8_shapes.py --shapes 8192,4096,4096 8192,8192,8192 --table payoff_sm90.json
    python benchmarks/bench_fp8_shapes.py --widths 1024 2048 4096 8192 --tokens 8192   # square layers
    python benchmarks/bench_fp8_shapes.py --device cpu --widths 64 128 --tokens 256 --repeats 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from mixprec.fp8 import (
    DelayedScaling,
    Fp8Linear,
    PayoffRow,
    PayoffTable,
    native_fp8_available,
    update_scales,
)
from mixprec.fp8.payoff import gpu_kind

Shape = tuple[int, int, int]


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
        y.backward(torch.ones_like(y))
        if isinstance(layer, Fp8Linear):
            update_scales([layer])  # the plan's one call per step (here: the one layer)
        layer.zero_grad(set_to_none=True)
        x.grad = None

    return fn


def kernel_count(fn: Callable[[], None], device: torch.device) -> tuple[int | None, int | None]:
    """(GPU kernels, ``_scaled_mm`` calls) of one ``fn()``, from the profiler; (None, None) on CPU."""
    if device.type != "cuda":
        return None, None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    kernels = sum(1 for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    gemms = sum(1 for e in events if e.name == "aten::_scaled_mm")
    return kernels, gemms


def sweep(shapes: list[Shape], casts: list[str], repeats: int, warmup: int, device: torch.device) -> list[dict]:
    timer = _timer(device)
    rows = []
    for m, k, n in shapes:
        torch.manual_seed(0)
        x = torch.randn(m, k, device=device, requires_grad=True)
        row: dict = {"m": m, "k": k, "n": n}
        variants: list[tuple[str, nn.Module]] = [("bf16", nn.Linear(k, n, device=device))]
        for cast in casts:
            layer = Fp8Linear(k, n, device=device, recipe=DelayedScaling(), cast=cast, scale_update="step")
            variants.append((f"fp8[{cast}]", layer))
        for label, layer in variants:
            fn = _step(layer, x, device)
            for _ in range(warmup):
                fn()
            row[label] = timer(fn, repeats)
            row[f"kernels[{label}]"], row[f"scaled_mm[{label}]"] = kernel_count(fn, device)
            if label != "bf16":
                row[f"speedup[{label}]"] = row["bf16"] / row[label]
        rows.append(row)
        parts = ", ".join(f"{label} {row[label]:.3f} ms" for label, _ in variants)
        print(f"  (M, K, N) = ({m}, {k}, {n}): {parts}", flush=True)
    return rows


def markdown(rows: list[dict], casts: list[str], device: torch.device, argv: list[str]) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    native = native_fp8_available(device)
    head = "| M | K | N | bf16 (ms) | kernels bf16 |"
    rule = "|---:|---:|---:|---:|---:|"
    for cast in casts:
        head += f" fp8 {cast} (ms) | speedup {cast} | kernels {cast} |"
        rule += "---:|---:|---:|"
    lines = [
        f"fp8 linear layer (DelayedScaling, statistics on, amaxes folded once per step) vs bf16 autocast, "
        f"forward + backward; device: {name}; native fp8 GEMMs: {native}; torch {torch.__version__}",
        "",
        head,
        rule,
    ]
    for r in rows:
        bf16_kernels = r["kernels[bf16]"]
        line = f"| {r['m']} | {r['k']} | {r['n']} | {r['bf16']:.3f} | {'-' if bf16_kernels is None else bf16_kernels} |"
        for cast in casts:
            label = f"fp8[{cast}]"
            kernels = r[f"kernels[{label}]"]
            shown = "-" if kernels is None else f"{kernels} ({r[f'scaled_mm[{label}]']} _scaled_mm)"
            line += f" {r[label]:.3f} | {r[f'speedup[{label}]']:.2f}x | {shown} |"
        lines.append(line)
    lines += ["", "command: `python benchmarks/bench_fp8_shapes.py " + shlex.join(argv) + "`"]
    return "\n".join(lines)


def table(rows: list[dict], cast: str, device: torch.device, argv: list[str]) -> PayoffTable:
    """The measured table of ``cast`` (what fp8-mixed's filter reads)."""
    kind = gpu_kind(device)
    assert kind is not None
    versions = f"torch {torch.__version__}"
    try:
        import triton

        versions += f", triton {triton.__version__}"
    except ImportError:
        pass
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    source = (f"benchmarks/bench_fp8_shapes.py {shlex.join(argv)} (cast={cast}; {versions}; measured {when})")
    label = f"fp8[{cast}]"
    return PayoffTable(
        kind=kind,
        device=torch.cuda.get_device_name(device),
        source=source,
        rows=tuple(PayoffRow(r["m"], r["k"], r["n"], round(r[f"speedup[{label}]"], 4), r[f"kernels[{label}]"])
                   for r in rows),
    )


def _shape(text: str) -> Shape:
    try:
        m, k, n = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes takes M,K,N triples such as 8192,4096,4096, not {text!r}") from None
    if min(m, k, n) <= 0:
        raise argparse.ArgumentTypeError(f"--shapes {text!r}: M, K and N must be positive")
    return m, k, n


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--shapes", type=_shape, nargs="+", default=None, help="M,K,N triples")
    p.add_argument("--widths", type=int, nargs="+", default=None, help="square layers K = N (with --tokens as M)")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--casts", nargs="+", default=["auto"], choices=["auto", "eager", "compile", "triton"])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--table", default=None, help="write the pay-off table of the first cast here (GPU only)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        return 0
    shapes = list(args.shapes or [])
    shapes += [(args.tokens, d, d) for d in (args.widths or [])]
    if not shapes:
        shapes = [(args.tokens, d, d) for d in (1024, 2048, 4096, 8192)]
    rows = sweep(shapes, args.casts, args.repeats, args.warmup, device)
    print(markdown(rows, args.casts, device, argv))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if args.table:
        if not native_fp8_available(device):
            print(f"--table {args.table}: not written (no native fp8 GEMMs on {device}: the emulation's times "
                  "predict nothing)")
        else:
            with open(args.table, "w") as f:
                json.dump(table(rows, args.casts[0], device, argv).to_json(), f, indent=2)
            print(f"pay-off table written to {args.table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

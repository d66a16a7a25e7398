"""Where a training step's peak GPU memory goes: mixprec's plans against the plain torch loop.

For each variant (default: ``torch-autocast-bf16``, ``bf16-mixed``, ``torch-autocast-fp16``,
``fp16-mixed``) the GPT of ``bench_gpu.py`` (124M parameters, batch 8 x 1024) trains two
warm-up steps; then one step runs under ``torch.cuda.memory._record_memory_history``. The
allocator's trace is replayed to find the moment of the step's peak, and the tensors alive
then that were allocated during the step are grouped by where they were allocated (the
first frames in mixprec, the model or the benchmark, and the op's own frame). Printed per
variant: the memory held before the step (weights, optimizer state), the step's peak above
it, and the largest groups at the peak; then, per pair of variants of one dtype, the groups
whose bytes differ. This is what explains a peak-memory ratio of ``bench_gpu.py``.

Without a CUDA device it prints "no CUDA device: nothing to measure" and exits with status 0.

Usage::

    python benchmarks/gpu_memory.py [--plans VARIANT ...] [--json PATH] [--top N]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu  # (the same model, batch and variants)

NO_CUDA_MESSAGE = "no CUDA device: nothing to measure"
DEFAULT = ("torch-autocast-bf16", "bf16-mixed", "torch-autocast-fp16", "fp16-mixed")
_OURS = ("mixprec", "bench_gpu", "gpu_memory")


def _where(frames: list[dict[str, Any]]) -> str:
    """A short allocation site: the op's own frame and the first of mixprec / the model / the benchmark."""
    if not frames:
        return "(no stack)"
    first = frames[0]
    own = next((f for f in frames if any(k in f.get("filename", "") for k in _OURS)), None)
    head = f"{first.get('name', '?')} ({Path(first.get('filename', '?')).name}:{first.get('line', '?')})"
    if own is None or own is first:
        return head
    return f"{head} <- {own.get('name', '?')} ({Path(own.get('filename', '?')).name}:{own.get('line', '?')})"


def peak_breakdown(snapshot: dict[str, Any], device: int) -> tuple[int, Counter[str]]:
    """(the largest bytes alive at once among allocations made while recording, those allocations by site)."""
    live: dict[int, tuple[int, str]] = {}
    current = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in snapshot["device_traces"][device]:
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[addr] = (size, _where(event.get("frames", [])))
            current += size
            if current > peak:
                peak, at_peak = current, dict(live)
        elif action in ("free_completed", "free") and addr in live:
            current -= live.pop(addr)[0]
    sites: Counter[str] = Counter()
    for size, where in at_peak.values():
        sites[where] += size
    return peak, sites


def measure(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    config, default_batch = bench_gpu.CONFIGS[args.model]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (args.batch or default_batch, config.seq_len + 1), generator=gen)
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    options = argparse.Namespace(optimizer="adamw-fused", lr=3e-4)
    step = bench_gpu.build_variant(name, config, device, options)
    for _ in range(2):
        step(x, y)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        step(x, y)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, sites = peak_breakdown(snapshot, device.index or 0)
    result = {"variant": name, "held_before_gib": before / 2**30, "step_peak_gib": peak / 2**30,
              "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
              "sites": {k: v / 2**30 for k, v in sites.most_common()}}
    del step, snapshot
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plans", nargs="+", default=list(DEFAULT))
    parser.add_argument("--model", default="gpt2-124m", choices=[c for c in bench_gpu.CONFIGS if c != "quick"])
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE)
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    results = []
    for name in args.plans:
        try:
            results.append(measure(name, args, device))
        except Exception as err:  # reported; the others still run
            results.append({"variant": name, "error": f"{type(err).__name__}: {err}"[:300]})
    for r in results:
        print(f"\n## {r['variant']}")
        if "error" in r:
            print(r["error"])
            continue
        print(f"held before the step {r['held_before_gib']:.3f} GiB; the step's peak above it {r['step_peak_gib']:.3f} GiB; "
              f"max_memory_allocated {r['max_allocated_gib']:.3f} GiB")
        for where, gib in list(r["sites"].items())[: args.top]:
            print(f"  {gib:8.3f} GiB  {where}")
    by_name = {r["variant"]: r for r in results if "error" not in r}
    for torch_name, ours in (("torch-autocast-bf16", "bf16-mixed"), ("torch-autocast-fp16", "fp16-mixed")):
        if torch_name in by_name and ours in by_name:
            a, b = by_name[torch_name], by_name[ours]
            print(f"\n## {ours} - {torch_name}: held {b['held_before_gib'] - a['held_before_gib']:+.3f} GiB, "
                  f"step peak {b['step_peak_gib'] - a['step_peak_gib']:+.3f} GiB")
            keys = set(a["sites"]) | set(b["sites"])
            diffs = sorted(((b["sites"].get(k, 0.0) - a["sites"].get(k, 0.0), k) for k in keys), key=lambda t: -abs(t[0]))
            for d, where in diffs[: args.top]:
                if abs(d) >= 1e-3:
                    print(f"  {d:+8.3f} GiB  {where}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

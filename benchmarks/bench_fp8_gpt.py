"""fp8-mixed against bf16-mixed on a GPT of about 1.3B parameters: speed and held-out loss.

The built-in GPT (24 layers, width 2048, 16 heads, sequence 2048, vocabulary 8192: 1.24B
parameters) trains ``--steps`` steps (default 100) with each plan from the same initial
weights on the same batches of a fixed Markov-chain language (``mixprec.cli.models``;
nothing downloaded): fused AdamW, lr 3e-4 after a 10-step linear warm-up (the session's
scheduler), clipping at 1.0. Reported per plan: the median step time after 10 steps (CUDA
events), tokens/s, the peak memory, and the loss on 8 held-out batches after training; then
fp8-mixed's speed against bf16-mixed's and the relative difference of their held-out losses
(the acceptance of the fp8 issue: >= 1.15x and within 1%).

Without a CUDA device (or without native fp8 GEMMs for fp8-mixed) it says so and exits 0.

Usage::

    python benchmarks/bench_fp8_gpt.py [--steps 100] [--batch 4] [--plans bf16-mixed fp8-mixed] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from mixprec import MixedPrecision
from mixprec.cli.models import GPT, GPTConfig, MarkovLanguage, TokenCrossEntropy
from mixprec.fp8 import native_fp8_available

WARMUP_LR_STEPS, UNTIMED = 10, 10


def train(plan: str, args: argparse.Namespace, batches: list[Any], heldout: list[Any], device: torch.device) -> dict[str, Any]:
    config = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, num_layers=args.layers, dim=args.dim, num_heads=args.heads)
    torch.manual_seed(0)
    with device:
        model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP_LR_STEPS))
    mp = MixedPrecision(plan, clip_grad_norm=1.0)
    model, opt, schedule, criterion = mp.prepare(model, opt, scheduler=schedule, criterion=TokenCrossEntropy())
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i, (x, y) in enumerate(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with mp.autocast():
            loss = criterion(model(x), y)
        mp.backward(loss)
        mp.step()
        end.record()
        if i >= UNTIMED:
            times.append((start, end))
    torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in times]
    model.eval()
    with torch.no_grad(), mp.autocast():
        held = [float(criterion(model(x), y)) for x, y in heldout]
    result = {"plan": plan, "median_ms": statistics.median(ms) if ms else math.nan,
              "tokens_per_s": args.batch * args.seq / (statistics.median(ms) / 1e3) if ms else math.nan,
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "heldout_loss": sum(held) / len(held),
              "skipped": len(batches) - mp.optimizer_steps, "parameters": sum(p.numel() for p in model.parameters())}
    del model, opt, mp
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plans", nargs="+", default=["bf16-mixed", "fp8-mixed"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    plans = [p for p in args.plans if p != "fp8-mixed" or native_fp8_available(device)]
    if len(plans) < len(args.plans):
        print("fp8-mixed left out: this GPU has no native fp8 GEMMs (compute capability < 8.9)")
    language = MarkovLanguage(args.vocab, args.seq, seed=0)
    g = torch.Generator().manual_seed(1)
    batches = [tuple(t.to(device) for t in language.sample(args.batch, g)) for _ in range(args.steps)]
    heldout = [tuple(t.to(device) for t in language.sample(args.batch, g)) for _ in range(8)]
    results = []
    for plan in plans:
        try:
            results.append(train(plan, args, batches, heldout, device))
        except Exception as err:  # reported; the others still run
            results.append({"plan": plan, "error": f"{type(err).__name__}: {err}"[:300]})
            gc.collect()
            torch.cuda.empty_cache()
    print(f"device {torch.cuda.get_device_name(device)}, torch {torch.__version__}, {args.steps} steps, batch "
          f"{args.batch} x {args.seq}, command: {' '.join([sys.executable, *sys.argv])}\n")
    print("| plan | parameters | step (ms) | tokens/s | peak (GiB) | held-out loss | skipped |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        if "error" in r:
            print(f"| {r['plan']} | error: {r['error']} | | | | | |")
            continue
        print(f"| {r['plan']} | {r['parameters'] / 1e9:.2f}B | {r['median_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
              f"{r['peak_gib']:.1f} | {r['heldout_loss']:.4f} | {r['skipped']} |")
    by = {r["plan"]: r for r in results if "error" not in r}
    if "bf16-mixed" in by and "fp8-mixed" in by:
        a, b = by["bf16-mixed"], by["fp8-mixed"]
        speed = a["median_ms"] / b["median_ms"]
        rel = abs(b["heldout_loss"] - a["heldout_loss"]) / a["heldout_loss"]
        print(f"\nfp8-mixed vs bf16-mixed: speed {speed:.3f}x (target >= 1.15x: {'met' if speed >= 1.15 else 'NOT met'}); "
              f"held-out loss differs by {100 * rel:.2f}% (target <= 1%: {'met' if rel <= 0.01 else 'NOT met'})")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Optimizer step alone: MasterWeightOptimizer(AdamW) on a bf16 GPT vs torch AdamW on fp32, side by side.

Usage: python benchmarks/bench_master_step.py [--device cuda] [--repeats 30] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from mixprec.models.tasks import build_task
from mixprec.optim import MasterWeightOptimizer
from mixprec.plans import cast_module_


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--size", default="small")
    a = ap.parse_args()
    dev = torch.device(a.device)
    low = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    task = build_task("gpt", size=a.size, seed=0)
    x, y = task.batch(task.default_batch_size, torch.Generator().manual_seed(0))
    x, y = x.to(dev), y.to(dev)
    base = task.model.to(dev)
    nparams = sum(p.numel() for p in base.parameters())

    def grads(model: torch.nn.Module) -> None:
        with torch.autocast(dev.type, dtype=low, enabled=True):
            loss = task.criterion(model(x).float(), y)
        loss.backward()

    runs = {}
    for name, kw in (("fp32 AdamW foreach", {"foreach": True}), ("fp32 AdamW fused", {"fused": True})):
        m = copy.deepcopy(base)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, **kw)
        grads(m)
        runs[name] = opt
    variants = (("default args: fused", {}, None), ("foreach=True", {"foreach": True}, None), ("guarded", {}, True))
    for name, kw, guard in variants:
        m = copy.deepcopy(base)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, **kw)
        values = cast_module_(m, low, keep=(torch.nn.LayerNorm,), keep_dtype=torch.float32)
        master = MasterWeightOptimizer(opt, master_values=values, guard_nonfinite=guard)
        grads(m)
        runs[f"{a.dtype}-master AdamW ({name})"] = master
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(3):
        for o in runs.values():
            o.step()
    for _ in range(a.repeats):
        for k, o in runs.items():
            sync()
            t = time.perf_counter()
            o.step()
            sync()
            times[k].append(time.perf_counter() - t)
    ref = statistics.median(times["fp32 AdamW foreach"])
    print(f"device={dev} params={nparams:,} repeats={a.repeats} threads={torch.get_num_threads()}")
    for k, v in times.items():
        med = statistics.median(v)
        print(f"{k:42s} median {med * 1e3:8.3f} ms  ratio vs fp32 foreach {med / ref:5.2f}")


if __name__ == "__main__":
    main()

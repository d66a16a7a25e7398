"""Autocast overhead: mixprec.autocast vs torch.autocast in the same training step.

For each model (a small GPT and a small CNN from ``mixprec.cli.models``) one training
step (forward, loss, backward, SGD step) runs under three contexts, CPU bf16:

- ``torch.autocast`` (the baseline);
- ``mixprec.autocast`` with no custom ops (target: within 2% of the baseline);
- ``mixprec.autocast`` with three custom ops (target: within 5%).

The default custom ops (``gelu``, ``relu``, ``adaptive_avg_pool2d`` moved to the low
list) already see bf16 inputs in these models, so the step computes the same thing
and the difference is mixprec's interception cost alone; pass ``--lower-ops`` /
``--fp32-ops`` to time a policy that changes the computation.

Repeats are interleaved (the order rotates every repeat) and the median is taken,
so machine noise hits every context alike. Prints a Markdown table and the command.

    python benchmarks/bench_autocast.py
    python benchmarks/bench_autocast.py --tasks gpt --repeats 30 --lower-ops layer_norm
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from mixprec.amp import autocast
from mixprec.cli.models import build_task
from mixprec.policy import OpPolicy

DTYPE = torch.bfloat16


def _contexts(policy: OpPolicy) -> dict[str, Callable[[], AbstractContextManager[Any]]]:
    return {
        "torch.autocast": lambda: torch.autocast("cpu", dtype=DTYPE),
        "mixprec, no custom ops": lambda: autocast(DTYPE, device_type="cpu"),
        "mixprec, custom ops": lambda: autocast(device_type="cpu", policy=policy),
    }


def _step(task: Any, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
          make_ctx: Callable[[], AbstractContextManager[Any]]) -> Callable[[], None]:  # fmt: skip
    def step() -> None:
        with make_ctx():
            loss = task.criterion(task.model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _time(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _bench_task(name: str, size: str, batch_size: int | None, policy: OpPolicy,
                repeats: int, warmup: int) -> dict[str, list[float]]:  # fmt: skip
    task = build_task(name, size=size, seed=0)
    bs = batch_size or task.default_batch_size
    x, y = task.batch(bs, torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(task.model.parameters(), lr=1e-4)
    steps = {label: _step(task, opt, x, y, ctx) for label, ctx in _contexts(policy).items()}
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {label: [] for label in steps}
    labels = list(steps)
    for r in range(repeats):
        order = labels[r % len(labels) :] + labels[: r % len(labels)]
        for label in order:
            times[label].append(_time(steps[label]))
    times["_batch"] = [float(bs)]
    return times


def _spread(samples: list[float], base: float) -> float:
    q = statistics.quantiles(samples, n=4)
    return (q[2] - q[0]) / base * 100


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="gpt,cnn", help="comma-separated mixprec.cli.models tasks")
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--batch-size", type=int, default=None, help="default: per task (gpt 4)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--lower-ops", default="gelu,relu,adaptive_avg_pool2d")
    parser.add_argument("--fp32-ops", default="")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lower = tuple(op for op in args.lower_ops.split(",") if op)
    fp32 = tuple(op for op in args.fp32_ops.split(",") if op)
    policy = OpPolicy(DTYPE, lower_ops=lower, fp32_ops=fp32)
    n_custom = len(lower) + len(fp32)

    rows = []
    for name in [t for t in args.tasks.split(",") if t]:
        batch = args.batch_size or (4 if name == "gpt" and args.size == "small" else None)
        times = _bench_task(name, args.size, batch, policy, args.repeats, args.warmup)
        base = statistics.median(times["torch.autocast"])
        plain = statistics.median(times["mixprec, no custom ops"])
        custom = statistics.median(times["mixprec, custom ops"])
        rows.append(
            f"| {name}-{args.size} | {int(times['_batch'][0])} | {base * 1e3:.1f} "
            f"(IQR {_spread(times['torch.autocast'], base):.1f}%) "
            f"| {plain / base:.3f} (IQR {_spread(times['mixprec, no custom ops'], base):.1f}%) "
            f"| {custom / base:.3f} (IQR {_spread(times['mixprec, custom ops'], base):.1f}%) |"
        )

    ops = ", ".join([*(f"{op}->low" for op in lower), *(f"{op}->fp32" for op in fp32)])
    print(
        f"CPU bf16 training step (forward, loss, backward, SGD), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {args.repeats} interleaved repeats, median; "
        "ratios are step time / torch.autocast step time (targets: <= 1.02 without custom "
        f"ops, <= 1.05 with {n_custom}); custom ops: {ops}\n"
    )
    print("| model | batch | torch.autocast step (ms) | mixprec, no custom ops | "
          f"mixprec, {n_custom} custom ops |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(row)
    print(f"\ncommand: python {' '.join(['benchmarks/bench_autocast.py', *sys.argv[1:]])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

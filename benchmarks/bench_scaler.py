"""Loss-scaler overhead: mixprec.DynamicLossScaler vs torch.amp.GradScaler in the same training step.

Both scalers drive identical models through identical fp16-mixed (and bf16-compute)
training steps in one process; repeats are interleaved and the median taken, so
machine noise hits both sides alike. A scaler-only row times unscale_ + step +
update on many parameters, where the scaler's own cost is all there is.

    python benchmarks/bench_scaler.py            # prints a Markdown table
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from mixprec import DynamicLossScaler
from mixprec.cli.models import build_task


def _training_step(task, model, opt, scaler, dtype, gen) -> Callable[[], None]:
    def step() -> None:
        x, y = task.batch(task.default_batch_size, gen)
        with torch.autocast("cpu", dtype=dtype):
            loss = task.criterion(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def _scaler_only(scaler, n_params: int, numel: int) -> Callable[[], None]:
    params = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(n_params)]
    opt = torch.optim.SGD(params, lr=0.0)
    grads = [torch.randn(numel) for _ in range(n_params)]
    one = torch.ones(())

    def step() -> None:
        scaler.scale(one)  # torch's scaler creates its state lazily here
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    return step


def _time(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _compare(make: Callable[[object], Callable[[], None]], repeats: int, warmup: int) -> tuple[float, float]:
    ours = make(DynamicLossScaler(init_scale=2.0**10, growth_interval=50))
    ref = make(torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=50))
    for _ in range(warmup):
        ours()
        ref()
    t_ours, t_ref = [], []
    for i in range(repeats):  # interleaved, alternating who goes first
        pair = ((ours, t_ours), (ref, t_ref)) if i % 2 == 0 else ((ref, t_ref), (ours, t_ours))
        for fn, bucket in pair:
            bucket.append(_time(fn))
    return statistics.median(t_ours), statistics.median(t_ref)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    args = parser.parse_args(argv)

    rows = []
    for task_name, dtype in (("mlp", torch.float16), ("gpt", torch.float16), ("gpt", torch.bfloat16)):
        def make(scaler, task_name=task_name, dtype=dtype):
            task = build_task(task_name, size=args.size, seed=0)
            opt = torch.optim.AdamW(task.model.parameters(), lr=1e-4)
            return _training_step(task, task.model, opt, scaler, dtype, torch.Generator().manual_seed(0))

        repeats = args.repeats if task_name == "mlp" else max(5, args.repeats // 3)
        ours, ref = _compare(make, repeats, args.warmup)
        label = f"{task_name} ({args.size}), {str(dtype).removeprefix('torch.')} autocast + AdamW"
        rows.append((label, ours, ref))
    ours, ref = _compare(lambda s: _scaler_only(s, 200, 4096), args.repeats * 3, args.warmup)
    rows.append(("scaler only: unscale_+step+update, 200 params x 4096", ours, ref))

    print(f"Command: `python benchmarks/bench_scaler.py --repeats {args.repeats} --size {args.size}` "
          f"(torch {torch.__version__}, {torch.get_num_threads()} threads)\n")
    print("| step | mixprec DynamicLossScaler (ms) | torch.amp.GradScaler (ms) | ratio |")
    print("|---|---:|---:|---:|")
    for label, o, r in rows:
        print(f"| {label} | {o * 1e3:.2f} | {r * 1e3:.2f} | {o / r:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

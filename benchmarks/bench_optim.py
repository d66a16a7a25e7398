"""Optimizer step of the low-precision plans vs torch's fp32 AdamW and optimi's Kahan AdamW.

Side by side in one process, interleaved, on a model of :mod:`mixprec.cli.models` (the small
GPT by default: 6 layers, 512 wide): the optimizer step alone (gradients from one
backward, then ``opt.step()`` timed) and the whole training step (forward, backward,
step). Rows:

- ``torch-fp32-foreach`` / ``torch-fp32-fused``: fp32 model, ``torch.optim.AdamW``
  with ``foreach=True`` / ``fused=True``; ratios are against the foreach row;
- ``bf16-pure``, ``bf16-kahan``, ``bf16-sr``, ``bf16-master``: the plans through the
  front door (``MixedPrecision(plan).prepare``) with a torch AdamW, as configured by
  default (``optimizer_compile="auto"``: Kahan and SR compile their update on a model
  this size; the first steps compile, during warm-up); the same wrappers with the fast
  path switched off (``... generic``), never compiled (``... eager``: the multi-tensor
  fast path) and always compiled (``... compiled``; on CUDA the default is the Triton kernel,
  ``mixprec.optim.triton_adam``);
- ``bf16-master-remainders...``, ``...-8bit``, ``...-fp8``, ``...-bf16-state``: remainder masters (``bf16-master``
  with ``remainders=True``) and 8-bit / fp8 / bf16 moments, by default and never compiled
  (``... eager``);
- ``optimi-kahan``: bf16 model, ``optimi.AdamW(..., kahan_sum=True)`` (torch-optimi).

Every optimizer uses lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01; ``--fused-inner``
gives the plans ``AdamW(fused=True)`` (``bench_gpu.py``'s default) instead of torch's default.
``--loss-steps N`` also trains every row N steps from the same initial weights on the
same batches and reports the held-out loss next to fp32's. Medians over ``--repeats``;
prints Markdown. A benchmark: it never fails on time.

Usage::

    python benchmarks/bench_optim.py                         # small GPT, step timings
    python benchmarks/bench_optim.py --repeats 5 --loss-steps 300
    python benchmarks/bench_optim.py --model gpt --size tiny --rows bf16-kahan,optimi-kahan
"""

from __future__ import annotations

import argparse
import functools
import math
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mixprec import MixedPrecision, get_plan
from mixprec.cli.models import build_task
from mixprec.optim import LowPrecisionOptimizer

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
INNER: dict[str, Any] = {}  # the plans' torch AdamW options (--fused-inner: fused=True, as bench_gpu.py's default)
BASELINE = "torch-fp32-foreach"


@dataclass
class Setup:
    """A prepared model and optimizer, with the two things to time."""

    opt: Any
    train_step: Callable[[Any, Any], float]
    evaluate: Callable[[Any, Any], float]
    params: list[torch.nn.Parameter]  # the model's parameters: where backward leaves gradients


def _torch_fp32(task: Any, device: torch.device, **flags: Any) -> Setup:
    model = task.model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **flags)

    def train_step(x: Any, y: Any) -> float:
        loss = task.criterion(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return Setup(opt, train_step, lambda x, y: float(task.criterion(model(x), y)), list(model.parameters()))


def _plan(task: Any, device: torch.device, plan: Any, fast: bool = True, compile: bool | str = "auto") -> Setup:
    mp = MixedPrecision(plan)
    inner = torch.optim.AdamW(task.model.to(device).parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **INNER)
    model, opt, criterion = mp.prepare(task.model, inner, criterion=task.criterion)
    if isinstance(opt, LowPrecisionOptimizer):
        opt.fast, opt.compile = fast, compile

    def train_step(x: Any, y: Any) -> float:
        with mp.autocast():
            loss = criterion(model(x), y)
        mp.backward(loss)
        mp.step()
        return float(loss.detach().float())

    def evaluate(x: Any, y: Any) -> float:
        with mp.autocast():
            return float(criterion(model(x), y).float())

    return Setup(opt, train_step, evaluate, list(task.model.parameters()))


def _optimi_kahan(task: Any, device: torch.device) -> Setup:
    import optimi

    model = task.model.to(device=device, dtype=torch.bfloat16)
    opt = optimi.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, kahan_sum=True)

    def loss_of(x: Any, y: Any) -> torch.Tensor:
        if x.is_floating_point():
            x = x.to(torch.bfloat16)
        return task.criterion(model(x).float(), y)

    def train_step(x: Any, y: Any) -> float:
        loss = loss_of(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return Setup(opt, train_step, lambda x, y: float(loss_of(x, y)), list(model.parameters()))


ROWS: dict[str, Callable[[Any, torch.device], Setup]] = {
    "torch-fp32-foreach": lambda t, d: _torch_fp32(t, d, foreach=True),
    "torch-fp32-fused": lambda t, d: _torch_fp32(t, d, fused=True),
    "bf16-pure": lambda t, d: _plan(t, d, "bf16-pure"),
    "bf16-kahan": lambda t, d: _plan(t, d, "bf16-kahan"),
    "bf16-sr": lambda t, d: _plan(t, d, "bf16-sr"),
    "bf16-pure generic": lambda t, d: _plan(t, d, "bf16-pure", fast=False),
    "bf16-kahan generic": lambda t, d: _plan(t, d, "bf16-kahan", fast=False),
    "bf16-sr generic": lambda t, d: _plan(t, d, "bf16-sr", fast=False),
    "bf16-pure compiled": lambda t, d: _plan(t, d, "bf16-pure", compile=True),
    "bf16-kahan compiled": lambda t, d: _plan(t, d, "bf16-kahan", compile=True),
    "bf16-sr compiled": lambda t, d: _plan(t, d, "bf16-sr", compile=True),
    "bf16-kahan eager": lambda t, d: _plan(t, d, "bf16-kahan", compile=False),
    "bf16-sr eager": lambda t, d: _plan(t, d, "bf16-sr", compile=False),
    "bf16-master": lambda t, d: _plan(t, d, "bf16-master"),
    "fp16-master": lambda t, d: _plan(t, d, "fp16-master"),  # guarded: a snapshot before each step
    "fp16-pure": lambda t, d: _plan(t, d, "fp16-pure"),  # guarded too
    "bf16-master-remainders": lambda t, d: _plan(t, d, get_plan("bf16-master", remainders=True)),
    "bf16-master-remainders-bf16-state": lambda t, d: _plan(
        t, d, get_plan("bf16-master", remainders=True, state_dtype="bf16")
    ),
    "bf16-master-remainders-8bit": lambda t, d: _plan(t, d, get_plan("bf16-master", remainders=True, state_dtype="8bit")),
    "bf16-kahan-8bit": lambda t, d: _plan(t, d, get_plan("bf16-kahan", state_dtype="8bit")),
    "bf16-sr-8bit": lambda t, d: _plan(t, d, get_plan("bf16-sr", state_dtype="8bit")),
    # the same, never compiled (the eager fast path: the default before the compiled route took them)
    "bf16-master-remainders-bf16-state eager": lambda t, d: _plan(
        t, d, get_plan("bf16-master", remainders=True, state_dtype="bf16"), compile=False
    ),
    "bf16-master-remainders-8bit eager": lambda t, d: _plan(
        t, d, get_plan("bf16-master", remainders=True, state_dtype="8bit"), compile=False
    ),
    "bf16-kahan-8bit eager": lambda t, d: _plan(t, d, get_plan("bf16-kahan", state_dtype="8bit"), compile=False),
    "bf16-sr-8bit eager": lambda t, d: _plan(t, d, get_plan("bf16-sr", state_dtype="8bit"), compile=False),
    "bf16-pure-8bit": lambda t, d: _plan(t, d, get_plan("bf16-pure", state_dtype="8bit")),
    "bf16-pure-bf16-state": lambda t, d: _plan(t, d, get_plan("bf16-pure", state_dtype="bf16")),
    "bf16-kahan-bf16-state": lambda t, d: _plan(t, d, get_plan("bf16-kahan", state_dtype="bf16")),
    "bf16-sr-bf16-state": lambda t, d: _plan(t, d, get_plan("bf16-sr", state_dtype="bf16")),
    "bf16-kahan-fp8": lambda t, d: _plan(t, d, get_plan("bf16-kahan", state_dtype="fp8")),
    "bf16-sr-fp8": lambda t, d: _plan(t, d, get_plan("bf16-sr", state_dtype="fp8")),
    "bf16-kahan-fp8 eager": lambda t, d: _plan(t, d, get_plan("bf16-kahan", state_dtype="fp8"), compile=False),
    # the same on the torch.compile route (the default before the native CPU kernel took them)
    "bf16-master-remainders-bf16-state compiled": lambda t, d: _plan(
        t, d, get_plan("bf16-master", remainders=True, state_dtype="bf16"), compile=True
    ),
    "bf16-kahan-8bit compiled": lambda t, d: _plan(t, d, get_plan("bf16-kahan", state_dtype="8bit"), compile=True),
    "bf16-sr-8bit compiled": lambda t, d: _plan(t, d, get_plan("bf16-sr", state_dtype="8bit"), compile=True),
    "optimi-kahan": _optimi_kahan,
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _to(batch: tuple[Any, Any], device: torch.device) -> tuple[Any, Any]:
    return batch[0].to(device), batch[1].to(device)


def _time(fn: Callable[[], Any], device: torch.device, inner: int) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / inner


def bench(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    device = torch.device(args.device)
    names = args.rows.split(",") if args.rows else list(ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; expected some of {', '.join(ROWS)}")
    setups: dict[str, Setup] = {}
    tasks: dict[str, Any] = {}
    for name in names:
        try:
            task = build_task(args.model, size=args.size, seed=0)
            setups[name] = ROWS[name](task, device)
            tasks[name] = task
        except Exception as exc:  # a row that cannot run here (e.g. fused AdamW on an old CPU build)
            print(f"skipping {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
    any_task = next(iter(tasks.values()))
    batch_size = args.batch or any_task.default_batch_size
    x, y = _to(any_task.batch(batch_size, torch.Generator().manual_seed(0)), device)
    results: dict[str, dict[str, float]] = {name: {} for name in setups}
    # warm up (state allocation, lazy init), leaving gradients in place for the step timings
    for s in setups.values():
        for _ in range(args.warmup):
            s.train_step(x, y)
    # gradients for the optimizer-step timings: one backward per row, then only steps
    for s in setups.values():
        s.train_step(x, y)
        _fill_grads(s.params)
    opt_times: dict[str, list[float]] = {n: [] for n in setups}
    train_times: dict[str, list[float]] = {n: [] for n in setups}
    for _ in range(args.repeats):
        for name, s in setups.items():
            opt_times[name].append(_time(s.opt.step, device, args.inner))
    for _ in range(args.repeats if args.train else 0):
        for name, s in setups.items():
            train_times[name].append(_time(functools.partial(s.train_step, x, y), device, args.inner))
    for name in setups:
        results[name]["opt_ms"] = 1e3 * statistics.median(opt_times[name])
        results[name]["train_ms"] = 1e3 * statistics.median(train_times[name]) if args.train else float("nan")
    if args.loss_steps:
        for name in list(setups):
            task = build_task(args.model, size=args.size, seed=0)
            s = ROWS[name](task, device)
            for step in range(args.loss_steps):
                s.train_step(*_to(task.batch(batch_size, torch.Generator().manual_seed(1000 + step)), device))
            with torch.no_grad():
                results[name]["eval_loss"] = s.evaluate(*_to(task.eval_batch(task.eval_batch_size), device))
    return results


def _fill_grads(params: list[torch.nn.Parameter]) -> None:
    """Give every model parameter a gradient, where backward would (the front door's step
    cleared them); a master-weight optimizer gathers them into its fp32 masters in step()."""
    gen = torch.Generator().manual_seed(7)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(device=p.device, dtype=p.dtype)


def markdown(results: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    base = results.get(BASELINE, {})
    lines = [
        f"`{' '.join(shlex.quote(a) for a in sys.argv)}` ({args.model}-{args.size}, {args.device}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, medians of {args.repeats} x {args.inner})",
        "",
        "| row | opt step ms | vs fp32 foreach | train step ms | vs fp32 foreach |"
        + (" held-out loss | vs fp32 |" if args.loss_steps else ""),
        "|---|---:|---:|---:|---:|" + ("---:|---:|" if args.loss_steps else ""),
    ]
    for name, r in results.items():
        trained = not math.isnan(r["train_ms"])
        cells = [name, f"{r['opt_ms']:.1f}", _ratio(r["opt_ms"], base.get("opt_ms")),
                 f"{r['train_ms']:.1f}" if trained else "-",
                 _ratio(r["train_ms"], base.get("train_ms")) if trained else "-"]
        if args.loss_steps:
            loss = r.get("eval_loss")
            ref = base.get("eval_loss")
            cells += [f"{loss:.4f}" if loss is not None else "-",
                      f"{loss - ref:+.4f}" if loss is not None and ref is not None else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}x" if base else "-"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--size", default="small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=0, help="batch size (default: the task's)")
    parser.add_argument("--rows", default="", help=f"comma-separated subset of: {', '.join(ROWS)}")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inner", type=int, default=3, help="steps per timing")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-train", dest="train", action="store_false", help="time the optimizer step only")
    parser.add_argument("--loss-steps", type=int, default=0, help="also train N steps and compare held-out loss")
    parser.add_argument("--fused-inner", action="store_true",
                        help="the plans wrap torch.optim.AdamW(fused=True) (bench_gpu.py's default) instead of torch's default")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (CPU; default: torch's)")
    args = parser.parse_args(argv)
    if args.fused_inner:
        INNER["fused"] = True
    if args.threads:
        torch.set_num_threads(args.threads)
    print(markdown(bench(args), args))


if __name__ == "__main__":
    main()

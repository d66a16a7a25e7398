"""GPU training-step benchmark: fp32 and plain ``torch.autocast`` next to every mixprec plan.

A GPT-2-small-sized model (12 layers, 768 wide, vocabulary 50,304, sequence 1,024: about
124M parameters, :class:`mixprec.cli.models.GPT`) is trained, from the same initial weights on
the same batch, by each variant in one process:

- ``torch-fp32``: the plain fp32 loop (``loss.backward()``, ``opt.step()``);
- ``torch-autocast-bf16``: ``torch.autocast("cuda", dtype=torch.bfloat16)``;
- ``torch-autocast-fp16``: ``torch.autocast("cuda", dtype=torch.float16)`` with
  ``torch.amp.GradScaler("cuda")``;
- every mixprec plan through :class:`mixprec.MixedPrecision` (``fp8-mixed`` only where the
  GPU has native fp8 GEMMs, compute capability >= 8.9);
- ``<plan>+graph`` (asked for by name, e.g. ``bf16-mixed+graph``): the plan's whole step
  (forward, backward, ``mp.step()``) captured in one CUDA graph
  (:func:`mixprec.graphs.capture_step`, fused capturable AdamW) and replayed, against the
  eager ``torch.autocast`` loop.

Every variant uses the same optimizer (AdamW, fused by default). Step times are measured
with CUDA events after warm-up steps; the median over all timed steps is reported, with
tokens/s and the peak of ``torch.cuda.max_memory_allocated`` during the timed steps. The
variants run one after another, forwards then backwards (A B C, C B A, ...: ``--rounds``),
so slow drift of the GPU's clocks affects them alike. Ratios are taken against the plain
``torch.autocast`` loop of the same low-precision dtype (bf16 for bf16 and fp8 plans,
fp16 for fp16 plans; the plain fp32 loop for the fp32 and tf32 plans), and fp8-mixed is
also compared with bf16-mixed. The targets of
docs/gpu.md are shown next to the numbers; this is a benchmark, not a test: it never
fails on time.

Without a CUDA device it prints "no CUDA device: nothing to benchmark" and exits with
status 0 (so a CPU-only CI job that runs every benchmark stays green).

Usage::

    python benchmarks/bench_gpu.py                       # GPT ~124M, every plan, Markdown
    python benchmarks/bench_gpu.py --quick               # a tiny GPT: a smoke run in seconds
    python benchmarks/bench_gpu.py --plans bf16-mixed fp8-mixed --json gpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec import MixedPrecision, get_plan
from mixprec.cli.models import GPT, GPTConfig, TokenCrossEntropy
from mixprec.fp8 import native_fp8_available
from mixprec.graphs import capture_step
from mixprec.plans import PLANS

NO_CUDA_MESSAGE = "no CUDA device: nothing to benchmark"

TORCH_FP32 = "torch-fp32"
TORCH_BF16 = "torch-autocast-bf16"
TORCH_FP16 = "torch-autocast-fp16"
BASELINES = (TORCH_FP32, TORCH_BF16, TORCH_FP16)

# name -> (config, batch size)
CONFIGS: dict[str, tuple[GPTConfig, int]] = {
    "gpt2-124m": (GPTConfig(vocab_size=50304, seq_len=1024, num_layers=12, dim=768, num_heads=12), 8),
    "quick": (GPTConfig(vocab_size=512, seq_len=128, num_layers=2, dim=128, num_heads=4), 4),
}

# Targets of docs/gpu.md (informational: printed next to the numbers, never enforced).
SPEED_TARGET_LOW = 0.98  # bf16/fp16 plans vs torch.autocast of the same dtype
SPEED_TARGET_FP8 = 1.30  # fp8-mixed vs bf16-mixed, on Hopper
MEMORY_BELOW_AUTOCAST = ("bf16-master", "fp16-master", "bf16-pure", "fp16-pure", "bf16-kahan")


@dataclass
class Result:
    """One variant's numbers (times in milliseconds, memory in bytes)."""

    name: str
    median_ms: float | None = None
    step_ms: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None
    peak_bytes: int | None = None
    final_loss: float | None = None
    speed_vs_autocast: float | None = None
    memory_vs_autocast: float | None = None
    speed_vs_bf16_mixed: float | None = None
    baseline: str | None = None
    target: str = ""
    error: str | None = None


GRAPHED = "+graph"  # a plan's variant whose whole step is one CUDA graph (mixprec.graphs.capture_step)
SPEED_TARGET_GRAPH = 1.15


def plan_of(name: str) -> str:
    """The plan a mixprec variant runs (``bf16-mixed+graph``: bf16-mixed)."""
    return name[: -len(GRAPHED)] if name.endswith(GRAPHED) else name


def low_dtype_of(name: str) -> torch.dtype | None:
    """The low-precision dtype a variant computes in (None for fp32 and tf32)."""
    name = plan_of(name)
    if name == TORCH_BF16:
        return torch.bfloat16
    if name == TORCH_FP16:
        return torch.float16
    if name == TORCH_FP32:
        return None
    dtype = get_plan(name).compute_dtype
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


def baseline_of(name: str) -> str | None:
    """The plain torch loop a variant is compared with: torch.autocast of the same dtype
    (bf16 for fp8-mixed), the plain fp32 loop for the fp32 and tf32 plans."""
    if name in BASELINES:
        return None
    dtype = low_dtype_of(name)
    if dtype is None:
        return TORCH_FP32
    return TORCH_FP16 if dtype == torch.float16 else TORCH_BF16


# ---------------------------------------------------------------------- one variant
StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _make_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    kind = {"adamw-fused": {"fused": True}, "adamw-foreach": {"foreach": True}}[args.optimizer]
    return torch.optim.AdamW(model.parameters(), lr=args.lr, **kind)


def build_variant(name: str, config: GPTConfig, device: torch.device, args: argparse.Namespace) -> StepFn:
    """A fresh model (same seed for every variant), its optimizer, and one training step."""
    torch.manual_seed(0)
    with device:
        model = GPT(config)
    opt = _make_optimizer(model, args)
    criterion = TokenCrossEntropy()
    device_type = device.type

    if name == TORCH_FP32:

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = criterion(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    if name in (TORCH_BF16, TORCH_FP16):
        dtype = low_dtype_of(name)
        scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device_type, dtype=dtype):
                loss = criterion(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    graphed = name.endswith(GRAPHED)
    if graphed:  # a capturable optimizer; the explainer's hooks cannot run in a replay
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True, capturable=True)
    mp = MixedPrecision(plan_of(name), explain_overflow=not graphed)
    prepared, wrapped, crit = mp.prepare(model, opt, criterion=criterion)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with mp.autocast():
            loss = crit(prepared(x), y)
        mp.backward(loss)
        mp.step()
        return loss.detach()

    if not graphed:
        return step
    captured: list[Any] = []

    def replay(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not captured:  # the first call (a warm-up step): three eager steps, then the capture
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*capturable=True.*")
                captured.append(capture_step(mp, step, x, y))
        else:
            captured[0].replay(x, y)
        return captured[0].outputs  # type: ignore[no-any-return]

    return replay


class _Timer:
    """CUDA events on a GPU; ``time.perf_counter`` with a synchronise-free CPU otherwise."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[Any, Any]] = []

    def time(self, fn: Callable[[], Any]) -> None:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            self.marks.append((start, end))
        else:
            t0 = time.perf_counter()
            fn()
            self.marks.append((t0, time.perf_counter()))

    def milliseconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in self.marks]
        return [(e - s) * 1e3 for s, e in self.marks]


def run_variant(
    name: str, config: GPTConfig, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device, args: argparse.Namespace
) -> tuple[list[float], int | None, float]:
    """Warm-up, then timed steps: (step times in ms, peak allocated bytes, last loss)."""
    step = build_variant(name, config, device, args)
    x, y = batch
    loss = torch.zeros(())
    for _ in range(args.warmup):
        loss = step(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    timer = _Timer(device)
    holder: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):
        timer.time(lambda: holder.__setitem__("loss", step(x, y)))
    times = timer.milliseconds()
    loss = holder.get("loss", loss)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return times, peak, float(loss.float().item())


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------ the matrix
def default_variants(device: torch.device) -> list[str]:
    plans = [p for p in PLANS if p != "fp8-mixed" or native_fp8_available(device)]
    return [*BASELINES, *plans]


def run(args: argparse.Namespace, device: torch.device) -> tuple[list[Result], dict[str, Any]]:
    config, default_batch = CONFIGS["quick" if args.quick else args.model]
    batch_size = args.batch or default_batch
    seq = min(args.seq or config.seq_len, config.seq_len)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch_size, seq + 1), generator=gen)
    batch = (tokens[:, :-1].to(device), tokens[:, 1:].to(device))
    names = [n if n in BASELINES else get_plan(plan_of(n)).name + n[len(plan_of(n)):]
             for n in (args.plans or default_variants(device))]
    names = list(dict.fromkeys(names))  # aliases ("bf16", "O2") name their canonical plan once
    results = {name: Result(name) for name in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else list(reversed(names))
        for name in order:
            res = results[name]
            if res.error is not None:
                continue
            try:
                times, peak, loss = run_variant(name, config, batch, device, args)
            except Exception as err:  # reported in the table; the run goes on
                res.error = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
                _free(device)
                continue
            res.step_ms += times
            res.peak_bytes = peak if res.peak_bytes is None or peak is None else max(res.peak_bytes, peak)
            res.final_loss = loss
            _free(device)
            print(f"  {name:22s} round {r + 1}: median {statistics.median(times):8.2f} ms", file=sys.stderr)
    tokens_per_step = batch_size * seq
    for res in results.values():
        if res.step_ms:
            res.median_ms = statistics.median(res.step_ms)
            res.tokens_per_s = tokens_per_step / (res.median_ms / 1e3)
    _add_ratios(results)
    n_params = _count_params(config)
    meta = {
        "device": _device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "model": "quick" if args.quick else args.model,
        "config": asdict(config),
        "parameters": n_params,
        "batch": batch_size,
        "seq": seq,
        "tokens_per_step": tokens_per_step,
        "optimizer": args.optimizer,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "native_fp8": native_fp8_available(device),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
    }
    return list(results.values()), meta


def _count_params(config: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(config).parameters())


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return f"{device.type} (smoke run: no CUDA device)"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0 or math.isnan(num) or math.isnan(den):
        return None
    return num / den


def _add_ratios(results: dict[str, Result]) -> None:
    for res in results.values():
        base_name = baseline_of(res.name)
        base = results.get(base_name) if base_name else None
        res.baseline = base_name
        if base is not None:
            res.speed_vs_autocast = _ratio(base.median_ms, res.median_ms)
            res.memory_vs_autocast = _ratio(res.peak_bytes, base.peak_bytes)
        if res.name == "fp8-mixed" and "bf16-mixed" in results:
            res.speed_vs_bf16_mixed = _ratio(results["bf16-mixed"].median_ms, res.median_ms)
        res.target = _target(res)


def _verdict(value: float | None, ok: Callable[[float], bool]) -> str:
    if value is None:
        return "n/a"
    return "met" if ok(value) else "NOT met"


def _target(res: Result) -> str:
    parts = []
    if res.name.endswith(GRAPHED):
        verdict = _verdict(res.speed_vs_autocast, lambda v: v >= SPEED_TARGET_GRAPH)
        parts.append(f"speed >= {SPEED_TARGET_GRAPH:.2f}x (one CUDA graph): {verdict}")
    elif res.name == "fp8-mixed":
        verdict = _verdict(res.speed_vs_bf16_mixed, lambda v: v >= SPEED_TARGET_FP8)
        parts.append(f"speed >= {SPEED_TARGET_FP8:.2f}x bf16-mixed: {verdict}")
    elif res.name not in BASELINES and low_dtype_of(res.name) is not None:
        verdict = _verdict(res.speed_vs_autocast, lambda v: v >= SPEED_TARGET_LOW)
        parts.append(f"speed >= {SPEED_TARGET_LOW:.2f}x: {verdict}")
    if res.name in MEMORY_BELOW_AUTOCAST:
        parts.append(f"memory < autocast: {_verdict(res.memory_vs_autocast, lambda v: v < 1.0)}")
    return "; ".join(parts)


# ------------------------------------------------------------------------ reporting
def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def markdown(results: list[Result], meta: dict[str, Any]) -> str:
    lines = [
        f"GPU training step: GPT {meta['model']} ({meta['parameters'] / 1e6:.1f}M parameters), "
        f"batch {meta['batch']} x {meta['seq']} tokens, {meta['optimizer']}",
        "",
        f"device: {meta['device']}; torch {meta['torch']}, CUDA {meta['cuda']}; "
        f"{meta['warmup']} warm-up + {meta['repeats']} timed steps x {meta['rounds']} rounds (median)",
        "",
        "| variant | step (ms) | tokens/s | peak memory | vs baseline: speed | memory | baseline | target (informational) |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        if r.error is not None:
            lines.append(f"| {r.name} | error: {r.error} | | | | | | |")
            continue
        speed = _fmt(r.speed_vs_autocast, ".3f", "x")
        if r.speed_vs_bf16_mixed is not None:
            speed += f" ({r.speed_vs_bf16_mixed:.3f}x bf16-mixed)"
        lines.append(
            f"| {r.name} | {_fmt(r.median_ms, '.2f')} | {_fmt(r.tokens_per_s, ',.0f')} | {_gib(r.peak_bytes)} | "
            f"{speed} | {_fmt(r.memory_vs_autocast, '.3f', 'x')} | {r.baseline or '-'} | {r.target} |"
        )
    diverged = [r.name for r in results if r.final_loss is not None and not math.isfinite(r.final_loss)]
    if diverged:
        lines += ["", f"non-finite loss at the last step: {', '.join(diverged)}"]
    lines += ["", f"command: `{meta['command']}`"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2-124m", choices=[c for c in CONFIGS if c != "quick"])
    parser.add_argument("--quick", action="store_true", help="a tiny GPT (2 layers, 128 wide): a smoke run")
    parser.add_argument("--plans", nargs="+", default=None, help=f"variants (default: {', '.join(BASELINES)} and every plan; a plan{GRAPHED}, e.g. "
                        f"bf16-mixed{GRAPHED}: its whole step captured in one CUDA graph)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default: 8; 4 with --quick)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's seq_len)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant and round (default: 3)")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per variant and round (default: 10)")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the variants, alternating order (default: 2)")
    parser.add_argument("--optimizer", default="adamw-fused", choices=["adamw-fused", "adamw-foreach"])
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": a smoke test of this script
    args = parser.parse_args(argv)
    for flag in ("warmup", "repeats", "rounds"):
        if getattr(args, flag) < (0 if flag == "warmup" else 1):
            parser.error(f"--{flag} must be positive, got {getattr(args, flag)}")

    for name in args.plans or ():
        if name not in BASELINES:
            try:
                get_plan(plan_of(name))
            except ValueError as err:
                parser.error(f"--plans: {err}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE)
        return 0
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32; the tf32 plan opts in itself
        torch.backends.cudnn.allow_tf32 = False
    results, meta = run(args, device)
    print(markdown(results, meta))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": [asdict(r) for r in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The host's share of one optimizer step on the GPU route, measured on the CPU.

On a GPU, a step whose kernels take less time than the host takes to launch them is as slow as
the host. This bench runs the low-precision plans' Triton route on the CPU (Triton's interpreter,
``TRITON_INTERPRET=1``) with the kernel launches replaced by nothing, so what it times is the
host work alone: routing, checks, the launch tables, bookkeeping. The model is a GPT with
GPT-124M's tensors (``--layers`` blocks: 12 gives its 148) at a tiny width, so the fp32 parameters
the plans leave to torch's AdamW, and torch's own rows, cost next to nothing to compute either:
torch's rows are its host overhead plus that. Launches per step are counted too (they must not
grow with the layers). Compare the host time with the kernels' time on the GPU
(``bench_optim.py --device cuda``): a route is host-bound where the host takes longer.

    python benchmarks/bench_optim_host.py --layers 12 24
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # (before Triton is first imported)

import torch

from mixprec import MixedPrecision, get_plan
from mixprec.cli.models.gpt import GPT, GPTConfig
from mixprec.optim import routing
from mixprec.optim import triton_adam as TA

PLANS: dict[str, Any] = {
    "bf16-pure": "bf16-pure", "bf16-kahan": "bf16-kahan", "bf16-sr": "bf16-sr",
    "bf16-kahan-fp32-state": get_plan("bf16-kahan", state_dtype="fp32"),
    "bf16-kahan-8bit": get_plan("bf16-kahan", state_dtype="8bit"),
    "bf16-sr-8bit": get_plan("bf16-sr", state_dtype="8bit"),
}


def _model(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=32, num_layers=layers, dim=64, num_heads=4))


def _grads(params: list[torch.nn.Parameter]) -> None:
    gen = torch.Generator().manual_seed(7)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(p.dtype)


def _time(step: Any, repeats: int) -> float:
    for _ in range(5):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 24])
    parser.add_argument("--rows", default=",".join(["torch-fp32-fused", *PLANS]))
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    routing.EXECUTORS["cpu"] = ("triton", "compiled", "eager")  # the CUDA table's executors
    launches: list[int] = []
    TA._launch = lambda kernel, grid, *a, **k: launches.append(1)  # the host's work only
    TA.kernel_works = lambda *a, **k: True  # (its check runs the kernel)
    print(f"`{' '.join(['python', *sys.argv])}` (torch {torch.__version__}, one thread; medians of {args.repeats})\n")
    print("| row | " + " | ".join(f"{n} layers: host ms, launches" for n in args.layers) + " |")
    print("|---|" + "---:|" * len(args.layers))
    for row in args.rows.split(","):
        cells = []
        for layers in args.layers:
            model = _model(layers)
            if row == "torch-fp32-fused":
                opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
                params = list(model.parameters())
            else:
                mp = MixedPrecision(PLANS[row])
                model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True))
                params = list(model.parameters())
            _grads(params)
            ms = _time(opt.step, args.repeats)
            launches.clear()
            opt.step()
            cells.append(f"{ms:.2f} ms, {len(launches) if row != 'torch-fp32-fused' else '-'}"
                         f" ({len(params)} tensors)")
        print(f"| {row} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

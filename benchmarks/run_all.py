"""Run every CPU benchmark in turn with its default settings (`make bench`).

    python benchmarks/run_all.py [--only plans,scaler,...] [--quick]

Each benchmark prints its own Markdown table; the commands and results that
BENCHMARKS.md records were run one by one on an otherwise idle machine. `--quick`
passes the smallest sizes and repeat counts, for a smoke run. The GPU benchmark
(`bench_gpu.py`) runs only where CUDA is available and says so otherwise.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name -> (script, arguments for --quick)
BENCHMARKS: dict[str, tuple[str, list[str]]] = {
    "plans": ("bench_plans.py", ["--size", "tiny", "--repeats", "2", "--warmup", "1"]),
    "scaler": ("bench_scaler.py", ["--size", "tiny", "--repeats", "3", "--warmup", "1"]),
    "autocast": ("bench_autocast.py", ["--size", "tiny", "--repeats", "2", "--warmup", "1"]),
    "fp8": ("bench_fp8.py", ["--size", "tiny", "--repeats", "2", "--warmup", "1"]),
    "optim": ("bench_optim.py", ["--size", "tiny", "--repeats", "2", "--inner", "1", "--warmup", "1"]),
    "state": ("bench_state.py", ["--size", "tiny", "--batch", "4"]),
    "integrations": ("bench_integrations.py", ["--steps", "6", "--warmup", "2", "--rounds", "1"]),
    "distributed": ("bench_distributed.py", ["--size", "tiny", "--steps", "3", "--warmup", "1"]),
    "soak": ("soak.py", ["--steps", "200"]),
    "gpu": ("bench_gpu.py", ["--quick"]),
}


def main() -> int:
    parser = argparse.ArgumentParser(description="Run every benchmark in turn.")
    parser.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated subset of: " + ", ".join(BENCHMARKS))
    parser.add_argument("--quick", action="store_true", help="smallest sizes and repeat counts (a smoke run)")
    args = parser.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    failed = []
    for name in names:
        script, quick = BENCHMARKS[name]
        path = HERE / script
        if not path.exists():
            print(f"## {name}: {script} is missing, skipped", flush=True)
            continue
        cmd = [sys.executable, str(path), *(quick if args.quick else [])]
        print(f"## {name}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        code = subprocess.call(cmd)
        print(f"## {name}: exit {code} after {time.perf_counter() - start:.0f} s\n", flush=True)
        if code != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Full-length soak: 2,000 fp16 steps through MixedPrecision with an overflow every 50 steps.

    python benchmarks/soak.py [--steps 2000] [--plan fp16-mixed]

Prints the step counts, the scale range and the resident-memory growth after warm-up.
`make test` runs the same loop for 400 steps (tests/robustness/test_soak.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import time

_TEST = pathlib.Path(__file__).resolve().parent.parent / "tests" / "robustness" / "test_soak.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--plan", default="fp16-mixed")
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("mixprec_soak", _TEST)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    start = time.perf_counter()
    report = module.soak(args.steps, plan=args.plan)
    elapsed = time.perf_counter() - start
    print(f"plan {args.plan}: {report.steps} steps in {elapsed:.1f} s")
    print(f"  stepped {report.stepped}, skipped {report.skipped} (injected overflows {report.injected})")
    print(f"  scale range [{report.min_scale:g}, {report.max_scale:g}]")
    print(f"  all-zero-gradient warnings: {report.zero_grad_warnings}")
    if report.rss_growth_mib is not None:
        print(f"  resident memory growth after warm-up: {report.rss_growth_mib:.2f} MiB")


if __name__ == "__main__":
    main()

"""Soak: a long fp16 run through the front door with an overflow every 50 steps.

`make test` runs a short soak (``MIXPREC_SOAK_STEPS``, default 400 steps);
``python benchmarks/soak.py`` runs the full 2,000 steps and prints the figures.
Checked: the scale stays where it and its reciprocal are finite fp32 numbers, every step is
counted (stepped + skipped = steps, skipped = injected overflows), nothing non-finite ever
reaches a parameter, and resident memory stays flat after warm-up.
"""

from __future__ import annotations

import gc
import os
import warnings
from dataclasses import dataclass

import pytest
import torch

from mixprec import MixedPrecision

OVERFLOW_EVERY = 50


@dataclass
class SoakReport:
    steps: int
    stepped: int
    skipped: int
    injected: int
    min_scale: float
    max_scale: float
    rss_growth_mib: float | None
    zero_grad_warnings: int


def _rss_mib() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def soak(steps: int, plan: str = "fp16-mixed") -> SoakReport:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    mp = MixedPrecision(plan, max_consecutive_skips=10)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    gen = torch.Generator().manual_seed(0)
    stepped = skipped = injected = 0
    scales: list[float] = []
    rss_start = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)
            with mp.autocast():
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            mp.backward(loss)
            if step % OVERFLOW_EVERY == OVERFLOW_EVERY - 1:
                injected += 1
                with torch.no_grad():
                    model[0].weight.grad.fill_(float("inf"))
            result = mp.step()
            stepped += result.stepped
            skipped += result.skipped
            scales.append(result.scale)
            if step == min(100, steps // 4):
                gc.collect()
                rss_start = _rss_mib()
            if step % 100 == 0:
                for p in model.parameters():
                    assert torch.isfinite(p).all(), f"non-finite parameter at step {step}"
    gc.collect()
    rss_end = _rss_mib()
    growth = None if rss_start is None or rss_end is None else rss_end - rss_start
    zero_warnings = sum("all-zero gradients" in str(w.message) for w in caught)
    return SoakReport(steps, stepped, skipped, injected, min(scales), max(scales), growth, zero_warnings)


def test_soak_under_periodic_overflow():
    steps = int(os.environ.get("MIXPREC_SOAK_STEPS", "400"))
    report = soak(steps)
    assert report.stepped + report.skipped == steps
    assert report.skipped == report.injected == steps // OVERFLOW_EVERY
    tiny = torch.finfo(torch.float32).tiny
    assert tiny <= report.min_scale and report.max_scale <= 2.0**24
    assert torch.isfinite(torch.tensor(1.0 / report.min_scale, dtype=torch.float32))
    assert report.zero_grad_warnings <= 1
    if report.rss_growth_mib is not None:
        assert report.rss_growth_mib < 20, f"resident memory grew by {report.rss_growth_mib:.1f} MiB"


@pytest.mark.slow
def test_soak_fp16_master():
    report = soak(int(os.environ.get("MIXPREC_SOAK_STEPS", "400")), plan="fp16-master")
    assert report.skipped == report.injected

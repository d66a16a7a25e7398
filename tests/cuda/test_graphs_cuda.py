"""The whole safe step in one CUDA graph (mixprec.graphs.capture_step) replays bit for bit
like the eager step: bf16-mixed, fp16-mixed (planted overflows inside the replayed steps
skip and back the scale off) and bf16-master, with clipping and a scheduler over a device
learning rate."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from mixprec import DynamicLossScaler, MixedPrecision
from mixprec.graphs import capture_step

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

STEPS, WARMUP = 12, 3
OVERFLOW_AT = (5, 6, 9)  # steps whose batch overflows fp16 (inside the replays: WARMUP <= step)


def _batch(step: int, plan: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(32, 64, generator=g), torch.randn(32, 16, generator=g)
    if plan.startswith("fp16") and step in OVERFLOW_AT:
        x = x * 3e4  # the first layer's fp16 output overflows
    return x.cuda(), y.cuda()


def _run(plan: str, graphed: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 16)).cuda()
    scaler = DynamicLossScaler(scale=2.0**10, growth_interval=3) if plan.startswith("fp16") else None
    mp = MixedPrecision(plan, clip_grad_norm=0.5, scaler=scaler, explain_overflow=False)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"), fused=True, capturable=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, schedule = mp.prepare(model, opt, scheduler=schedule)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with mp.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        mp.backward(loss)
        mp.step()
        return loss

    results, losses = [], []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*capturable=True.*")
        if graphed:
            step = capture_step(mp, train_step, *_batch(0, plan), warmup=WARMUP)
            results = [None] * WARMUP
            for i in range(WARMUP, STEPS):
                results.append(step.replay(*_batch(i, plan)))
                losses.append(step.outputs.detach().clone())
        else:
            for i in range(STEPS):
                x, y = _batch(0 if i < WARMUP else i, plan)  # the warm-up trains on the capture's batch
                loss = train_step(x, y)
                results.append(mp.last_result)
                if i >= WARMUP:
                    losses.append(loss.detach().clone())
    torch.cuda.synchronize()
    outcomes = [(r.skipped, r.scale, r.grad_norm) for r in results[WARMUP:]]
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}, "outcomes": outcomes,
            "losses": losses, "lr": float(opt.param_groups[0]["lr"]), "steps": mp.optimizer_steps}


@pytest.mark.parametrize("plan", ["bf16-mixed", "fp16-mixed", "bf16-master"])
def test_a_captured_step_replays_bit_for_bit_like_the_eager_step(plan: str) -> None:
    eager, graphed = _run(plan, graphed=False), _run(plan, graphed=True)
    assert graphed["outcomes"] == eager["outcomes"]
    assert graphed["steps"] == eager["steps"] and graphed["lr"] == eager["lr"]
    for a, b in zip(graphed["losses"], eager["losses"], strict=True):
        assert torch.equal(a, b)
    for name, w in eager["weights"].items():
        assert torch.equal(graphed["weights"][name], w), name
    if plan.startswith("fp16"):
        skipped = [i for i, (s, _, _) in enumerate(graphed["outcomes"], start=WARMUP) if s]
        assert skipped == list(OVERFLOW_AT)
        scales = [scale for _, scale, _ in graphed["outcomes"]]
        assert min(scales) < 2.0**10  # backed off inside the replays


def test_a_replay_reads_nothing_back_during_the_replay() -> None:
    """The replays of a steady step under CUDA's sync detector: nothing waits for the device."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 16).cuda()
    mp = MixedPrecision("bf16-mixed", explain_overflow=False)
    opt = torch.optim.AdamW(model.parameters(), fused=True, capturable=True)
    model, opt = mp.prepare(model, opt)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with mp.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        mp.backward(loss)
        mp.step()
        return loss

    x, y = torch.randn(8, 64, device="cuda"), torch.randn(8, 16, device="cuda")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*capturable=True.*")
        step = capture_step(mp, train_step, x, y)
    step.replay(x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    for _ in range(3):
        step.replay(x, y)
    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert mp.optimizer_steps == 3 + 4  # warm-up steps and replays, counted

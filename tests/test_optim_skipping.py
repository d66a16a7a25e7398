"""The low-precision wrappers' steps decided on the device (:mod:`mixprec.optim.skipping`).

bf16-pure, bf16-kahan and bf16-sr skip a step from the front door's device flag on every executor
that can mask its writes (torch's fused kernel in the eager chunks, the compiled loop, the native
kernel): ``backward()`` + ``step()`` then read nothing back (counted as ``tests._syncs`` does), and a
run with planted overflows and non-finite losses ends with the host-decided run's bits: weights,
compensation, moments, step counts, rounding noise, learning rates and results.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec.step as step_module
from mixprec import MixedPrecision, get_plan
from mixprec.cli.models.gpt import TokenCrossEntropy
from mixprec.optim import (
    KahanOptimizer,
    LowPrecisionOptimizer,
    RemainderOptimizer,
    StochasticRoundingOptimizer,
    native,
)
from tests._syncs import count_syncs
from tests.test_device_first import _gpt, _loss

needs_native = pytest.mark.skipif(not native.status()[0], reason="the native optimizer kernel is not available")

#: (plan, options): the executor each takes on the CPU for these small models
MASKED = {
    "pure-eager": ("bf16-pure", {}),  # torch's fused kernel on the bf16 tensors
    "sr-eager": ("bf16-sr", {}),  # fused kernel on fp32 chunks, stochastic store, noise put back
    "kahan-native": ("bf16-kahan", {"state_dtype": "8bit"}),
    "sr-native": ("bf16-sr", {"state_dtype": "8bit"}),
    "pure-native": ("bf16-pure", {"state_dtype": "8bit"}),
}


def _session(plan: str, options: dict):  # type: ignore[no-untyped-def]
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    mp = MixedPrecision(get_plan(plan, **options))
    return mp, *mp.prepare(model, opt, criterion=TokenCrossEntropy())


@pytest.mark.parametrize("case", [*MASKED, "kahan-compiled"])
def test_a_steady_low_precision_step_reads_nothing_back(case: str) -> None:
    if "native" in case and not native.status()[0]:
        pytest.skip("the native optimizer kernel is not available")
    plan, options = MASKED.get(case, ("bf16-kahan", {"optimizer_compile": True}))
    mp, model, opt, crit = _session(plan, options)
    for i in range(3):  # the first step creates the state (decided on the host)
        mp.backward(_loss(mp, model, crit, i))
        mp.step()
    loss = _loss(mp, model, crit, 3)
    with count_syncs(strict=True):
        mp.backward(loss)
        assert opt.skips_on_device()
        result = mp.step()
    assert not result.resolved and result.stepped


def test_kahan_on_the_eager_path_reads_the_flag_once() -> None:
    """A bf16 Kahan compensation would not come back bit for bit from an unchanged weight: the eager
    chunks of a Kahan wrapper step only after the host read the flag (one read a step)."""
    mp, model, opt, crit = _session("bf16-kahan", {})
    for i in range(3):
        mp.backward(_loss(mp, model, crit, i))
        mp.step()
    loss = _loss(mp, model, crit, 3)
    with count_syncs() as counter:
        mp.backward(loss)
        assert not opt.skips_on_device()
        mp.step()
    assert counter.reads == 1


def _planted_run(plan: str, options: dict, host: bool, monkeypatch, steps: int = 8):  # type: ignore[no-untyped-def]
    """Overflows planted in steps 1, 4, 5 and a NaN loss in step 2; ``host``: every optimizer steps
    only after the host read the decision."""
    if host:
        monkeypatch.setattr(step_module, "skips_on_device", lambda opt: False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.9 ** e)
    mp = MixedPrecision(get_plan(plan, **options), clip_grad_norm=5.0, max_consecutive_skips=100)
    model, opt, sched = mp.prepare(model, opt, scheduler=sched)
    gen = torch.Generator().manual_seed(1)
    lrs, results, device_steps = [], [], 0
    for i in range(steps):
        with mp.autocast():
            loss = model(torch.randn(4, 16, generator=gen)).float().pow(2).mean()
        if i == 2:
            loss = loss * float("nan")
        mp.backward(loss)
        if i in (1, 4, 5):
            model[0].weight.grad.view(-1)[3] = float("inf")
        mp.settle_outcome()
        lrs.append(opt.param_groups[0]["lr"])
        device_steps += step_module.skips_on_device(opt)
        results.append(mp.step())
    monkeypatch.undo()
    return [p.detach().clone() for p in model.parameters()], lrs, results, mp.state_dict(), device_steps


@pytest.mark.parametrize("case", [*MASKED, "kahan-eager", "sr-compiled"])
def test_planted_overflows_give_the_host_decided_bits(case: str, monkeypatch) -> None:
    if "native" in case and not native.status()[0]:
        pytest.skip("the native optimizer kernel is not available")
    plan, options = MASKED.get(case) or {
        "kahan-eager": ("bf16-kahan", {}), "sr-compiled": ("bf16-sr", {"optimizer_compile": True}),
    }[case]
    device = _planted_run(plan, options, False, monkeypatch)
    host = _planted_run(plan, options, True, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(device[0], host[0], strict=True))
    assert device[1] == host[1]
    assert device[2] == host[2]
    assert device[3] == host[3]  # step counts, moments, compensation, noise, scheduler
    assert [i for i, r in enumerate(device[2]) if r.skipped] == [1, 2, 4, 5]
    assert host[4] == 0 and device[4] == (0 if case == "kahan-eager" else 7)  # all but the first step (it creates the state)


def _wrapped(cls: type, dtype: torch.dtype = torch.bfloat16, **kwargs) -> tuple[torch.optim.Optimizer, nn.Parameter]:  # type: ignore[type-arg]
    w = nn.Parameter(torch.ones(8, dtype=dtype))
    opt = cls(torch.optim.AdamW([w], lr=0.1, fused=True), **kwargs)
    w.grad = torch.ones_like(w)
    opt.step()
    w.grad = torch.ones_like(w)
    return opt, w


def test_what_cannot_skip_on_the_device_says_so() -> None:
    assert _wrapped(LowPrecisionOptimizer)[0].skips_on_device()
    assert not _wrapped(LowPrecisionOptimizer, torch.float16)[0].skips_on_device()  # guarded on the host
    assert not _wrapped(RemainderOptimizer)[0].skips_on_device()  # its ties are a host list
    assert not _wrapped(LowPrecisionOptimizer, fused=False)[0].skips_on_device()  # foreach chunks: no flag
    w = nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    w.grad = torch.ones_like(w)
    assert not LowPrecisionOptimizer(torch.optim.AdamW([w], fused=True)).skips_on_device()  # a first step
    assert not LowPrecisionOptimizer(torch.optim.AdamW([w], foreach=True)).skips_on_device()  # not fused
    opt, _ = _wrapped(StochasticRoundingOptimizer)
    assert opt.skips_on_device()


@needs_native
def test_a_skipped_step_is_settled_before_a_checkpoint_and_a_host_decided_step() -> None:
    opt, w = _wrapped(KahanOptimizer, state_dtype="8bit")
    before = (w.detach().clone(), {k: v.clone() for k, v in opt.optimizer.state[w].items()}, opt.compensation(w).clone())
    opt.step_skipping(torch.ones(()))
    assert torch.equal(w, before[0]) and torch.equal(opt.compensation(w), before[2])
    state = opt.state_dict()["state"][0]
    assert all(torch.equal(state[k], v) for k, v in before[1].items())  # the count is put back first
    assert opt.settle() is None  # nothing left to settle
    opt.step_skipping(torch.zeros(()))
    opt.step()  # a host-decided step settles the device-decided one first
    assert float(opt.optimizer.state[w]["step"]) == 3.0

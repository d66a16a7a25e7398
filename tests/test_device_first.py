"""The device-first step: in steady state ``backward()`` + ``step()`` read no device value back.

Counted on the CPU, as a GPU would pay for them (``tests._syncs``: a dispatch mode for the
aten reads, patched ``Tensor`` methods for the Python-level ones). The decision, the loss
scale, the clip factor and the masked update stay on the device; the host's bookkeeping
reads the outcome one step late, from a copy made when it was computed. Also: the op count
of ``step()`` does not grow with the model, and the device-decided run is bit for bit the
host-decided one (weights, loss scales, learning rates, skips), for every hysteresis mode.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec.step as step_module
from mixprec import DynamicLossScaler, MixedPrecision
from mixprec.cli.models.gpt import GPT, GPTConfig, TokenCrossEntropy
from tests._dist import run_ranks
from tests._syncs import count_syncs

#: the plans whose every optimizer skips on the device (with a fused optimizer)
DEVICE_FIRST = ("fp32", "tf32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "fp8-mixed")
HYSTERESIS = (
    {"hysteresis": 2, "hysteresis_mode": "consecutive"},
    {"hysteresis": 2, "hysteresis_mode": "since_growth"},
    {"hysteresis": 3, "hysteresis_mode": "deepspeed", "growth_delay": 1},
    {"min_scale": 2.0, "max_scale": 2.0**20, "growth_interval": 3},
)


def _gpt(layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, num_layers=layers, dim=32, num_heads=2))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x = torch.randint(0, 64, (2, 16), generator=g)
    return x, torch.roll(x, -1, 1)


def _session(plan: str, layers: int = 2, **kwargs):  # type: ignore[no-untyped-def]
    model = _gpt(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    mp = MixedPrecision(plan, **kwargs)
    model, opt, crit = mp.prepare(model, opt, criterion=TokenCrossEntropy())
    return mp, model, opt, crit


def _loss(mp, model, crit, i: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    x, y = _batch(i)
    with mp.autocast():
        return crit(model(x), y)


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("plan", DEVICE_FIRST)
def test_a_steady_step_reads_nothing_back_in_the_own_loop(plan: str, clip: float | None) -> None:
    mp, model, _, crit = _session(plan, clip_grad_norm=clip)
    for i in range(3):  # the first steps create the optimizer state (decided on the host)
        mp.backward(_loss(mp, model, crit, i))
        mp.step()
    loss = _loss(mp, model, crit, 3)
    with count_syncs(strict=True):
        mp.backward(loss)
        result = mp.step()
    assert not result.resolved  # nothing read yet
    assert result.stepped and result.grad_norm > 0 and mp.optimizer_steps >= 3


@pytest.mark.parametrize("plan", DEVICE_FIRST)
def test_a_steady_step_reads_nothing_back_through_the_composable_halves(plan: str) -> None:
    mp, model, _, crit = _session(plan)
    for i in range(4):
        loss = _loss(mp, model, crit, i)
        with count_syncs(strict=i == 3):
            with mp.backward_context():
                mp.scale_loss(loss).backward()
            mp.micro_batch_done()
            mp.unscale_()
            norm = mp.clip_grad_norm_(10.0)
            mp.step()
        assert isinstance(norm, torch.Tensor)
    assert not mp.last_step_skipped


@pytest.mark.parametrize("scaling", HYSTERESIS)
def test_fp16_steps_with_every_hysteresis_mode_read_nothing_back_also_when_they_skip(scaling) -> None:
    mp, model, _, crit = _session("fp16-master", scaler=DynamicLossScaler(init_scale=2.0**10, **scaling))
    for i in range(3):
        mp.backward(_loss(mp, model, crit, i))
        mp.step()
    for i in range(3, 7):
        loss = _loss(mp, model, crit, i)
        with count_syncs(strict=True):
            mp.backward(loss)
            if i in (4, 5):  # planted overflows
                next(iter(model.parameters())).grad.view(-1)[0] = float("inf")
            mp.step()
    assert mp.last_result.skipped is False and mp.state_dict()["scaler"]["overflow_steps"] == 2


def test_the_step_ops_do_not_grow_with_the_number_of_layers() -> None:
    """The extra work of the mixed and master plans' step is per model, not per parameter."""

    def step_ops(plan: str, layers: int) -> int:
        mp, model, _, crit = _session(plan, layers)
        for i in range(4):
            mp.backward(_loss(mp, model, crit, i))
            if i == 3:
                with count_syncs() as counter:
                    mp.step()
                return sum(counter.ops.values())
            mp.step()
        raise AssertionError("unreachable")

    for plan in ("fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master"):
        assert step_ops(plan, 2) == step_ops(plan, 8), plan


# ----------------------------------------------------------- the same numbers as the host deciding
def _planted_run(plan: str, overflows: set[int], nonfinite: set[int], host: bool, monkeypatch, steps: int = 8,
                 **scaling):  # type: ignore[no-untyped-def]
    """A run with planted gradient overflows and non-finite losses; ``host``: every optimizer is
    stepped only after the host read the decision (the step before it was device-first)."""
    if host:
        monkeypatch.setattr(step_module, "skips_on_device", lambda opt: False)
    else:
        monkeypatch.undo()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.9 ** e)
    scaler = DynamicLossScaler(init_scale=2.0**8, growth_interval=2, **scaling) if "fp16" in plan else None
    mp = MixedPrecision(plan, scaler=scaler, clip_grad_norm=5.0, max_consecutive_skips=100)
    model, opt, sched = mp.prepare(model, opt, scheduler=sched)
    gen = torch.Generator().manual_seed(1)
    lrs, results = [], []
    for i in range(steps):
        with mp.autocast():
            loss = model(torch.randn(4, 8, generator=gen)).float().pow(2).mean()
        if i in nonfinite:
            loss = loss * float("nan")
        mp.backward(loss)
        if i in overflows:
            model[0].weight.grad.view(-1)[3] = float("inf")
        mp.settle_outcome()
        lrs.append(opt.param_groups[0]["lr"])  # what this step's update uses
        results.append(mp.step())
    monkeypatch.undo()
    return [p.detach().clone() for p in model.parameters()], lrs, results, mp.state_dict()


@pytest.mark.parametrize("plan", ["bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master"])
def test_planted_overflows_give_the_host_decided_weights_scales_rates_and_skips(plan, monkeypatch) -> None:
    overflows, nonfinite = {1, 4, 5}, {2}
    device = _planted_run(plan, overflows, nonfinite, False, monkeypatch)
    host = _planted_run(plan, overflows, nonfinite, True, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(device[0], host[0], strict=True))
    assert device[1] == host[1]
    assert device[2] == host[2]  # StepResults (NaN norms compare equal)
    assert device[3] == host[3]
    skipped = [i for i, r in enumerate(device[2]) if r.skipped]
    assert skipped == sorted(overflows | nonfinite) if plan != "fp16-mixed" else set(skipped) >= overflows | nonfinite


_CODES = st.lists(st.sampled_from([0, 0, 0, 1, 2, 2, 3, 4]), min_size=1, max_size=40)
_CONFIGS = st.sampled_from([
    {}, {"hysteresis": 2}, {"hysteresis": 3, "hysteresis_mode": "since_growth"},
    {"hysteresis": 2, "hysteresis_mode": "deepspeed"}, {"hysteresis": 2, "hysteresis_mode": "deepspeed", "growth_delay": 1},
    {"min_scale": 4.0, "max_scale": 2.0**12}, {"growth_interval": 1, "growth_factor": 3.0, "backoff_factor": 0.25},
])


@settings(max_examples=60, deadline=None)
@given(codes=_CODES, config=_CONFIGS, found_on_overflow=st.booleans())
def test_the_scale_settled_on_the_device_is_the_host_decided_one_for_every_hysteresis_mode(
    codes: list[int], config: dict, found_on_overflow: bool
) -> None:
    """``settle(code)`` + ``counted(reason)`` against ``update()`` / ``skip()``, as the host-decided
    ledger called them, over generated decision sequences (an overflow that is only an fp32-overflowing
    norm on finite gradients when ``found_on_overflow`` is False)."""
    config = {"growth_interval": 3, **config}
    device = DynamicLossScaler(init_scale=2.0**6, **config)
    host = DynamicLossScaler(init_scale=2.0**6, **config)
    w = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=0.1)
    reasons = step_module.REASONS
    for code in codes:
        found = 1.0 if code == 2 and found_on_overflow else 0.0
        for scaler in (device, host):
            w.grad = torch.tensor([found * math.inf if found else 1.0, 0.0])
            scaler.unscale_(opt, sync=False)
            scaler.decided([opt], torch.tensor(found), None)
        device.settle(torch.tensor(float(code)))
        device.counted(reasons[code])
        if code in (0, 2):
            host.update()
        else:
            host.skip()
        assert device.state_dict() == host.state_dict(), (codes, config)
        assert device.last_step_skipped == host.last_step_skipped


# ------------------------------------------------------------------ several ranks
def _ranks_worker(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import fully_shard

    from mixprec.distributed import fsdp_policy

    for layout, plan in (("ddp", "fp16-mixed"), ("ddp", "bf16-master"), ("ddp", "fp16-master"),
                         ("fsdp", "bf16-mixed"), ("fsdp", "fp16-mixed"), ("fsdp", "bf16-master")):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        mp = MixedPrecision(plan, clip_grad_norm=1.0)
        if layout == "fsdp":
            for layer in (model[0], model[2], model):
                fully_shard(layer, mp_policy=fsdp_policy(mp.plan))
            model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
        else:
            model = mp.prepare_model(model, ddp=True)
            opt = mp.prepare_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
        gen = torch.Generator().manual_seed(10 + rank)
        for i in range(5):
            x = torch.randn(4, 8, generator=gen)
            with mp.autocast():
                loss = model(x).float().pow(2).mean()
            with count_syncs(strict=i >= 3) as counter:
                mp.backward(loss)
                if i == 4 and rank == 1:  # an inf in one rank's own gradient (shard): skipped on both, no read
                    grad = next(p for p in model.parameters() if p.grad is not None).grad
                    (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")
                mp.step()
            assert counter.reads == 0 or i < 3, (layout, plan, dict(counter.counts))
        assert mp.last_step_skipped, (layout, plan)
        del opt


@pytest.mark.distributed
def test_ddp_and_fsdp2_steps_read_nothing_back_and_skip_together() -> None:
    run_ranks(_ranks_worker, 2)

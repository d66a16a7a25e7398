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
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec.step as step_module
from mixprec import ConstantLossScaler, DynamicLossScaler, MixedPrecision
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


# ------------------------------------------------------------------ the host's bookkeeping, one step late
def test_a_collapsed_scale_restarts_before_the_next_forward_also_after_an_explicit_clip() -> None:
    """on_scale_collapse='reset' restarts the scale on the device, in the step that collapsed: the
    next loss is scaled by the restarted scale (a host reset one step late would have unscaled a
    loss scaled by the collapsed one), and a loop that clips itself keeps working."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=2000)  # the scale "reset" restarts at
    mp = MixedPrecision("fp16-mixed", scaler=scaler, max_zero_grad_steps=3, on_scale_collapse="reset")
    model, _ = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    scaler.update(new_scale=2.0**-3)  # collapsed below 1
    scales = []
    with pytest.warns(RuntimeWarning, match="3 consecutive optimizer steps ran on all-zero gradients"):
        for _ in range(6):
            with mp.autocast():
                loss = model(torch.randn(4, 8)).float().sum() * 0.0  # all-zero gradients
            mp.backward(loss)
            mp.clip_grad_norm_(1.0)  # the loop clips itself: the scaler's records stay until step()
            mp.step()
            scales.append(float(mp.scaler.scale_tensor()))
    assert scales[:3] == [2.0**-3, 2.0**-3, 2.0**10] and scales[3:] == [2.0**10] * 3


def test_every_master_optimizer_is_undone_when_one_refuses_the_update() -> None:
    """fp16-master with a fused AdamW (device-first) and a momentum SGD (decided on the host): an
    update that would write inf into fp16 weights through the first undoes the second too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    mp = MixedPrecision("fp16-master", scaler=ConstantLossScaler(1.0), max_consecutive_skips=10)
    model, first, second = mp.prepare(
        model, torch.optim.AdamW(model[0].parameters(), lr=1e-3, fused=True),
        torch.optim.SGD(model[1].parameters(), lr=1e-3, momentum=0.9))
    for _ in range(3):
        with mp.autocast():
            loss = model(torch.randn(2, 4).half()).float().pow(2).mean()
        mp.backward(loss)
        mp.step()
    with torch.no_grad():
        first.master_of(model[0].weight)[0, 0] = 65500.0  # one more step rounds it to inf in fp16
        model[0].weight[0, 0] = 65504.0
    first.param_groups[0]["lr"], first.param_groups[0]["weight_decay"] = 100.0, 0.0
    before = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for opt in (first, second) for m in opt.masters]
    with mp.autocast():
        loss = model(torch.randn(2, 4).half() * 1e-4).float().pow(2).mean()  # (small: the big weight stays finite)
    mp.backward(loss)
    for p in model[0].parameters():
        p.grad.fill_(-1.0)  # the update adds about lr to every weight
    result = mp.step()
    assert result.skip_reason == "nonfinite_weights"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(masters, [m for opt in (first, second) for m in opt.masters],
                                                 strict=True))


def test_the_explainer_names_an_intermittent_overflow_when_nothing_reads_the_results() -> None:
    """The host learns outcomes a step late: a tracer armed then watches the forward after the next,
    and the step whose forward ran untraced is not judged (it used to disable the explainer)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 4))
    mp = MixedPrecision("fp16-mixed", scaler=ConstantLossScaler(1.0), max_consecutive_skips=100)
    model, _ = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    hot = {"on": False}
    model[2].register_forward_hook(lambda m, a, out: out * 1e6 if hot["on"] else None)  # fp16 overflows there
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(12):
            hot["on"] = i % 2 == 1  # every other step
            with mp.autocast():
                loss = model(torch.randn(8, 16)).float().pow(2).mean()
            mp.backward(loss)
            mp.step()  # nothing reads the result
    found = [str(w.message) for w in caught if "mixprec: steps are being skipped" in str(w.message)]
    assert len(found) == 1 and "module '2' (Linear)" in found[0], found


def test_a_result_read_after_a_load_is_counted_into_the_replaced_state_not_the_loaded_one(tmp_path) -> None:
    mp, model, opt, crit = _session("bf16-mixed")
    for i in range(3):
        mp.backward(_loss(mp, model, crit, i))
        mp.step()
    saved = mp.state_dict()  # 3 steps
    mp.backward(_loss(mp, model, crit, 3))
    result = mp.step()  # decided on the device, not read
    mp.load_state_dict(saved)
    assert result.stepped and result.optimizer_steps == 4  # its own count, read now
    assert mp.optimizer_steps == 3  # the loaded state, untouched by the read


def test_the_mixed_plans_hold_no_more_memory_in_a_step_than_torchs_loop() -> None:
    """Every storage alive during a training step, counted (mixprec.diagnostics' live accounting):
    bf16-mixed's peak above the persistent state equals torch.autocast + fused AdamW's, also with
    the criterion prepared (its fp32 loss), so no kept copy of the logits or second gradient."""
    from mixprec.diagnostics.memory.live import LiveStorages

    config = GPTConfig(vocab_size=4096, seq_len=64, num_layers=2, dim=64, num_heads=2)
    x = torch.randint(0, 4096, (4, 64), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, 1)

    def peak(step, model, opt) -> int:  # type: ignore[no-untyped-def]
        for _ in range(2):
            step()
        live = LiveStorages()
        for t in [*model.parameters(), *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))]:
            live.add(t, dynamic=False)
        live.peak = base = live.live
        with live.tracking():
            step()
        return live.peak - base

    torch.manual_seed(0)
    model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    crit = TokenCrossEntropy()

    def torch_step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = crit(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    reference = peak(torch_step, model, opt)
    torch.manual_seed(0)
    mp = MixedPrecision("bf16-mixed")
    model2 = GPT(config)
    model2, opt2, crit2 = mp.prepare(model2, torch.optim.AdamW(model2.parameters(), fused=True), criterion=TokenCrossEntropy())

    def mp_step() -> None:
        with mp.autocast():
            loss = crit2(model2(x), y)
        mp.backward(loss)
        mp.step()

    ours = peak(mp_step, model2, opt2)
    assert ours <= reference + 4096, (ours, reference)  # (a few scalars: the decision and its host copy)

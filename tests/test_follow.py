"""Masters and compensation follow the model's weights (mixprec.optim.follow).

Whoever writes a low-precision model's weights after ``prepare`` (``load_state_dict``, user
code), the next step starts from exactly those values; masters of later optimizers are
seeded from the fp32 values the conversion cast down; micro-batches add up in fp32 however
a loop marks its boundaries.

References: a session prepared directly from the loaded fp32 weights (the same math, so
bit for bit), one ``prepare`` with every optimizer, and mixprec's own ``grad_accum_steps``.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch

from mixprec import MixedPrecision

MASTER_PLANS = ["bf16-master", "fp16-master"]


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def _loss(model: torch.nn.Module, mp: MixedPrecision, step: int, scale: float = 1.0) -> torch.Tensor:
    x, y = _batch(step)
    with mp.autocast():
        return torch.nn.functional.mse_loss(model(x).float(), y) * scale


def _train(model: torch.nn.Module, mp: MixedPrecision, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = _loss(model, mp, step)
        mp.backward(loss)
        mp.step()
        losses.append(loss.item())
    return losses


def _prepared(plan: str, seed: int = 0, lr: float = 0.05, opt: type = torch.optim.AdamW) -> tuple[Any, Any, MixedPrecision]:
    mp = MixedPrecision(plan)
    model = _mlp(seed)
    model, optimizer = mp.prepare(model, opt(model.parameters(), lr=lr))
    return model, optimizer, mp


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _fp32_state(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in _mlp(seed).state_dict().items()}


# ------------------------------------------------------------------ loads after prepare
@pytest.mark.parametrize("plan", MASTER_PLANS)
def test_weights_loaded_after_prepare_train_as_if_prepared_from_them(plan: str) -> None:
    """Before: the masters kept the initial weights, and the first step wrote them back."""
    model, _, mp = _prepared(plan, seed=0, opt=torch.optim.SGD)  # stateless: the reference can match it
    _train(model, mp, range(3))  # the masters now hold trained weights
    model.load_state_dict(_fp32_state(seed=1))  # fp32 values into a low-precision model
    ref_model, _, ref_mp = _prepared(plan, seed=1, opt=torch.optim.SGD)  # prepared from those fp32 weights
    assert _train(model, mp, range(3, 8)) == _train(ref_model, ref_mp, range(3, 8))
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("plan", MASTER_PLANS)
def test_loaded_weights_survive_a_step_with_lr_zero(plan: str) -> None:
    model, optimizer, mp = _prepared(plan, lr=0.0, opt=torch.optim.SGD)
    _train(model, mp, range(2))
    low = model.state_dict()  # the low-precision weights as saved
    other = _mlp(seed=3)
    model.load_state_dict(other.state_dict())
    _train(model, mp, range(2, 3))
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(p, q.to(p.dtype))
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        if (m := optimizer.master_of(p)) is not None:
            assert torch.equal(m, q.detach())  # the fp32 values loaded, not their rounding
    assert low.keys() == model.state_dict().keys()


@pytest.mark.parametrize("plan", MASTER_PLANS)
def test_reloading_the_same_low_precision_weights_keeps_the_masters(plan: str) -> None:
    """A reload of what the model holds (a broadcast, an optimizer-first resume) loses nothing."""
    model, optimizer, mp = _prepared(plan)
    _train(model, mp, range(3))
    masters = [m.clone() for m in optimizer.masters]
    model.load_state_dict(copy.deepcopy(model.state_dict()))
    optimizer.step()  # no gradients: the masters are only checked against the weights
    assert all(torch.equal(a, b) for a, b in zip(masters, optimizer.masters, strict=True))


@pytest.mark.parametrize("plan", MASTER_PLANS)
@pytest.mark.parametrize("order", ["model_first", "optimizer_first"])
def test_resume_is_exact_in_either_load_order(plan: str, order: str) -> None:
    model, optimizer, mp = _prepared(plan)
    _train(model, mp, range(3))
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": optimizer.state_dict(), "mp": mp.state_dict()}, saved)
    expected = _train(model, mp, range(3, 6)), _weights(model)
    saved.seek(0)
    ckpt = torch.load(saved, weights_only=False)
    model2, optimizer2, mp2 = _prepared(plan, seed=7)
    if order == "model_first":
        model2.load_state_dict(ckpt["model"])
        optimizer2.load_state_dict(ckpt["opt"])
    else:
        optimizer2.load_state_dict(ckpt["opt"])
        model2.load_state_dict(ckpt["model"])
    mp2.load_state_dict(ckpt["mp"])
    assert _train(model2, mp2, range(3, 6)) == expected[0]
    assert all(torch.equal(a, b) for a, b in zip(_weights(model2), expected[1], strict=True))


@pytest.mark.parametrize("plan", MASTER_PLANS)
def test_weights_written_by_user_code_are_where_the_next_step_starts(plan: str) -> None:
    model, optimizer, mp = _prepared(plan, lr=0.0, opt=torch.optim.SGD)
    _train(model, mp, range(2))
    first, last = model[0].weight, model[3].weight
    kept_master = optimizer.master_of(last).clone()
    other_rows = optimizer.master_of(first)[1:].clone()
    with torch.no_grad():
        first[0].mul_(0.5)  # in place: the version counter moves
    replaced = torch.full_like(model[3].bias, 0.25)
    model[3].bias.data = replaced  # .data: the version counter stays, the storage changes
    written = first.detach().clone()
    _train(model, mp, range(2, 3))
    assert torch.equal(first, written) and torch.equal(model[3].bias, replaced)
    assert torch.equal(optimizer.master_of(first)[0], written[0].float())
    assert torch.equal(optimizer.master_of(first)[1:], other_rows)  # rows not written keep their fp32 bits
    assert torch.equal(optimizer.master_of(last), kept_master)  # untouched weights keep their fp32 bits


def test_a_skipped_step_keeps_the_loaded_weights() -> None:
    model, optimizer, mp = _prepared("fp16-master")
    _train(model, mp, range(2))
    other = _mlp(seed=4)
    model.load_state_dict(other.state_dict())
    mp.backward(_loss(model, mp, 2, scale=float("inf")))
    assert mp.step().skipped
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(p, q.to(p.dtype))
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        master = optimizer.master_of(p)
        assert master is None or torch.equal(master, q.detach())


# ------------------------------------------------------------------------------ Kahan
def test_kahan_compensation_follows_loads_and_writes() -> None:
    """Before: the old compensation was added to the loaded weight (about one bf16 step off)."""
    model, optimizer, mp = _prepared("bf16-kahan", lr=1e-3)
    _train(model, mp, range(5))
    assert any(optimizer.compensation(p) is not None and optimizer.compensation(p).abs().sum() > 0 for p in model.parameters())
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    fp32 = _fp32_state(seed=5)
    model.load_state_dict(fp32)
    for name, p in model.named_parameters():
        comp = optimizer.compensation(p)
        if p.dtype == torch.bfloat16 and comp is not None:  # weight + compensation stands for the fp32 value
            exact = fp32[name] - p.float()
            assert torch.equal(comp, exact.to(comp.dtype))
    loaded = _weights(model)
    _train(model, mp, range(5, 7))
    assert all(torch.equal(a, b) for a, b in zip(loaded, _weights(model), strict=True))
    with torch.no_grad():
        model[0].weight.add_(1.0)
    written = model[0].weight.detach().clone()
    _train(model, mp, range(7, 8))
    assert torch.equal(model[0].weight, written)


# ---------------------------------------------------------------- several optimizers
@pytest.mark.parametrize("plan", MASTER_PLANS)
def test_a_second_prepare_optimizers_seeds_from_the_fp32_values(plan: str) -> None:
    """Before: the second optimizer's masters were seeded from the already-rounded weights."""
    fp32 = _mlp(seed=2)
    mp = MixedPrecision(plan)
    model = mp.prepare_model(copy.deepcopy(fp32))
    first = mp.prepare_optimizers(torch.optim.SGD(model[0].parameters(), lr=0.1))
    second = mp.prepare_optimizers(torch.optim.SGD(model[3].parameters(), lr=0.1))
    for opt, source in ((first, fp32[0]), (second, fp32[3])):
        for master, original in zip(opt.masters, source.parameters(), strict=True):
            assert torch.equal(master, original.detach())
    assert not mp._prepared.fp32_values  # every seed used: no second copy kept


@pytest.mark.parametrize("plan", MASTER_PLANS)
def test_a_load_between_the_halves_seeds_the_masters(plan: str) -> None:
    mp = MixedPrecision(plan)
    model = mp.prepare_model(_mlp(seed=0))
    fp32 = _fp32_state(seed=6)
    model.load_state_dict(fp32)  # e.g. a framework's on_fit_start / load_raw
    opt = mp.prepare_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    for name, p in model.named_parameters():
        master = opt.master_of(p)
        if master is not None:
            assert torch.equal(master, fp32[name])


# ------------------------------------------------------------------------ accumulation
@pytest.mark.parametrize("plan", MASTER_PLANS)
@pytest.mark.parametrize("halves", [False, True])
def test_manual_accumulation_adds_up_in_fp32(plan: str, halves: bool) -> None:
    """Two backwards before one step (Lightning's manual optimisation, Fabric) equal
    grad_accum_steps=2. Before: the second backward added into the bf16/fp16 gradients."""
    ref_model, _, ref_mp = _prepared(plan, seed=0)
    ref_mp.grad_accum_steps = 2
    model, _, mp = _prepared(plan, seed=0)
    for step in range(3):
        for micro in range(2):
            ref_mp.backward(_loss(ref_model, ref_mp, 2 * step + micro))
            loss = _loss(model, mp, 2 * step + micro) / 2
            if halves:
                with mp.backward_context():
                    mp.scale_loss(loss).backward()
                mp.micro_batch_done()
            else:
                mp.backward(loss)
        assert ref_mp.step().stepped and mp.step().stepped
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)


# ------------------------------------------------------------------------------ copies
def test_a_copy_of_a_prepared_model_loads_without_touching_the_original() -> None:
    model, optimizer, mp = _prepared("bf16-master")
    _train(model, mp, range(2))
    masters = [m.clone() for m in optimizer.masters]
    twin = copy.deepcopy(model)
    twin.load_state_dict(_fp32_state(seed=8))
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(masters, optimizer.masters, strict=True))
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the load hooks pickle with the model
    buffer.seek(0)
    again = torch.load(buffer, weights_only=False)
    again.load_state_dict(_fp32_state(seed=8))
    assert all(torch.equal(a, b) for a, b in zip(masters, optimizer.masters, strict=True))


# ------------------------------------------------------------- review: saves, skips, .data
@pytest.mark.parametrize("plan", MASTER_PLANS)
def test_a_save_after_a_write_holds_the_written_weights(plan: str) -> None:
    """Before: state_dict() saved the stale masters, and a resume (model, then optimizer) wrote them back."""
    model, optimizer, mp = _prepared(plan)
    _train(model, mp, range(2))
    with torch.no_grad():
        model[0].weight.mul_(0.5)
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": optimizer.state_dict(), "mp": mp.state_dict()})
    expected = _train(model, mp, range(2, 4)), _weights(model)
    model2, optimizer2, mp2 = _prepared(plan, seed=9)
    model2.load_state_dict(ckpt["model"])
    optimizer2.load_state_dict(ckpt["opt"])
    mp2.load_state_dict(ckpt["mp"])
    assert torch.equal(model2[0].weight, ckpt["model"]["0.weight"])
    assert _train(model2, mp2, range(2, 4)) == expected[0]
    assert all(torch.equal(a, b) for a, b in zip(_weights(model2), expected[1], strict=True))


def test_writes_through_data_are_followed_on_request() -> None:
    """``p.data.copy_`` bypasses the version counter: follow_model() takes such writes."""
    model, optimizer, mp = _prepared("bf16-master", lr=0.0, opt=torch.optim.SGD)
    _train(model, mp, range(2))
    untouched = optimizer.master_of(model[3].weight).clone()
    model[0].weight.data.copy_(torch.full_like(model[0].weight, 3.0))
    optimizer.follow_model()
    _train(model, mp, range(2, 3))
    assert torch.equal(model[0].weight, torch.full_like(model[0].weight, 3.0))
    assert torch.equal(optimizer.master_of(model[3].weight), untouched)


@pytest.mark.parametrize("in_backward", [False, True])
def test_a_skipped_kahan_step_does_not_bring_back_a_written_weights_residual(in_backward: bool) -> None:
    """Before: the undo copy of the compensation was taken before the write was noticed, and a
    skip restored the old residual onto the new weight."""
    mp = MixedPrecision("bf16-kahan", optimizer_in_backward=in_backward)
    model = _mlp(0)
    model, optimizer = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    _train(model, mp, range(2))
    assert optimizer.compensation(model[0].weight) is not None
    for group in optimizer.param_groups:
        group["lr"] = 0.0  # from here a step adds only what the compensation holds
    with torch.no_grad():
        model[0].weight.fill_(1e-3)  # small: an old residual (~1e-5) would move it by several ulps
    written = model[0].weight.detach().clone()
    mp.backward(_loss(model, mp, 2, scale=float("inf")))
    assert mp.step().skipped
    _train(model, mp, range(3, 5))
    assert torch.equal(model[0].weight, written)  # no old residual added to the written weight

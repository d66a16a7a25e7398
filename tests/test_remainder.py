"""bf16-master with remainders: exact fp32 masters as the bf16 weight + an int16 remainder.

The oracle is today's bf16-master (fp32 masters): the same weights, masters and losses
bit for bit, through skipped steps and a resume, in fewer bytes.
"""

from __future__ import annotations

import math

import pytest
import torch

from mixprec import MixedPrecision, get_plan, load_checkpoint, save_checkpoint
from mixprec.optim import MasterWeightOptimizer, RemainderOptimizer
from mixprec.optim.quant import split_master

SKIPS = (7, 19)  # steps whose batch holds an inf: skipped, the scale of no plan involved


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(  # 300 x 1000 = 300k elements: cut into pieces with chunk_numel=2**16
        torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.LayerNorm(256), torch.nn.Linear(256, 300),
        torch.nn.Linear(300, 1000),
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8, 32, generator=g), torch.randn(8, 1000, generator=g)
    if step in SKIPS:
        x[0, 0] = float("inf")
    return x, y


def _setup(plan, **kw):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    mp = MixedPrecision(plan, **kw)
    model, opt = mp.prepare(model, opt)
    return model, opt, mp


def _train(model, mp, steps: range, seen: list[int] | None = None) -> list[float]:
    """The losses; ``seen`` gets, per step, whether it was skipped (1000) plus the tie count held."""
    losses = []
    for step in steps:
        x, y = _batch(step)
        with mp.autocast():
            loss = (model(x).float() - y).pow(2).mean()
        mp.backward(loss)
        result = mp.step()
        losses.append(float(loss.detach()))
        if seen is not None:
            ties = sum(t.numel() for t in mp.optimizers[0].kinds.values["remainder_ties"].values())
            seen.append(1000 * result.skipped + ties)
    return losses


def _same_losses(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True))


def _masters(model, opt) -> list[torch.Tensor]:
    low = [p for p in model.parameters() if p.dtype == torch.bfloat16]
    if isinstance(opt, MasterWeightOptimizer):
        return [opt.master_of(p).detach().clone() for p in low]
    return [opt.master(p) for p in low]


def _bits_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b, strict=True))


REMAINDERS = get_plan("bf16-master", remainders=True)


@pytest.mark.parametrize("chunk", [None, 1 << 16])  # the CPU default: whole weights; 2**16: the 300k one in pieces
def test_fifty_steps_with_skips_and_a_resume_equal_bf16_master_bit_for_bit(tmp_path, chunk) -> None:
    model1, opt1, mp1 = _setup("bf16-master")
    losses1 = _train(model1, mp1, range(50))

    model2, opt2, mp2 = _setup(REMAINDERS)
    assert isinstance(opt2, RemainderOptimizer)
    opt2.chunk_numel = chunk
    seen: list[int] = []
    losses2 = _train(model2, mp2, range(25), seen)
    save_checkpoint(tmp_path / "c.pt", model=model2, optimizers=[opt2], mp=mp2)
    model3, opt3, mp3 = _setup(REMAINDERS)
    opt3.chunk_numel = chunk
    load_checkpoint(tmp_path / "c.pt", model=model3, optimizers=[opt3], mp=mp3)
    losses2 += _train(model3, mp3, range(25, 50), seen)

    assert _same_losses(losses1, losses2)
    assert [i for i, v in enumerate(seen) if v >= 1000] == list(SKIPS)  # the skipped steps changed nothing
    for a, b in zip(model1.parameters(), model3.parameters(), strict=True):
        assert torch.equal(a, b)
    assert _bits_equal(_masters(model1, opt1), _masters(model3, opt3))
    assert sum(v % 1000 for v in seen) > 10  # masters exactly halfway, rounded down, met and kept exactly


def _train_clipped(model, mp, steps: range, by_hand: bool) -> list[float]:
    losses = []
    for step in steps:
        x, y = _batch(step)
        with mp.autocast():
            loss = (model(x).float() - y).pow(2).mean()
        mp.backward(loss)
        if by_hand:  # as a framework clips: before step(), through the front door
            mp.clip_grad_norm_(0.01)
        mp.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("variant", ["step", "by-hand", "generic"])
def test_clipped_runs_equal_bf16_master_bit_for_bit(variant: str) -> None:
    """A clip factor times a bf16 gradient rounds to bf16; fp32 masters multiply its exact fp32
    copy. The remainder wrapper applies the factor in fp32 where it expands the gradient, and
    the norm is measured alike for bf16 and fp32 gradients, so clipped runs stay bit-identical
    (max_norm 0.01 clips every step; steps 7 and 19 are skipped, their clip is not carried)."""
    clip = None if variant == "by-hand" else 0.01
    model1, opt1, mp1 = _setup("bf16-master", clip_grad_norm=clip)
    losses1 = _train_clipped(model1, mp1, range(24), by_hand=variant == "by-hand")
    model2, opt2, mp2 = _setup(REMAINDERS, clip_grad_norm=clip)
    opt2.fast = variant != "generic"
    losses2 = _train_clipped(model2, mp2, range(24), by_hand=variant == "by-hand")
    assert _same_losses(losses1, losses2)
    assert _bits_equal(_masters(model1, opt1), _masters(model2, opt2))
    assert opt2._grad_scales == []  # applied, not carried into the next step


def test_a_deferred_clip_is_dropped_with_the_gradients() -> None:
    model, opt, mp = _setup(REMAINDERS)
    x, y = _batch(0)
    with mp.autocast():
        loss = (model(x).float() - y).pow(2).mean()
    mp.backward(loss)
    before = [p.grad.clone() for p in model.parameters()]
    mp.clip_grad_norm_(1e-3)
    low = [(p.grad, b) for p, b in zip(model.parameters(), before, strict=True) if p.dtype == torch.bfloat16]
    assert all(torch.equal(g, b) for g, b in low)  # owed, applied in fp32 inside the step
    assert len(opt._grad_scales) == 1
    opt.zero_grad()
    assert opt._grad_scales == []


@pytest.mark.parametrize("variant", ["generic", "in-backward"])
def test_the_other_paths_equal_the_fast_path(variant: str) -> None:
    model1, opt1, mp1 = _setup(REMAINDERS)
    losses1 = _train(model1, mp1, range(12))
    if variant == "generic":
        model2, opt2, mp2 = _setup(REMAINDERS)
        opt2.fast = False
    else:
        model2, opt2, mp2 = _setup(REMAINDERS, optimizer_in_backward=True)
    losses2 = _train(model2, mp2, range(12))
    assert _same_losses(losses1, losses2)
    assert _bits_equal(_masters(model1, opt1), _masters(model2, mp2.optimizers[0] if variant != "generic" else opt2))


def _bytes_per_parameter(plan, **kw) -> float:
    """Every storage the model and the optimizer hold while a step runs (after its backward),
    counted once, per model parameter."""
    model, opt, mp = _setup(plan, **kw)
    _train(model, mp, range(3))
    x, y = _batch(3)
    with mp.autocast():
        loss = (model(x).float() - y).pow(2).mean()
    mp.backward(loss)  # the gradients as a step holds them (under in_backward: freed inside backward)
    inner = [q for g in opt.param_groups for q in g["params"]]
    tensors = [*model.parameters(), *inner, *(p.grad for p in [*model.parameters(), *inner]), *opt.state_tensors()]
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total / sum(p.numel() for p in model.parameters())


# 14 (12) bytes per bf16 parameter; the fp32 LayerNorm and the step counters add 0.003
@pytest.mark.parametrize(("in_backward", "limit"), [(False, 14.01), (True, 12.01)])
def test_training_state_bytes_per_parameter(in_backward: bool, limit: float) -> None:
    per_param = _bytes_per_parameter(REMAINDERS, optimizer_in_backward=in_backward)
    assert per_param <= limit, per_param
    assert _bytes_per_parameter("bf16-master") >= 16.0 > per_param  # fp32 masters: 16


def test_the_plan_says_what_it_keeps_and_refuses_fp16() -> None:
    text = REMAINDERS.explain()
    assert "remainder (int16, 2 B/weight" in text and "bf16 weight + an int16 remainder" in text
    assert REMAINDERS.fingerprint()["optimizer"] == "remainder"
    with pytest.raises(ValueError, match="remainders=True needs bf16 weights, plan 'fp16-master' has fp16"):
        get_plan("fp16-master", remainders=True)
    with pytest.raises(ValueError, match="compile must be True"):
        RemainderOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))], lr=1.0),
                           compile="sometimes")
    with pytest.raises(ValueError, match=r"needs bf16 parameters, got torch\.float16"):
        RemainderOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(2, dtype=torch.float16))], lr=1.0))


def test_a_master_plan_checkpoint_is_not_resumed_silently_under_remainders(tmp_path) -> None:
    model, opt, mp = _setup("bf16-master")
    _train(model, mp, range(2))
    save_checkpoint(tmp_path / "c.pt", model=model, optimizers=[opt], mp=mp)
    model2, opt2, mp2 = _setup(REMAINDERS)
    with pytest.raises(ValueError, match="remainder"):
        load_checkpoint(tmp_path / "c.pt", model=model2, optimizers=[opt2], mp=mp2)


def test_the_remainder_state_is_validated_before_anything_loads() -> None:
    model, opt, mp = _setup(REMAINDERS)
    _train(model, mp, range(2))
    sd = opt.state_dict()
    entry = dict(sd["mixprec_lowbit"])
    entry["remainder"] = {**entry["remainder"], 0: torch.zeros(3, dtype=torch.int16)}
    with pytest.raises(ValueError, match=r"saved remainder 0 has shape \(3,\), expected \(256, 32\)"):
        opt.load_state_dict({**sd, "mixprec_lowbit": entry})
    entry["remainder"] = dict(sd["mixprec_lowbit"]["remainder"])
    entry["remainder_ties"] = {0: torch.tensor([10**9])}
    with pytest.raises(ValueError, match="int64 list of element indices below 8192"):
        opt.load_state_dict({**sd, "mixprec_lowbit": entry})


def test_a_wider_load_into_the_model_becomes_the_master_exactly() -> None:
    model, opt, mp = _setup(REMAINDERS)
    _train(model, mp, range(2))
    torch.manual_seed(5)
    fp32 = {k: torch.randn_like(v, dtype=torch.float32) for k, v in model.state_dict().items()}
    model.load_state_dict(fp32)
    for name, p in model.named_parameters():
        if p.dtype == torch.bfloat16:
            assert torch.equal(opt.master(p).view(torch.int32), fp32[name].view(torch.int32)), name


def test_seeds_from_the_fp32_model_are_kept_exactly() -> None:
    model = _model()
    fp32 = [p.detach().clone() for p in model.parameters()]
    model, opt = MixedPrecision(REMAINDERS).prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for p, value in zip(model.parameters(), fp32, strict=True):
        if p.dtype == torch.bfloat16:
            assert torch.equal(opt.master(p).view(torch.int32), value.view(torch.int32))
            weight, _, _ = split_master(value)
            assert torch.equal(weight.view(torch.int16), p.detach().view(torch.int16))


def test_a_state_dict_moves_between_the_fast_and_the_generic_path_bit_for_bit() -> None:
    import copy

    model, opt, mp = _setup(REMAINDERS)
    _train(model, mp, range(6))
    sd = copy.deepcopy(opt.state_dict())
    model2, opt2, mp2 = _setup(REMAINDERS)
    model2.load_state_dict(model.state_dict())
    opt2.fast = False
    opt2.load_state_dict(sd)
    for m, p in ((model, mp), (model2, mp2)):
        _train(m, p, range(6, 12))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))
    assert _bits_equal(_masters(model, opt), _masters(model2, opt2))


def test_a_write_then_a_load_of_the_same_weights_keeps_no_stale_remainder() -> None:
    model, opt, mp = _setup(REMAINDERS)
    _train(model, mp, range(2))
    w = model[0].weight
    with torch.no_grad():
        w[0, 0] = 5.0
    model.load_state_dict(model.state_dict())
    assert float(opt.master(w)[0, 0]) == 5.0


@pytest.mark.parametrize("setting", [{"foreach": True}, {"foreach": False}])
def test_a_group_that_picks_its_implementation_still_equals_bf16_master(setting) -> None:
    runs = []
    for plan in ("bf16-master", REMAINDERS):
        model = _model()
        mp = MixedPrecision(plan)
        model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3, **setting))
        _train(model, mp, range(8))
        runs.append((model, opt))
    (m1, o1), (m2, o2) = runs
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters(), strict=True))
    assert _bits_equal(_masters(m1, o1), _masters(m2, o2))


def test_sparse_gradients_are_refused_at_prepare() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True))
    with pytest.raises(ValueError, match="sparse"):
        MixedPrecision(REMAINDERS).prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _ddp_worker(rank: int, world: int, out: str) -> None:
    import os

    from mixprec.checkpoint import unwrap_model
    from mixprec.cli.models import build_task

    results = {}
    for name, plan in (("master", get_plan("bf16-master")), ("remainders", REMAINDERS)):
        task = build_task("gpt", size="tiny", seed=0)
        mp = MixedPrecision(plan, clip_grad_norm=0.1)
        opt = torch.optim.AdamW(task.model.parameters(), lr=1e-3, weight_decay=0.01)
        model, opt, criterion = mp.prepare(task.model, opt, criterion=task.criterion, ddp=True)
        for step in range(8):
            x, y = task.batch(2 * world, torch.Generator().manual_seed(100 + step))
            with mp.autocast():
                loss = criterion(model(x[rank * 2 : rank * 2 + 2]), y[rank * 2 : rank * 2 + 2])
            mp.backward(loss)
            assert mp.step().stepped
        results[name] = [p.detach().clone() for p in unwrap_model(model).parameters()]
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.distributed
def test_under_ddp_with_clipping_remainders_equal_bf16_master_bit_for_bit(tmp_path) -> None:
    from tests._dist import run_ranks

    run_ranks(_ddp_worker, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for result in ranks:
        for a, b in zip(result["master"], result["remainders"], strict=True):
            assert torch.equal(a, b)
    for a, b in zip(ranks[0]["remainders"], ranks[1]["remainders"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n", [1, 1023, 1024, 5000, 3 * 1024])
def test_the_tie_screen_finds_every_tie_and_nothing_else(n: int) -> None:
    """A tie (low 17 bits 0x8000) anywhere: first and last element of a block, several in one
    block, in the tail after the whole blocks; near-misses (0x18000: the low half alone) are not."""
    from mixprec.optim.codecs import ties_of as _ties_of

    g = torch.Generator().manual_seed(n)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    planted = sorted({0, n - 1, n // 2, min(n - 1, 1023), min(n - 1, 1024), min(n - 1, 5)})
    bits[planted] = (bits[planted] & ~0x1FFFF) | 0x8000
    near = [i for i in range(2, n, 97) if i not in planted]
    bits[near] = (bits[near] & ~0x1FFFF) | 0x18000
    flat = bits.view(torch.float32)
    low = torch.empty(n, dtype=torch.int16)
    low.copy_(bits)
    expected = ((bits & 0x1FFFF) == 0x8000).nonzero().view(-1)
    found = _ties_of(flat, low)
    assert found.tolist() == expected.tolist()
    assert set(planted) <= set(found.tolist())


@pytest.mark.parametrize("then", ["value-clip", "step-clips-again"])
def test_an_in_place_change_after_a_deferred_clip_sees_the_clipped_gradients(then: str) -> None:
    """The factor a norm clip deferred goes into .grad before a value clip clamps it, and is
    not applied a second time when step() measures the changed gradients and clips again: the
    update equals bf16-master's within bf16 rounding (before: 6x too small, or clipped twice)."""

    def effective_grad(plan) -> torch.Tensor:
        model = _model()
        mp = MixedPrecision(plan, **({"clip_grad_norm": 0.01} if then == "step-clips-again" else {}))
        model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
        before = _masters(model, opt)
        x, y = _batch(100)
        with mp.autocast():
            loss = (model(x).float() - y).pow(2).mean()
        mp.backward(loss)
        mp.clip_grad_norm_(0.01)
        mp.clip_grad_value_(1e-4 if then == "value-clip" else 10.0)
        mp.step()
        return torch.cat([(b - a).flatten() for a, b in zip(_masters(model, opt), before, strict=True)])

    want, got = effective_grad("bf16-master"), effective_grad(REMAINDERS)
    assert float(got.norm()) == pytest.approx(float(want.norm()), rel=1e-2)
    assert float(got.abs().max()) == pytest.approx(float(want.abs().max()), rel=1e-2)

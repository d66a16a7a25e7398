"""A state kind registered in one place (this file): an fp32 moving average of the weights.

Without touching another file it is checkpointed, validated on load, put back with a step
that is undone (the fp16 guards, the master guard, another optimizer's refusal, the
optimizer in backward) and counted by the memory estimate.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mixprec.diagnostics.memory.state import state_bytes
from mixprec.optim import (
    InBackwardOptimizer,
    KahanOptimizer,
    LowPrecisionOptimizer,
    MasterWeightOptimizer,
    StochasticRoundingOptimizer,
)
from mixprec.optim.kinds import StateKind


def _start(param: torch.Tensor) -> torch.Tensor:
    return param.detach().float()


def _follow(param: torch.Tensor, ema: torch.Tensor) -> None:
    ema.mul_(0.75).add_(param.detach().float(), alpha=0.25)


EMA = StateKind("ema", "optimizer_state", "fp32 moving average of each weight", dtype=torch.float32,
                init=_start, after_step=_follow)

WRAPPERS = {
    "master": lambda opt: MasterWeightOptimizer(opt),
    "nearest": lambda opt: LowPrecisionOptimizer(opt),
    "kahan": lambda opt: KahanOptimizer(opt),
    "stochastic": lambda opt: StochasticRoundingOptimizer(opt),
}


def _model(dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    model[0].to(dtype)
    model[2].to(dtype)
    return model


def _setup(kind: str, dtype: torch.dtype = torch.bfloat16, lr: float = 1e-2, seed: int = 0):
    model = _model(dtype, seed)
    opt = WRAPPERS[kind](torch.optim.AdamW(model.parameters(), lr=lr))
    opt.add_state_kind(EMA)
    return model, opt


def _low(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.dtype != torch.float32]


def _backward(model: torch.nn.Module, seed: int, scale: float = 1.0) -> None:
    torch.manual_seed(100 + seed)
    x = torch.randn(4, 8).to(model[0].weight.dtype)
    (model(x).float().pow(2).mean() * scale).backward()


def _ema(opt, model) -> list[torch.Tensor]:
    return [opt.kinds.get("ema", p).clone() for p in _low(model)]


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_the_kind_follows_each_step_and_is_checkpointed(kind: str) -> None:
    dtype = torch.bfloat16
    model, opt = _setup(kind, dtype)
    expected = {p: p.detach().float().clone() for p in _low(model)}
    for step in range(3):
        _backward(model, step)
        opt.step()
        opt.zero_grad()
        for p in _low(model):
            expected[p].mul_(0.75).add_(p.detach().float(), alpha=0.25)
    for p in _low(model):
        assert torch.equal(opt.kinds.get("ema", p), expected[p])
    assert [k for k in opt.kinds.values["ema"]] == _low(model)  # only the low-precision weights have one

    sd = copy.deepcopy(opt.state_dict())  # torch's state_dict holds the live moments
    model2, opt2 = _setup(kind, dtype, seed=1)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(_ema(opt, model), _ema(opt2, model2), strict=True))
    for m, o in ((model, opt), (model2, opt2)):
        _backward(m, 7)
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(_ema(opt, model), _ema(opt2, model2), strict=True))


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_the_kind_is_validated_before_anything_loads(kind: str) -> None:
    model, opt = _setup(kind)
    _backward(model, 0)
    opt.step()
    sd = opt.state_dict()
    entry = sd["mixprec_state_kinds"] if kind == "master" else sd[type(opt)._STATE_KEY]
    bad = {**entry, "ema": {**entry["ema"], 0: torch.zeros(3)}}
    bad_sd = {**sd, ("mixprec_state_kinds" if kind == "master" else type(opt)._STATE_KEY): bad}
    model2, opt2 = _setup(kind, seed=1)
    _backward(model2, 1)
    opt2.step()
    before = (_ema(opt2, model2), [v.clone() for s in opt2.state.values() for v in s.values()
                                    if isinstance(v, torch.Tensor)])
    with pytest.raises(ValueError, match=r"saved ema 0 has shape \(3,\), expected \(16, 8\)"):
        opt2.load_state_dict(bad_sd)
    after = (_ema(opt2, model2), [v.clone() for s in opt2.state.values() for v in s.values()
                                   if isinstance(v, torch.Tensor)])
    assert all(torch.equal(a, b) for a, b in zip(before[0] + before[1], after[0] + after[1], strict=True))

    # a wrapper without the kind refuses to drop it silently
    plain = WRAPPERS[kind](torch.optim.AdamW(_model(seed=2).parameters(), lr=1e-2))
    with pytest.raises(ValueError, match=r"state of kind 'ema'.*add_state_kind"):
        plain.load_state_dict(sd)


@pytest.mark.parametrize("kind", ["master", "nearest", "kahan"])
def test_a_refused_fp16_step_puts_the_kind_back(kind: str) -> None:
    model, opt = _setup(kind, torch.float16, lr=1e-3)
    _backward(model, 0)
    opt.step()
    opt.zero_grad()
    before = _ema(opt, model)
    with torch.no_grad():
        model[0].weight.fill_(65000.0)  # a step of about lr = 1e4 takes it past fp16's 65504
    for g in opt.param_groups:
        g["lr"] = 1e4
    _backward(model, 1)
    opt.step()
    assert bool(opt.step_nonfinite())
    assert all(torch.equal(a, b) for a, b in zip(before, _ema(opt, model), strict=True))


@pytest.mark.parametrize("kind", ["master", "kahan"])
def test_undo_step_puts_the_kind_back(kind: str) -> None:
    model, opt = _setup(kind, torch.float16)
    _backward(model, 0)
    opt.step()
    opt.zero_grad()
    before = _ema(opt, model)
    _backward(model, 1)
    opt.step()
    assert not bool(opt.step_nonfinite())
    assert not all(torch.equal(a, b) for a, b in zip(before, _ema(opt, model), strict=True))
    opt.undo_step()  # another optimizer of the same step refused its update
    assert all(torch.equal(a, b) for a, b in zip(before, _ema(opt, model), strict=True))


@pytest.mark.parametrize("kind", ["kahan", "stochastic"])
def test_the_optimizer_in_backward_undoes_the_kind(kind: str) -> None:
    model, opt = _setup(kind)
    in_bwd = InBackwardOptimizer(opt)
    _backward(model, 0)
    assert in_bwd.finish()
    before = _ema(opt, model)
    torch.manual_seed(3)
    x = torch.randn(4, 8).to(torch.bfloat16)
    x[0, 0] = float("inf")  # a non-finite gradient somewhere: the whole step is undone
    model(x).float().nan_to_num(0.0, 0.0, 0.0).sum().backward()
    assert in_bwd.undo_bytes() > 0
    assert not in_bwd.finish()
    assert all(torch.equal(a, b) for a, b in zip(before, _ema(opt, model), strict=True))
    assert in_bwd.undo_bytes() == 0


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_the_memory_estimate_counts_the_kind(kind: str) -> None:
    model = _model()
    opt = WRAPPERS[kind](torch.optim.AdamW(model.parameters(), lr=1e-2))
    without = state_bytes(model, opt)
    opt.add_state_kind(EMA)
    predicted = state_bytes(model, opt)
    ema_bytes = sum(p.numel() * 4 for p in _low(model))
    assert predicted["optimizer_state"] - without["optimizer_state"] == ema_bytes
    _backward(model, 0)
    opt.step()
    held = sum(t.numel() * t.element_size() for t in opt.kinds.values["ema"].values())
    assert held == ema_bytes
    assert state_bytes(model, opt)["optimizer_state"] == predicted["optimizer_state"]  # as predicted
    assert any(t is opt.kinds.get("ema", model[0].weight) for t in opt.state_tensors())


def test_a_kind_is_described_once_with_checked_fields() -> None:
    with pytest.raises(ValueError, match="category 'moments'; expected one of"):
        StateKind("bad", "moments", "x")
    with pytest.raises(ValueError, match="must be an identifier"):
        StateKind("two words", "optimizer_state", "x")
    opt = KahanOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1))
    with pytest.raises(ValueError, match="'compensation' is already registered"):
        opt.add_state_kind(StateKind("compensation", "compensation", "again"))


@pytest.mark.parametrize("kind", ["nearest", "kahan", "master"])
def test_a_guarded_step_snapshot_holds_what_the_estimate_counts(kind: str) -> None:
    model, opt = _setup(kind, torch.float16)
    for step in range(2):  # the second step's snapshot copies the state the first created
        opt.zero_grad()
        _backward(model, step)
        opt.step()
    snap = opt._snapshot
    inner = [q for g in opt.param_groups for q in g["params"]]
    held = sum(q.numel() * q.element_size() for q in inner)
    held += sum(v.numel() * v.element_size() for q in inner for v in opt.state[q].values()
                if isinstance(v, torch.Tensor))
    held += sum(t.numel() * t.element_size() for t in opt.kinds.tensors())
    assert snap.nbytes() == held
    assert held <= opt.step_transient_bytes()


def test_a_wrapper_pickled_before_state_kinds_keeps_its_compensation() -> None:
    model, opt = _setup("kahan")
    _backward(model, 0)
    opt.step()
    comp = {p: c.clone() for p, c in opt.kinds.values["compensation"].items()}
    state = dict(opt.__getstate__())
    del state["kinds"]
    state["_comp"] = comp  # how KahanOptimizer kept it before
    old = object.__new__(KahanOptimizer)
    old.__setstate__(state)
    assert all(torch.equal(old.compensation(p), c) for p, c in comp.items())
    _backward(model, 1)
    old.step()


def test_kind_names_the_wrappers_use_and_compensation_of_fp32_weights_are_refused() -> None:
    with pytest.raises(ValueError, match="'counter' is taken by the wrappers' own checkpoint entries"):
        StateKind("counter", "optimizer_state", "x")
    model, opt = _setup("kahan")
    with pytest.raises(ValueError, match=r"set_compensation\(\) on a torch\.float32 parameter"):
        opt.set_compensation(model[1].weight, torch.zeros_like(model[1].weight))


def _everywhere(param: torch.Tensor) -> bool:
    return True


@pytest.mark.parametrize("kind", ["master", "nearest"])
def test_a_kind_of_every_parameter_follows_the_fp32_ones_too(kind: str) -> None:
    model = _model()
    opt = WRAPPERS[kind](torch.optim.AdamW(model.parameters(), lr=1e-2))
    opt.add_state_kind(StateKind("ema", "optimizer_state", "x", dtype=torch.float32, init=_start, after_step=_follow,
                                 applies=_everywhere))
    _backward(model, 0)
    opt.step()
    assert all(opt.kinds.get("ema", p) is not None for p in model.parameters())
    assert state_bytes(model, opt)["optimizer_state"] == sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ) + sum(p.numel() * 4 for p in model.parameters())


def test_the_optimizer_in_backward_predicts_its_undo_copies() -> None:
    model, opt = _setup("kahan", torch.float16)
    in_bwd = InBackwardOptimizer(opt)
    _backward(model, 0)
    assert in_bwd.finish()
    _backward(model, 1)  # a second backward: its copies are held until finish()
    assert in_bwd.undo_bytes() == in_bwd.step_transient_bytes()
    in_bwd.finish()


def test_a_checkpoint_saved_before_a_kind_was_added_loads_and_one_with_a_foreign_kind_is_refused(tmp_path) -> None:
    from mixprec import load_checkpoint, save_checkpoint

    model = _model()
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _backward(model, 0)
    opt.step()
    save_checkpoint(tmp_path / "plain.pt", model=model, optimizers=[opt])
    opt.add_state_kind(EMA)
    load_checkpoint(tmp_path / "plain.pt", model=model, optimizers=[opt])  # the kind starts afresh
    _backward(model, 1)
    opt.step()
    save_checkpoint(tmp_path / "ema.pt", model=model, optimizers=[opt])
    model2 = _model(seed=3)
    opt2 = MasterWeightOptimizer(torch.optim.AdamW(model2.parameters(), lr=1e-2))
    before = [p.detach().clone() for p in model2.parameters()]
    with pytest.raises(ValueError, match="state of kind 'ema'"):
        load_checkpoint(tmp_path / "ema.pt", model=model2, optimizers=[opt2])
    assert all(torch.equal(a, b) for a, b in zip(before, model2.parameters(), strict=True))

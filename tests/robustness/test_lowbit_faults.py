"""Faults in low-precision optimizer steps: a finite update that overflows fp16 weights.

Reproduction: an fp16 weight at 60000 plus a finite update of 8000 rounds to inf
(fp16 tops out at 65504). The wrapper must report it through ``step_nonfinite()`` and
leave everything as it was before the step: weights, Kahan compensation and the
optimizer state including step counts (compared exactly against copies taken before).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from mixprec.optim import KahanOptimizer, LowPrecisionOptimizer, StochasticRoundingOptimizer

WRAPPERS = [LowPrecisionOptimizer, KahanOptimizer]


def _snapshot(params, opt):
    state = {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
             for i, p in enumerate(params) if p in opt.state}
    comp = {i: c.clone() for i, p in enumerate(params) if (c := opt.compensation(p)) is not None}
    return [p.detach().clone() for p in params], state, comp


def _assert_unchanged(params, opt, before) -> None:
    values, state, comp = before
    for i, (p, v) in enumerate(zip(params, values, strict=True)):
        assert torch.equal(p, v), f"parameter {i} changed"
    assert sorted(i for i, p in enumerate(params) if p in opt.state) == sorted(state)
    for i, saved in state.items():
        live = opt.state[params[i]]
        assert list(live) == list(saved), i
        for k, v in saved.items():
            assert torch.equal(live[k], v) if isinstance(v, torch.Tensor) else live[k] == v, (i, k)
    for i, c in comp.items():
        assert torch.equal(opt.compensation(params[i]), c), f"compensation {i} changed"


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("cls", WRAPPERS)
def test_finite_sgd_update_overflowing_fp16_changes_nothing(cls, fast):
    big = torch.nn.Parameter(torch.full((4,), 60000.0, dtype=torch.float16))
    small = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    opt = cls(torch.optim.SGD([big, small], lr=1.0, momentum=0.5), fast=fast)
    # a first, fine step: momentum buffers exist
    big.grad, small.grad = torch.full_like(big, 1.0), torch.full_like(small, 0.5)
    opt.step()
    assert not opt.step_nonfinite()
    before = _snapshot([big, small], opt)
    # 60000 + 8000 (momentum adds 0.5) does not fit fp16: refused, nothing changed, even `small`
    big.grad, small.grad = torch.full_like(big, -8000.0), torch.full_like(small, 0.25)
    opt.step()
    flag = opt.step_nonfinite()
    assert isinstance(flag, torch.Tensor) and flag.dtype == torch.bool and bool(flag)
    _assert_unchanged([big, small], opt, before)
    # the next finite step goes through as if the refused one never happened
    big.grad, small.grad = torch.full_like(big, 100.0), torch.full_like(small, 0.5)
    opt.step()
    assert not opt.step_nonfinite()
    assert torch.equal(big, torch.full_like(big, 60000.0 - 100.5 - 1.0))


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("cls", WRAPPERS)
def test_adam_overflow_keeps_step_counts_and_moments(cls, fast):
    w = torch.nn.Parameter(torch.tensor([65400.0, 1.0], dtype=torch.float16))
    opt = cls(torch.optim.AdamW(torch.nn.ParameterList([w]).parameters(), lr=10.0, weight_decay=0.0),
              fast=fast, state_dtype=None)
    w.grad = torch.tensor([-1.0, 1.0], dtype=torch.float16)
    opt.step()  # 65410: fine
    assert not opt.step_nonfinite() and opt.state[w]["step"].item() == 1.0
    opt.param_groups[0]["lr"] = 200.0  # an LR spike: 65410 + 200 overflows
    before = _snapshot([w], opt)
    opt.step()
    assert bool(opt.step_nonfinite())
    _assert_unchanged([w], opt, before)
    assert opt.state[w]["step"].item() == 1.0


@pytest.mark.parametrize("cls", WRAPPERS)
def test_first_step_overflow_leaves_no_state(cls):
    w = torch.nn.Parameter(torch.full((2,), 60000.0, dtype=torch.float16))
    opt = cls(torch.optim.Adam([w], lr=8000.0))
    w.grad = torch.full_like(w, -1.0)
    opt.step()
    assert bool(opt.step_nonfinite())
    assert w not in opt.state and torch.equal(w, torch.full_like(w, 60000.0))


@pytest.mark.parametrize("cls", WRAPPERS)
def test_undo_step_restores_a_successful_step_exactly(cls):
    # another optimizer of the same step refused its update: the front door undoes this one
    w = torch.nn.Parameter(torch.linspace(-2, 2, 7, dtype=torch.float16))
    opt = cls(torch.optim.AdamW([w], lr=1e-3))
    for step in range(3):
        w.grad = torch.full_like(w, 0.1 * (step + 1))
        opt.step()
    before = _snapshot([w], opt)
    sd = copy.deepcopy(opt.state_dict())
    w.grad = torch.full_like(w, 0.7)
    opt.step()
    assert not opt.step_nonfinite()
    opt.undo_step()
    _assert_unchanged([w], opt, before)
    assert str(opt.state_dict()) == str(sd)
    opt.undo_step()  # undoing again changes nothing more
    _assert_unchanged([w], opt, before)


def test_undo_and_flag_errors():
    # bf16 has fp32's range: no flag, no snapshot, no undo
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    opt = StochasticRoundingOptimizer(torch.optim.SGD([w], lr=0.1))
    w.grad = torch.ones_like(w)
    opt.step()
    assert opt.step_nonfinite() is None
    with pytest.raises(NotImplementedError, match=re.escape("StochasticRoundingOptimizer cannot undo a step")):
        opt.undo_step()
    h = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    opt16 = KahanOptimizer(torch.optim.SGD([h], lr=0.1))
    with pytest.raises(RuntimeError, match=re.escape("KahanOptimizer.undo_step() needs a step() to undo")):
        opt16.undo_step()

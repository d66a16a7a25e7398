"""Fault injection for master-weight plans: inf/NaN gradients at random micro-batches, with
gradient accumulation and clipping, through the front door and through the wrapper API
with a loss scaler. Invariant: no master, model weight or optimizer state is ever
non-finite, and a skipped step changes nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mixprec import DynamicLossScaler, MixedPrecision
from mixprec.optim import MasterWeightOptimizer
from mixprec.plans import cast_module_


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


class _Poison:
    """A backward hook on the first layer's output: multiplies its gradient by inf or NaN when armed."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.value: float | None = None
        model[0].register_forward_hook(self._forward)

    def _forward(self, module: torch.nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
        if self.value is None or not out.requires_grad:
            return out
        value = self.value
        out.register_hook(lambda g: g * value)
        return out


def _all_finite(model: torch.nn.Module, opt: MasterWeightOptimizer) -> None:
    for p in model.parameters():
        assert torch.isfinite(p).all(), "non-finite model weight"
    for m in opt.param_groups[0]["params"]:
        assert torch.isfinite(m).all(), "non-finite master"
    for state in opt.optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                assert torch.isfinite(v).all(), "non-finite optimizer state"


def _state(model: torch.nn.Module, opt: MasterWeightOptimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    out += [m.detach().clone() for m in opt.masters]
    sd = copy.deepcopy(opt.optimizer.state_dict())
    out += [v for s in sd["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def _faults(seed: int, n: int) -> list[float | None]:
    g = torch.Generator().manual_seed(seed)
    draws = torch.rand(n, generator=g).tolist()
    return [float("inf") if d < 0.15 else float("nan") if d < 0.3 else None for d in draws]


@pytest.mark.parametrize("plan", ["bf16-master", "fp16-master"])
@pytest.mark.parametrize("seed", [0, 1])
def test_front_door_never_writes_nonfinite_values(plan, seed):
    model = _model(seed)
    mp = MixedPrecision(plan, grad_accum_steps=2, clip_grad_norm=0.5, max_consecutive_skips=100)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    poison = _Poison(model)
    gen = torch.Generator().manual_seed(seed)
    faults = _faults(seed, 24)
    for micro, fault in enumerate(faults):
        poison.value = fault
        x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 3, generator=gen)
        before = _state(model, opt) if micro % 2 == 1 else None
        with mp.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        mp.backward(loss)
        result = mp.step()
        _all_finite(model, opt)
        if before is not None and result.skipped:
            for a, b in zip(before, _state(model, opt), strict=True):
                assert torch.equal(a, b)
        if micro % 2 == 1:  # an accumulation boundary: any poisoned micro-batch skips the step
            assert result.skipped == (fault is not None or faults[micro - 1] is not None)
    assert mp.optimizer_steps > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", [0, 1])
def test_wrapper_api_with_a_scaler_never_writes_nonfinite_values(dtype, seed):
    """No front door: the loop a framework writes around the wrapper's hooks."""
    model = _model(seed)
    values = cast_module_(model, dtype, keep=(torch.nn.LayerNorm,), keep_dtype=torch.float32)
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), master_values=values)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    poison = _Poison(model)
    gen = torch.Generator().manual_seed(seed)
    faults = _faults(seed + 10, 24)
    stepped = 0
    for micro, fault in enumerate(faults):
        poison.value = fault
        x, y = torch.randn(8, 8, generator=gen).to(dtype), torch.randn(8, 3, generator=gen)
        scaler.scale(torch.nn.functional.mse_loss(model(x).float(), y) / 2).backward()
        if micro % 2 == 0:
            opt.accumulate_grads()  # fp32 accumulation between micro-batches
            continue
        before = _state(model, opt)
        opt.prepare_grads()
        scaler.unscale_(opt)
        grads = [m.grad for m in opt.param_groups[0]["params"] if m.grad is not None]
        torch.nn.utils.clip_grad_norm_(opt.param_groups[0]["params"], 0.5)
        out = scaler.step(opt)
        scaler.update()
        finite = all(torch.isfinite(g).all() for g in grads)
        if not finite:  # the scaler skipped: nothing changed
            assert out is None
            for a, b in zip(before, _state(model, opt), strict=True):
                assert torch.equal(a, b)
        else:
            stepped += 1
        opt.zero_grad()
        _all_finite(model, opt)
    assert stepped > 0


def test_fp16_weights_pushed_past_the_range_are_never_written():
    """Finite gradients, but updates that carry fp16 weights beyond 65504: each such step is undone."""
    w = torch.nn.Parameter(torch.linspace(50000.0, 65000.0, 16).to(torch.float16))
    opt = MasterWeightOptimizer(torch.optim.SGD([w], lr=1.0, momentum=0.5))
    gen = torch.Generator().manual_seed(0)
    undone = 0
    for _ in range(20):
        w.grad = (torch.randn(16, generator=gen) * 3000).to(torch.float16)
        before = (w.detach().clone(), opt.masters[0].detach().clone())
        opt.step()
        if bool(opt.step_nonfinite()):
            undone += 1
            assert torch.equal(w, before[0]) and torch.equal(opt.masters[0], before[1])
        assert torch.isfinite(w).all() and (opt.masters[0].abs() < 65520).all()
        opt.zero_grad()
    assert undone > 0

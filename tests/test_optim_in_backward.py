"""Optimizer in backward: each parameter updated inside backward, its gradient freed, exact skips.

References: the same wrapper stepped after backward (bit-identical weights, state and
compensation on CPU), and copies taken before a backward in which one gradient is made
non-finite (every parameter, state and compensation restored bit for bit).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from mixprec.optim import KahanOptimizer, LowPrecisionOptimizer, StochasticRoundingOptimizer
from mixprec.optim.in_backward import InBackwardOptimizer
from mixprec.plans import cast_module_

WRAPPERS = [LowPrecisionOptimizer, KahanOptimizer, StochasticRoundingOptimizer]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    cast_module_(model, torch.bfloat16, keep=(torch.nn.LayerNorm,), keep_dtype=torch.float32)
    return model


def _loss(model, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    return torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y)


def _state(model, opt):
    return [
        (p.detach().clone(), {k: v.clone() for k, v in opt.state.get(p, {}).items()},
         None if (c := opt.compensation(p)) is None else c.clone())
        for p in model.parameters()
    ]


def _assert_equal_states(a, b, label: str, *, weight_ulps: int = 0) -> None:
    for i, ((pa, sa, ca), (pb, sb, cb)) in enumerate(zip(a, b, strict=True)):
        if weight_ulps:
            ulp = torch.finfo(pa.dtype).eps * torch.maximum(pa.float().abs(), pb.float().abs())
            assert ((pa.float() - pb.float()).abs() <= weight_ulps * ulp).all(), f"{label}: parameter {i}"
        else:
            assert torch.equal(pa, pb), f"{label}: parameter {i}"
        assert list(sa) == list(sb), f"{label}: state keys {i}"
        for k in sa:
            assert torch.equal(sa[k], sb[k]), f"{label}: state {k} of {i}"
        assert (ca is None) == (cb is None) and (ca is None or torch.equal(ca, cb)), f"{label}: compensation {i}"


@pytest.mark.parametrize("cls", WRAPPERS)
def test_in_backward_equals_stepping_after_backward_and_frees_grads(cls):
    ref_model, model = _model(), _model()
    ref = cls(torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1))
    opt = cls(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    in_bwd = InBackwardOptimizer(opt)
    # stochastic rounding: the hooks draw the noise in backward's parameter order, so each
    # weight may land on the other bf16 neighbour (one step compared: same moments)
    sr = cls is StochasticRoundingOptimizer
    for step in range(1 if sr else 4):
        _loss(ref_model, step).backward()
        ref.step()
        ref.zero_grad()
        _loss(model, step).backward()
        assert all(p.grad is None for p in model.parameters())  # released inside backward
        assert in_bwd.finish()
        _assert_equal_states(_state(model, opt), _state(ref_model, ref), f"{cls.__name__} step {step}",
                             weight_ulps=1 if sr else 0)


@pytest.mark.parametrize("cls", WRAPPERS)
def test_nonfinite_gradient_anywhere_leaves_every_parameter_untouched(cls):
    model = _model()
    opt = cls(torch.optim.AdamW(model.parameters(), lr=1e-2))
    in_bwd = InBackwardOptimizer(opt)
    for step in range(2):
        _loss(model, step).backward()
        assert in_bwd.finish()
    before = _state(model, opt)
    extra = copy.deepcopy(opt.extra_state())
    # the first layer's gradient is the last one backward produces: every other parameter
    # is already updated when it turns out non-finite
    handle = model[0].weight.register_hook(lambda g: g * float("inf"))
    _loss(model, 2).backward()
    handle.remove()
    assert not in_bwd.finish()
    _assert_equal_states(_state(model, opt), before, f"{cls.__name__} after the refused backward")
    assert str(opt.extra_state()) == str(extra)
    assert all(opt.state[p]["step"].item() == 2.0 for p in model.parameters())
    # training goes on as if that backward never happened
    _loss(model, 3).backward()
    assert in_bwd.finish()


def test_loss_scale_is_undone_in_the_hooks():
    ref_model, model = _model(), _model()
    ref = KahanOptimizer(torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9))
    opt = KahanOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    in_bwd = InBackwardOptimizer(opt)
    for step in range(3):
        _loss(ref_model, step).backward()
        ref.step()
        ref.zero_grad()
        in_bwd.set_grad_scale(1 / 256)
        (_loss(model, step) * 256).backward()
        assert in_bwd.finish()
    _assert_equal_states(_state(model, opt), _state(ref_model, ref), "scaled")


def test_in_backward_needs_a_lowbit_wrapper():
    model = _model()
    with pytest.raises(TypeError, match=re.escape("InBackwardOptimizer needs a mixprec LowPrecisionOptimizer")):
        InBackwardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))  # type: ignore[arg-type]
    in_bwd = InBackwardOptimizer(KahanOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)))
    in_bwd.remove()
    _loss(model, 0).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_each_update_in_backward_finds_its_group_through_an_index():
    """Each per-parameter update in backward looks its group up in an index built once
    (rebuilt only when the groups change: O(parameters) per backward, not O(parameters^2)),
    and steps it with that group's options: the same as stepping after backward."""

    def make():
        torch.manual_seed(0)
        layers = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(30)])
        cast_module_(layers, torch.bfloat16)
        params = list(layers.parameters())
        groups = [
            {"params": params[:20], "lr": 1e-2, "weight_decay": 0.0},
            {"params": params[20:40], "lr": 3e-3, "weight_decay": 0.3},
            {"params": params[40:], "lr": 1e-3, "weight_decay": 0.1, "betas": (0.5, 0.9)},
        ]
        return layers, KahanOptimizer(torch.optim.AdamW(groups))

    ref_layers, ref = make()
    layers, opt = make()
    in_bwd = InBackwardOptimizer(opt)
    indexes = []
    for step in range(3):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step)).bfloat16()
        ref_layers(x).float().sum().backward()
        ref.step()
        ref.zero_grad()
        layers(x).float().sum().backward()
        assert in_bwd.finish()
        indexes.append(opt._index)
        _assert_equal_states(_state(layers, opt), _state(ref_layers, ref), f"step {step}")
    assert indexes[0] is indexes[1] is indexes[2]  # built once while the groups stay the same
    opt.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))], "lr": 0.5})
    new = opt.optimizer.param_groups[-1]["params"][0]
    new.grad = torch.ones_like(new)
    opt.step_selected({new})  # a new group: found after re-indexing, stepped with its lr
    assert opt.state[new]["step"] == 1 and float(new.detach().float().mean()) < -0.4


def _reference_step(ref_model, ref, step: int) -> None:
    _loss(ref_model, step).backward()
    ref.step()
    ref.zero_grad()


@pytest.mark.parametrize("late", ["unfrozen", "added"])
def test_a_parameter_without_a_hook_is_updated_by_finish_then_hooked(late):
    """Unfrozen after the hooks were installed, or added with add_param_group: its gradient is
    applied by finish(), in the same step and with the same undo copies, and begin() (or that
    finish) hooks it, so the next backward releases its gradient as it goes."""

    def make():
        model = _model()
        if late == "unfrozen":
            model[0].requires_grad_(False)
            params = list(model.parameters())
        else:
            params = list(model[1:].parameters())
        return model, KahanOptimizer(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1))

    (ref_model, ref), (model, opt) = make(), make()
    in_bwd = InBackwardOptimizer(opt)
    for m, o in ((ref_model, ref), (model, opt)):
        if late == "unfrozen":
            m[0].requires_grad_(True)
        else:
            o.add_param_group({"params": list(m[0].parameters()), "lr": 3e-3})
    for step in range(3):
        _reference_step(ref_model, ref, step)
        _loss(model, step).backward()
        released = [p.grad is None for p in model[0].parameters()]
        assert released == [step > 0] * 2  # the first finish hooked them
        assert in_bwd.finish()
        assert all(p.grad is None for p in model.parameters())
        _assert_equal_states(_state(model, opt), _state(ref_model, ref), f"{late}, step {step}")


def test_a_missed_parameter_with_an_inf_gradient_undoes_the_whole_backward():
    model = _model()
    model[0].requires_grad_(False)
    opt = KahanOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    in_bwd = InBackwardOptimizer(opt)
    _loss(model, 0).backward()
    assert in_bwd.finish()
    before = _state(model, opt)
    model[0].requires_grad_(True)  # no hook: its (inf) gradient is found by finish()
    handle = model[0].weight.register_hook(lambda g: g * float("inf"))
    _loss(model, 1).backward()
    handle.remove()
    assert not in_bwd.finish()
    _assert_equal_states(_state(model, opt), before, "after the refused backward")


def _interrupting(exc: type[BaseException]):
    def hook(g):
        raise exc("stopped mid-backward")

    return hook


@pytest.mark.parametrize("cls", WRAPPERS)
@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt])
def test_an_interrupted_backward_is_undone_by_guard(cls, exc):
    model = _model()
    opt = cls(torch.optim.AdamW(model.parameters(), lr=1e-2))
    in_bwd = InBackwardOptimizer(opt)
    _loss(model, 0).backward()
    assert in_bwd.finish()
    before, extra = _state(model, opt), copy.deepcopy(opt.extra_state())
    handle = model[0].weight.register_hook(_interrupting(exc))  # the last gradient: the rest is updated
    with pytest.raises(exc, match="stopped mid-backward"), in_bwd.guard():
        _loss(model, 1).backward()
    handle.remove()
    assert in_bwd.undo_bytes() == 0
    _assert_equal_states(_state(model, opt), before, f"{cls.__name__} after the interrupted backward")
    assert str(opt.extra_state()) == str(extra)
    assert all(p.grad is None for p in model.parameters())
    _loss(model, 1).backward()  # the retry
    assert in_bwd.finish()


def test_an_interrupted_backward_outside_guard_is_undone_by_begin_or_refused_by_finish():
    ref_model, model = _model(), _model()
    ref = KahanOptimizer(torch.optim.AdamW(ref_model.parameters(), lr=1e-2))
    opt = KahanOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    in_bwd = InBackwardOptimizer(opt)
    _reference_step(ref_model, ref, 0)
    _loss(model, 0).backward()
    assert in_bwd.finish()
    before = _state(model, opt)
    handle = model[0].weight.register_hook(_interrupting(ValueError))
    with pytest.raises(ValueError, match="stopped mid-backward"):
        _loss(model, 1).backward()
    with pytest.raises(RuntimeError, match=re.escape(
        "finish() called after a backward that did not complete (an exception or KeyboardInterrupt stopped it): "
        "its updates were undone; run the backward again"
    )):
        in_bwd.finish()
    _assert_equal_states(_state(model, opt), before, "after finish() refused it")
    with pytest.raises(ValueError, match="stopped mid-backward"):
        _loss(model, 1).backward()
    handle.remove()
    in_bwd.begin()  # the retry's begin() undoes it
    _assert_equal_states(_state(model, opt), before, "after begin()")
    _reference_step(ref_model, ref, 1)
    _loss(model, 1).backward()
    assert in_bwd.finish()
    _assert_equal_states(_state(model, opt), _state(ref_model, ref), "the retried step")


def test_a_held_backward_refuses_the_next_until_released():
    model = _model()
    opt = KahanOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    in_bwd = InBackwardOptimizer(opt)
    _loss(model, 0).backward()
    assert in_bwd.finish(hold=True)
    held = _state(model, opt)
    again = (
        " before step(): under optimizer_in_backward=True the last backward already updated the weights and "
        "counts as one step, so another backward cannot join it (no gradient accumulation); call mp.step() "
        "after each backward"
    )
    with pytest.raises(RuntimeError, match=re.escape("a second backward ran" + again)):
        _loss(model, 1).backward()
    with pytest.raises(RuntimeError, match=re.escape("begin() called again" + again)):
        in_bwd.begin()
    _assert_equal_states(_state(model, opt), held, "after the refused backward")
    assert all(p.grad is None for p in model.parameters())
    assert in_bwd.release()
    _loss(model, 1).backward()
    assert in_bwd.finish(hold=True)


def test_a_parameter_whose_gradient_arrives_in_two_parts_is_refused():
    """Reentrant activation checkpointing over a layer also used outside it: the layer's
    gradient accumulates in the outer backward and again in the nested one."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8, bias=False).bfloat16()
    opt = KahanOptimizer(torch.optim.AdamW(layer.parameters(), lr=1e-2))
    in_bwd = InBackwardOptimizer(opt)
    before = _state(layer, opt)
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(RuntimeError, match=re.escape(
        "a parameter of shape (8, 8) got its gradient in two parts within one backward (reentrant activation "
        "checkpointing over a parameter also used outside it): under optimizer_in_backward=True it would be "
        "updated twice; use torch.utils.checkpoint.checkpoint(..., use_reentrant=False) or "
        "optimizer_in_backward=False"
    )), in_bwd.guard():
        layer(checkpoint(layer, x, use_reentrant=True)).float().sum().backward()
    _assert_equal_states(_state(layer, opt), before, "after the refused backward")
    y = layer(checkpoint(layer, x, use_reentrant=False)).float().sum()
    y.backward()  # non-reentrant: one accumulation per parameter
    assert in_bwd.finish()

"""Fault injection through fp8 layers: inf/NaN in inputs, weights and output gradients.

A small model with fp8 linear layers trains for a few steps under the front door's
protocol (snapshot the persistent buffers, forward, backward, one skip decision from the
loss, the gradients and the plan's non-finite flag, restore on a skip). Faults are
injected at random steps. Checked at every step: no parameter or buffer is ever
non-finite, amax histories never hold inf/NaN, every faulty step is flagged and skipped,
and the faulty run ends bit for bit where a control run that never saw those steps ends.
The recipe constructors are fuzzed: any argument gives a recipe or a TypeError/ValueError
that names the argument, never anything else.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec import get_plan
from mixprec.fp8 import (
    MAX_MARGIN,
    CurrentScaling,
    DelayedScaling,
    Fp8Linear,
    Fp8Recipe,
    compute_scale,
    convert_to_fp8,
    fp8_layers,
    nonfinite_flag,
)

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")

KINDS = ("input", "weight", "grad_output")
STEPS = 6


def _model(recipe: Fp8Recipe, sanitise: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)]
    if sanitise:  # a model that hides inf/NaN from its loss: only the fp8 flag sees them
        layers.append(_NanToNum())
    return convert_to_fp8(torch.nn.Sequential(*layers), recipe, emulate=True)


class _NanToNum(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(STEPS)]


def _persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}"] = buf
    return out


@dataclass(frozen=True)
class Fault:
    kind: str  # "input", "weight" or "grad_output"
    layer: int  # index into the fp8 layers
    value: float  # inf, -inf or nan


def _train(
    model: torch.nn.Module, faults: dict[int, Fault], skip_steps: frozenset[int] = frozenset()
) -> tuple[list[bool], list[bool]]:
    """Train STEPS steps; returns per step (stepped, flagged). ``skip_steps`` are not run at all."""
    plan = get_plan("fp8-mixed")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    layers = list(fp8_layers(model).values())
    stepped: list[bool] = []
    flagged: list[bool] = []
    for step, (x, y) in enumerate(_batches()):
        if step in skip_steps:
            continue
        snapshot = {k: v.clone() for k, v in _persistent_buffers(model).items()}
        fault = faults.get(step)
        handles: list[Any] = []
        saved_weight = None
        if fault is not None:
            target = layers[fault.layer]
            if fault.kind == "input":
                def corrupt_input(module: torch.nn.Module, args: tuple[torch.Tensor, ...], v: float = fault.value) -> Any:
                    bad = args[0].clone()
                    bad[0, 1] = v
                    return (bad,)

                handles.append(target.register_forward_pre_hook(corrupt_input))
            elif fault.kind == "weight":
                saved_weight = target.weight.detach().clone()
                with torch.no_grad():
                    target.weight[1, 2] = fault.value
            else:
                def corrupt_grad(module: torch.nn.Module, grad_out: tuple[torch.Tensor, ...], v: float = fault.value) -> Any:
                    bad = grad_out[0].clone()
                    bad[2, 0] = v
                    return (bad,)

                handles.append(target.register_full_backward_pre_hook(corrupt_grad))

        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        plan.before_unscale(model, None)
        flag = plan.nonfinite_flag(model)
        assert flag is not None and flag.dtype == torch.bool and flag.shape == ()
        grads_ok = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
        skip = bool(flag) or not bool(torch.isfinite(loss)) or not grads_ok
        if skip:
            with torch.no_grad():
                for k, v in _persistent_buffers(model).items():
                    v.copy_(snapshot[k])
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        plan.after_step(model)
        for h in handles:
            h.remove()
        if saved_weight is not None:
            with torch.no_grad():
                layers[fault.layer].weight.copy_(saved_weight)  # type: ignore[union-attr]
        stepped.append(not skip)
        flagged.append(bool(flag))
        _check_state(model)
    return stepped, flagged


def _check_state(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), f"parameter {name} is not finite"
    for name, b in model.named_buffers():
        if b.is_floating_point():
            assert torch.isfinite(b).all(), f"buffer {name} is not finite: {b}"
    for layer in fp8_layers(model).values():
        assert (layer.fp8_amax_history >= 0).all()
        assert (layer.fp8_scale > 0).all()
    assert not nonfinite_flag(model)  # reset after every step


RECIPES = [
    DelayedScaling(amax_history_len=4),
    DelayedScaling(fmt="e4m3", amax_history_len=2, amax_compute_algo="most_recent"),
    DelayedScaling(fmt="e5m2", amax_history_len=3, margin=1),
    CurrentScaling(),
]

faults_strategy = st.dictionaries(
    keys=st.integers(min_value=0, max_value=STEPS - 1),
    values=st.builds(
        Fault,
        kind=st.sampled_from(KINDS),
        layer=st.integers(min_value=0, max_value=1),
        value=st.sampled_from([math.inf, -math.inf, math.nan]),
    ),
    max_size=3,
)


@settings(max_examples=12, deadline=None)
@given(faults=faults_strategy, recipe=st.sampled_from(RECIPES), sanitise=st.booleans())
def test_faulty_steps_are_flagged_skipped_and_leave_no_trace(faults, recipe, sanitise):
    model = _model(recipe, sanitise)
    stepped, flagged = _train(model, faults)
    faulty = frozenset(faults)
    # Every injected fault is flagged by the fp8 layers themselves and skips its step.
    assert flagged == [step in faulty for step in range(STEPS)]
    assert stepped == [step not in faulty for step in range(STEPS)]
    # Twin run: a control that never ran the faulty steps ends in the same state, bit for bit.
    control = _model(recipe, sanitise)
    _train(control, {}, skip_steps=faulty)
    for (name, a), b in zip(model.state_dict().items(), control.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_only_the_flag_sees_an_inf_that_a_model_hides_from_its_loss_and_gradients():
    # A frozen fp8 projection whose output the model sanitises: the loss and every
    # gradient are finite, and the saturated value would be trained on silently.
    torch.manual_seed(0)
    proj = Fp8Linear(16, 16, recipe=DelayedScaling(amax_history_len=4))
    proj.weight.requires_grad_(False)
    model = torch.nn.Sequential(proj, _NanToNum(), torch.nn.Linear(16, 16))
    x = torch.randn(8, 16)
    x[0, 0] = math.inf
    loss = F.mse_loss(model(x), torch.zeros(8, 16))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert bool(nonfinite_flag(model)) and bool(get_plan("fp8-mixed").nonfinite_flag(model))


def test_repeated_faults_never_enter_the_history_of_a_long_run():
    model = _model(DelayedScaling(amax_history_len=8))
    faults = {s: Fault(KINDS[s % 3], s % 2, [math.inf, math.nan][s % 2]) for s in range(0, STEPS, 2)}
    stepped, _ = _train(model, faults)
    assert stepped == [s % 2 == 1 for s in range(STEPS)]
    for layer in fp8_layers(model).values():
        assert torch.isfinite(layer.fp8_amax_history).all()
        assert (layer.fp8_amax_history[:, :3] > 0).all()  # three clean steps recorded


# --------------------------------------------------------------------------- recipe fuzzing

anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["hybrid", "e4m3", "e5m2", "max", "most_recent", "HYBRID", ""]),
)

ARGS = {
    DelayedScaling: ("fmt", "margin", "amax_history_len", "amax_compute_algo", "amax_init"),
    CurrentScaling: ("fmt", "margin"),
}


@settings(max_examples=150, deadline=None)
@given(
    cls=st.sampled_from([DelayedScaling, CurrentScaling]),
    data=st.data(),
)
def test_recipe_constructors_accept_or_reject_any_argument_cleanly(cls, data):
    names = ARGS[cls]
    chosen = data.draw(st.lists(st.sampled_from(names), unique=True, min_size=1, max_size=len(names)))
    kwargs = {name: data.draw(anything, label=name) for name in chosen}
    try:
        recipe = cls(**kwargs)
    except (TypeError, ValueError) as err:
        message = str(err)
        assert message.startswith(f"{cls.__name__}("), message
        assert any(f"{name}=" in message for name in chosen), message
        return
    # Accepted: the recipe is sound, and a layer built with it stays finite.
    assert isinstance(recipe.margin, int) and 0 <= recipe.margin <= MAX_MARGIN
    if isinstance(recipe, DelayedScaling):
        assert isinstance(recipe.amax_history_len, int) and recipe.amax_history_len >= 1
        assert recipe.amax_compute_algo in ("max", "most_recent")
        if recipe.amax_history_len > 64:
            return  # a long history is valid; keep the layer below cheap
    layer = Fp8Linear(16, 16, recipe=recipe)
    x = torch.randn(4, 16).requires_grad_()
    y = layer(x)
    y.backward(torch.randn_like(y))
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert torch.isfinite(layer.fp8_scale).all() and (layer.fp8_scale > 0).all()


@settings(max_examples=100, deadline=None)
@given(
    amax=st.one_of(st.floats(min_value=0.0, width=32), st.sampled_from([math.inf, math.nan])),
    margin=st.integers(min_value=0, max_value=MAX_MARGIN),
    fmt_max=st.sampled_from([448.0, 57344.0]),
)
def test_compute_scale_is_always_a_finite_positive_scale_with_a_finite_inverse(amax, margin, fmt_max):
    scale = compute_scale(torch.tensor(amax), fmt_max, margin=margin, prev_scale=3.0)
    assert torch.isfinite(scale) and scale > 0 and torch.isfinite(scale.reciprocal())
    if not math.isfinite(amax) or amax == 0:
        assert scale.item() == 3.0


@pytest.mark.parametrize("margin", [130, 1023, 2000, -1])
def test_margins_that_used_to_give_nan_or_overflow_are_rejected_up_front(margin):
    with pytest.raises(ValueError, match=rf"^DelayedScaling\(margin={margin}\): margin must be between 0 and 64"):
        DelayedScaling(margin=margin)


def test_deepcopy_keeps_the_flag_buffer_separate():
    model = _model(CurrentScaling())
    twin = copy.deepcopy(model)
    x = torch.randn(2, 16)
    x[0, 0] = math.nan
    model(x)
    assert bool(nonfinite_flag(model)) and not nonfinite_flag(twin)

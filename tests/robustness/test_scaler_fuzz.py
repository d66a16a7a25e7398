"""Loss scalers under arbitrary input, and a long run under periodic overflow.

Fuzzing: constructors and ``load_state_dict`` of DynamicLossScaler, ConstantLossScaler and
NoOpScaler with arbitrary values (floats incl. nan/inf/huge/tiny, ints incl. huge, strings,
None, tensors, nested junk). Every input either works, leaving a scaler whose scale is in
[SCALE_FLOOR, SCALE_CEILING] and whose state round-trips, or raises ValueError/TypeError
naming the argument (or state key); a failed load leaves ``state_dict()`` unchanged.

Soak: the default scaler on a tiny model, an inf gradient every 50 steps, against
``torch.amp.GradScaler`` step for step; plus a run pinned at the scale floor.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mixprec import ConstantLossScaler, DynamicLossScaler, NoOpScaler
from mixprec.scaling import SCALE_CEILING, SCALE_FLOOR

INF = float("inf")
FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_special_floats = st.sampled_from(
    [0.0, -0.0, 1.0, -1.0, INF, -INF, math.nan, 1e39, 1e-50, 2.0**-130, 2.0**-127, SCALE_FLOOR,
     SCALE_CEILING, 3.5e38, 1e-300, 1e300, 0.5, 2.0, 1.0000001, 0.9999999]
)
_scalars = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    _special_floats,
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([10**400, -(10**400), 2**31, 2**63, 0, 1, 7, 2000]),
    st.text(max_size=6),
    st.sampled_from(["cpu", "cuda", "gpu", "consecutive", "since_growth", "no", "", "nan"]),
    st.none(),
    st.booleans(),
    st.builds(torch.tensor, st.floats(allow_nan=True, allow_infinity=True, width=32)),
    st.builds(lambda n: torch.ones(n), st.integers(0, 3)),
)
junk = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-3, 3)), inner, max_size=3),
    ),
    max_leaves=6,
)

_DYNAMIC_ARGS = (
    "device", "init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled",
    "hysteresis", "hysteresis_mode", "min_scale", "max_scale",
)
_VALID = {
    "device": st.sampled_from(["cpu", torch.device("cpu"), None]),
    "init_scale": st.one_of(st.floats(SCALE_FLOOR, SCALE_CEILING), st.sampled_from([1.0, 2.0**16])),
    "growth_factor": st.floats(1.0001, 1e6),
    "backoff_factor": st.floats(SCALE_FLOOR, 0.9999),
    "growth_interval": st.integers(1, 10),
    "enabled": st.booleans(),
    "hysteresis": st.integers(1, 4),
    "hysteresis_mode": st.sampled_from(["consecutive", "since_growth"]),
    "min_scale": st.sampled_from([None, SCALE_FLOOR, 1.0]),
    "max_scale": st.sampled_from([None, 2.0**24, SCALE_CEILING]),
}


@st.composite
def _dynamic_kwargs(draw) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(_DYNAMIC_ARGS), unique=True, max_size=5))
    return {n: draw(st.one_of(_VALID[n], junk)) for n in names}


def _assert_names_one_of(exc: BaseException, names) -> None:
    assert isinstance(exc, ValueError | TypeError), repr(exc)
    msg = str(exc)
    assert any(name in msg for name in names), f"{msg!r} names none of {sorted(names)}"


def _exercise(scaler) -> None:
    """A working scaler: one clean and one overflowing step keep the scale in range; state round-trips.

    (A disabled scaler is the identity: it steps with whatever gradients it gets, so no overflow.)
    """
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.0)
    for bad in (False, True) if scaler.is_enabled() else (False,):
        scaler.scale((w * (INF if bad else 1.0)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if scaler.is_enabled():
            assert SCALE_FLOOR <= scaler.get_scale() <= SCALE_CEILING
    assert torch.isfinite(w).all()
    state = scaler.state_dict()
    clone = type(scaler)() if isinstance(scaler, NoOpScaler) else (
        ConstantLossScaler(1.0) if isinstance(scaler, ConstantLossScaler) else DynamicLossScaler()
    )
    if isinstance(scaler, DynamicLossScaler) and not scaler.is_enabled():
        return
    clone.load_state_dict(state)
    assert clone.state_dict() == state


@FUZZ
@given(kwargs=_dynamic_kwargs())
def test_dynamic_constructor_accepts_or_names_the_argument(kwargs):
    try:
        scaler = DynamicLossScaler(**kwargs)
    except Exception as exc:
        _assert_names_one_of(exc, kwargs)
        return
    _exercise(scaler)


@FUZZ
@given(scale=st.one_of(junk, st.floats(SCALE_FLOOR, SCALE_CEILING)))
def test_constant_constructor_accepts_or_names_the_argument(scale):
    try:
        scaler = ConstantLossScaler(scale)
    except Exception as exc:
        _assert_names_one_of(exc, ["scale"])
        return
    _exercise(scaler)


def _trained(kind: str):
    if kind == "constant":
        s: Any = ConstantLossScaler(64.0)
    else:
        s = DynamicLossScaler(init_scale=256.0, growth_interval=3, hysteresis=2, hysteresis_mode=kind, max_scale=2.0**20)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.0)
    for bad in (False, True, False, False):
        s.scale((w * (INF if bad else 1.0)).sum()).backward()
        s.step(opt)
        s.update()
        opt.zero_grad()
    return s


_SCALERS = {kind: _trained(kind) for kind in ("consecutive", "since_growth", "constant")}


@st.composite
def _mutated_state(draw):
    kind = draw(st.sampled_from(sorted(_SCALERS)))
    state: Any = dict(_SCALERS[kind].state_dict())
    how = draw(st.sampled_from(["values", "values", "drop", "add", "whole"]))
    touched: list[str] = []
    if how == "whole":
        state = draw(junk)
    elif how == "drop":
        touched = draw(st.lists(st.sampled_from(sorted(state)), unique=True, min_size=1, max_size=3))
        for key in touched:
            del state[key]
    elif how == "add":
        key = draw(st.one_of(st.text(max_size=6), st.integers(), st.none()))
        state[key] = draw(junk)
        touched = [str(key)]
    else:
        touched = draw(st.lists(st.sampled_from(sorted(state)), unique=True, min_size=1, max_size=3))
        for key in touched:
            state[key] = draw(st.one_of(junk, _special_floats))
    return kind, state, touched


@FUZZ
@given(case=_mutated_state())
def test_load_state_dict_accepts_or_refuses_without_change(case):
    kind, state, touched = case
    scaler = _trained(kind)
    before = scaler.state_dict()
    try:
        scaler.load_state_dict(state)
    except Exception as exc:
        assert isinstance(exc, ValueError | TypeError), repr(exc)
        assert "state_dict" in str(exc), str(exc)
        if len(touched) == 1 and isinstance(state, dict) and touched[0] in _SCALERS[kind].state_dict():
            assert touched[0].strip("_").split("_")[0] in str(exc), (touched, str(exc))
        assert scaler.state_dict() == before
        return
    _exercise(scaler)


@FUZZ
@given(state=junk)
def test_noop_and_disabled_scalers_load_only_empty_or_nothing(state):
    for scaler in (NoOpScaler(), DynamicLossScaler(enabled=False)):
        try:
            scaler.load_state_dict(state)
        except Exception as exc:
            assert isinstance(exc, ValueError | TypeError), repr(exc)
            assert "state_dict" in str(exc) or "NoOpScaler has no state" in str(exc), str(exc)
        assert scaler.state_dict() == {} and not scaler.is_enabled()


# ------------------------------------------------------------------------------- soak
def _soak_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("steps", [200, pytest.param(2000, marks=pytest.mark.slow)])
@pytest.mark.parametrize("variant", ["default", "floor"])
def test_soak_periodic_overflow(steps, variant):
    """An inf gradient every 50 steps: scale in range, every overflow counted, weights finite.

    "default": DynamicLossScaler() against torch.amp.GradScaler step for step (same scale,
    same weights). "floor": a scale driven to SCALE_FLOOR and kept there.
    """
    kwargs = {} if variant == "default" else {"init_scale": 4 * SCALE_FLOOR, "backoff_factor": 0.25}
    ours, ref = DynamicLossScaler(**kwargs), torch.amp.GradScaler("cpu", **kwargs)
    models = [_soak_model(), _soak_model()]
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in models]
    g = torch.Generator().manual_seed(0)
    injected = 0
    for step in range(steps):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)
        bad = step % 50 == 49
        injected += bad
        for model, opt, scaler in zip(models, opts, (ours, ref), strict=True):
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if bad:
                model[0].weight.grad[0, 0] = INF
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        assert ours.last_step_skipped == bad
        assert SCALE_FLOOR <= ours.get_scale() <= SCALE_CEILING
        if variant == "default":
            assert ours.get_scale() == ref.get_scale(), step
    assert ours.overflow_steps == ours.skipped_steps == injected == steps // 50
    assert ours.state_dict()["steps"] == steps
    assert all(torch.isfinite(p).all() for p in models[0].parameters())
    if variant == "default":
        assert ours.get_scale() == 2.0**16 * 0.5**injected
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
            assert torch.equal(a, b)
    else:
        assert ours.get_scale() == SCALE_FLOOR

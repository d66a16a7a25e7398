"""Fuzzing the front door's constructor and every load_state_dict it owns.

Any input either works or raises ValueError/TypeError whose message names the argument
(or key); after a refused load nothing has changed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mixprec
from mixprec import MixedPrecision

JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)

CONSTRUCTOR_ARGS = ("grad_accum_steps", "clip_grad_norm", "max_consecutive_skips", "compile", "trace_overflow", "scaler")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(CONSTRUCTOR_ARGS), value=JUNK)
def test_constructor_accepts_or_names_the_argument(name, value):
    try:
        MixedPrecision("bf16-mixed", **{name: value})
    except (ValueError, TypeError) as exc:
        assert name in str(exc), f"{name}={value!r}: {exc}"


@settings(max_examples=60, deadline=None)
@given(plan=st.one_of(JUNK, st.sampled_from(mixprec.PLANS)))
def test_plan_argument_accepts_or_raises_a_clear_error(plan):
    try:
        MixedPrecision(plan)
    except (ValueError, TypeError) as exc:
        assert "plan" in str(exc).lower(), f"plan={plan!r}: {exc}"


def _trained(plan: str) -> tuple[MixedPrecision, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 16))
    mp = MixedPrecision(plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = mp.prepare(model, opt)
    for _ in range(2):
        with mp.autocast():
            loss = model(torch.randn(4, 16)).float().pow(2).mean()
        mp.backward(loss)
        mp.step()
    return mp, model, opt


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


def _same(a, b) -> bool:
    ta, tb = list(_tensors(a)), list(_tensors(b))
    if len(ta) != len(tb):
        return False
    if not all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(ta, tb, strict=True)):
        return False
    strip = lambda d: repr(d) if not isinstance(d, dict) else repr({k: v for k, v in d.items() if k != "state"})  # noqa: E731
    return strip(a) == strip(b)


def _mutations(sd: dict) -> st.SearchStrategy:
    keys = sorted(sd)
    return st.one_of(
        st.tuples(st.just("set"), st.sampled_from(keys), JUNK),
        st.tuples(st.just("drop"), st.sampled_from(keys), st.none()),
        st.tuples(st.just("add"), st.text(min_size=1, max_size=6), JUNK),
    )


SESSION_PLANS = ("fp16-mixed", "bf16-master", "bf16-kahan")


@pytest.mark.parametrize("plan", SESSION_PLANS)
def test_session_load_state_dict_is_all_or_nothing_under_fuzzing(plan):
    mp, model, opt = _trained(plan)
    good = mp.state_dict()

    @settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(mutation=_mutations(good))
    def check(mutation):
        kind, key, value = mutation
        sd = copy.deepcopy(good)
        if kind == "drop":
            sd.pop(key)
        else:
            sd[key] = value
        before = (mp.state_dict(), mp.optimizer_steps)
        try:
            mp.load_state_dict(sd)
        except (ValueError, TypeError):
            after = (mp.state_dict(), mp.optimizer_steps)
            assert after == before, f"{mutation}: a refused load changed the session"
        else:
            mp.load_state_dict(good)  # accepted: put the good state back for the next example

    check()


@pytest.mark.parametrize("plan", ["bf16-master", "fp16-master", "bf16-kahan", "bf16-sr", "fp16-pure"])
def test_optimizer_wrapper_load_state_dict_is_all_or_nothing_under_fuzzing(plan):
    mp, model, opt = _trained(plan)
    good = opt.state_dict()
    good_params = [p.detach().clone() for p in model.parameters()]

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(mutation=_mutations(good), shrink=st.booleans())
    def check(mutation, shrink):
        kind, key, value = mutation
        sd = copy.deepcopy(good)
        if shrink:  # a state tensor of the wrong shape
            for state in sd.get("state", {}).values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        state[k] = v.flatten()[:1].clone()
                        break
                break
        elif kind == "drop":
            sd.pop(key)
        else:
            sd[key] = value
        before = copy.deepcopy(opt.state_dict())
        try:
            opt.load_state_dict(sd)
        except (ValueError, TypeError):
            assert _same(opt.state_dict(), before), f"{mutation}: a refused load changed the optimizer"
            for p, q in zip(model.parameters(), good_params, strict=True):
                assert torch.equal(p.detach(), q), "a refused load changed the model"
        else:
            opt.load_state_dict(good)

    check()

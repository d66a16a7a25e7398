"""MixedPrecision(optimizer_in_backward=True): updates inside backward, exact skips, fewer bytes."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from mixprec import DynamicLossScaler, MixedPrecision, get_plan


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(n)]


def _run(plan: str, in_backward: bool, batches, poison: int | None = None):
    model = _model()
    mp = MixedPrecision(plan, optimizer_in_backward=in_backward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = mp.prepare(model, opt)
    results = []
    for step, (x, y) in enumerate(batches):
        handle = None
        if step == poison:  # an inf gradient in the FIRST layer, whose gradient autograd produces last
            handle = model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        with mp.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        mp.backward(loss)
        if handle is not None:
            handle.remove()
        results.append(mp.step())
    return model, opt, results


@pytest.mark.parametrize("plan", ["bf16-pure", "bf16-kahan", "bf16-sr"])
def test_in_backward_equals_the_normal_step(plan):
    batches = _batches(6)
    a, _, ra = _run(plan, False, batches)
    b, _, rb = _run(plan, True, batches)
    assert all(r.stepped for r in ra + rb)
    assert all(r.grad_norm is None for r in rb)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        # bit-identical for pure and Kahan; stochastic rounding draws its noise in another order,
        # so after 6 AdamW steps weights may sit a few bf16 ulps (2**-7 relative) apart
        tol = 4 * 2**-7 * p.detach().float().abs().max().item() if plan == "bf16-sr" else 0.0
        torch.testing.assert_close(p.detach().float(), q.detach().float(), rtol=0, atol=tol)


@pytest.mark.parametrize("plan", ["bf16-pure", "bf16-kahan", "bf16-sr"])
def test_an_inf_gradient_anywhere_leaves_every_parameter_untouched(plan):
    batches = _batches(4)
    model, opt, results = _run(plan, True, batches[:2])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_before = copy.deepcopy(opt.state_dict())
    model2, opt2, results2 = _run(plan, True, batches[:3], poison=2)
    assert [r.skipped for r in results2] == [False, False, True]
    assert results2[2].skip_reason == "overflow"
    for k, v in model2.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a skipped in-backward step"
    after = opt2.state_dict()
    for i, st in state_before["state"].items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(after["state"][i][key], value), (i, key)


def test_gradients_are_freed_during_backward_and_state_is_8_bytes_per_parameter():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    mp = MixedPrecision("bf16-kahan", optimizer_in_backward=True)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    with mp.autocast():
        loss = model(torch.randn(4, 64)).float().pow(2).mean()
    mp.backward(loss)
    assert all(p.grad is None for p in model.parameters())  # released as soon as each was used
    assert mp.step().stepped
    n = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(
        t.numel() * t.element_size()
        for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    compensation = sum(t.numel() * t.element_size() for t in opt.state_dict()["mixprec_lowbit"]["compensation"].values())
    assert (weights + state + compensation) / n == 8.0  # bf16 weight 2 + compensation 2 + two bf16 moments 4


def test_in_backward_refuses_what_it_cannot_do_exactly():
    msg = "optimizer_in_backward=True does not work with "
    with pytest.raises(ValueError, match=re.escape(msg + "grad_accum_steps=2")):
        MixedPrecision("bf16-kahan", optimizer_in_backward=True, grad_accum_steps=2)
    with pytest.raises(ValueError, match=re.escape(msg + "clip_grad_norm=1.0")):
        MixedPrecision("bf16-kahan", optimizer_in_backward=True, clip_grad_norm=1.0)
    with pytest.raises(ValueError, match=re.escape("plan 'bf16-master' (use bf16-pure, bf16-kahan, bf16-sr or get_plan('bf16-master', remainders=True))")):
        MixedPrecision("bf16-master", optimizer_in_backward=True)
    with pytest.raises(ValueError, match=re.escape("a loss scaler (DynamicLossScaler; use a bf16 plan)")):
        MixedPrecision("bf16-kahan", optimizer_in_backward=True, scaler=DynamicLossScaler())
    model = _model()
    a, b = torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[2].parameters(), lr=0.1)
    with pytest.raises(ValueError, match=re.escape("optimizer_in_backward=True takes one optimizer")):
        MixedPrecision("bf16-kahan", optimizer_in_backward=True).prepare(model, a, b)
    with pytest.raises(TypeError, match=re.escape("optimizer_in_backward= must be True or False")):
        MixedPrecision("bf16-kahan", optimizer_in_backward="yes")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# One state machine for every entry: mp.backward or the halves (scale_loss + backward_context +
# micro_batch_done), several backwards per step, late parameters, exceptions mid-backward.

EXACT_PLANS = ["bf16-pure", "bf16-kahan"]  # stochastic rounding: the normal path draws its noise in another order


def _params_and_state(model, opt):
    return (
        [p.detach().clone() for p in model.parameters()],
        copy.deepcopy(opt.state_dict()),
    )


def _assert_same(a, b, label: str) -> None:
    (pa, sa), (pb, sb) = a, b
    for i, (x, y) in enumerate(zip(pa, pb, strict=True)):
        assert torch.equal(x, y), f"{label}: parameter {i}"
    assert sa["state"].keys() == sb["state"].keys(), f"{label}: optimizer state keys"
    for i, st in sa["state"].items():
        assert st.keys() == sb["state"][i].keys(), f"{label}: state keys of {i}"
        for key, value in st.items():
            other = sb["state"][i][key]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            assert same, f"{label}: state {key!r} of parameter {i}"
    for key in set(sa) - {"state", "param_groups"}:
        assert str(sa[key]) == str(sb[key]), f"{label}: {key}"


def _halves_backward(mp, model, x, y) -> None:
    with mp.autocast():
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    with mp.backward_context():
        mp.scale_loss(loss).backward()
    mp.micro_batch_done()


def _one_line_backward(mp, model, x, y) -> None:
    with mp.autocast():
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    mp.backward(loss)


def _inf_in_first_layer(model):
    """An inf gradient in the first layer, whose gradient autograd produces last: every other
    parameter is already updated inside backward when it arrives."""
    return model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")))


@pytest.mark.parametrize("plan", ["bf16-pure", "bf16-kahan", "bf16-sr"])
def test_the_composable_halves_skip_an_inf_gradient_exactly_as_backward_does(plan):
    batches = _batches(4)
    runs = []
    for entry in (_one_line_backward, _halves_backward):
        model = _model()
        mp = MixedPrecision(plan, optimizer_in_backward=True)
        model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
        results = []
        for step, (x, y) in enumerate(batches):
            handle = _inf_in_first_layer(model) if step == 2 else None
            entry(mp, model, x, y)
            if handle is not None:
                handle.remove()
            results.append(mp.step())
        assert [(r.stepped, r.skipped) for r in results] == [(True, False)] * 2 + [(False, True), (True, False)]
        assert results[2].skip_reason == "overflow" and mp.optimizer_steps == 3
        assert all(torch.isfinite(p).all() for p in model.parameters())
        runs.append(_params_and_state(model, opt))
    _assert_same(runs[1], runs[0], f"{plan}: the halves against mp.backward")


@pytest.mark.parametrize("entry", [_one_line_backward, _halves_backward], ids=["backward", "halves"])
def test_undo_copies_never_accumulate_across_steps(entry):
    """Measured: the bytes of live tensors are the same after every step, skipped or not
    (step 1 creates the optimizer state; the copies each backward makes are freed with it)."""
    from mixprec.diagnostics.memory.live import LiveStorages

    model = _model()
    mp = MixedPrecision("bf16-kahan", optimizer_in_backward=True, explain_overflow=False)  # (its tracer would hold records)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    live = LiveStorages()
    after = []
    with live.tracking():
        for step, (x, y) in enumerate(_batches(6)):
            handle = _inf_in_first_layer(model) if step == 3 else None
            entry(mp, model, x, y)
            if handle is not None:
                handle.remove()
            mp.step()
            after.append(live.live)
    assert after[1:] == [after[1]] * 5, after


@pytest.mark.parametrize("entry", [_one_line_backward, _halves_backward], ids=["backward", "halves"])
def test_undo_copies_held_inside_backward_are_bounded_and_freed_by_its_end(entry):
    model = _model()
    mp = MixedPrecision("bf16-kahan", optimizer_in_backward=True)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    in_bwd = mp._in_backward
    held_in_backward: list[int] = []
    model[0].weight.register_hook(lambda g: held_in_backward.append(in_bwd.undo_bytes()))  # runs last
    for x, y in _batches(3):
        entry(mp, model, x, y)
        assert in_bwd.undo_bytes() == 0
        mp.step()
    # the last layer is updated when the first layer's gradient arrives: its weight and state are held
    later = list(model[2].parameters())
    state = sum(t.numel() * t.element_size() for p in later for t in opt.state[p].values() if isinstance(t, torch.Tensor))
    weights = sum(p.numel() * p.element_size() for p in later)
    assert weights + state <= held_in_backward[-1] <= in_bwd.step_transient_bytes()


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda mp: mp.clip_grad_norm_(0.05), "clip_grad_norm_()"),
        (lambda mp: mp.clip_grad_value_(0.05), "clip_grad_value_()"),
        (lambda mp: mp.grad_norm(), "grad_norm()"),
        (lambda mp: mp.unscale_(), "unscale_()"),
    ],
)
def test_gradient_reads_after_the_updates_are_refused_under_in_backward(call, name):
    model = _model()
    mp = MixedPrecision("bf16-kahan", optimizer_in_backward=True)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    (x, y), = _batches(1)
    _halves_backward(mp, model, x, y)
    before = _params_and_state(model, opt)
    with pytest.raises(RuntimeError, match=re.escape(
        f"{name} does not work with optimizer_in_backward=True: each parameter is updated inside backward and "
        "its gradient freed at once, so no gradient is left to unscale, measure or clip (a global-norm clip "
        "needs every gradient before the first update); use MixedPrecision(optimizer_in_backward=False) to "
        "clip or read gradients"
    )):
        call(mp)
    _assert_same(_params_and_state(model, opt), before, "after the refusal")
    assert mp.step().stepped


def _train(plan, in_backward, batches, *, before_step=None, entry=_one_line_backward, optimizer=None):
    model = _model()
    mp = MixedPrecision(plan, optimizer_in_backward=in_backward)
    opt = optimizer(model) if optimizer is not None else torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = mp.prepare(model, opt)
    for step, (x, y) in enumerate(batches):
        if before_step is not None:
            before_step(step, model, opt)
        entry(mp, model, x, y)
        assert mp.step().stepped
    return model, opt


@pytest.mark.parametrize("plan", EXACT_PLANS)
@pytest.mark.filterwarnings("ignore:plan .* rounds")
def test_a_parameter_unfrozen_after_prepare_trains_as_in_the_normal_path(plan):
    def freeze_then_unfreeze(step, model, opt):
        model[0].requires_grad_(step >= 2)

    def frozen_at_prepare(model):
        model[0].requires_grad_(False)
        return torch.optim.AdamW(model.parameters(), lr=1e-2)

    batches = _batches(5)
    plan = get_plan(plan, convert_frozen=True)  # (Kahan: a weight frozen at prepare is rounded to bf16 only when asked)
    ref = _train(plan, False, batches, before_step=freeze_then_unfreeze, optimizer=frozen_at_prepare)
    got = _train(plan, True, batches, before_step=freeze_then_unfreeze, optimizer=frozen_at_prepare)
    assert not torch.equal(got[0][0].weight, _model()[0].weight.to(got[0][0].weight.dtype))  # it trained
    _assert_same(_params_and_state(*got), _params_and_state(*ref), f"{plan}: unfrozen after prepare")


@pytest.mark.parametrize("plan", EXACT_PLANS)
@pytest.mark.parametrize("entry", [_one_line_backward, _halves_backward], ids=["backward", "halves"])
def test_a_param_group_added_after_prepare_trains_as_in_the_normal_path(plan, entry):
    def add_first_layer(step, model, opt):
        if step == 2:
            opt.add_param_group({"params": list(model[0].parameters()), "lr": 3e-3, "weight_decay": 0.1})

    def last_layer_only(model):
        return torch.optim.AdamW(model[2].parameters(), lr=1e-2)

    batches = _batches(5)
    ref = _train(plan, False, batches, before_step=add_first_layer, optimizer=last_layer_only)
    got = _train(plan, True, batches, before_step=add_first_layer, optimizer=last_layer_only, entry=entry)
    assert len(got[1].param_groups) == 2 and all(p.grad is None for p in got[0].parameters())
    _assert_same(_params_and_state(*got), _params_and_state(*ref), f"{plan}: a group added after prepare")


AGAIN = (
    " before step(): under optimizer_in_backward=True the last backward already updated the weights and "
    "counts as one step, so another backward cannot join it (no gradient accumulation); call mp.step() after "
    "each backward"
)


@pytest.mark.parametrize("plan", EXACT_PLANS)
def test_a_second_backward_before_step_is_refused_and_changes_nothing(plan):
    batches = _batches(3)
    ref = _train(plan, True, batches[:1])
    model = _model()
    mp = MixedPrecision(plan, optimizer_in_backward=True)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    (x, y), (x2, y2), (x3, y3) = batches
    _one_line_backward(mp, model, x, y)
    after_first = _params_and_state(model, opt)
    with pytest.raises(RuntimeError, match=re.escape("backward() called again" + AGAIN)):
        _one_line_backward(mp, model, x2, y2)
    with pytest.raises(RuntimeError, match=re.escape("scale_loss() called again" + AGAIN)):
        _halves_backward(mp, model, x2, y2)
    # a backward run directly (no scale_loss), a clean one and one with an inf gradient: refused at
    # its first update, before it changes anything
    for poison in (False, True):
        handle = _inf_in_first_layer(model) if poison else None
        with mp.autocast():
            loss = torch.nn.functional.mse_loss(model(x3).float(), y3)
        with pytest.raises(RuntimeError, match=re.escape("a second backward ran" + AGAIN)):
            loss.backward()
        if handle is not None:
            handle.remove()
    with pytest.raises(RuntimeError, match=re.escape(
        "micro_batch_done() called without a backward since the last one: nothing would be counted. Call "
        "scale_loss(loss), run the backward of what it returns inside backward_context(), then "
        "micro_batch_done() (backward(loss) does all three)"
    )):
        mp.micro_batch_done()
    with pytest.raises(RuntimeError, match=re.escape(
        "state_dict() called between a backward and its step() under optimizer_in_backward=True: the weights "
        "already hold that backward's update; call step() first, then save"
    )):
        mp.state_dict(mid_accumulation=True)
    _assert_same(_params_and_state(model, opt), after_first, f"{plan}: after the refused backwards")
    assert all(p.grad is None for p in model.parameters())
    result = mp.step()
    assert result.stepped and not result.skipped and mp.optimizer_steps == 1
    _assert_same(_params_and_state(model, opt), _params_and_state(*ref), f"{plan}: one step counted, one applied")
    _one_line_backward(mp, model, x2, y2)  # after step() the next backward is accepted
    assert mp.step().stepped and mp.optimizer_steps == 2


def _bare_backward(mp, model, x, y) -> None:
    """A framework that runs the backward outside backward_context()."""
    with mp.autocast():
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    mp.scale_loss(loss).backward()
    mp.micro_batch_done()


@pytest.mark.parametrize("plan", EXACT_PLANS)
@pytest.mark.parametrize("entry", [_one_line_backward, _halves_backward, _bare_backward], ids=["backward", "halves", "bare"])
@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt])
def test_an_exception_mid_backward_undoes_every_update_and_a_retry_is_exact(plan, entry, exc):
    batches = _batches(5)
    ref_model, ref_opt = _train(plan, True, batches[:4])
    ref_skip = _params_and_state(ref_model, ref_opt)
    model = _model()
    mp = MixedPrecision(plan, optimizer_in_backward=True)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for x, y in batches[:2]:
        entry(mp, model, x, y)
        mp.step()
    before = _params_and_state(model, opt)

    def interrupt(g):
        raise exc("stopped mid-backward")

    handle = model[0].weight.register_hook(interrupt)  # the last gradient: every other update has run
    with pytest.raises(exc, match="stopped mid-backward"):
        entry(mp, model, *batches[2])
    handle.remove()
    state = mp.state_dict()  # a save works (and, for a bare backward, undoes it first)
    assert state["optimizer_steps"] == 2
    _assert_same(_params_and_state(model, opt), before, f"{plan}: after the interrupted backward")
    assert all(p.grad is None for p in model.parameters())
    for step in (2, 3):  # the retry, then a clean step
        entry(mp, model, *batches[step])
        assert mp.step().stepped
    handle = _inf_in_first_layer(model)  # a later skip restores this step's copies, not stale ones
    entry(mp, model, *batches[4])
    handle.remove()
    assert mp.step().skipped and mp.optimizer_steps == 4
    _assert_same(_params_and_state(model, opt), ref_skip, f"{plan}: retried run against an uninterrupted one")


@pytest.mark.parametrize("plan", EXACT_PLANS)
def test_an_exception_after_the_backward_inside_backward_context_undoes_it(plan):
    """Autograd finished (every update ran), then a Ctrl-C inside backward_context(): the step
    is dropped as a whole, so its updates are undone too and the retry is exact."""
    batches = _batches(2)
    ref = _train(plan, True, batches)
    model = _model()
    mp = MixedPrecision(plan, optimizer_in_backward=True)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _halves_backward(mp, model, *batches[0])
    mp.step()
    before = _params_and_state(model, opt)
    with mp.autocast():
        loss = torch.nn.functional.mse_loss(model(batches[1][0]).float(), batches[1][1])
    with pytest.raises(KeyboardInterrupt), mp.backward_context():
        mp.scale_loss(loss).backward()
        raise KeyboardInterrupt
    _assert_same(_params_and_state(model, opt), before, f"{plan}: after the interrupted step")
    assert mp.state_dict()["optimizer_steps"] == 1
    _halves_backward(mp, model, *batches[1])
    assert mp.step().stepped
    _assert_same(_params_and_state(model, opt), _params_and_state(*ref), f"{plan}: the retried step")


def test_copies_of_an_interrupted_backward_are_dropped_when_a_checkpoint_was_loaded_since():
    """A user's handler loads the last checkpoint after a backward outside backward_context()
    was interrupted: the loaded weights win; a later skip restores only its own copies."""
    model = _model()
    mp = MixedPrecision("bf16-kahan", optimizer_in_backward=True)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    checkpoint = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    batches = _batches(4)
    _one_line_backward(mp, model, *batches[0])
    mp.step()
    handle = model[0].weight.register_hook(lambda g: (_ for _ in ()).throw(ValueError("stop")))
    with pytest.raises(ValueError, match="stop"):
        _bare_backward(mp, model, *batches[1])
    handle.remove()
    model.load_state_dict(checkpoint[0])
    opt.load_state_dict(checkpoint[1])
    loaded = _params_and_state(model, opt)
    handle = _inf_in_first_layer(model)
    _one_line_backward(mp, model, *batches[2])  # the retry: refused by its inf gradient
    handle.remove()
    assert mp.step().skipped
    _assert_same(_params_and_state(model, opt), loaded, "a skip after the load")
    _one_line_backward(mp, model, *batches[3])
    assert mp.step().stepped
    ref, ref_opt = _train("bf16-kahan", True, batches[3:])
    _assert_same(_params_and_state(model, opt), _params_and_state(ref, ref_opt), "training on from the load")


def test_micro_batch_done_without_a_boundary_is_refused_under_in_backward():
    model = _model()
    mp = MixedPrecision("bf16-kahan", optimizer_in_backward=True)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    (x, y), = _batches(1)
    with mp.autocast():
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    with mp.backward_context():
        mp.scale_loss(loss).backward()
    with pytest.raises(ValueError, match=re.escape(
        "micro_batch_done(boundary=False) under optimizer_in_backward=True: each backward already updated the "
        "weights, so gradients cannot accumulate over micro-batches; call step() after each backward, or use "
        "optimizer_in_backward=False to accumulate"
    )):
        mp.micro_batch_done(boundary=False)
    mp.micro_batch_done(boundary=True)
    result = mp.step()
    assert result.stepped and not result.accumulating and mp.optimizer_steps == 1


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_under_in_backward_equals_the_normal_path(reentrant):
    """A reentrant checkpoint runs a nested backward inside the outer one: its updates are part
    of the same step (one outcome, one undo), not a backward of their own."""
    from torch.utils.checkpoint import checkpoint

    def entry(mp, model, x, y):
        with mp.autocast():
            h = checkpoint(model[0], x.requires_grad_(), use_reentrant=reentrant)  # reentrant: needs an input with grad
            loss = torch.nn.functional.mse_loss(model[2](model[1](h)).float(), y)
        mp.backward(loss)

    batches = _batches(4)
    ref = _train("bf16-kahan", False, batches, entry=entry)
    got = _train("bf16-kahan", True, batches, entry=entry)
    assert not torch.equal(got[0][0].weight, _model()[0].weight.to(got[0][0].weight.dtype))  # it trained
    _assert_same(_params_and_state(*got), _params_and_state(*ref), f"checkpoint(use_reentrant={reentrant})")

"""PyTorch's own GradScaler unit tests, ported to run with DynamicLossScaler in place of GradScaler.

The scenarios, numbers and tolerances are those of PyTorch's ``test_grad_scaling_*`` tests
(``test/test_cuda.py`` and the device-generic ones in ``test/test_torch.py``), on CPU. Each
test runs twice, with ``torch.amp.GradScaler("cpu", ...)`` and with
``DynamicLossScaler("cpu", ...)``, the only difference being the class: the torch run
shows the test itself is right.

Not ported (they do not apply on CPU or do not test the scaler):
``test_grad_scaling_device_as_key`` (torch.device hashing), ``test_grad_scaling_multigpu``
and the multi-device half of ``test_grad_scaling_scale`` (two GPUs), the kernel-only
checks of ``torch._amp_update_scale_`` / ``torch._amp_foreach_non_finite_check_and_unscale_``
(ported here as the equivalent scaler-level sequences), ``test_grad_scaler_deprecated_warning``
(``torch.cuda.amp.GradScaler``'s deprecation), and the Adam/AdamW variants of
``test_grad_scaling_autocast``, which PyTorch itself expects to fail its tolerance.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch

from mixprec import DynamicLossScaler

INF = float("inf")


def _torch_scaler(**kwargs: Any) -> Any:
    return torch.amp.GradScaler("cpu", **kwargs)


def _mixprec_scaler(**kwargs: Any) -> Any:
    return DynamicLossScaler("cpu", **kwargs)


@pytest.fixture(params=[_torch_scaler, _mixprec_scaler], ids=["torch", "mixprec"])
def make_scaler(request) -> Callable[..., Any]:
    return request.param


def _models_and_optimizers(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    """A control model/optimizer and an identical one that will use the scaler."""
    control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    scaling = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with torch.no_grad():
        for c, s in zip(control.parameters(), scaling.parameters(), strict=True):
            s.copy_(c)
    kwargs = {"lr": 1.0, **(optimizer_kwargs or {})}
    return control, scaling, optimizer_ctor(control.parameters(), **kwargs), optimizer_ctor(scaling.parameters(), **kwargs)


def _scaling_case(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    torch.manual_seed(0)
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]
    skip_iter = 2
    return (*_models_and_optimizers(optimizer_ctor, optimizer_kwargs), data, torch.nn.MSELoss(), skip_iter)


def _run_scaling_case(make_scaler, run, unskipped, skipped, atol=1e-7, optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    """Control (no scaler) vs scaled run; the scale must have grown ``unskipped`` and backed off ``skipped`` times."""
    for enabled in (True, False):
        mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, skip_iter = _scaling_case(
            optimizer_ctor, optimizer_kwargs
        )
        # A modest initial scale and growth every step magnify any error in the growth handling.
        scaler = make_scaler(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)
        run(data, mod_control, opt_control, scaler, loss_fn, skip_iter, False)
        ret = run(data, mod_scaling, opt_scaling, scaler, loss_fn, skip_iter, True)
        scaler = ret if ret else scaler
        if enabled:
            growth = scaler.get_growth_factor() ** unskipped if unskipped > 0 else 1.0
            backoff = scaler.get_backoff_factor() ** skipped if skipped > 0 else 1.0
            assert scaler.get_scale() == 128.0 * growth * backoff
        else:
            assert scaler.get_scale() == 1.0
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters(), strict=True):
            torch.testing.assert_close(c.grad, s.grad, atol=atol, rtol=1e-5)
            c_state, s_state = opt_control.state[c], opt_scaling.state[s]
            for k in c_state:
                torch.testing.assert_close(c_state[k], s_state[k], atol=atol, rtol=1e-5, msg=k)
            torch.testing.assert_close(c, s, atol=atol, rtol=1e-5)


# ---------------------------------------------------------------- scale / state_dict / update
def test_grad_scaling_scale(make_scaler):
    scaler = make_scaler(init_scale=2.0)
    t = torch.full((1,), 4.0)
    outputs = scaler.scale((t.clone(), (t.clone(), t.clone()), [t.clone(), (t.clone(), t.clone())]))
    flat = [outputs[0], *outputs[1], outputs[2][0], *outputs[2][1]]
    assert all(o.item() == 8.0 for o in flat)
    assert scaler._scale.device == t.device


@pytest.mark.parametrize("lazy_init_scale", [True, False])
def test_grad_scaling_state_dict(make_scaler, lazy_init_scale):
    s0 = make_scaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = make_scaler(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    s1._init_growth_tracker = 7  # a value for load_state_dict to overwrite
    if lazy_init_scale:
        s1.scale(torch.full((1,), 4.0))
        assert isinstance(s1._scale, torch.Tensor) and s1._scale.dtype == torch.float32
    s1.load_state_dict(s0.state_dict())
    assert s1.get_scale() == 3.0
    assert s1.get_growth_factor() == 4.0
    assert s1.get_backoff_factor() == 0.5
    assert s1.get_growth_interval() == 2
    assert s1._init_growth_tracker == 0


def test_grad_scaling_update_scale(make_scaler):
    """The update-kernel sequence (growth 2, backoff 0.25, interval 2), through the scaler."""
    scaler = make_scaler(init_scale=4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.0)
    seen = []
    for bad in (False, False, True):  # two clean iterations, then a skipped one
        scaler.scale((w * (INF if bad else 1.0)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        seen.append((scaler._get_growth_tracker(), scaler.get_scale()))
    assert seen == [(1, 4.0), (0, 8.0), (0, 2.0)]


# ---------------------------------------------------------------------------- unscaling
def test_grad_scaling_unscale(make_scaler):
    inv_scale = torch.full((1,), 0.25)
    g = torch.full((20, 20), 4.0)

    def perfect_storm_grads(inject_inf: int) -> list[torch.Tensor]:
        # contiguous, non-contiguous slices and fp16, so both kernel paths are used
        grads = [g.clone(), g.clone()[:, :5], g.to(torch.float16), g.to(torch.float16)]
        if inject_inf >= 0:
            grads[inject_inf][2, 2] = INF
        return grads

    scaler = make_scaler()
    dummy_params = [torch.empty_like(grad) for grad in perfect_storm_grads(-1)]
    dummy_opt = torch.optim.SGD(dummy_params, lr=1.0)
    for inject_inf in range(-1, len(dummy_params)):
        found_inf = torch.full((1,), 0.0)
        grads = perfect_storm_grads(inject_inf)
        for p, grad in zip(dummy_params, grads, strict=True):
            p.grad = grad
        found = scaler._unscale_grads_(dummy_opt, inv_scale, found_inf, True)
        if inject_inf < 0:
            assert sum(v.item() for v in found.values()) == 0
            for grad in grads:
                torch.testing.assert_close(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)
        else:
            assert sum(v.item() for v in found.values()) == 1


def test_grad_scaling_unscale_sparse(make_scaler):
    scaler = make_scaler()
    inv_scale = torch.full((1,), 0.25)
    found_inf = torch.empty((1,))
    cur = found_inf.device
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    v = torch.tensor([16.0, 32.0, 64.0])
    s = torch.sparse_coo_tensor(i, v, (2, 3), check_invariants=True)

    p = s.clone()
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = s.clone()
    found_inf.zero_()
    assert scaler._unscale_grads_(opt, inv_scale, found_inf, False)[cur].item() == 0.0
    assert torch.equal(p.grad.to_dense(), (s / 4).to_dense())
    for bad in (INF, float("nan")):
        p.grad = torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, bad]), (2, 3), check_invariants=True)
        found_inf.zero_()
        assert scaler._unscale_grads_(opt, inv_scale, found_inf, False)[cur].item() == 1.0

    p = s.clone().half()
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = s.clone().half()
    found_inf.zero_()
    assert scaler._unscale_grads_(opt, inv_scale, found_inf, True)[cur].item() == 0.0
    assert torch.equal(p.grad.to_dense(), (s.half() / 4).to_dense())
    # Duplicate indices: each value fits fp16, their sum (64000 + 64000) does not.
    i = torch.tensor([[0, 1, 0], [2, 0, 2]])
    p.grad = torch.sparse_coo_tensor(i, torch.tensor([64000.0, 32.0, 64000.0]), (2, 3), dtype=torch.float16, check_invariants=True)
    found_inf.zero_()
    assert scaler._unscale_grads_(opt, inv_scale, found_inf, True)[cur].item() == 1.0


# ------------------------------------------------------------------ training-loop cases
@pytest.mark.parametrize("optimizer_kwargs", [None, {"foreach": True}], ids=["default", "foreach"])
def test_grad_scaling_autocast(make_scaler, optimizer_kwargs):
    """Scaling + autocast (bf16 on CPU) against neither, with the scaler pickled mid-run."""
    try_pickle = False

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (inp, target) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast("cpu", enabled=try_scaling_api):
                loss = loss_fn(model(inp), target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    with torch.no_grad():
                        model[1].weight.grad.fill_(INF)
                scaler.step(optimizer)
                scaler.update()
                if try_pickle:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                loss.backward()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()
        return scaler

    # bf16 autocast against pure fp32: the tolerance of PyTorch's bf16 ports.
    _run_scaling_case(make_scaler, run, unskipped=3, skipped=1, atol=1e-2, optimizer_kwargs=optimizer_kwargs)
    try_pickle = True
    _run_scaling_case(make_scaler, run, unskipped=3, skipped=1, atol=1e-2, optimizer_kwargs=optimizer_kwargs)


@pytest.mark.parametrize(
    ("optimizer_ctor", "amsgrad", "separate_unscale"),
    list(itertools.product((torch.optim.Adam, torch.optim.AdamW), (False, True), (False, True))),
)
def test_grad_scaling_autocast_fused_optimizers(make_scaler, optimizer_ctor, amsgrad, separate_unscale):
    """A fused optimizer (unscales in its kernel) against the same optimizer unfused, one scaler."""
    kwargs = {"fused": True, "amsgrad": amsgrad}
    mod_control, mod_scaling, _, opt_scaling, data, loss_fn, _ = _scaling_case(optimizer_ctor, kwargs)
    opt_control = optimizer_ctor(mod_control.parameters(), lr=1.0, fused=False, amsgrad=amsgrad)
    scaler = make_scaler(init_scale=128.0)
    for inp, target in data:
        for model, opt, unscale in ((mod_control, opt_control, False), (mod_scaling, opt_scaling, separate_unscale)):
            opt.zero_grad()
            with torch.autocast("cpu"):
                loss = loss_fn(model(inp), target)
            scaler.scale(loss).backward()
            if unscale:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        for pc, ps in zip(mod_control.parameters(), mod_scaling.parameters(), strict=True):
            torch.testing.assert_close(pc.grad, ps.grad)
            torch.testing.assert_close(pc, ps)
            for k, v in opt_control.state[pc].items():
                actual = opt_scaling.state[ps][k]
                torch.testing.assert_close(v, actual.squeeze() if k == "step" else actual)


@pytest.mark.parametrize(
    ("optimizer_ctor", "optimizer_kwargs"),
    list(
        itertools.product(
            (torch.optim.Adam, torch.optim.AdamW),
            ({"foreach": False, "fused": False}, {"foreach": True, "fused": False}, {"foreach": False, "fused": True}),
        )
    ),
)
def test_params_invalidated_with_grads_invalidated_between_unscale_and_step(make_scaler, optimizer_ctor, optimizer_kwargs):
    """The inf check happens in unscale_(): gradients broken after it are stepped with (as torch)."""
    model, _, optimizer, _, data, loss_fn, _ = _scaling_case(optimizer_ctor, optimizer_kwargs)
    scaler = make_scaler(init_scale=128.0)
    for inp, target in data:
        optimizer.zero_grad()
        with torch.autocast("cpu"):
            loss = loss_fn(model(inp), target)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        for j, param in enumerate(model.parameters()):
            param.grad.copy_(torch.tensor(INF if j % 2 else float("nan")))
        scaler.step(optimizer)
        scaler.update()
    assert all(p.isnan().any() or p.isinf().any() for p in model.parameters())


def test_grad_scale_will_not_overflow(make_scaler):
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = make_scaler(growth_interval=1, growth_factor=2**4, init_scale=1e38)
    optimizer.zero_grad()
    x = torch.randn(1, 5)
    y = 1e-30 * torch.randn(1, 1)
    scaler.scale(((model(x) - y) ** 2).mean()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler._scale != INF and not scaler._scale.isnan()


def test_grad_scaling_clipping(make_scaler):
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2
        for i, (inp, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(inp), target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                if i == skip_iter and scaler.is_enabled():
                    with torch.no_grad():
                        model[1].weight.grad.fill_(INF)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(make_scaler, run, unskipped=3, skipped=1, atol=1e-5)


def test_grad_scaling_clipping_separate_unscale(make_scaler):
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2
        for i, (inp, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(inp), target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    with torch.no_grad():
                        model[1].weight.grad.fill_(INF)
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(make_scaler, run, unskipped=3, skipped=1)


def test_grad_scaling_penalty(make_scaler):
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (inp, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(inp), target)
            if try_scaling_api:
                grad_params = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
                inv_scale = 1.0 / scaler.get_scale()
                grad_params = [p * inv_scale for p in grad_params]
            else:
                grad_params = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            grad_norm = sum(grad.pow(2).sum() for grad in grad_params).sqrt()
            loss = loss + grad_norm
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    with torch.no_grad():
                        model[1].weight.grad.fill_(INF)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(make_scaler, run, unskipped=3, skipped=1)


def test_grad_scaling_accumulation(make_scaler):
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        iters_to_accumulate = 2
        for i, (inp, target) in enumerate(data):
            loss = loss_fn(model(inp), target) / iters_to_accumulate
            if try_scaling_api:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if (i + 1) % iters_to_accumulate == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad()

    _run_scaling_case(make_scaler, run, unskipped=2, skipped=0)


def test_grad_scaling_multiple(make_scaler):
    """Two models, two optimizers, two losses; one optimizer's gradients overflow once."""
    for enabled in (True, False):
        mod_control0, mod_scaling0, opt_control0, opt_scaling0, data, loss_fn, skip_iter = _scaling_case()
        mod_control1, mod_scaling1, opt_control1, opt_scaling1 = _models_and_optimizers()
        scaler = make_scaler(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)

        def run(model0, model1, optimizer0, optimizer1, try_scaling_api, scaler=scaler, data=data, skip_iter=skip_iter, loss_fn=loss_fn):
            for i, (inp, target) in enumerate(data):
                optimizer0.zero_grad()
                optimizer1.zero_grad()
                output0, output1 = model0(inp), model1(inp)
                loss0 = loss_fn(0.3 * output0 + 0.7 * output1, target)
                loss1 = loss_fn(0.6 * output0 - 0.4 * output1, target)
                if try_scaling_api:
                    scaler.scale(loss0).backward(retain_graph=True)
                    scaler.scale(loss1).backward()
                    if i == skip_iter and scaler.is_enabled():
                        with torch.no_grad():
                            model1[1].weight.grad.fill_(INF)
                    scaler.unscale_(optimizer0)  # one optimizer unscaled separately, as a stress test
                    scaler.step(optimizer0)
                    scaler.step(optimizer1)
                    scaler.update()
                else:
                    loss0.backward(retain_graph=True)
                    loss1.backward()
                    optimizer0.step()
                    if (not scaler.is_enabled()) or (i != skip_iter):
                        optimizer1.step()

        run(mod_control0, mod_control1, opt_control0, opt_control1, False)
        run(mod_scaling0, mod_scaling1, opt_scaling0, opt_scaling1, True)
        expected = 128.0 * scaler.get_growth_factor() ** 3 * scaler.get_backoff_factor() if enabled else 1.0
        assert scaler.get_scale() == expected
        for c, s in zip(
            itertools.chain(mod_control0.parameters(), mod_control1.parameters()),
            itertools.chain(mod_scaling0.parameters(), mod_scaling1.parameters()),
            strict=True,
        ):
            torch.testing.assert_close(c, s, rtol=1e-5, atol=1e-7)


def test_grad_scaler_pass_itself(make_scaler):
    """Optimizers with _step_supports_amp_scaling: the grad_scaler= keyword (deprecated) or attributes."""
    scaler = make_scaler(init_scale=2.0)
    seen: dict[str, Any] = {}

    class _PlaceHolderOptimizer(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})
            self._step_supports_amp_scaling = True

    class Optimizer1(_PlaceHolderOptimizer):
        def step(self, closure=None, *, grad_scaler=None):
            seen["1"] = (grad_scaler is scaler, hasattr(self, "grad_scale"), hasattr(self, "found_inf"))

    class Optimizer2(_PlaceHolderOptimizer):
        def step(self, closure=None):
            seen["2"] = (isinstance(self.grad_scale, torch.Tensor), isinstance(self.found_inf, torch.Tensor))

    m = torch.nn.Linear(4, 1)
    o1, o2 = Optimizer1(m.parameters()), Optimizer2(m.parameters())
    with torch.autocast("cpu"):
        loss = m(torch.randn(4, 4)).mean()
    scaler.scale(loss).backward()
    with pytest.warns(FutureWarning):
        scaler.step(o1)
    scaler.step(o2)
    scaler.update()
    assert seen == {"1": (True, False, False), "2": (True, True)}


# ------------------------------------------------------ frameworks that drive a GradScaler
def _overflow_then_clean(step_fn, scaler, w, opt) -> list[tuple[Any, list[float], float]]:
    seen = []
    for bad in (False, True, False):
        scaler.scale((w * (INF if bad else 1.0)).sum()).backward()
        seen.append((step_fn(), w.tolist(), scaler.get_scale()))
        opt.zero_grad()
    return seen


@pytest.mark.integration
def test_accelerate_accelerated_optimizer_drives_it_like_gradscaler(make_scaler):
    """AcceleratedOptimizer.step(): scaler.step(optimizer, closure), update(), and its skip detection."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        accelerate.Accelerator(cpu=True)
        w = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([w], lr=0.5)
        scaler = make_scaler(init_scale=8.0)
        aopt = AcceleratedOptimizer(opt, device_placement=False, scaler=scaler)

        def step():
            aopt.step()
            return aopt.step_was_skipped

        assert _overflow_then_clean(step, scaler, w, opt) == [
            (False, [0.5, 0.5], 8.0), (True, [0.5, 0.5], 4.0), (False, [0.0, 0.0], 4.0)
        ]
    finally:  # accelerate's state is process-wide: leave none behind
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.mark.integration
def test_lightning_fabric_precision_plugin_drives_it_like_gradscaler(make_scaler):
    """Fabric's MixedPrecision("16-mixed"): backward/scale, unscale_gradients, optimizer_step, state_dict."""
    pytest.importorskip("lightning")
    from lightning.fabric.plugins.precision.amp import MixedPrecision

    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.5)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=make_scaler(init_scale=8.0))

    def step():
        plugin.unscale_gradients(opt)
        return plugin.optimizer_step(opt)

    seen = []
    for bad in (False, True, False):
        plugin.backward((w * (INF if bad else 1.0)).sum(), None)
        seen.append((step(), w.tolist(), plugin.scaler.get_scale()))
        opt.zero_grad()
    assert seen == [(None, [0.5, 0.5], 8.0), (None, [0.5, 0.5], 4.0), (None, [0.0, 0.0], 4.0)]
    state = plugin.state_dict()
    plugin.load_state_dict(state)
    assert plugin.state_dict() == state and state["scale"] == 4.0

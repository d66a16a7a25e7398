"""The update rule written once (mixprec.optim.rule) and the one route decision (mixprec.optim.routing.plan).

The eager backend of the rule is held to torch's single-tensor Adam/AdamW and SGD bit for bit,
its fused backend (the compiled route's, run here uncompiled) to within fp32 rounding; the
route plan the memory estimate predicts is the one the step takes.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mixprec.optim import KahanOptimizer, RemainderOptimizer, native, routing, rule

ADAM_OPTIONS = list(itertools.product((torch.optim.Adam, torch.optim.AdamW), (False, True), (False, True), (0.0, 0.1)))


def _tensors(seed: int, n: int = 1000) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) * 10.0 ** float(torch.randint(-6, 1, (), generator=g)) for _ in range(4)]
    return w, grads


@pytest.mark.parametrize(("cls", "amsgrad", "maximize", "weight_decay"), ADAM_OPTIONS)
def test_the_eager_rule_is_torchs_single_tensor_adam_bit_for_bit(cls, amsgrad, maximize, weight_decay) -> None:
    w0, grads = _tensors(0)
    ref = torch.nn.Parameter(w0.clone())
    opt = cls([ref], lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=weight_decay, amsgrad=amsgrad,
              maximize=maximize, foreach=False)
    h = rule.adam_hyper(opt, opt.param_groups[0])
    w, m, v, vmax = [w0.clone()], [torch.zeros_like(w0)], [torch.zeros_like(w0)], [torch.zeros_like(w0)]
    for step, g in enumerate(grads, start=1):
        ref.grad = g.clone()
        opt.step()
        step_size, bc2_sqrt = rule.bias_corrections(h, float(step))
        out = rule.adam(rule.FOREACH, h, step_size, bc2_sqrt, w, [g.clone()], m, v, vmax if amsgrad else None)
        assert out[0] is w and out[1] is m and out[2] is v  # in place on the lists given
        state = opt.state[ref]
        assert torch.equal(w[0], ref.detach()), step
        assert torch.equal(m[0], state["exp_avg"]) and torch.equal(v[0], state["exp_avg_sq"]), step
        if amsgrad:
            assert torch.equal(vmax[0], state["max_exp_avg_sq"]), step


@pytest.mark.parametrize("tensor_hyper", [False, True])
@pytest.mark.parametrize(("cls", "amsgrad", "maximize", "weight_decay"), ADAM_OPTIONS)
def test_the_fused_rule_is_within_fp32_rounding_of_the_eager_one(cls, amsgrad, maximize, weight_decay, tensor_hyper) -> None:
    w0, grads = _tensors(1)
    opt = cls([torch.nn.Parameter(w0.clone())], lr=1e-2, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
    h = rule.adam_hyper(opt, opt.param_groups[0])
    eager = [[w0.clone()], [torch.zeros_like(w0)], [torch.zeros_like(w0)], [torch.zeros_like(w0)]]
    fused: list[torch.Tensor | None] = [w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0), torch.zeros_like(w0)]
    # the compiled route takes its hyperparameters as fp32 0-dim tensors (no recompilation when
    # they change): 1 - beta2 then carries fp32's rounding of beta2 (about 1e-5 of it)
    th = h._replace(**{k: torch.tensor(getattr(h, k)) for k in ("lr", "beta1", "beta2", "eps", "weight_decay")})
    rtol = 1e-4 if tensor_hyper else 1e-6
    for step, g in enumerate(grads, start=1):
        step_size, bc2_sqrt = rule.bias_corrections(h, float(step))
        rule.adam(rule.FOREACH, h, step_size, bc2_sqrt, eager[0], [g.clone()], eager[1], eager[2],
                  eager[3] if amsgrad else None)
        args = (th, torch.tensor(step_size), torch.tensor(bc2_sqrt)) if tensor_hyper else (h, step_size, bc2_sqrt)
        fused = list(rule.adam(rule.FUSED, *args, fused[0], g, fused[1], fused[2], fused[3] if amsgrad else None))
        for a, b in zip(eager, fused, strict=True):
            if b is not None:  # within rounding of each element (and of the operands, where they cancel)
                bound = rtol * (a[0].abs() + a[0].abs().max() * 0.1)
                assert bool(((a[0] - b).abs() <= bound).all()), (step, float((a[0] - b).abs().max()))
    assert not torch.equal(eager[0][0], w0)  # the steps moved the weights


@pytest.mark.parametrize(("momentum", "dampening", "nesterov", "maximize", "weight_decay"), [
    (0.0, 0.0, False, False, 0.0), (0.9, 0.0, False, False, 0.0), (0.9, 0.1, False, True, 0.01),
    (0.9, 0.0, True, False, 0.01), (0.5, 0.0, True, True, 0.0),
])
def test_the_eager_rule_is_torchs_single_tensor_sgd_bit_for_bit(momentum, dampening, nesterov, maximize, weight_decay) -> None:
    w0, grads = _tensors(2)
    ref = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([ref], lr=0.1, momentum=momentum, dampening=dampening, nesterov=nesterov, maximize=maximize,
                          weight_decay=weight_decay, foreach=False)
    h = rule.sgd_hyper(opt.param_groups[0])
    w, kept = [w0.clone()], {}
    for g in grads:
        ref.grad = g.clone()
        opt.step()
        buf = kept.get("buf")
        rule.sgd(rule.FOREACH, h, w, [g.clone()], buf, lambda b: kept.update(buf=[t.clone() for t in b]))
        assert torch.equal(w[0], ref.detach())
        if momentum:
            assert torch.equal(kept["buf"][0], opt.state[ref]["momentum_buffer"])
        else:
            assert "buf" not in kept


def _low(n: int, *, grad: bool = True) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.randn(n).bfloat16())
    if grad:
        p.grad = torch.randn(n).bfloat16()
    return p


@pytest.mark.parametrize(("cls", "state_dtype"), [
    (KahanOptimizer, "8bit"), (KahanOptimizer, "bf16"), (RemainderOptimizer, "bf16"), (RemainderOptimizer, None),
])
def test_the_estimate_predicts_the_routes_the_step_takes(cls, state_dtype) -> None:
    params = [_low(4096), _low(1000), _low(256 * 3)]
    opt = cls(torch.optim.AdamW(params, lr=1e-3), state_dtype=state_dtype)
    comps = opt._compiled_rounding_inputs()
    step = routing.plan(opt.rounding, opt.state_dtype, opt.compile, params, comps=comps)
    predicted = routing.plan(opt.rounding, opt.state_dtype, opt.compile, params, predict=True)
    assert [id(p) for p in step.native] == [id(p) for p in predicted.native]
    assert [id(p) for p in step.triton] == [id(p) for p in predicted.triton] == []  # (the CPU lists no Triton)
    assert [id(p) for p in step.compiled] == [id(p) for p in predicted.compiled]
    assert [id(p) for p in step.eager] == [id(p) for p in predicted.eager]
    native_here = native.use_native_route("auto", opt.rounding, opt.state_dtype)
    assert bool(step.native) == native_here  # contiguous bf16 CPU weights: all native where the route is on
    if not native_here:
        assert [id(p) for p in step.rest] == [id(p) for p in params]


def test_the_executor_table_lists_the_native_kernel_on_the_cpu_only() -> None:
    assert routing.executors("cpu")[0] == "native" and routing.executors("cpu")[-1] == "eager"
    for device in ("cuda", "xpu", "mps"):
        assert "native" not in routing.executors(device) and routing.executors(device)[-1] == "eager"
    # a weight on a device whose table lists no native executor is not offered to it
    p = _low(256)
    assert not routing.plan("kahan", torch.uint8, "auto", [p], predict=True, native_first=False).native

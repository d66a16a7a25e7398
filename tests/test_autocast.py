"""mixprec.autocast: identity with torch.autocast, custom op lists in forward and backward,
nesting, threads, activation checkpointing, torch.compile, weight-cast freshness, the
custom-op hook, op_stats, and the fp16 overflow that an fp32 island fixes."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointError, checkpoint

import mixprec
from mixprec.amp import (
    autocast,
    autocast_backward,
    custom_op_precision,
    register_op,
    unregister_op,
)
from mixprec.islands import apply_fp32_islands
from mixprec.policy import OpPolicy, Precision, registered_ops
from mixprec.stats import OpStats, op_stats

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _state() -> tuple[Any, ...]:
    return (
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_cache_enabled(),
        torch._C._len_torch_function_stack(),
    )


@pytest.fixture(autouse=True)
def _global_state_unchanged() -> Iterator[None]:
    before = _state()
    yield
    assert _state() == before, "torch's global autocast state leaked out of the test"


class Block(nn.Module):
    """linear -> softmax attention-ish -> layer_norm -> linear, with a matmul."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        a = F.softmax(h @ h.transpose(-1, -2), dim=-1)
        return self.out(self.norm(a @ h))


def _block(seed: int = 0) -> Block:
    torch.manual_seed(seed)
    return Block()


def _x(*shape: int, seed: int = 1, dtype: torch.dtype = FP32, grad: bool = False) -> torch.Tensor:
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return t.requires_grad_(grad)


# ------------------------------------------------------------------ acceptance basics
def test_moving_linear_to_fp32_and_softmax_to_low_changes_their_dtypes() -> None:
    lin, x = nn.Linear(4, 4), _x(2, 4)
    with torch.autocast("cpu", dtype=BF16):
        assert lin(x).dtype == BF16
        assert torch.softmax(x, -1).dtype == FP32
    with autocast(BF16, device_type="cpu", fp32_ops=["linear"], lower_ops=["softmax"]):
        assert torch.is_autocast_enabled("cpu")
        y = lin(x)
        s1, s2, s3 = torch.softmax(x, -1), F.softmax(x, dim=-1), x.softmax(-1)
        mm = x @ x.T  # untouched ops keep torch's class
    assert y.dtype == FP32
    assert s1.dtype == s2.dtype == s3.dtype == BF16
    assert mm.dtype == BF16
    # values: exactly the explicit casts
    assert torch.equal(y, F.linear(x, lin.weight, lin.bias))
    assert torch.equal(s1, torch.softmax(x.to(BF16), -1))


def test_global_state_restored_even_on_error() -> None:
    before = _state()
    with pytest.raises(ZeroDivisionError), autocast(BF16, device_type="cpu", fp32_ops=["linear"]):
        _ = 1 / 0
    assert _state() == before


def test_no_custom_ops_is_torch_autocast_bitwise_forward_and_backward() -> None:
    model, x = _block(), _x(3, 5, 8)
    with torch.autocast("cpu", dtype=BF16):
        ref = model(x)
    ref.float().sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    with autocast(BF16, device_type="cpu"):
        assert torch._C._len_torch_function_stack() == 0  # nothing added per op
        out = model(x)
    out.float().sum().backward()
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    for p, g in zip(model.parameters(), ref_grads, strict=True):
        assert p.grad is not None and torch.equal(p.grad, g)


def test_defaults_follow_torch_autocast_arguments() -> None:
    a = autocast(device_type="cpu")
    assert a.dtype == torch.get_autocast_dtype("cpu") and a.enabled
    b = autocast("fp16", device_type="cpu", cache_enabled=False)
    with b:
        assert torch.get_autocast_dtype("cpu") == FP16 and not torch.is_autocast_cache_enabled()
    with autocast(device_type="cpu", enabled=False):
        assert not torch.is_autocast_enabled("cpu")
    policy = OpPolicy(FP16, fp32_ops=["linear"])
    assert autocast(device_type="cpu", policy=policy).dtype == FP16


def test_argument_errors() -> None:
    policy = OpPolicy(BF16, fp32_ops=["linear"])
    with pytest.raises(ValueError, match=re.escape("autocast() got both policy= and lower_ops=/fp32_ops=")):
        autocast(device_type="cpu", policy=policy, lower_ops=["softmax"])
    msg = "autocast() got dtype=torch.float16 but policy.dtype=torch.bfloat16; they must agree"
    with pytest.raises(ValueError, match=re.escape(msg)):
        autocast(FP16, device_type="cpu", policy=policy)
    with pytest.raises(ValueError, match="unknown op name 'lineer'"):
        autocast(device_type="cpu", fp32_ops=["lineer"])
    msg = "autocast() got dtype='cpu', a device type; mixprec.autocast takes the dtype first"
    with pytest.raises(ValueError, match=re.escape(msg)):
        autocast("cpu")
    with pytest.raises(TypeError, match=re.escape("autocast()(func) needs a callable, got int")):
        autocast(device_type="cpu")(3)  # type: ignore[type-var]


def test_decorator_and_reentrant_instance() -> None:
    ac = autocast(BF16, device_type="cpu", fp32_ops=["mm"])

    @ac
    def f(a: torch.Tensor, depth: int) -> list[torch.dtype]:
        inner = f(a, depth - 1) if depth else []
        return [torch.mm(a, a).dtype, (a @ a).dtype, *inner]

    assert f(_x(2, 2), 2) == [FP32, BF16] * 3
    assert not torch.is_autocast_enabled("cpu")


# ------------------------------------------------------------------------- backward
def test_backward_returns_grads_in_each_inputs_dtype_and_matches_explicit_casts() -> None:
    w = _x(4, 4, seed=2, grad=True)  # fp32 weight
    xb = _x(3, 4, dtype=BF16, grad=True)  # bf16 activation
    with autocast(BF16, device_type="cpu", fp32_ops=["linear"], lower_ops=["softmax"]):
        y = torch.softmax(F.linear(xb, w), -1)
    assert y.dtype == BF16
    y.float().sum().backward()
    assert w.grad is not None and xb.grad is not None
    assert (w.grad.dtype, xb.grad.dtype) == (FP32, BF16)
    # oracle: the same casts written by hand, no autocast
    w2, x2 = w.detach().clone().requires_grad_(), xb.detach().clone().requires_grad_()
    y2 = torch.softmax(F.linear(x2.float(), w2).to(BF16), -1)
    y2.float().sum().backward()
    assert torch.equal(y, y2) and torch.equal(w.grad, w2.grad) and torch.equal(xb.grad, x2.grad)  # type: ignore[arg-type]


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_custom_ops_hold_under_no_grad_and_inference_mode(context: str) -> None:
    model, x = _block(), _x(2, 5, 8)
    policy = OpPolicy(BF16, fp32_ops=["linear"], lower_ops=["softmax", "layer_norm"])
    with autocast(device_type="cpu", policy=policy):
        ref = model(x)
    ctx = torch.no_grad() if context == "no_grad" else torch.inference_mode()
    with ctx, autocast(device_type="cpu", policy=policy), op_stats() as stats:
        out = model(x)
    assert torch.equal(out, ref) and out.dtype == FP32
    # inference mode skips the decomposition of linear into addmm
    assert stats.dtypes_of("addmm") | stats.dtypes_of("linear") == {FP32}
    assert stats.dtypes_of("_softmax") | stats.dtypes_of("softmax") == {BF16}
    assert stats.dtypes_of("native_layer_norm") | stats.dtypes_of("layer_norm") == {BF16}


# -------------------------------------------------------------------------- nesting
def test_nested_regions_innermost_decides() -> None:
    lin, x = nn.Linear(4, 4), _x(2, 4)
    with autocast(BF16, device_type="cpu", fp32_ops=["linear"], lower_ops=["softmax"]):
        assert (lin(x).dtype, x.softmax(-1).dtype) == (FP32, BF16)
        with autocast(device_type="cpu", enabled=False):
            assert (lin(x).dtype, x.softmax(-1).dtype) == (FP32, FP32)
        with torch.autocast("cpu", enabled=False):  # plain torch too: autocast off, lists idle
            assert (lin(x).dtype, x.softmax(-1).dtype) == (FP32, FP32)
        with autocast(FP16, device_type="cpu"):  # other dtype, default lists
            assert (lin(x).dtype, x.softmax(-1).dtype) == (FP16, FP32)
        with autocast(BF16, device_type="cpu"):  # same dtype, no custom ops: default lists
            assert (lin(x).dtype, x.softmax(-1).dtype) == (BF16, FP32)
        with autocast(FP16, device_type="cpu", lower_ops=["softmax"]):  # other dtype, own lists
            assert (lin(x).dtype, x.softmax(-1).dtype) == (FP16, FP16)
        assert (lin(x).dtype, x.softmax(-1).dtype) == (FP32, BF16)  # outer lists resume


def test_nested_other_dtype_does_not_reuse_the_outer_weight_cast() -> None:
    # torch.autocast keys its weight-cast cache by tensor only; a nested region of another
    # dtype would get the outer region's casts (torch raises "must have the same dtype")
    lin, x = nn.Linear(4, 4), _x(2, 4)
    with autocast(BF16, device_type="cpu"):
        a = lin(x)
        with autocast(FP16, device_type="cpu"):
            b = lin(x)
        c = lin(x)
    assert (a.dtype, b.dtype, c.dtype) == (BF16, FP16, BF16)
    assert torch.equal(b, F.linear(x.half(), lin.weight.half(), lin.bias.half()))


# -------------------------------------------------------------------------- threads
class _LinearInBackward(torch.autograd.Function):
    """Identity in forward; backward computes its grad with F.linear under custom_bwd."""

    seen: list[torch.dtype] = []  # noqa: RUF012

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(w)
        return x.clone()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (w,) = ctx.saved_tensors
        out = F.linear(g, w)
        _LinearInBackward.seen.append(out.dtype)
        return out.to(g.dtype), None


def test_policy_applies_in_backward_code_under_autocast_backward() -> None:
    policy = OpPolicy(BF16, fp32_ops=["linear"])
    w = torch.eye(4)
    _LinearInBackward.seen.clear()
    for helper in (False, True):
        x = _x(2, 4, grad=True)
        with autocast(device_type="cpu", policy=policy):
            y = _LinearInBackward.apply(x, w)
        if helper:
            with autocast_backward(policy):
                y.sum().backward()
        else:
            y.sum().backward()
    # custom_bwd re-enters bf16 autocast in backward; only the helper brings the lists back
    assert _LinearInBackward.seen == [BF16, FP32]


def test_threads_each_get_their_own_policy() -> None:
    lin, x = nn.Linear(4, 4), _x(2, 4)
    barrier = threading.Barrier(2)
    results: dict[str, list[torch.dtype]] = {}
    errors: list[BaseException] = []

    def worker(name: str, policy: OpPolicy) -> None:
        try:
            with autocast(device_type="cpu", policy=policy):
                barrier.wait(timeout=10)
                dtypes = [lin(x).dtype for _ in range(20)]
                barrier.wait(timeout=10)
            results[name] = dtypes
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [
        threading.Thread(target=worker, args=("fp32", OpPolicy(BF16, fp32_ops=["linear"]))),
        threading.Thread(target=worker, args=("default", OpPolicy(BF16))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert set(results["fp32"]) == {FP32} and set(results["default"]) == {BF16}


# ------------------------------------------------------------------ checkpointing
def _ckpt_run(use_reentrant: bool | None, helper: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model, x = _block(), _x(3, 5, 8, grad=True)
    policy = OpPolicy(BF16, fp32_ops=["linear"], lower_ops=["softmax", "layer_norm"])
    with autocast(device_type="cpu", policy=policy):
        y = model(x) if use_reentrant is None else checkpoint(model, x, use_reentrant=use_reentrant)
    loss = y.float().pow(2).sum()
    if helper:
        with autocast_backward(policy):
            loss.backward()
    else:
        loss.backward()
    grads = [p.grad for p in model.parameters()] + [x.grad]
    assert all(g is not None for g in grads)
    return y, grads  # type: ignore[return-value]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recompute_follows_the_policy(use_reentrant: bool) -> None:
    ref_y, ref_grads = _ckpt_run(None, helper=False)
    y, grads = _ckpt_run(use_reentrant, helper=True)
    assert torch.equal(y, ref_y)
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.dtype == r.dtype and torch.equal(g, r)


def test_checkpoint_without_the_helper_is_caught_or_differs() -> None:
    """What autocast_backward prevents: torch restores autocast but not the custom lists."""
    ref_y, ref_grads = _ckpt_run(None, helper=False)
    with pytest.raises(CheckpointError, match="metadata"):
        _ckpt_run(False, helper=False)
    _, grads = _ckpt_run(True, helper=False)
    assert any(not torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))


def test_autocast_backward_without_custom_ops_is_a_no_op() -> None:
    with autocast_backward(None):
        assert torch._C._len_torch_function_stack() == 0
    with autocast_backward(OpPolicy(BF16)):
        assert torch._C._len_torch_function_stack() == 0
    with pytest.raises(TypeError, match=re.escape("policy must be a mixprec.OpPolicy or None, got str")):
        autocast_backward("bf16")  # type: ignore[arg-type]


# ------------------------------------------------------------ weight-cast freshness
def test_no_stale_cast_after_in_place_update() -> None:
    lin, x = nn.Linear(4, 4), _x(2, 4)
    policy = OpPolicy(BF16, lower_ops=["layer_norm"])
    ln = nn.LayerNorm(4)
    # custom-listed op: mixprec's casts are never cached, even within one region
    with autocast(device_type="cpu", policy=policy):
        a = ln(x)
        with torch.no_grad():
            ln.weight.mul_(3.0)
        b = ln(x)
    assert not torch.equal(a, b)
    assert torch.equal(b, F.layer_norm(x.to(BF16), (4,), ln.weight.to(BF16), ln.bias.to(BF16)))
    # default ops: a new region casts afresh (torch clears its cache on exit)
    outs = []
    for _ in range(2):
        with autocast(BF16, device_type="cpu"):
            outs.append(lin(x))
        with torch.no_grad():
            lin.weight.add_(1.0)
    assert not torch.equal(outs[0], outs[1])
    # within one region, cache_enabled=False keeps default ops fresh too
    with autocast(BF16, device_type="cpu", cache_enabled=False):
        c = lin(x)
        with torch.no_grad():
            lin.weight.add_(1.0)
        d = lin(x)
    assert not torch.equal(c, d)
    assert torch.equal(d, F.linear(x.to(BF16), lin.weight.to(BF16), lin.bias.to(BF16)))


def test_cached_default_casts_behave_as_torch_within_one_region() -> None:
    # torch.autocast caches leaf-weight casts until the outermost region exits; with no
    # custom ops mixprec is torch.autocast, so the same (documented) behaviour
    def run(ctx: Any) -> bool:
        lin, x = nn.Linear(4, 4), _x(2, 4)
        with ctx:
            a = lin(x)
            with torch.no_grad():
                lin.weight.add_(1.0)
            b = lin(x)
        return torch.equal(a, b)

    assert run(autocast(BF16, device_type="cpu")) == run(torch.autocast("cpu", dtype=BF16))


# ------------------------------------------------------------------- custom-op hook
class NeedsFp32(torch.autograd.Function):
    """Stands for a C extension kernel that only accepts float32."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or scale.dtype != torch.float32:
            raise RuntimeError(f"expected scalar type Float but found {x.dtype}")
        ctx.save_for_backward(scale)
        return x * scale

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return g * scale, None


def test_register_op_fixes_an_fp32_only_autograd_function() -> None:
    lin, x, scale = nn.Linear(4, 4), _x(2, 4, grad=True), torch.full((4,), 2.0)
    msg = "expected scalar type Float but found torch.bfloat16"
    with pytest.raises(RuntimeError, match=re.escape(msg)), torch.autocast("cpu", dtype=BF16):
        NeedsFp32.apply(lin(x), scale)
    register_op(NeedsFp32, "fp32")
    try:
        assert any(name.endswith("test_autocast.NeedsFp32") for name in registered_ops())
        with torch.autocast("cpu", dtype=BF16):  # torch's autocast as well as mixprec's
            h = lin(x)
            y = NeedsFp32.apply(h, scale)
        assert (h.dtype, y.dtype) == (BF16, FP32)
        y.sum().backward()
        assert x.grad is not None and x.grad.dtype == FP32
        assert torch.equal(y, h.float() * scale)
        assert NeedsFp32.apply(x.detach(), scale).dtype == FP32  # outside autocast: untouched
        register_op(NeedsFp32, "low")  # re-registering replaces the precision
        with autocast(BF16, device_type="cpu"), pytest.raises(RuntimeError, match="expected scalar type Float"):
            NeedsFp32.apply(x, scale)
    finally:
        assert unregister_op(NeedsFp32)
    assert "apply" not in NeedsFp32.__dict__
    assert not unregister_op(NeedsFp32)


def test_custom_op_precision_decorator_on_functions() -> None:
    @custom_op_precision("promote")
    def mix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        assert a.dtype == b.dtype, "the kernel needs one dtype"
        return a + b

    @custom_op_precision(Precision.LOW)
    def low(a: torch.Tensor) -> torch.Tensor:
        return a * 2

    a32, a16 = _x(4), _x(4, dtype=BF16)
    with autocast(BF16, device_type="cpu"):
        assert mix(a32, a16).dtype == FP32 and mix(a16, a32).dtype == FP32
        assert mix(a16, a16).dtype == BF16
        assert low(a32).dtype == BF16
    with pytest.raises(ValueError, match=re.escape("unknown precision 'half'; expected one of 'low', 'fp32', 'promote'")):
        custom_op_precision("half")


@torch.library.custom_op("mixprec_test::fp32_only", mutates_args=())
def _fp32_only(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or y.dtype != torch.float32:
        raise RuntimeError(f"expected scalar type Float but found {x.dtype}, {y.dtype}")
    return x * y


@_fp32_only.register_fake
def _(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_register_op_on_a_torch_library_op() -> None:
    a, b = _x(4, dtype=BF16), _x(4)
    with pytest.raises(RuntimeError, match="expected scalar type Float"), torch.autocast("cpu", dtype=BF16):
        _fp32_only(a, b)
    register_op(_fp32_only, "fp32")
    try:
        with torch.autocast("cpu", dtype=BF16):
            out = _fp32_only(a, b)
            out2 = torch.ops.mixprec_test.fp32_only(a, b)
        assert out.dtype == FP32 and torch.equal(out, a.float() * b) and torch.equal(out, out2)
        register_op("mixprec_test::fp32_only", "promote")
        with torch.autocast("cpu", dtype=BF16):
            assert _fp32_only(b, a).dtype == FP32
    finally:
        assert unregister_op(_fp32_only)
    with pytest.raises(RuntimeError, match="expected scalar type Float"), torch.autocast("cpu", dtype=BF16):
        _fp32_only(a, b)


def test_register_op_refuses_aten_ops() -> None:
    with pytest.raises(ValueError, match=re.escape("register_op() is for user ops; 'aten::mm' is a PyTorch op")):
        register_op(torch.ops.aten.mm, "fp32")


# --------------------------------------------------------------------------- op_stats
def test_op_stats_counts_post_autocast_dtypes_forward_and_backward() -> None:
    lin, x = nn.Linear(4, 4), _x(2, 4, grad=True)
    with op_stats() as stats:
        with autocast(BF16, device_type="cpu", lower_ops=["softmax"]):
            y = torch.softmax(lin(x).float(), -1)
        y.float().sum().backward()
    assert isinstance(stats, OpStats)
    assert stats[("addmm", BF16)] == 1
    assert stats[("_softmax", BF16)] == 1
    assert stats.calls("_softmax_backward_data") == 1
    assert stats.calls(dtype=BF16) >= 3
    assert ("mm", BF16) in stats  # backward of the bf16 linear
    table = str(stats).splitlines()
    assert table[0] == "| op | fp32 | bf16 | fp16 | other |"
    row = next(r for r in table if r.startswith("| addmm |"))
    assert row == "| addmm | 0 | 1 | 0 | 0 |"
    n = len(stats)
    torch.mm(x, x.T)  # outside: not counted
    assert len(stats) == n


def test_op_stats_reports_integer_ops() -> None:
    a = torch.arange(4)
    with op_stats() as stats:
        torch.add(a, a)
    assert dict(stats) == {("add", torch.int64): 1}
    assert "int64: 1" in str(stats)


# ------------------------------------------------------------ fp16 overflow, island
class T5LayerNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + 1e-6))


class DenseReluDense(nn.Module):
    def __init__(self, d: int, ff: int) -> None:
        super().__init__()
        self.wi = nn.Linear(d, ff, bias=False)
        self.wo = nn.Linear(ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(F.relu(self.wi(x)))


class T5LayerFF(nn.Module):
    def __init__(self, d: int = 16, ff: int = 64) -> None:
        super().__init__()
        self.layer_norm = T5LayerNorm(d)
        self.DenseReluDense = DenseReluDense(d, ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.DenseReluDense(self.layer_norm(x))


class T5Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList([T5LayerFF(), T5LayerFF()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x)
        return x


def _t5_block() -> T5Block:
    torch.manual_seed(0)
    block = T5Block()
    with torch.no_grad():
        for layer in block.layer:  # large feed-forward weights: activations pass fp16's 65504
            layer.DenseReluDense.wi.weight.mul_(40.0)
            layer.DenseReluDense.wo.weight.mul_(2000.0)
    return block


def test_t5_block_overflows_fp16_and_an_fp32_island_fixes_it() -> None:
    block, x = _t5_block(), _x(2, 6, 16)
    ref = block(x)  # fp32
    assert torch.isfinite(ref).all() and ref.abs().max() > 65504
    ffn_out: list[torch.Tensor] = []
    hook = block.layer[0].DenseReluDense.register_forward_hook(lambda m, i, o: ffn_out.append(o))
    with autocast(FP16, device_type="cpu"):
        plain = block(x)
    hook.remove()
    assert ffn_out[0].dtype == FP16 and torch.isinf(ffn_out[0]).any()  # fp16 overflow: inf
    assert not torch.isfinite(plain).all()  # and inf / nan downstream
    names = apply_fp32_islands(block, OpPolicy(FP16, fp32_modules=["layer.*.DenseReluDense"]))
    assert names == ["layer.0.DenseReluDense", "layer.1.DenseReluDense"]
    with autocast(FP16, device_type="cpu"):
        fixed = block(x)
    assert fixed.dtype == FP32 and torch.isfinite(fixed).all()
    torch.testing.assert_close(fixed, ref, rtol=1e-5, atol=1e-3)


# ---------------------------------------------------------------------- torch.compile
@pytest.mark.slow
def test_compile_same_dtypes_values_and_no_graph_breaks() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    model, x = _block(), _x(2, 5, 8)
    policy = OpPolicy(BF16, fp32_ops=["linear"], lower_ops=["softmax", "layer_norm"])
    with autocast(device_type="cpu", policy=policy):
        eager = model(x)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
        explained = torch._dynamo.explain(model)(x)
    assert compiled.dtype == eager.dtype == FP32
    assert torch.equal(compiled, eager)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    # the same compiled function under the default lists: a recompile, not stale policy
    torch._dynamo.reset()
    fn = torch.compile(model, backend="aot_eager", fullgraph=True)
    with autocast(device_type="cpu", policy=policy):
        a = fn(x)
    with autocast(BF16, device_type="cpu"):
        b = fn(x)
        b_eager = model(x)
    assert a.dtype == FP32 and b.dtype == BF16 and torch.equal(b, b_eager)


@pytest.mark.slow
def test_compile_with_the_region_inside_the_compiled_function() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    model, x = _block(), _x(2, 5, 8)

    def step(inp: torch.Tensor) -> torch.Tensor:
        with autocast(BF16, device_type="cpu"):
            return model(inp)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    with torch.autocast("cpu", dtype=BF16):
        eager = model(x)
    assert compiled.dtype == eager.dtype == BF16 and torch.equal(compiled, eager)


@pytest.mark.slow
def test_compile_inductor_matches_eager_dtypes_and_values() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    model, x = _block(), _x(2, 5, 8, grad=True)
    policy = OpPolicy(BF16, fp32_ops=["linear"], lower_ops=["softmax"])
    with autocast(device_type="cpu", policy=policy):
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True)(x)
    assert compiled.dtype == eager.dtype
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)
    compiled.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == FP32


# ------------------------------------------------------------------ bad inputs
@pytest.mark.parametrize("enabled", ["false", "no", 1, 0, None])
def test_enabled_must_be_a_bool(enabled) -> None:
    hint = "; a string such as 'false' would count as True" if isinstance(enabled, str) else ""
    msg = f"enabled must be True or False, got {enabled!r} ({type(enabled).__name__}){hint}"
    with pytest.raises(TypeError, match=re.escape(msg) + "$"):
        mixprec.autocast(torch.bfloat16, device_type="cpu", enabled=enabled)


def test_exit_without_enter_is_a_clear_error() -> None:
    ctx = mixprec.autocast(torch.bfloat16, device_type="cpu")
    with pytest.raises(RuntimeError, match=re.escape(
        "autocast(dtype=torch.bfloat16, device_type='cpu', enabled=True).__exit__() called without a matching "
        "__enter__() in this thread; use `with autocast(...):` (or call __enter__() first)"
    )):
        ctx.__exit__(None, None, None)
    with ctx:  # still usable
        assert torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("nosuchns::op", "register_op() got 'nosuchns::op', but no such op is registered with torch.library"),
        ("::op", "register_op() got '::op'; a library op is named 'namespace::op'"),
    ],
)
def test_register_op_of_an_unknown_library_op_is_a_value_error(target, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        mixprec.register_op(target, "fp32")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"dtype": torch.int8}, ValueError, "autocast() dtype must be torch.bfloat16 or torch.float16, got torch.int8"),
        ({"device_type": "gpu"}, ValueError, "device_type='gpu' is not a device type autocast supports"),
        ({"cache_enabled": "yes"}, TypeError, "cache_enabled must be True, False or None, got 'yes'"),
        ({"lower_ops": 3}, TypeError, "lower_ops must be a sequence of op names, got 3"),
    ],
)
def test_bad_autocast_arguments_are_named(kwargs, error, message) -> None:
    kwargs = {"device_type": "cpu", **kwargs}
    with pytest.raises(error, match=re.escape(message)):
        mixprec.autocast(**kwargs)


@pytest.mark.parametrize("dtype", [FP32, torch.float64, "fp32"])
def test_disabled_autocast_accepts_any_floating_dtype_as_torch_does(dtype: Any) -> None:
    """Config-driven code writes ``autocast(dtype=cfg.dtype, enabled=cfg.amp)`` with an fp32 dtype."""
    lin, x = nn.Linear(4, 4), _x(2, 4)
    with torch.autocast("cpu", dtype=FP32, enabled=False):  # the oracle accepts it
        expected = lin(x)
    with autocast(dtype, device_type="cpu", enabled=False, lower_ops=["softmax"]):
        assert not torch.is_autocast_enabled("cpu")
        assert torch.equal(lin(x), expected) and x.softmax(-1).dtype == FP32
    with pytest.raises(ValueError, match="enabled=False"):  # enabled, fp32 is still refused with the fix
        autocast(FP32, device_type="cpu")

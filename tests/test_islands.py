"""fp32 islands: selection by class and glob, idempotence, removal, state_dict, dtypes in
and out, gradients, deepcopy and torch.compile."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.amp import autocast
from mixprec.islands import (
    FP32Island,
    apply_fp32_islands,
    fp32_island_names,
    is_fp32_island,
    match_fp32_modules,
    remove_fp32_islands,
)
from mixprec.policy import OpPolicy

BF16, FP32 = torch.bfloat16, torch.float32


class Attn(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qk = nn.Linear(d, d)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.qk(x)
        return self.softmax(h @ h.transpose(-1, -2)) @ x


class Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = Attn(d)
        self.ff = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(self.attn(self.ln(x)))


class Net(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(d), Layer(d)])
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _x(*shape: int, dtype: torch.dtype = FP32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)


def test_select_by_class_and_glob_idempotent_state_dict_unchanged() -> None:
    net = _net()
    keys = list(net.state_dict())
    values = {k: v.clone() for k, v in net.state_dict().items()}
    policy = OpPolicy(fp32_modules=[nn.LayerNorm, "*.attn.softmax"])
    assert match_fp32_modules(net, policy) == [
        "layers.0.ln", "layers.0.attn.softmax", "layers.1.ln", "layers.1.attn.softmax",
    ]  # fmt: skip
    assert fp32_island_names(net) == []  # matching changes nothing
    names = apply_fp32_islands(net, policy)
    assert names == match_fp32_modules(net, policy)
    assert apply_fp32_islands(net, policy) == names  # idempotent
    assert apply_fp32_islands(net, policy).handle.names == []  # nothing newly marked
    assert fp32_island_names(net) == names
    assert list(net.state_dict()) == keys
    assert all(torch.equal(v, values[k]) for k, v in net.state_dict().items())
    ln = net.layers[0].ln
    assert isinstance(ln, nn.LayerNorm) and isinstance(ln, FP32Island) and is_fp32_island(ln)
    assert remove_fp32_islands(net) == names
    assert type(net.layers[0].ln) is nn.LayerNorm and fp32_island_names(net) == []


def test_handle_removes_only_what_it_marked() -> None:
    net = _net()
    first = apply_fp32_islands(net, [nn.LayerNorm])
    second = apply_fp32_islands(net, OpPolicy(fp32_modules=["head", "layers.0.ln"]))
    assert second == ["layers.0.ln", "head"] and second.handle.names == ["head"]
    assert second.handle.remove() == ["head"]
    assert fp32_island_names(net) == first
    assert first.handle.remove() == first
    assert fp32_island_names(net) == []


def test_island_runs_fp32_with_autocast_off_inside() -> None:
    net = _net()
    x = _x(2, 4, 8)
    seen: dict[str, tuple[bool, torch.dtype]] = {}

    def probe(name: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            seen[name] = (torch.is_autocast_enabled("cpu"), args[0].dtype)

        return hook

    net.layers[0].attn.qk.register_forward_pre_hook(probe("inside"))
    net.layers[1].attn.qk.register_forward_pre_hook(probe("outside"))
    apply_fp32_islands(net, ["layers.0.attn"])
    with torch.autocast("cpu", dtype=BF16):
        h = net.layers[0].ln(x)
        assert h.dtype == FP32  # layer_norm keeps fp32 on CPU; make the input bf16:
        out0 = net.layers[0].attn(h.to(BF16))
        out1 = net.layers[1].attn(h.to(BF16))
    assert seen["inside"] == (False, FP32)
    assert seen["outside"] == (True, BF16)
    assert out0.dtype == FP32 and out1.dtype == BF16
    assert torch.is_autocast_enabled("cpu") is False
    # values: the plain fp32 computation of the bf16-rounded input
    with torch.no_grad():
        assert torch.equal(out0, net.layers[0].attn.__class__._mixprec_island_base.forward(net.layers[0].attn, h.to(BF16).float()))


def test_island_ignores_mixprec_custom_lists_inside() -> None:
    net = _net()
    apply_fp32_islands(net, ["layers.*.attn"])
    with autocast(BF16, device_type="cpu", lower_ops=["softmax"]):
        y = net.layers[0].attn(_x(2, 4, 8))
        z = F.softmax(_x(2, 4), -1)
    assert y.dtype == FP32 and z.dtype == BF16


def test_marking_casts_island_params_to_fp32_and_pure_models_stay_transparent() -> None:
    net = _net().to(BF16)
    apply_fp32_islands(net, [nn.LayerNorm])
    assert net.layers[0].ln.weight.dtype == FP32 and net.layers[0].ff.weight.dtype == BF16
    x = _x(2, 4, 8, dtype=BF16)
    out = net(x)  # no autocast: bf16 model, fp32 islands cast back to the input dtype
    assert out.dtype == BF16
    ln_out = net.layers[0].ln(x)
    assert ln_out.dtype == BF16
    ref = F.layer_norm(x.float(), (8,), net.layers[0].ln.weight, net.layers[0].ln.bias).to(BF16)
    assert torch.equal(ln_out, ref)


def test_gradients_flow_in_each_inputs_dtype() -> None:
    net = _net()
    apply_fp32_islands(net, ["layers.0.attn"])
    x = _x(2, 4, 8, dtype=BF16).requires_grad_()
    with torch.autocast("cpu", dtype=BF16):
        y = net.layers[0].attn(x)
    y.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == BF16
    assert net.layers[0].attn.qk.weight.grad is not None
    assert net.layers[0].attn.qk.weight.grad.dtype == FP32


def test_kwargs_and_float64_inputs() -> None:
    class KW(nn.Module):
        def forward(self, a: torch.Tensor, *, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return a, b, c

    m = nn.Sequential(KW())
    apply_fp32_islands(m, [KW])
    with torch.autocast("cpu", dtype=BF16):
        a, b, c = m[0](_x(2, dtype=BF16), b=_x(2, dtype=BF16), c=_x(2, dtype=torch.float64))
    assert (a.dtype, b.dtype, c.dtype) == (FP32, FP32, torch.float64)


def test_exception_inside_island_restores_autocast() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    m = nn.Sequential(Boom())
    apply_fp32_islands(m, [Boom])
    with torch.autocast("cpu", dtype=BF16):
        with pytest.raises(RuntimeError, match="boom"):
            m(_x(2))
        assert torch.is_autocast_enabled("cpu")


def test_deepcopy_keeps_islands_independent() -> None:
    net = _net()
    apply_fp32_islands(net, [nn.LayerNorm])
    twin = copy.deepcopy(net)
    assert fp32_island_names(twin) == fp32_island_names(net)
    remove_fp32_islands(twin)
    assert fp32_island_names(net) == ["layers.0.ln", "layers.1.ln"]
    x = _x(2, 4, 8)
    with torch.autocast("cpu", dtype=BF16):
        assert torch.equal(net(x), copy.deepcopy(net)(x))


def test_bad_rules_are_refused() -> None:
    with pytest.raises(TypeError, match=re.escape("fp32_modules takes nn.Module classes")):
        apply_fp32_islands(_net(), [3])  # type: ignore[list-item]


@pytest.mark.slow
def test_islands_compile_without_graph_breaks() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    net = _net()
    apply_fp32_islands(net, OpPolicy(fp32_modules=["*.attn"]))
    x = _x(2, 4, 8)
    with torch.autocast("cpu", dtype=BF16):
        eager = net(x)
        compiled = torch.compile(net, backend="aot_eager", fullgraph=True)(x)
        explained = torch._dynamo.explain(net)(x)
    assert compiled.dtype == eager.dtype and torch.equal(compiled, eager)
    assert explained.graph_break_count == 0


# ------------------------------------------------------- islands under the plans
@pytest.mark.parametrize("plan", ["bf16-master", "fp16-master", "bf16-pure", "fp16-pure"])
def test_islands_keep_their_exact_fp32_values_through_prepare(plan: str) -> None:
    from mixprec import MixedPrecision, get_plan

    net = _net()
    with torch.no_grad():
        net.head.weight[0, 0] = 1e5  # inf in fp16, 99840 in bf16
        net.head.weight[0, 1] = 1 + 2**-10 + 2**-12  # not representable in either
    ref = {k: v.clone() for k, v in net.head.state_dict().items()}
    scaling = {"init_scale": 1.0} if plan.startswith("fp16") else {}  # 1e5 * 2**16 overflows fp16 grads
    mp = MixedPrecision(get_plan(plan, fp32_modules=["head"], **scaling))
    net, opt = mp.prepare(net, torch.optim.SGD(net.parameters(), lr=0.0))
    for name, value in net.head.state_dict().items():
        assert value.dtype == FP32
        assert torch.equal(value, ref[name]), f"{plan}: head.{name} was rounded by prepare()"
    assert net.layers[0].ff.weight.dtype == get_plan(plan).compute_dtype
    with mp.autocast():
        loss = net(_x(2, 4, 8)).float().mean()
    mp.backward(loss)
    assert mp.step().stepped
    assert torch.equal(net.head.weight, ref["weight"])  # lr 0: an exact no-op update


@pytest.mark.parametrize("plan", ["bf16-pure", "fp16-pure"])
@pytest.mark.parametrize("rule", ["0", nn.Embedding])
def test_pure_plan_island_fed_integer_ids_hands_its_neighbours_the_model_dtype(plan: str, rule) -> None:
    from mixprec import MixedPrecision, get_plan

    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    table = net[0].weight.detach().clone()
    mp = MixedPrecision(get_plan(plan, fp32_modules=[rule]))
    net, _opt = mp.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    ids = torch.tensor([1, 2, 3])
    with mp.autocast():
        emb = net[0](ids)
        out = net(ids)
    low = get_plan(plan).compute_dtype
    assert emb.dtype == low and torch.equal(emb, F.embedding(ids, table).to(low))
    assert out.dtype == low


def test_a_glob_that_matches_nothing_is_an_error() -> None:
    msg = (
        "fp32_modules glob 'layers.*.atn' matches no module of Net; did you mean 'layers.1.attn', "
        "'layers.0.attn', 'layers.1.attn.qk'? Module names: '', layers, layers.0, layers.0.ln,"
    )
    with pytest.raises(ValueError, match=re.escape(msg)) as info:
        apply_fp32_islands(_net(), OpPolicy(fp32_modules=["layers.*.attn", "layers.*.atn"]))
    assert str(info.value).endswith("... (15 modules). Fix the pattern (globs match qualified names as "
                                    "model.named_modules() gives them, e.g. 'encoder.*.attn')")
    from mixprec import MixedPrecision, get_plan

    net = _net()
    with pytest.raises(ValueError, match=re.escape("fp32_modules glob 'nope' matches no module of Net")):
        MixedPrecision(get_plan("bf16-mixed", fp32_modules=["nope"])).prepare(net)
    assert fp32_island_names(net) == []


def test_pure_input_cast_hands_an_island_first_layer_its_fp32_inputs() -> None:
    from mixprec import get_plan
    from mixprec.islands import install_input_cast

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    x = torch.tensor([[1e5, 1.0, 2.0, 3.0]])  # 1e5 is inf in fp16
    expected = net[0](x).to(torch.float16)
    get_plan("fp16-pure", fp32_modules=["0"]).convert_model(net)
    handles = install_input_cast(net, torch.float16)
    seen: dict[str, torch.Tensor] = {}
    net[0].register_forward_hook(lambda m, a, o: seen.setdefault("island", o))
    out = net(x)
    assert out.dtype == torch.float16
    assert torch.equal(seen["island"], expected)  # not -inf: the island saw 1e5
    for h in handles:
        h.remove()
    root_island = nn.Linear(4, 2)
    apply_fp32_islands(root_island, OpPolicy(fp32_modules=[""]))
    assert install_input_cast(root_island, torch.float16) == []  # a whole-model island takes inputs as they are

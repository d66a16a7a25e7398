"""Unusual parameters under every plan: trained with the plan's semantics, or refused at
``prepare`` with the value and the fix, never a torch-internal error mid-training.

- parameters the optimizer gains later (``add_param_group``, also on the inner optimizer
  of a master-weight wrapper): they get fp32 masters and train as if given at prepare;
- a parameter shared by two optimizers: refused before the model is converted;
- sparse embedding gradients: trained where the plan keeps fp32 weights or masters,
  refused (naming ``nn.Embedding(sparse=True)``) where the wrapper expands them densely;
- complex, fp64 and zero-element parameters; an empty ``nn.Linear`` under fp8;
- a model cast after ``prepare`` (``model.to(dtype)``): a clear error naming the fix;
- the compiled optimizer route: a compilation that fails or is interrupted is not
  recorded as a compiled layout.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

from mixprec import PLANS, MixedPrecision, get_plan
from mixprec.fp8 import Fp8Linear, convert_to_fp8
from mixprec.optim import KahanOptimizer, MasterWeightOptimizer, StochasticRoundingOptimizer

_MASTER = ("bf16-master", "fp16-master")
_DENSE_ONLY = ("bf16-pure", "fp16-pure", "bf16-kahan", "bf16-sr")  # wrappers that expand gradients densely
_CAST_INPUTS = ("bf16-pure", "fp16-pure")  # no autocast: the model's inputs are cast for it


def _inner(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(opt, "optimizer", opt)


def _train(mp: MixedPrecision, model: nn.Module, batches: list[torch.Tensor]) -> list[bool]:
    stepped = []
    for x in batches:
        with mp.autocast():
            loss = model(x).float().pow(2).mean()
        mp.backward(loss)
        stepped.append(mp.step().stepped)
    return stepped


def _batches(n: int = 3, width: int = 16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(4, width, generator=gen) for _ in range(n)]


# ------------------------------------------------------------ parameters added later
def _two_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("where", ["inner", "wrapper"])
def test_param_group_added_after_prepare_trains_as_if_given_at_prepare(plan, where):
    """A group added after prepare (on the wrapper, or on the inner optimizer a framework
    holds) trains bit for bit as the same group given at prepare: under master plans it gets
    an fp32 master seeded with the exact fp32 values the conversion cast down."""
    ref_model = _two_layers()
    ref_opt = torch.optim.AdamW(
        [{"params": ref_model[0].parameters()}, {"params": ref_model[2].parameters(), "lr": 3e-4}], lr=1e-3
    )
    ref_mp = MixedPrecision(plan)
    ref_model, ref_opt = ref_mp.prepare(ref_model, ref_opt)
    ref_stepped = _train(ref_mp, ref_model, _batches())

    model = _two_layers()
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, torch.optim.AdamW(model[0].parameters(), lr=1e-3))
    target = _inner(opt) if where == "inner" else opt
    target.add_param_group({"params": list(model[2].parameters()), "lr": 3e-4})
    assert _train(mp, model, _batches()) == ref_stepped
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q), plan
    if plan in _MASTER:
        assert all(opt.master_of(p) is not None for p in model[2].parameters())
        assert all(m.dtype == torch.float32 for g in opt.param_groups for m in g["params"])
        for a, b in zip(opt.masters, ref_opt.masters, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("where", ["inner", "wrapper"])
def test_param_group_added_after_prepare_under_remainders_is_seeded_exactly(where):
    """Remainder masters of a group added after prepare start from the exact fp32 values the
    conversion cast down, as bf16-master's masters do: the run stays bit-identical to it."""
    ref_model = _two_layers()
    ref_opt = torch.optim.AdamW(
        [{"params": ref_model[0].parameters()}, {"params": ref_model[2].parameters(), "lr": 3e-4}], lr=1e-3
    )
    ref_mp = MixedPrecision("bf16-master")
    ref_model, ref_opt = ref_mp.prepare(ref_model, ref_opt)
    ref_stepped = _train(ref_mp, ref_model, _batches())

    model = _two_layers()
    mp = MixedPrecision(get_plan("bf16-master", remainders=True))
    model, opt = mp.prepare(model, torch.optim.AdamW(model[0].parameters(), lr=1e-3))
    target = _inner(opt) if where == "inner" else opt
    target.add_param_group({"params": list(model[2].parameters()), "lr": 3e-4})
    assert _train(mp, model, _batches()) == ref_stepped
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.master(p), ref_opt.master_of(q))
    copied = copy.deepcopy(opt)  # the seeds are prepare()'s: a copy neither keeps nor needs them
    assert copied._seeds is None


@pytest.mark.parametrize("plan", _MASTER)
def test_inner_add_param_group_small_updates_are_not_rounded_away(plan):
    """The symptom of the bug: without a master a low-precision weight never moves when each
    update is below half a unit in its last place; with the master it accumulates them."""
    model = _two_layers()
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, torch.optim.SGD(model[0].parameters(), lr=1e-6))
    opt.optimizer.add_param_group({"params": [model[2].weight]})
    before = model[2].weight.detach().clone()
    master_before = None
    for x in _batches(4):
        with mp.autocast():
            loss = model(x).float().pow(2).mean()
        mp.backward(loss)
        mp.step()
        if master_before is None:
            master_before = opt.master_of(model[2].weight).detach().clone()
    assert opt.master_of(model[2].weight) is not None
    assert not torch.equal(opt.master_of(model[2].weight), master_before)  # the fp32 master moves
    assert torch.equal(model[2].weight.detach(), opt.master_of(model[2].weight).to(before.dtype))


def test_inner_add_param_group_state_dict_and_copies():
    """Saved before the first step, the added group's masters are in the state dict; a
    pickled or deep-copied wrapper (the weak reference to prepare's seeds dropped) works."""
    model = _two_layers()
    mp = MixedPrecision("bf16-master")
    model, opt = mp.prepare(model, torch.optim.AdamW(model[0].parameters(), lr=1e-3))
    opt.optimizer.add_param_group({"params": list(model[2].parameters())})
    sd = opt.state_dict()
    assert len(sd["mixprec_master_weights"]) == 4
    assert [m.dtype for m in sd["mixprec_master_weights"]] == [torch.float32] * 4
    clone = pickle.loads(pickle.dumps(opt))
    assert len(clone.masters) == 4
    assert len(copy.deepcopy(opt).masters) == 4


def test_inner_add_param_group_of_a_parameter_with_a_master_is_refused():
    model = _two_layers()
    mp = MixedPrecision("bf16-master")
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    opt.optimizer.add_param_group({"params": [model[0].weight]})  # torch sees the master, not this
    with pytest.raises(ValueError, match="list each parameter once"):
        opt.step()


# ------------------------------------------------------------ shared parameters
@pytest.mark.parametrize("plan", PLANS)
def test_parameter_shared_by_two_optimizers_is_refused_before_conversion(plan):
    model = _two_layers()
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    second = torch.optim.Adam(model[2].parameters(), lr=0.1)
    mp = MixedPrecision(plan)
    with pytest.raises(ValueError, match=r"parameter '2\.weight' is held by two optimizers .*one optimizer"):
        mp.prepare(model, first, second)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing was converted
    assert mp.model is None
    mp.prepare(model, first)  # the fix: each parameter in one optimizer


@pytest.mark.parametrize("plan", ["fp16-mixed", "bf16-master"])
def test_parameter_shared_across_prepare_optimizers_calls_is_refused(plan):
    model = _two_layers()
    mp = MixedPrecision(plan)
    model = mp.prepare_model(model)
    mp.prepare_optimizers(torch.optim.SGD(model[0].parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"parameter '0\.bias' is held by two optimizers"):
        mp.prepare_optimizers(torch.optim.SGD([model[0].bias, model[2].weight], lr=0.1))
    assert len(mp.optimizers) == 1
    mp.prepare_optimizers(torch.optim.SGD(model[2].parameters(), lr=0.1))  # disjoint: fine
    assert len(mp.optimizers) == 2


@pytest.mark.parametrize("plan", ["bf16-mixed", "bf16-master", "bf16-kahan"])
def test_parameter_added_to_one_optimizer_then_given_to_another_is_refused(plan):
    model = _two_layers()
    mp = MixedPrecision(plan)
    model = mp.prepare_model(model)
    first = mp.prepare_optimizers(torch.optim.SGD(model[0].parameters(), lr=0.1))
    _inner(first).add_param_group({"params": [model[2].weight]})
    with pytest.raises(ValueError, match=r"parameter '2\.weight' is held by two optimizers .*optimizer 1"):
        mp.prepare_optimizers(torch.optim.SGD(model[2].parameters(), lr=0.1))


# ------------------------------------------------------------ sparse gradients
def _embedding_model(sparse: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(20, 16, sparse=sparse), nn.Linear(16, 16))


def _train_tokens(mp: MixedPrecision, model: nn.Module, steps: int = 3) -> list[bool]:
    gen = torch.Generator().manual_seed(2)
    out = []
    for _ in range(steps):
        with mp.autocast():
            loss = model(torch.randint(0, 20, (6,), generator=gen)).float().pow(2).mean()
        mp.backward(loss)
        out.append(mp.step().stepped)
    return out


@pytest.mark.parametrize("plan", _DENSE_ONLY)
def test_sparse_embedding_refused_at_prepare_where_gradients_expand_densely(plan):
    model = _embedding_model()
    mp = MixedPrecision(plan)
    with pytest.raises(ValueError, match=r"Embedding '0'.*sparse=True.*sparse=False"):
        mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # refused before converting
    # the fixes it names: dense gradients, or the embedding kept in fp32
    dense = _embedding_model(sparse=False)
    mp = MixedPrecision(plan)
    dense, opt = mp.prepare(dense, torch.optim.SGD(dense.parameters(), lr=0.1))
    assert any(_train_tokens(mp, dense))
    island = _embedding_model()
    mp = MixedPrecision(get_plan(plan, fp32_modules=[nn.Embedding]))
    island, opt = mp.prepare(island, torch.optim.SGD(island.parameters(), lr=0.1))
    before = island[0].weight.detach().clone()
    assert island[0].weight.dtype == torch.float32
    assert any(_train_tokens(mp, island))
    assert not torch.equal(island[0].weight, before)


@pytest.mark.parametrize("plan", [p for p in PLANS if p not in _DENSE_ONLY])
def test_sparse_embedding_trains_where_the_plan_keeps_fp32(plan):
    model = _embedding_model()
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = model[0].weight.detach().clone()
    assert any(_train_tokens(mp, model, steps=4))
    assert not torch.equal(model[0].weight, before)


def test_frozen_sparse_embedding_is_accepted_by_pure_plans():
    model = _embedding_model()
    model[0].weight.requires_grad_(False)
    mp = MixedPrecision("bf16-pure")
    model, opt = mp.prepare(model, torch.optim.SGD(model[1].parameters(), lr=0.1))
    assert any(_train_tokens(mp, model))


# ------------------------------------------------------------ complex parameters
class _ComplexNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 16)
        self.phase = nn.Parameter(torch.randn(16, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * self.phase).abs()


@pytest.mark.parametrize("plan", PLANS)
def test_complex_parameters_train_under_every_plan(plan):
    """complex64 parameters keep their dtype under every plan (there is no low-precision
    complex dtype to compute in) and are updated as fp32 parameters are."""
    model = _ComplexNet()
    mp = MixedPrecision(plan, clip_grad_norm=1.0)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    before = model.phase.detach().clone()
    assert any(_train(mp, model, _batches(4)))
    assert model.phase.dtype == torch.complex64
    assert not torch.equal(model.phase, before)
    assert torch.isfinite(torch.view_as_real(model.phase)).all()


def test_complex_fp32_plan_equals_plain_torch():
    model, ref = _ComplexNet(), _ComplexNet()
    mp = MixedPrecision("fp32")
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    norms = []
    for x in _batches(3):
        mp.backward(model(x).pow(2).mean())
        norms.append(mp.step().grad_norm)
        ref(x).pow(2).mean().backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")))
        ref_opt.step()
        ref_opt.zero_grad()
        assert norms[-1] == pytest.approx(ref_norm, rel=1e-6)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("plan", ["fp16-mixed", "fp16-master", "bf16-mixed"])
def test_nonfinite_complex_gradient_skips_the_step(plan):
    model = _ComplexNet()
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    before = [p.detach().clone() for p in model.parameters()]
    with mp.autocast():
        loss = model(_batches(1)[0]).float().pow(2).mean()
    mp.backward(loss)
    model.phase.grad[3] = complex(float("inf"), 0.0)
    result = mp.step()
    assert result.skipped and result.skip_reason == "overflow"
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)


# ------------------------------------------------------------ fp64 models
@pytest.mark.parametrize("plan", ["fp32", "tf32", "bf16-mixed", "fp16-mixed"])
def test_fp64_model_steps_under_plans_that_keep_its_weights(plan):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)).double()
    mp = MixedPrecision(plan, clip_grad_norm=0.5)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    results = []
    for x in _batches(3):
        with mp.autocast():
            loss = model(x.double()).float().pow(2).mean()
        mp.backward(loss)
        results.append(mp.step())
    assert any(r.stepped for r in results)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert all(r.grad_norm is None or r.grad_norm > 0 for r in results)
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_fp64_model_under_fp32_plan_equals_plain_torch():
    torch.manual_seed(0)
    model = nn.Linear(16, 4).double()
    ref = copy.deepcopy(model)
    mp = MixedPrecision("fp32")
    model, opt = mp.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for x in _batches(3):
        mp.backward(model(x.double()).pow(2).mean())
        result = mp.step()
        ref(x.double()).pow(2).mean().backward()
        expected = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")))
        ref_opt.step()
        ref_opt.zero_grad()
        assert result.grad_norm == pytest.approx(expected, rel=1e-6)
    assert torch.equal(model.weight, ref.weight) and torch.equal(model.bias, ref.bias)


# ------------------------------------------------------------ zero-element parameters
class _WithEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 16)
        self.empty = nn.Parameter(torch.zeros(0, 16))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Initializing zero-element tensors is a no-op"
            self.head = nn.Linear(16, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.empty.sum() + self.head(x).sum()


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW])
def test_zero_element_parameters_train_under_every_plan(plan, optimizer):
    model = _WithEmpty()
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, optimizer(model.parameters(), lr=1e-2))
    before = model.fc.weight.detach().clone()
    assert any(_train(mp, model, _batches(3)))
    assert model.empty.shape == (0, 16) and model.head.weight.shape == (0, 16)
    assert not torch.equal(model.fc.weight, before)


@pytest.mark.parametrize("shape", [(16, 0), (0, 16), (0, 0)])
@pytest.mark.parametrize("bias", [True, False])
def test_empty_fp8_linear_matches_linear(shape, bias):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = Fp8Linear(*shape, bias=bias)
        ref = nn.Linear(*shape, bias=bias)
    ref.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("fp8_")})
    x = torch.randn(3, 5, shape[0], requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    y, yr = layer(x), ref(xr)
    assert y.shape == yr.shape == (3, 5, shape[1])
    assert torch.equal(y, yr)
    y.sum().backward()
    yr.sum().backward()
    assert torch.equal(x.grad, xr.grad)
    assert torch.equal(layer.weight.grad, ref.weight.grad)
    if bias:
        assert torch.equal(layer.bias.grad, ref.bias.grad)


def test_convert_to_fp8_leaves_empty_linear_layers():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 0))
    convert_to_fp8(model)
    assert [type(m) for m in model] == [Fp8Linear, nn.Linear]


# ------------------------------------------------------------ a model cast after prepare
def _normed() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 16))


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_model_cast_after_prepare_is_a_clear_error(plan, dtype):
    model = _normed()
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    prepared = [p.dtype for p in model.parameters()]
    model.to(dtype)
    if [p.dtype for p in model.parameters()] == prepared:  # the cast changed nothing
        assert any(_train(mp, model, _batches(2)))
        return
    with pytest.raises(RuntimeError, match=r"autocast\(\): parameter '.*' was prepared as .*prepare it again"), mp.autocast():
        pass
    # the fix it names: prepare the model again, for its new dtypes
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert any(_train(mp, model, _batches(2)))


def test_model_cast_between_backward_and_step_is_caught_at_step():
    model = _normed()
    mp = MixedPrecision("bf16-master")
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    with mp.autocast():
        loss = model(_batches(1)[0]).float().pow(2).mean()
    mp.backward(loss)
    before = [m.detach().clone() for m in opt.masters]
    model.float()
    with pytest.raises(RuntimeError, match=r"step\(\): parameter '0.weight' was prepared as torch.bfloat16"):
        mp.step()
    assert all(torch.equal(m, b) for m, b in zip(opt.masters, before, strict=True))


# ------------------------------------------------------------ compiled route bookkeeping
def _large_param() -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.randn(64, 64).bfloat16())
    p.grad = torch.randn(64, 64).bfloat16()
    return p


def _raising(exc: BaseException):
    def compiled(fn, **kwargs):
        def run(*args, **kw):
            raise exc

        return run

    return compiled


@pytest.mark.parametrize("cls", [KahanOptimizer, StochasticRoundingOptimizer])
def test_interrupted_compile_records_no_layout(cls, monkeypatch):
    """A Ctrl-C while the compiled update compiles leaves nothing stepped and no layout
    recorded as compiled: the checkpoint and the layout budgets are as before."""
    import mixprec.optim.compiled as compiled

    monkeypatch.setattr(compiled, "_LAYOUTS", set())
    monkeypatch.setattr(compiled, "compiled", _raising(KeyboardInterrupt()))
    p = _large_param()
    opt = cls(torch.optim.AdamW([p], lr=1e-2), compile=True)
    before = p.detach().clone()
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert torch.equal(p, before)
    assert opt.state_dict()[opt._STATE_KEY]["compiled_layouts"] == []
    assert not compiled._LAYOUTS


def test_failed_compile_records_no_layout_and_steps_eagerly(monkeypatch):
    import mixprec.optim.compiled as compiled
    import mixprec.optim.routing as routing

    monkeypatch.setattr(compiled, "_LAYOUTS", set())
    monkeypatch.setattr(compiled, "compiled", _raising(torch._dynamo.exc.TorchDynamoException("no compiler")))
    monkeypatch.setattr(routing, "use_compiled_route", lambda *args, **kwargs: True)
    monkeypatch.setattr(routing, "mark_compile_failed", lambda *args: None)  # keep the process's compiler usable
    p, q = _large_param(), _large_param()
    with torch.no_grad():
        q.copy_(p)
    q.grad = p.grad.clone()
    auto = KahanOptimizer(torch.optim.AdamW([p], lr=1e-2), compile="auto")
    eager = KahanOptimizer(torch.optim.AdamW([q], lr=1e-2), compile=False)
    auto.step()
    eager.step()
    assert torch.equal(p, q)
    assert auto.state_dict()[auto._STATE_KEY]["compiled_layouts"] == []
    assert not compiled._LAYOUTS
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):  # compile=True: the cause is raised
        KahanOptimizer(torch.optim.AdamW([q], lr=1e-2), compile=True).step()
    assert not compiled._LAYOUTS


def test_masters_of_a_plain_wrapper_are_unchanged_by_the_seed_lookup():
    """MasterWeightOptimizer built by hand (no prepare seeds) still works, and add_param_group
    starts the new master from the weight."""
    model = _two_layers()
    values = {p: p.detach().clone() for p in model[0].parameters()}
    model.to(torch.bfloat16)
    opt = MasterWeightOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), master_values=values)
    opt.add_param_group({"params": [model[2].weight]})
    assert torch.equal(opt.master_of(model[2].weight), model[2].weight.float())
    assert torch.equal(opt.master_of(model[0].weight), values[model[0].weight])

"""A prepared model stays an ordinary module (DESIGN.md, additions for the field).

For every plan, with and without fp32 islands and overflow tracing, a model prepared by
``MixedPrecision.prepare``:

- ``copy.deepcopy`` gives a copy that computes what the original computes, with its own
  weights; the copy's hooks reach the copy, never the original nor the run's session
  objects (tracer, buffer guard): a copy (an EMA or evaluation copy) is not part of the run;
- ``torch.save`` then ``torch.load(weights_only=False)`` gives back a model that computes
  the same outputs;
- ``state_dict`` / ``load_state_dict`` of a copy behave as for the original.
"""

from __future__ import annotations

import copy
import gc
import io
import types
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from mixprec import PLANS, MixedPrecision, get_plan
from mixprec.buffers import BufferGuard
from mixprec.islands import fp32_island_names, is_fp32_island
from mixprec.tracing import OverflowTracer

_NO_ISLANDS = {"fp32", "tf32"}  # no low-precision compute: fp32 islands are refused there


class Net(nn.Module):
    """Tiny: fp8-eligible Linears (multiples of 16), a LayerNorm (the island), a BatchNorm (buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.norm(self.fc1(x)))))


VARIANTS = [
    pytest.param((plan, islands, trace), id=plan + ("-islands" if islands else "") + ("-trace" if trace else ""))
    for plan in PLANS
    for islands in (False, True)
    for trace in (False, True)
    if not (islands and plan in _NO_ISLANDS)
]


def make(variant: tuple[str, bool, bool], **options: Any) -> tuple[MixedPrecision, nn.Module, Any]:
    plan_name, islands, trace = variant
    torch.manual_seed(0)
    plan = get_plan(plan_name, fp32_modules=(nn.LayerNorm,)) if islands else get_plan(plan_name)
    mp = MixedPrecision(plan, trace_overflow=trace, **options)
    net = Net()
    model, opt = mp.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert model is net
    if islands:
        assert fp32_island_names(model) == ["norm"]
    return mp, model, opt


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)) for _ in range(n)]


def train_step(mp: MixedPrecision, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, Any]:
    with mp.autocast():
        loss = nn.functional.mse_loss(model(x).float(), y)
    mp.backward(loss)
    result = mp.step()
    return loss.item(), (result.stepped, result.skipped, result.scale, result.overflow)


def run(mp: MixedPrecision, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), mp.autocast():  # fp32 inputs: the pure plans' models cast them
        return model(x)


def trained(variant: tuple[str, bool, bool]) -> tuple[MixedPrecision, nn.Module, torch.Tensor]:
    """A model after two steps, in eval mode, and an input."""
    mp, model, _ = make(variant)
    for x, y in batches(2):
        train_step(mp, model, x, y)
    model.eval()
    return mp, model, torch.randn(4, 16)


def zero_(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def detached_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_like(twin: nn.Module, model: nn.Module) -> None:
    """Same class, same islands, same dtypes, same state; parameters of its own."""
    assert type(twin) is type(model)
    assert fp32_island_names(twin) == fp32_island_names(model)
    assert all(is_fp32_island(t) == is_fp32_island(m) for t, m in zip(twin.modules(), model.modules(), strict=True))
    assert same_state(detached_state(twin), detached_state(model))
    assert not {id(p) for p in twin.parameters()} & {id(p) for p in model.parameters()}


# ------------------------------------------------------------------ deepcopy
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_deepcopy_computes_with_its_own_weights(variant):
    mp, model, x = trained(variant)
    want = run(mp, model, x)
    twin = copy.deepcopy(model)
    check_like(twin, model)
    assert torch.equal(run(mp, twin, x), want)
    zero_(twin)
    assert torch.equal(run(mp, twin, x), torch.zeros_like(want))
    assert torch.equal(run(mp, model, x), want)  # the original still computes with its weights


def _reachable(root: Any) -> dict[int, Any]:
    """Objects reachable from ``root`` through attributes, containers, closures, bound methods
    and weak references (never through classes, modules or functions' globals)."""
    seen: dict[int, Any] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen[id(obj)] = obj
        if obj is None or isinstance(obj, type | types.ModuleType | str | bytes | int | float | torch.dtype):
            continue
        if isinstance(obj, types.FunctionType):
            stack.extend(c.cell_contents for c in obj.__closure__ or () if c.cell_contents is not None)
            stack.extend(obj.__defaults__ or ())
            stack.extend((obj.__kwdefaults__ or {}).values())
            continue
        if isinstance(obj, types.MethodType):
            stack.extend((obj.__self__, obj.__func__))
            continue
        if isinstance(obj, weakref.ref):
            target = obj()
            if target is not None:
                stack.append(target)
            continue
        if isinstance(obj, torch.Tensor):  # its hooks only (data is no reference)
            stack.extend((getattr(obj, "_backward_hooks", None) or {}).values())
            stack.extend((getattr(obj, "_post_accumulate_grad_hooks", None) or {}).values())
            continue
        stack.extend(gc.get_referents(obj))
    return seen


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_deepcopy_reaches_neither_the_original_nor_the_run(variant):
    mp, model, x = trained(variant)
    twin = copy.deepcopy(model)
    forbidden = {
        id(o): o
        for o in (
            mp, *mp.optimizers, *model.modules(), *model.parameters(), *model.buffers(),
            *[getattr(o, "optimizer", None) for o in mp.optimizers],
        )
        if o is not None
    }
    reached = _reachable(twin)
    assert not [type(o).__name__ for i, o in forbidden.items() if i in reached], "the copy reaches the original"
    # session objects belong to the run, not to copies (not even copies of them)
    session = [type(o).__name__ for o in reached.values() if isinstance(o, BufferGuard | OverflowTracer | MixedPrecision)]
    assert not session, "the copy carries the run's session objects"


@pytest.mark.parametrize("variant", VARIANTS)
def test_an_ema_copy_is_not_part_of_the_run(variant):
    """A copy trained on, overflowing and loaded at every step changes neither the run's
    losses, step results, weights and buffers, nor what its tracer finds."""

    def session(with_copy: bool) -> tuple[Any, ...]:
        mp, model, _ = make(variant)
        results, ema = [], None
        for x, y in batches(3):
            results.append(train_step(mp, model, x, y))
            if not with_copy:
                continue
            if ema is None:
                ema = copy.deepcopy(model)
            live = model.state_dict()
            blend = {
                k: v.lerp(live[k].to(v.dtype), 0.5) if v.is_floating_point() else v
                for k, v in ema.state_dict().items()
            }
            ema.load_state_dict(blend)  # fp32 values into a low-precision copy: no master follows
            with mp.autocast():  # the copy trains too (BatchNorm statistics, gradients)
                ema(x).float().pow(2).mean().backward()
        if with_copy:
            with mp.autocast():  # an overflow in the copy is the copy's, not the run's
                ema(torch.full((8, 16), float("inf"))).float().sum().backward()
        finding = mp.tracer.first_overflow() if mp.tracer is not None else None
        return results, detached_state(model), finding, mp.state_dict()["scaler"]

    want, got = session(False), session(True)
    assert got[0] == want[0]
    assert same_state(got[1], want[1])
    assert got[2] == want[2]
    assert got[3] == want[3]


def test_the_original_is_still_traced_after_a_copy():
    mp, model, x = trained(("bf16-pure", False, True))
    twin = copy.deepcopy(model)
    run(mp, twin, torch.full_like(x, float("inf")))
    assert mp.tracer.first_overflow() is None
    run(mp, model, torch.full_like(x, float("inf")))
    finding = mp.tracer.first_overflow()
    assert finding is not None and finding.direction == "forward" and finding.in_input  # the batch held the inf


@pytest.mark.parametrize(
    "plan",
    [p for p in PLANS if get_plan(p).supports_optimizer_in_backward and get_plan(p).scaling.kind == "none"],
)
def test_a_copy_of_an_optimizer_in_backward_model_does_not_step_the_run(plan):
    mp, model, _ = make((plan, False, False), optimizer_in_backward=True)
    x, y = batches(1)[0]
    before = detached_state(model)
    twin = copy.deepcopy(model)
    with mp.autocast():
        twin(x).float().pow(2).mean().backward()
    assert same_state(detached_state(model), before)
    train_step(mp, model, x, y)  # the run still updates in backward
    assert not same_state(detached_state(model), before)


# ---------------------------------------------------------------- torch.save
def save_load(model: nn.Module) -> Any:
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("variant", VARIANTS)
def test_torch_save_and_load_give_back_the_model(variant):
    mp, model, x = trained(variant)
    want = run(mp, model, x)
    loaded = save_load(model)
    check_like(loaded, model)
    assert torch.equal(run(mp, loaded, x), want)
    zero_(loaded)
    assert torch.equal(run(mp, loaded, x), torch.zeros_like(want))
    assert torch.equal(run(mp, model, x), want)
    # a copy of what was loaded pickles again
    again = save_load(copy.deepcopy(loaded))
    assert torch.equal(run(mp, again, x), torch.zeros_like(want))
    # and the run goes on
    model.train()
    train_step(mp, model, *batches(1)[0])


@pytest.mark.parametrize("variant", VARIANTS)
def test_torch_save_between_forward_and_step(variant):
    """Saved mid-step (the tracer and the buffer guard hold the step's records and snapshot):
    the loaded model is the model as it was then, and the run goes on as without the save."""

    def session(save: bool) -> tuple[Any, ...]:
        mp, model, _ = make(variant)
        (x, y), (x2, y2) = batches(2)
        with mp.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        loaded = save_load(model) if save else None
        then = detached_state(model)
        mp.backward(loss)
        first = mp.step()
        if loaded is not None:
            assert same_state(detached_state(loaded), then)
            with mp.autocast():  # the loaded model trains on its own
                loaded(torch.full_like(x, float("inf"))).float().sum().backward()
        second = train_step(mp, model, x2, y2)
        finding = mp.tracer.first_overflow() if mp.tracer is not None else None
        return (first.stepped, first.scale), second, detached_state(model), finding

    want, got = session(False), session(True)
    assert got[:2] == want[:2] and got[3] == want[3]
    assert same_state(got[2], want[2])


# ------------------------------------------------------- state_dict of a copy
@pytest.mark.parametrize("variant", VARIANTS)
def test_state_dict_of_a_copy_behaves_as_for_the_original(variant):
    mp, model, x = trained(variant)
    state = detached_state(model)
    twin = copy.deepcopy(model)
    assert same_state(detached_state(twin), state)
    changed = {k: (v.float() * 0.5 + 0.25 if v.is_floating_point() else v) for k, v in state.items()}
    twin.load_state_dict(changed)
    assert same_state(detached_state(model), state)  # the original is untouched
    # the copy took the values as a freshly prepared model of the same kind takes them
    _, fresh, _ = make(variant)
    fresh.eval()
    fresh.load_state_dict(changed)
    assert same_state(detached_state(twin), detached_state(fresh))
    assert torch.equal(run(mp, twin, x), run(mp, fresh, x))
    # the original's own state dict loads into the copy, and the copy's into the original
    twin.load_state_dict(state)
    assert torch.equal(run(mp, twin, x), run(mp, model, x))
    model.load_state_dict(detached_state(twin))
    assert same_state(detached_state(model), state)

"""A new plan is one file plus one registry line: a toy plan defined only here runs through
the session, DDP and the memory estimate without any change to mixprec.

The toy plan keeps fp32 weights and computes in bf16 under autocast (bf16-mixed's
numerics), wraps the optimizer in its own wrapper that keeps an fp32 running average
of the weights (extra optimizer-side state the memory estimate must count), and keeps
its own non-finite flag that can veto a step (as fp8 layers do).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision, get_plan, register_plan
from mixprec.optim import WrappedOptimizer
from mixprec.plans import MixedPlan, Plan, unregister_plan
from tests._dist import run_ranks

TOY = "toy-bf16-avg"


class AveragingOptimizer(WrappedOptimizer):
    """Steps the inner optimizer, then updates an fp32 running average of every parameter."""

    def __init__(self, optimizer: torch.optim.Optimizer, decay: float = 0.5) -> None:
        super().__init__(optimizer)
        self.decay = decay
        self.average = {p: p.detach().float().clone() for g in optimizer.param_groups for p in g["params"]}
        self.steps = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        out = self.optimizer.step(closure)
        self.steps += 1
        for p, avg in self.average.items():
            avg.mul_(self.decay).add_(p.float(), alpha=1 - self.decay)
        return out

    def state_bytes(self) -> dict[str, int]:
        inner = super().state_bytes()
        own = sum(t.numel() * t.element_size() for t in self.average.values())
        return {**inner, "optimizer_state": inner.get("optimizer_state", 0) + own}

    def state_tensors(self) -> Iterator[torch.Tensor]:
        yield from super().state_tensors()
        yield from self.average.values()


@dataclass(frozen=True)
class ToyPlan(MixedPlan):
    """bf16 autocast, fp32 weights, a weight-averaging optimizer and a plan-level veto flag."""

    family: ClassVar[str] = "toy"
    summary: ClassVar[str] = "bf16 compute, fp32 weights, fp32 running average of the weights"
    supports_fsdp: ClassVar[bool] = False

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, fp32_values: dict[Any, Any]) -> Any:
        return AveragingOptimizer(optimizer)

    def nonfinite_flag(self, model: nn.Module) -> torch.Tensor | None:
        return getattr(model, "toy_veto", None)

    def after_step(self, model: nn.Module) -> None:
        flag = getattr(model, "toy_veto", None)
        if flag is not None:
            flag.zero_()


@pytest.fixture(autouse=True)
def _registered():
    register_plan(TOY, lambda: ToyPlan(TOY, compute_dtype=torch.bfloat16))
    yield
    unregister_plan(TOY)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(n)]


def _train(plan: str, model: nn.Module, batches: list[Any], **prepare: Any) -> tuple[MixedPrecision, Any, list[float]]:
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), **prepare)
    losses = []
    for x, y in batches:
        with mp.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        mp.backward(loss)
        mp.step()
        losses.append(loss.item())
    return mp, opt, losses


def test_the_toy_plan_trains_through_the_session_like_the_plan_it_extends() -> None:
    base = _model()
    mp, opt, losses = _train(TOY, copy.deepcopy(base), _batches())
    _, _, reference = _train("bf16-mixed", copy.deepcopy(base), _batches())
    assert losses == reference  # same numerics: bf16 autocast, fp32 weights
    assert isinstance(opt, AveragingOptimizer) and opt.steps == 4
    assert mp.plan.name == TOY and mp.optimizer_steps == 4
    assert "fp32 running average" in get_plan(TOY).explain()


def test_the_toy_plans_own_flag_vetoes_a_step_through_the_session() -> None:
    model = _model()
    model.toy_veto = torch.zeros((), dtype=torch.bool)  # type: ignore[assignment]
    mp = MixedPrecision(TOY)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batches(1)[0]
    with mp.autocast():
        loss = nn.functional.cross_entropy(model(x), y)
    mp.backward(loss)
    model.toy_veto.fill_(True)
    result = mp.step()
    assert result.skip_reason == "nonfinite_plan" and opt.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not bool(model.toy_veto)  # after_step ran


def test_the_memory_estimate_counts_the_toy_wrappers_state_and_matches_the_measurement() -> None:
    from mixprec.diagnostics import estimate_memory, measure_memory

    model = _model()
    n = sum(p.numel() for p in model.parameters())
    est = estimate_memory(model, TOY, optimizer="sgd")
    plain = estimate_memory(model, "bf16-mixed", optimizer="sgd")
    assert est.plan == TOY
    assert est.bytes["optimizer_state"] - plain.bytes["optimizer_state"] == 4 * n  # the fp32 averages
    assert est.bytes["weights"] == plain.bytes["weights"] == 4 * n
    meas = measure_memory(_model, TOY, lambda: torch.randn(6, 8), optimizer="sgd")
    assert meas.bytes["optimizer_state"] == est.bytes["optimizer_state"]


def test_a_plan_that_does_not_support_fsdp_is_refused_by_name() -> None:
    from mixprec.distributed import fsdp_policy

    with pytest.raises(ValueError, match=r"toy-bf16-avg.*not supported under FSDP2"):
        fsdp_policy(TOY)


def _ddp_worker(rank: int, world_size: int) -> None:
    register_plan(TOY, lambda: ToyPlan(TOY, compute_dtype=torch.bfloat16))
    batches = _batches(4)
    shard = [(x[rank::world_size], y[rank::world_size]) for x, y in batches]
    mp, opt, _ = _train(TOY, _model(), shard, ddp=True)
    assert mp.is_ddp and isinstance(opt, AveragingOptimizer) and opt.steps == 4
    flat = torch.cat([p.detach().reshape(-1) for p in mp.model.parameters()])  # type: ignore[union-attr]
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered), "replicas diverged"
    # DDP averages the gradients of the halves: exactly one process accumulating the same halves
    ref_mp = MixedPrecision("bf16-mixed", grad_accum_steps=world_size)
    reference = _model()
    reference, ref_opt = ref_mp.prepare(reference, torch.optim.SGD(reference.parameters(), lr=0.1))
    for x, y in batches:
        for r in range(world_size):
            with ref_mp.autocast():
                loss = nn.functional.cross_entropy(reference(x[r::world_size]), y[r::world_size])
            ref_mp.backward(loss)
            ref_mp.step()
    ref = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    assert torch.equal(flat, ref)


@pytest.mark.distributed
def test_the_toy_plan_runs_under_ddp() -> None:
    run_ranks(_ddp_worker, 2)


def test_a_registered_name_must_be_new_and_built_ins_stay() -> None:
    for taken in ("bf16-mixed", "BF16-MIXED", "o1", "Fp32", "16-TRUE"):  # names resolve without regard to case
        with pytest.raises(ValueError, match="is taken"):
            register_plan(taken, lambda: ToyPlan("x"))
    with pytest.raises(ValueError, match="built-in plan"):
        unregister_plan("bf16-mixed")
    register_plan("toy-broken", lambda: "not a plan")  # type: ignore[arg-type,return-value]
    try:
        with pytest.raises(TypeError, match="returned str, not a Plan"):
            get_plan("toy-broken")
    finally:
        unregister_plan("toy-broken")
    assert isinstance(get_plan(TOY), Plan)

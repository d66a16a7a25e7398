"""Every plan under DDP, two ways: ``prepare(..., ddp=True)`` and a DDP that a framework wraps
around the model after ``prepare_model`` (as Accelerate does). Replicas must stay bit-identical
after every step and equal one process on the concatenated batch within the plan's tolerance."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from mixprec import MixedPrecision, get_plan
from mixprec.optim import native
from tests._dist import run_ranks

WORLD, STEPS, PER_RANK = 2, 4, 4
PLANS = (
    "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-pure", "fp16-pure",
    "bf16-kahan", "bf16-sr", "fp8-mixed",
)
# Max abs difference of any weight vs one process after the run (SGD with momentum): DDP
# averages gradients in another order and, under autocast, computes on half batches (other
# GEMM blocking), so results differ in the last bits of the compute dtype; low-precision
# weights may then round to the neighbouring value (|w| < 1 here: a bf16 ulp is <= 2**-8,
# an fp16 ulp <= 2**-11). fp8 quantises each rank's output gradients with its own scale.
TOLERANCE = {
    "bf16-mixed": 5e-4, "fp16-mixed": 1e-4, "fp8-mixed": 1e-2,
    "bf16-master": 4e-3, "fp16-master": 5e-4, "bf16-pure": 8e-3, "fp16-pure": 1e-3,
    "bf16-kahan": 8e-3, "bf16-sr": 8e-3,
}
# Adam(W) with low-precision moments, which step on the native CPU route where it is available
# (mixprec.optim.native): the same arithmetic on every replica, so replicas stay bit-identical.
# Against one process, as the bf16 plans above: a weight may land on the neighbouring bf16 value.
ADAM_PLANS = {
    "bf16-kahan/8bit": ({"name": "bf16-kahan", "state_dtype": "8bit"}, 8e-3),
    "bf16-sr/8bit": ({"name": "bf16-sr", "state_dtype": "8bit"}, 8e-3),
    "bf16-master/remainders-8bit": ({"name": "bf16-master", "remainders": True, "state_dtype": "8bit"}, 8e-3),
    "bf16-master/remainders-bf16": ({"name": "bf16-master", "remainders": True, "state_dtype": "bf16"}, 8e-3),
}
TOLERANCE |= {name: tolerance for name, (_, tolerance) in ADAM_PLANS.items()}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 8)
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD * PER_RANK, 16, generator=g), torch.randn(WORLD * PER_RANK, 8, generator=g)


def _train(plan: str, rank: int, mode: str) -> list[dict[str, torch.Tensor]]:
    """mode: "prepare" (ddp=True), "wrapped" (framework DDP after prepare_model) or "single"."""
    model = _model()
    if plan in ADAM_PLANS:
        spec = dict(ADAM_PLANS[plan][0])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        mp = MixedPrecision(get_plan(spec.pop("name"), **spec))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        mp = MixedPrecision(plan)
    if mode == "prepare":
        model, opt = mp.prepare(model, opt, ddp=True)
    else:
        model = mp.prepare_model(model)
        opt = mp.prepare_optimizers(opt)
        if mode == "wrapped":
            model = DistributedDataParallel(model)
    history = []
    for step in range(STEPS):
        x, y = _batch(step)
        if mode != "single":
            x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
        with mp.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        mp.backward(loss)
        assert mp.step().stepped, (plan, mode, step)
        inner = getattr(model, "module", model)
        history.append({n: p.detach().float().clone() for n, p in inner.named_parameters()})
    return history


def _worker(rank: int, world: int, out: str) -> None:
    results: dict[str, object] = {}
    real_call, calls = native._call, [0]

    def counted(lib, job):
        calls[0] += 1
        return real_call(lib, job)

    native._call = counted  # (this worker process only)
    for plan in (*PLANS, *ADAM_PLANS):
        for mode in ("prepare", "wrapped"):
            calls[0] = 0
            try:
                results[f"{plan}/{mode}"] = _train(plan, rank, mode)
                results[f"{plan}/{mode}/native calls"] = calls[0]
            except Exception as exc:  # reported by the test of that plan, the others still run
                results[f"{plan}/{mode}"] = f"{type(exc).__name__}: {exc}"
            torch.distributed.barrier()
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_plans")
    run_ranks(_worker, WORLD, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["prepare", "wrapped"])
@pytest.mark.parametrize("plan", [*PLANS, *ADAM_PLANS])
def test_every_plan_under_ddp_keeps_replicas_identical_and_matches_one_process(ddp_results, plan, mode):
    r0, r1 = (r[f"{plan}/{mode}"] for r in ddp_results)
    for r in (r0, r1):
        assert not isinstance(r, str), f"{plan} {mode} failed on a rank: {r[:400]}"
    for step, (a, b) in enumerate(zip(r0, r1, strict=True)):
        for name in a:
            assert torch.equal(a[name], b[name]), f"{plan} {mode}: replicas differ at step {step} in {name}"
    if plan in ADAM_PLANS and native.status(build=False)[0]:  # these steps took the native route
        assert all(r[f"{plan}/{mode}/native calls"] >= STEPS for r in ddp_results), plan
    single = _train(plan, 0, "single")
    for name, value in r0[-1].items():
        diff = (value - single[-1][name]).abs().max().item()
        print(f"{plan} {mode} {name}: max |DDP - one process| = {diff:.3g}")
        assert diff <= TOLERANCE[plan], f"{plan} {mode}: {name} differs from one process by {diff}"
    first = copy.deepcopy(single[0])
    assert any(not torch.equal(first[n], r0[-1][n]) for n in first), "nothing trained"

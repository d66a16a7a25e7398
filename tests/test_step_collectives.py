"""One skip decision per step: one collective and one host read, whatever the number of optimizers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mixprec import MixedPrecision
from tests._dist import run_ranks


def _worker(rank: int, world_size: int, plan: str, n_optimizers: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(n_optimizers)))
    mp = MixedPrecision(plan)
    model, *opts = mp.prepare(model, *(torch.optim.SGD(layer.parameters(), lr=0.1) for layer in model))
    calls: list[str] = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append("all_reduce")
        return real(tensor, *args, **kwargs)

    x = torch.randn(4, 8)
    with mp.autocast():
        loss = model(x).float().square().mean()
    mp.backward(loss)
    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        result = mp.step()
    finally:
        dist.all_reduce = real  # type: ignore[assignment]
    assert result.stepped
    assert calls == ["all_reduce"], f"{plan} with {n_optimizers} optimizers made {len(calls)} collectives"


@pytest.mark.distributed
@pytest.mark.parametrize("plan", ["fp16-mixed", "bf16-mixed"])
def test_one_collective_per_step_for_three_optimizers(plan: str) -> None:
    run_ranks(_worker, 2, plan, 3)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("plan", ["bf16-mixed", "fp16-mixed"])
def test_at_most_one_host_read_decides_the_step(plan: str, fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Optimizers that cannot skip on the device (torch's non-fused ones) make the decision read
    the device once (flags and norm together), not once per optimizer; fused ones none (the
    decision and the loss scale stay on the device; the result is read lazily)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    mp = MixedPrecision(plan)
    model, *_ = mp.prepare(model, *(torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9, fused=fused)
                                    for layer in model))
    for _ in range(2):  # the first step creates the momentum (decided on the host: a skip must not create it)
        with mp.autocast():
            loss = model(torch.randn(4, 8)).float().square().mean()
        mp.backward(loss)
        if _ == 0:
            mp.step()
    mp.settle_outcome()  # the first step's outcome: a copy on the host (free on a GPU by now)
    reads: list[str] = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, _n=name, _r=real: reads.append(_n) or _r(t))
    result = mp.step()
    monkeypatch.undo()
    assert result.stepped and result.grad_norm is not None and result.grad_norm > 0
    assert reads == ([] if fused else ["tolist"]), reads


def test_a_norm_that_overflows_fp32_on_finite_gradients_skips_but_leaves_the_scale_to_the_gradients() -> None:
    """The scaler learns what the gradients say (finite here), as torch.amp.GradScaler would."""
    from mixprec import DynamicLossScaler

    w = nn.Parameter(torch.zeros(4))
    mp = MixedPrecision("fp16-mixed", scaler=DynamicLossScaler(init_scale=1.0, growth_interval=1))
    model = nn.ParameterList([w])
    model, opt = mp.prepare(model, torch.optim.SGD([w], lr=0.1))
    mp.scale_loss(w.sum() * 0).backward()  # a backward so the step has something to decide
    mp.micro_batch_done()
    w.grad = torch.full((4,), 3e38)  # finite, but the sum of squares overflows fp32
    result = mp.step()
    assert result.skip_reason == "overflow" and torch.equal(w.detach(), torch.zeros(4))
    assert mp.scaler.get_scale() == 2.0  # a clean step for the scaler: it grew, as before


def _tp_worker(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,))
    model = parallelize_module(nn.Sequential(nn.Linear(8, 8)), mesh, {"0": ColwiseParallel()})
    mp = MixedPrecision("bf16-mixed")
    model, _ = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with mp.autocast():
        loss = model(torch.randn(4, 8)).float().square().mean()
    mp.backward(loss)
    full = torch.cat([p.grad.full_tensor().reshape(-1) for p in model.parameters()])  # gathers the shards
    local = torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()])
    result = mp.step()
    assert result.stepped
    assert result.grad_norm == pytest.approx(float(full.norm()), rel=1e-6)  # the norm over the mesh
    assert result.grad_norm != pytest.approx(float(local.norm()), rel=1e-3)  # not this rank's shard


@pytest.mark.distributed
def test_tensor_parallel_dtensor_gradients_step() -> None:
    """DTensor gradients outside FSDP2 (tensor parallelism) have their norm taken over the mesh."""
    run_ranks(_tp_worker, 2)


@pytest.mark.parametrize("plan", ["bf16-master", "fp16-master"])
def test_the_session_gathers_master_gradients_once_per_step(plan: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once by the scaler's unscale_ (enabled or not), once more inside the wrapper's own step
    (which, used without a session, must gather itself; it finds nothing new). It was three."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    calls: list[int] = []
    real = opt.prepare_grads
    monkeypatch.setattr(opt, "prepare_grads", lambda: calls.append(1) or real())
    with mp.autocast():
        loss = model(torch.randn(4, 8)).float().square().mean()
    mp.backward(loss)
    mp.unscale_()  # a framework's hook before step(): no second gather
    assert mp.step().stepped
    assert len(calls) == 2


def test_the_total_norm_of_mixed_dtypes_equals_that_of_their_fp32_copies_bit_for_bit() -> None:
    """Measured per tensor, then once over all in the order given: how the dtypes group does
    not change the rounding (remainder masters clip exactly as fp32 masters)."""
    from mixprec.step import total_norm

    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        grads = [torch.randn(int(n), generator=g) * 10 ** float(torch.rand(1, generator=g) * 6 - 3)
                 for n in torch.randint(1, 5000, (7,), generator=g)]
        mixed = [x.bfloat16() if i % 3 else x for i, x in enumerate(grads)]
        copies = [x.float() for x in mixed]
        assert torch.equal(total_norm(mixed, None), total_norm(copies, None)), trial

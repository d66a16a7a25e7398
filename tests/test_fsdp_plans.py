"""Every plan without masters under FSDP2 (two gloo ranks): bf16/fp16 shards stepped by mixprec's wrappers.

The reference is one process on the global batch, from the same low-precision weights
(converted before sharding; a Kahan run then starts from zero compensation in both). The
sharded update is elementwise, so the runs differ only in the gradients' rounding (each
rank's backward sees half the batch; the reduce-scatter averages in fp32 and rounds to
the weights' dtype once).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixprec import MixedPrecision, get_plan
from mixprec.cli.models import build_task
from tests._dist import assert_same, run_ranks, whole
from tests.test_distributed import (
    _check_close,
    _fsdp2_available,
    _global_batch,
    _params,
    _rank_slice,
)

WORLD = 2
ROOT = Path(__file__).resolve().parent.parent
STEPS, INF_STEP = 10, 4
PLANS = ("bf16-pure", "fp16-pure", "bf16-kahan", "bf16-sr", "fp16-master", "fp8-mixed")


def _train(plan_name: str, rank: int, world: int, *, shard: bool, adam: bool = False, ddp: bool = False,
           compile: bool = False) -> dict:
    from mixprec.distributed import fully_shard_model, local_tensor

    task = build_task("mlp", size="tiny", seed=0)
    plan = get_plan(plan_name)
    model = task.model
    if plan.family in ("pure", "lowbit"):
        plan.convert_model(model)  # the reference starts from the same low-precision weights
    mp = MixedPrecision(plan, clip_grad_norm=1.0, compile=compile)
    if shard:
        model = fully_shard_model(model, plan, units=(type(model.blocks[0]),))
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01) if adam
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    model, opt, criterion = mp.prepare(model, opt, criterion=task.criterion, ddp=ddp)
    stepped, norms, losses = [], [], []
    for step in range(STEPS):
        x, y = _global_batch(task, step, 16)
        if shard or ddp:
            x, y = _rank_slice(x, rank, world), _rank_slice(y, rank, world)
        with mp.autocast():
            loss = criterion(model(x), y)
        mp.backward(loss)
        if step == INF_STEP and rank == 0:  # one rank's local shard only
            first = next(p for p in model.parameters() if p.grad is not None)
            local_tensor(first.grad).view(-1)[0] = float("inf")
        result = mp.step()
        stepped.append(result.stepped)
        norms.append(result.grad_norm)
        total = loss.detach().float().clone()
        if shard or ddp:  # the global batch's loss: the mean of the ranks' halves
            torch.distributed.all_reduce(total)
            total /= world
        losses.append(float(total))
    if shard:
        from mixprec.checkpoint import unwrap_model

        params = {n: p.full_tensor().detach().clone() for n, p in unwrap_model(model).named_parameters()}
    else:
        params = _params(model.module if ddp else model)
    return {
        "params": params, "stepped": stepped, "norms": norms, "losses": losses,
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "state": {k: v for k, v in opt.state_bytes().items() if v} if hasattr(opt, "state_bytes") else {},
        "wrapper": type(opt).__name__,
    }


def _worker(rank: int, world: int, out: str) -> None:
    results = {name: _train(name, rank, world, shard=True) for name in PLANS}
    results["bf16-kahan adamw"] = _train("bf16-kahan", rank, world, shard=True, adam=True)
    results["fp8-mixed ddp"] = _train("fp8-mixed", rank, world, shard=False, ddp=True)  # the like-for-like oracle
    results["bf16-kahan compiled"] = _train("bf16-kahan", rank, world, shard=True, compile=True)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.long
@pytest.mark.distributed
def test_plans_without_masters_train_sharded_like_one_process(tmp_path):
    reason = _fsdp2_available()
    if reason is not None:
        pytest.skip(reason)
    run_ranks(_worker, WORLD, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD))
    expected_skips = [step != INF_STEP for step in range(STEPS)]
    # MixedPrecision(compile=True) over FSDP2 shards: the compiled model trains as the eager one (the
    # bf16 weights, stored by the same Kahan step from the same fp32 gradients, bit for bit here)
    for r in (r0, r1):
        eager, compiled = r["bf16-kahan"], r["bf16-kahan compiled"]
        assert compiled["stepped"] == eager["stepped"] and compiled["losses"] == eager["losses"]
        for name, w in eager["params"].items():
            assert torch.equal(compiled["params"][name], w), name
    for label in (*PLANS, "bf16-kahan adamw"):
        a, b = r0[label], r1[label]
        plan_name, adam = label.split()[0], label.endswith("adamw")
        reference = _train(plan_name, 0, 1, shard=False, adam=adam)
        if plan_name != "fp16-master":  # (its fp32 shards are the masters: torch's optimizer steps them)
            assert a["wrapper"] == reference["wrapper"], label  # the plan's own optimizer wrapper
            assert a["dtypes"] == reference["dtypes"], label  # bf16/fp16 shards, fp32 norm layers
        # one skip decision: an inf in one rank's shard skips the step on both
        assert a["stepped"] == b["stepped"] == expected_skips, label
        assert a["norms"] == b["norms"], label  # the whole gradient's norm, on both ranks
        assert a["losses"] == b["losses"], label
        for name in a["params"]:  # the gathered weights are the same on both ranks
            assert torch.equal(a["params"][name], b["params"][name]), (label, name)
        for step in range(STEPS):
            if step != INF_STEP:
                assert a["norms"][step] == pytest.approx(reference["norms"][step], rel=2e-2), (label, step)
                # (fp8: gradients quantised with 2 mantissa bits from other tensors than one process's)
                rel = 2e-2 if plan_name == "fp8-mixed" else 1e-2
                assert a["losses"][step] == pytest.approx(reference["losses"][step], rel=rel), (label, step)
        if plan_name == "bf16-sr":
            # each shard draws its own rounding noise, one process other noise: every stored
            # update may round to the other neighbour, one bf16 ulp (2**-8 relative) per step
            for name, ref in reference["params"].items():
                diff = (a["params"][name].float() - ref.float()).abs()
                assert bool((diff <= 2e-3 + STEPS * 2.0**-8 * ref.float().abs()).all()), (label, name, diff.max())
        elif plan_name == "fp8-mixed":
            # fp8 quantises gradients with 2-3 mantissa bits, from each rank's half-batch output gradients
            # (whose amax, MAX-reduced, is about twice one process's): the DDP tests' bound
            for name, ref in reference["params"].items():
                diff = (a["params"][name].float() - ref.float()).abs().max().item()
                assert diff <= 1e-2, (label, name, diff)
            # like for like, DDP on the same two ranks (the same half batches, the same reduced amaxes):
            # the fp32 gradients' reduction order apart, the same run
            ddp = r0["fp8-mixed ddp"]
            assert ddp["stepped"] == a["stepped"] and a["losses"] == pytest.approx(ddp["losses"], rel=1e-5), label
            for name, w in ddp["params"].items():
                assert (a["params"][name] - w).abs().max().item() <= 1e-6, (label, name)
        else:
            _check_close(a["params"], reference["params"], f"FSDP2 {label}")
        # each rank keeps half of the optimizer's state (and of the Kahan compensation); under
        # fp16-master the fp32 shards are the masters, and torch's optimizer state is its own
        for key, one in (reference["state"].items() if plan_name != "fp16-master" else ()):
            per_rank = a["state"][key]
            assert abs(per_rank - one / WORLD) <= 0.05 * one / WORLD, (label, key, per_rank, one)


def _refusal_worker(rank: int, world: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from mixprec.distributed import fully_shard_model

    found = {}
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)))  # fp32 shards
    try:
        MixedPrecision("bf16-kahan").prepare(model, torch.optim.AdamW(model.parameters()))
    except ValueError as exc:
        found["fp32 shards"] = str(exc)
    model = fully_shard_model(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)), "bf16-kahan")
    try:  # refused when the wrapper is made, before any step
        MixedPrecision("bf16-kahan").prepare(model, torch.optim.Adafactor(model.parameters()))
    except ValueError as exc:
        found["adafactor"] = str(exc)
    try:
        MixedPrecision(get_plan("bf16-kahan", state_dtype="8bit")).prepare(model, torch.optim.AdamW(model.parameters()))
    except ValueError as exc:
        found["8bit"] = str(exc)
    # by hand, with torch's usual bf16 policy: the fp32 norm layer would be gathered in bf16
    from torch.distributed.fsdp import MixedPrecisionPolicy

    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    get_plan("bf16-kahan").convert_model(net)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard(net[1], mp_policy=bf16)
    fully_shard(net, mp_policy=bf16)
    try:
        MixedPrecision("bf16-kahan").prepare(net, torch.optim.AdamW(net.parameters()))
    except ValueError as exc:
        found["bf16 gather"] = str(exc)
    model = fully_shard_model(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)), "bf16-kahan")
    try:
        MixedPrecision("bf16-kahan", optimizer_in_backward=True).prepare(model, torch.optim.AdamW(model.parameters()))
    except ValueError as exc:
        found["in backward"] = str(exc)
    from mixprec.optim import KahanOptimizer, RemainderOptimizer

    try:
        RemainderOptimizer(torch.optim.AdamW(model.parameters()))
    except ValueError as exc:
        found["remainder"] = str(exc)
    opt = KahanOptimizer(torch.optim.AdamW(model.parameters()))
    try:
        opt.set_compensation(next(model.parameters()), torch.zeros(8, 8, dtype=torch.bfloat16))
    except ValueError as exc:
        found["set_compensation"] = str(exc)
    # state predicted before the first step: this rank's part
    found["predicted"] = opt.state_bytes()
    model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    found["measured"] = opt.state_bytes()
    # an fp32 island holding its own parameter and units inside it: shards, trains
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    class Enc(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = torch.nn.Parameter(torch.zeros(8))
            self.blocks = torch.nn.Sequential(Block(), Block())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks(x + self.pos)

    island_plan = get_plan("bf16-pure", fp32_modules=["0"])
    net = fully_shard_model(torch.nn.Sequential(Enc(), torch.nn.Linear(8, 2)), island_plan, units=(Block,),
                            reshard_after_forward=True)
    net, island_opt = MixedPrecision(island_plan).prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    net(torch.randn(2, 8)).float().sum().backward()
    island_opt.step()
    found["island"] = sorted({str(p.dtype) for p in net[0].parameters()}) + sorted({str(p.dtype) for p in net[1].parameters()})
    # stochastic rounding: each shard mixes its index into the noise's seed, so two shards holding the
    # same values round them differently; the state is the seed and the call count, the same on every
    # rank, so a whole-model state dict saved from rank 0 loads on every rank as it is
    import warnings

    from mixprec.optim import StochasticRoundingOptimizer
    from mixprec.optim.checks import lift_wrapper_state

    layers = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)]
    for layer in layers:  # every row of the first weight gets the same gradient
        torch.nn.init.constant_(layer.weight, 1.0)
        torch.nn.init.zeros_(layer.bias)
    sr_model = fully_shard_model(torch.nn.Sequential(*layers), "bf16-sr")
    sr_opt = StochasticRoundingOptimizer(torch.optim.AdamW(sr_model.parameters()))
    sr_model(torch.randn(2, 8, generator=torch.Generator().manual_seed(0)).bfloat16()).float().sum().backward()
    sr_opt.step()
    found["sr local"] = sr_model[0].weight.to_local().detach().view(torch.int16).clone()
    sd = lift_wrapper_state(sr_opt.state_dict(), "mixprec_lowbit")
    found["sr keys"] = sorted(k for k in sd["mixprec_lowbit"] if k != "compiled_layouts")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sr_opt.load_state_dict(sd)
    found["sr warned"] = [str(w.message) for w in caught]
    found["sr counter"] = sr_opt.rounding_state()["counter"]
    # fp8: the Linear layers become fp8 layers before sharding, so a model sharded without them is refused
    net = fully_shard(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)))
    try:
        MixedPrecision("fp8-mixed").prepare(net, torch.optim.AdamW(net.parameters()))
    except ValueError as exc:
        found["fp8 layers"] = str(exc)
    try:
        fully_shard_model(net, "fp8-mixed")
    except ValueError as exc:
        found["fp8 sharded"] = str(exc)
    # ... while a model none of whose Linear layers is eligible (8 features) is sharded as it is, and runs
    net = fully_shard_model(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)), "fp8-mixed")
    net, fp8_opt = MixedPrecision("fp8-mixed").prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    net(torch.randn(2, 8)).float().sum().backward()
    fp8_opt.step()
    found["fp8 none eligible"] = "trained"
    # a pickle or copy of the wrapper carries no stand-ins of this run's shards
    found["copy views"] = len(opt.__getstate__()["_shard_views"])
    found["views"] = len(opt._shard_views)
    torch.save(found, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.distributed
def test_what_cannot_be_sharded_is_refused_with_the_fix(tmp_path):
    reason = _fsdp2_available()
    if reason is not None:
        pytest.skip(reason)
    run_ranks(_refusal_worker, WORLD, str(tmp_path))
    found = torch.load(tmp_path / "rank0.pt", weights_only=True)
    other = torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert found["sr keys"] == other["sr keys"] == ["counter", "seed"]
    assert found["sr warned"] == other["sr warned"] == [] and found["sr counter"] == other["sr counter"] == 1
    assert not torch.equal(found["sr local"], other["sr local"])  # the same values, each shard's own noise
    assert "was sharded with fp32 weights" in found["fp32 shards"]
    assert "fully_shard_model(model, plan" in found["fp32 shards"]
    assert "Adafactor is not one of them" in found["adafactor"]
    assert "8-bit optimizer states are not supported on FSDP2 shards" in found["8bit"]
    assert "holds fp32 weights gathered as bf16" in found["bf16 gather"], found["bf16 gather"]
    assert "optimizer_in_backward=True does not" in found["in backward"]  # (several ranks: refused for that first)
    assert "does not run on FSDP2 shards" in found["remainder"]
    assert "pass a DTensor sharded like it" in found["set_compensation"]
    assert found["predicted"] == found["measured"], (found["predicted"], found["measured"])
    assert found["views"] == 4 and found["copy views"] == 0
    assert found["island"] == ["torch.float32", "torch.bfloat16"]  # the island fp32, the rest bf16
    assert "holds no fp8 layers" in found["fp8 layers"] and "fully_shard_model(model, plan" in found["fp8 layers"]
    assert "got a model already sharded: an fp8 plan" in found["fp8 sharded"], found["fp8 sharded"]
    assert found["fp8 none eligible"] == "trained"


def _in_backward_worker(rank: int, world: int, out: str) -> None:
    from mixprec.distributed import fully_shard_model

    model = fully_shard_model(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)), "bf16-kahan")
    try:
        MixedPrecision("bf16-kahan", optimizer_in_backward=True).prepare(model, torch.optim.AdamW(model.parameters()))
        found = "prepared"
    except ValueError as exc:
        found = str(exc)
    torch.save(found, os.path.join(out, "in-backward.pt"))


@pytest.mark.distributed
def test_optimizer_in_backward_is_refused_on_a_one_rank_fsdp2_model(tmp_path):
    reason = _fsdp2_available()
    if reason is not None:
        pytest.skip(reason)
    run_ranks(_in_backward_worker, 1, str(tmp_path))
    found = torch.load(tmp_path / "in-backward.pt", weights_only=True)
    assert "optimizer_in_backward=True does not run on an FSDP2 model" in found, found


def test_policies_of_the_plans_without_masters():
    from mixprec.distributed import fsdp_policy, sharded_plan

    for name in ("bf16-pure", "bf16-kahan", "bf16-sr", "fp16-pure"):
        policy = fsdp_policy(name)
        assert policy.param_dtype is None  # the shards are bf16/fp16 already: gathered as stored
        plan = sharded_plan(name)
        assert plan.weight_dtype == get_plan(name).weight_dtype and plan.master_dtype is None
        assert plan.fingerprint()["optimizer"] == get_plan(name).fingerprint()["optimizer"]
    assert "compensation" in str(sharded_plan("bf16-kahan").explain())
    with pytest.raises(ValueError, match=re.escape("FSDP2 does not need")):
        fsdp_policy(get_plan("bf16-master", remainders=True))
    fp8 = fsdp_policy("fp8-mixed")  # fp32 shards gathered in fp32, quantised by the fp8 layers
    assert (fp8.param_dtype, fp8.reduce_dtype) == (None, torch.float32)
    import dataclasses
    from typing import ClassVar

    from mixprec.plans.mixed import MixedPlan

    @dataclasses.dataclass(frozen=True)
    class Unsharded(MixedPlan):  # a plan of the user's own, not written for shards
        supports_fsdp: ClassVar[bool] = False

    mixed = get_plan("bf16-mixed")
    custom = Unsharded(**{f.name: getattr(mixed, f.name) for f in dataclasses.fields(mixed)})
    with pytest.raises(ValueError, match=re.escape("is not supported under FSDP2")):
        fsdp_policy(custom)


# ------------------------------------------------------------------ sharded checkpoints
RESUME_PLANS = ("bf16-kahan", "bf16-sr", "fp16-pure", "bf16-master", "fp8-mixed", "bf16-pure", "fp16-master", "bf16-mixed")


def _session(plan_name: str, mesh_shape: tuple[int, ...] | None = None):
    from torch.distributed.device_mesh import init_device_mesh

    from mixprec.distributed import fully_shard_model

    task = build_task("mlp", size="tiny", seed=0)
    plan = get_plan(plan_name)
    mp = MixedPrecision(plan, clip_grad_norm=1.0)
    mesh = None if mesh_shape is None else init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    model = fully_shard_model(task.model, plan, mesh=mesh, units=(type(task.model.blocks[0]),))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    model, opt, criterion = mp.prepare(model, opt, criterion=task.criterion)
    return task, mp, model, opt, criterion


def _steps(task, mp, model, criterion, rank: int, world: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = _global_batch(task, step, 16)
        x, y = _rank_slice(x, rank, world), _rank_slice(y, rank, world)
        with mp.autocast():
            loss = criterion(model(x), y)
        mp.backward(loss)
        mp.step()
        losses.append(float(loss))
    return losses


def _full(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _resume_worker(rank: int, world: int, out: str) -> None:
    from mixprec import load_checkpoint, save_checkpoint

    results = {}
    for plan_name in RESUME_PLANS:
        path = os.path.join(out, f"{plan_name}.pt")
        task, mp, model, opt, criterion = _session(plan_name)
        first = _steps(task, mp, model, criterion, rank, world, range(3))
        save_checkpoint(path, model=model, optimizers=[opt], mp=mp)
        straight = _steps(task, mp, model, criterion, rank, world, range(3, 6))
        want = _full(model)
        # a save that fails on one rank fails on every rank and leaves the previous checkpoint in place
        failed = ""
        if plan_name == "bf16-kahan":
            import mixprec.checkpoint as ckpt

            write = ckpt._write

            def failing(target: str, payload: dict, write=write) -> None:
                if "rank00001" in target:
                    raise OSError(28, "No space left on device")
                write(target, payload)

            ckpt._write = failing
            try:
                save_checkpoint(path, model=model, optimizers=[opt], mp=mp)
            except (OSError, RuntimeError) as exc:
                failed = str(exc)
            finally:
                ckpt._write = write

            def failing_switch(target: str, payload: dict, write=write, path=path) -> None:
                if target == path:  # rank 0's switch to the new save: no rank may wait for it forever
                    raise OSError(122, "Disk quota exceeded")
                write(target, payload)

            ckpt._write = failing_switch
            try:
                save_checkpoint(path, model=model, optimizers=[opt], mp=mp)
            except (OSError, RuntimeError) as exc:
                failed += " | " + str(exc)
            finally:
                ckpt._write = write
            # a load that fails on one rank while applying is undone on every rank
            task3, mp3, model3, opt3, _ = _session(plan_name)
            before = _full(model3)
            if rank == 1:
                mp3.load_state_dict = lambda *a, **k: (_ for _ in ()).throw(ValueError("planted"))
            try:
                load_checkpoint(path, model=model3, optimizers=[opt3], mp=mp3)
            except (ValueError, RuntimeError) as exc:
                failed += " | " + str(exc)
            after = _full(model3)
            failed += " | unchanged" if all(torch.equal(before[n], after[n]) for n in before) else " | changed"
        # a fresh run resumed from the checkpoint continues bit for bit
        task, mp2, model2, opt2, criterion2 = _session(plan_name)
        load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2)
        resumed = _steps(task, mp2, model2, criterion2, rank, world, range(3, 6))
        got = _full(model2)
        results[plan_name] = {
            "losses": first + straight, "resumed": resumed, "same": all(torch.equal(want[n], got[n]) for n in want),
            "files": sorted(os.listdir(path + ".shards")), "failed": failed,
        }
        # saving again replaces the parts of the earlier save
        save_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2)
        results[plan_name]["after"] = sorted(os.listdir(path + ".shards"))
        # what that save holds, whole, and where 3 more steps on these 2 ranks take it (for the loads on 1 and 3)
        results[plan_name]["saved"] = _gathered(model2, opt2, mp2)
        results[plan_name]["next"] = _steps(task, mp2, model2, criterion2, rank, world, range(6, 9))
        results[plan_name]["next_params"] = _full(model2)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.long
@pytest.mark.distributed
def test_sharded_checkpoints_resume_bit_for_bit(tmp_path):
    reason = _fsdp2_available()
    if reason is not None:
        pytest.skip(reason)
    run_ranks(_resume_worker, WORLD, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD))
    for plan_name in RESUME_PLANS:
        a, b = r0[plan_name], r1[plan_name]
        assert a["same"] and b["same"], plan_name  # weights after 3 more steps: bit for bit
        assert a["resumed"] == a["losses"][3:], plan_name
        assert b["resumed"] == b["losses"][3:], plan_name
        assert len(a["after"]) == 1 and a["after"][0] not in a["files"], plan_name  # the earlier parts removed
        if plan_name == "bf16-kahan":  # the failed saves: refused on both ranks, the checkpoint still loads
            fa, fb = a["failed"].split(" | "), b["failed"].split(" | ")
            assert "No space left on device" in fb[0] and "failed on another rank" in fa[0], (fa, fb)
            assert "Disk quota exceeded" in fa[1] and "failed on another rank" in fb[1], (fa, fb)
            # the failed load: rank 1's own error, rank 0 undone too
            assert "planted" in fb[2] and "failed on another rank" in fa[2], (fa, fb)
            assert fa[3] == fb[3] == "unchanged", (fa, fb)
        else:
            assert a["files"] == b["files"] and len(a["files"]) == 1, plan_name
        parts = sorted(os.listdir(tmp_path / f"{plan_name}.pt.shards" / a["after"][0]))
        assert parts == ["rank00000-of-00002.pt", "rank00001-of-00002.pt"]
    # another number of ranks: the state is put together and cut again, exactly
    # (and on 2 ranks as 2 replicas of one shard: another mesh)
    for world, mesh in ((1, None), (4, None), (2, (2, 1))):  # (4: the head's 5 rows as 2, 2, 1 and 0)
        run_ranks(_reshard_load_worker, world, str(tmp_path), RESUME_PLANS, mesh)
        loaded = [torch.load(tmp_path / f"reshard{r}-of-{world}.pt", weights_only=True) for r in range(world)]
        for plan_name in RESUME_PLANS:
            for rank, got in enumerate(loaded):
                assert "was saved by 2 ranks and is loaded by " + str(world) in got[plan_name]["warning"], plan_name
                assert ("sharding it otherwise" in got[plan_name]["warning"]) == (world == 2), plan_name
                assert ("did not save" in got[plan_name]["warning"]) == (rank >= 2), (plan_name, rank)
                assert_same(got[plan_name]["state"], r0[plan_name]["saved"], f"{plan_name} on {world}")
            # (fp16: whether a step at scale 2^16 overflows, and is skipped, depends on how the batch is split)
            if world == 1 and not plan_name.startswith("fp16"):  # the whole batch on one rank: as the 2 ranks' halves
                assert loaded[0][plan_name]["next"] == pytest.approx(
                    [(x + y) / 2 for x, y in zip(r0[plan_name]["next"], r1[plan_name]["next"], strict=True)], rel=1e-2)
                if plan_name == "bf16-sr":  # other rounding noise: a bf16 ulp per step at most
                    for name, ref in r0[plan_name]["next_params"].items():
                        diff = (loaded[0][plan_name]["params"][name].float() - ref.float()).abs()
                        assert bool((diff <= 2e-3 + 3 * 2.0**-8 * ref.float().abs()).all()), (name, float(diff.max()))
                else:
                    _check_close(loaded[0][plan_name]["params"], r0[plan_name]["next_params"], f"{plan_name} 2 -> 1")
            else:  # 4 ranks or 2 replicas, or fp16's own skips: the ranks stay one model
                for name, w in loaded[0][plan_name]["params"].items():
                    assert all(torch.equal(got[plan_name]["params"][name], w) for got in loaded), (plan_name, name)
                    assert bool(torch.isfinite(w).all()), (plan_name, name)


def test_shard_extents_are_torch_chunks_and_replicas_are_told_apart():
    """Where a rank's shard lies, as DTensor's Shard splits a dimension (torch.chunk: equal
    chunks rounded up, the last shorter or empty), on one mesh dimension or under a replicated one."""
    from mixprec.checkpoint.sharded import _extent, _is_replica

    for length in range(10):
        for size in range(1, 5):
            chunks = torch.arange(length).chunk(size)
            for coord in range(size):
                layout = {"shape": [length, 3], "mesh": [size], "coordinate": [coord], "placements": [["S", 0]]}
                (begin, n), whole = _extent(layout)
                want = chunks[coord].tolist() if coord < len(chunks) else []
                assert list(range(begin, begin + n)) == want and whole == (0, 3), (length, size, coord)
    hsdp = {"shape": [5], "mesh": [2, 2], "coordinate": [1, 1], "placements": [["R"], ["S", 0]]}
    assert _extent(hsdp) == [(3, 2)] and _is_replica(hsdp)
    assert not _is_replica({**hsdp, "coordinate": [0, 1]})
    assert "placement" in _extent({**hsdp, "placements": [["R"], ["?", "Partial(sum)"]]})
    assert "more than one" in _extent({**hsdp, "placements": [["S", 0], ["S", 0]]})


def test_a_part_without_its_layout_is_refused_on_another_number_of_ranks():
    from mixprec.checkpoint.sharded import reshard

    parts = [{"sharded": {"dtensors": {"model": [], "optimizers": []}}, "model": {}, "optimizers": []}] * 2
    with pytest.raises(ValueError, match=r"saved by 2 ranks .* do not record how their tensors were split"):
        reshard("ck.pt", parts, torch.nn.Linear(2, 2), [], 0)


def _gathered(model, opt, mp) -> dict:
    """Model, optimizer and session state with every DTensor whole (the rounding noise left out)."""
    return {"model": whole(model.state_dict()), "optimizer": whole(opt.state_dict()), "mp": whole(mp.state_dict())}


def _reshard_load_worker(rank: int, world: int, out: str, plans: tuple[str, ...], mesh: tuple[int, ...] | None) -> None:
    """Load the 2 ranks' checkpoints on ``world`` ranks (a ``mesh`` of that shape: replicas x shards);
    the state whole, then 3 more steps."""
    import warnings

    from mixprec import load_checkpoint

    results = {}
    for plan_name in plans:
        task, mp, model, opt, criterion = _session(plan_name, mesh)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_checkpoint(os.path.join(out, f"{plan_name}.pt"), model=model, optimizers=[opt], mp=mp)
        state = _gathered(model, opt, mp)
        losses = _steps(task, mp, model, criterion, rank, world, range(6, 9))
        results[plan_name] = {"state": state, "next": losses, "params": _full(model),
                              "warning": " | ".join(str(w.message) for w in caught)}
    torch.save(results, os.path.join(out, f"reshard{rank}-of-{world}.pt"))


# ------------------------------------------------------------------------------- HSDP
HSDP_PLANS = ("bf16-kahan", "bf16-sr", "bf16-master")


def _hsdp_worker(rank: int, world: int, out: str) -> None:
    """A 2-D mesh: 2 replicas x 2 shards (HSDP; as two nodes of two ranks each)."""
    from torch.distributed.device_mesh import init_device_mesh

    from mixprec import save_checkpoint
    from mixprec.distributed import local_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    results = {}
    for plan_name in HSDP_PLANS:
        task, mp, model, opt, criterion = _hsdp_session(plan_name, mesh)
        stepped, norms = [], []
        for step in range(STEPS):
            x, y = _global_batch(task, step, 16)
            x, y = _rank_slice(x, rank, world), _rank_slice(y, rank, world)
            with mp.autocast():
                loss = criterion(model(x), y)
            mp.backward(loss)
            if step == INF_STEP and rank == 3:
                first = next(p for p in model.parameters() if p.grad is not None)
                local_tensor(first.grad).view(-1)[0] = float("inf")
            result = mp.step()
            stepped.append(result.stepped)
            norms.append(result.grad_norm)
        results[plan_name] = {
            "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
            "local": {n: local_tensor(p).detach().clone() for n, p in model.named_parameters()},
            "stepped": stepped, "norms": norms,
        }
        if plan_name == "bf16-kahan":  # for a run on one mesh dimension of 2 ranks to load
            save_checkpoint(os.path.join(out, "hsdp.pt"), model=model, optimizers=[opt], mp=mp)
            results[plan_name]["saved"] = _gathered(model, opt, mp)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def _hsdp_session(plan_name: str, mesh=None):
    from mixprec.distributed import fully_shard_model

    task = build_task("mlp", size="tiny", seed=0)
    plan = get_plan(plan_name)
    model = task.model
    if plan.family == "lowbit":
        plan.convert_model(model)
    mp = MixedPrecision(plan, clip_grad_norm=1.0)
    model = fully_shard_model(model, plan, mesh=mesh, units=(type(model.blocks[0]),))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt, criterion = mp.prepare(model, opt, criterion=task.criterion)
    return task, mp, model, opt, criterion


def _hsdp_reshard_worker(rank: int, world: int, out: str) -> None:
    """The HSDP run's checkpoint (2 replicas x 2 shards) loaded by 2 ranks sharding one mesh dimension."""
    import warnings

    from mixprec import load_checkpoint

    task, mp, model, opt, criterion = _hsdp_session("bf16-kahan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_checkpoint(os.path.join(out, "hsdp.pt"), model=model, optimizers=[opt], mp=mp)
    torch.save(_gathered(model, opt, mp), os.path.join(out, f"hsdp-loaded{rank}.pt"))


@pytest.mark.distributed
def test_hsdp_two_replicas_of_two_shards_train_like_one_process(tmp_path):
    reason = _fsdp2_available()
    if reason is not None:
        pytest.skip(reason)
    run_ranks(_hsdp_worker, 4, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(4)]
    expected = [step != INF_STEP for step in range(STEPS)]
    for plan_name in HSDP_PLANS:
        reference = _train(plan_name, 0, 1, shard=False)
        runs = [r[plan_name] for r in ranks]
        assert all(run["stepped"] == expected for run in runs), (plan_name, [run["stepped"] for run in runs])
        # the whole gradient's norm on every rank (at the injected step each replica sees its own
        # gradients: the inf was planted after the reduction, in one replica)
        clean = [step for step in range(STEPS) if step != INF_STEP]
        assert all([run["norms"][s] for s in clean] == [runs[0]["norms"][s] for s in clean] for run in runs), plan_name
        for name in runs[0]["params"]:
            assert all(torch.equal(run["params"][name], runs[0]["params"][name]) for run in runs), (plan_name, name)
            # rank r holds shard r % 2 of replica r // 2: replicas hold equal shards, rounding noise included
            assert torch.equal(runs[0]["local"][name], runs[2]["local"][name]), (plan_name, name)
            assert torch.equal(runs[1]["local"][name], runs[3]["local"][name]), (plan_name, name)
        for step in range(STEPS):
            if step != INF_STEP:
                assert runs[0]["norms"][step] == pytest.approx(reference["norms"][step], rel=2e-2), (plan_name, step)
        if plan_name == "bf16-sr":
            for name, ref in reference["params"].items():
                diff = (runs[0]["params"][name].float() - ref.float()).abs()
                assert bool((diff <= 2e-3 + STEPS * 2.0**-8 * ref.float().abs()).all()), (plan_name, name)
        else:
            _check_close(runs[0]["params"], reference["params"], f"HSDP {plan_name}")
    # its checkpoint on 2 ranks and one mesh dimension: the state is put together from one replica, exactly
    run_ranks(_hsdp_reshard_worker, 2, str(tmp_path))
    for r in range(2):
        assert_same(torch.load(tmp_path / f"hsdp-loaded{r}.pt", weights_only=True), ranks[0]["bf16-kahan"]["saved"],
                     f"HSDP -> 2 ranks, rank {r}")


def _two_nodes(tmp: Path, *args: str) -> None:
    """``examples/train_fsdp.py`` launched as two torchrun nodes of one process each on localhost."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=nodes{port}", "--local-addr=127.0.0.1",
           str(ROOT / "examples" / "train_fsdp.py"), *args]
    nodes = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=180)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), "\n".join(o[-3000:] for o in outputs)
    (tmp / f"log{port}.txt").write_text("\n".join(outputs))


@pytest.mark.long
@pytest.mark.distributed
def test_two_torchrun_nodes_hsdp_resume_bit_for_bit(tmp_path):
    """`torchrun --nnodes 2 --nproc_per_node 1` on localhost: each node one replica (HSDP, 2 x 1 mesh).
    Stopped at step 6 and resumed from its sharded checkpoint, it ends where a straight run ends."""
    reason = _fsdp2_available()
    if reason is not None:
        pytest.skip(reason)
    common = ["--plan", "bf16-sr", "--replicas", "2", "--ckpt-every", "6"]
    _two_nodes(tmp_path, *common, "--steps", "6", "--ckpt", str(tmp_path / "ck.pt"))
    _two_nodes(tmp_path, *common, "--steps", "12", "--ckpt", str(tmp_path / "ck.pt"), "--out", str(tmp_path / "resumed.pt"))
    _two_nodes(tmp_path, *common, "--steps", "12", "--out", str(tmp_path / "straight.pt"))
    resumed, straight = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("resumed", "straight"))
    assert resumed["world"] == straight["world"] == 2
    assert resumed["losses"] == straight["losses"][6:]
    assert straight["losses"][-1] < straight["losses"][0]
    for name, w in straight["weights"].items():
        assert torch.equal(resumed["weights"][name], w), name


def _flatten_worker(rank: int, world: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    from mixprec.distributed import fully_shard_model

    mesh = init_device_mesh("cpu", (world,))
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(80, 16, generator=g), torch.randn(80, 4, generator=g)

    def build(plan: str):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4), torch.nn.LayerNorm(4))
        net = fully_shard_model(net, plan, mesh=mesh, units=(torch.nn.Linear,))
        mp = MixedPrecision(plan)
        model, opt = mp.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        return mp, model, opt

    def run(mp, model, steps) -> list[float]:
        losses = []
        for s in steps:
            xs, ys = x[s * 8 : (s + 1) * 8][rank::world], y[s * 8 : (s + 1) * 8][rank::world]
            with mp.autocast():
                loss = (model(xs).float() - ys).pow(2).mean()
            mp.backward(loss)
            mp.step()
            losses.append(float(loss.detach()))
        return losses

    for plan in ("bf16-master", "bf16-kahan"):
        mp, model, opt = build(plan)
        run(mp, model, range(3))
        model_sd, opt_sd = get_state_dict(model, opt, options=options)
        dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=os.path.join(out, plan))
        straight = run(mp, model, range(3, 6))
        mp2, model2, opt2 = build(plan)
        model_sd, opt_sd = get_state_dict(model2, opt2, options=options)
        sd = {"model": model_sd, "optim": opt_sd}
        dcp.load(sd, checkpoint_id=os.path.join(out, plan))
        if plan == "bf16-master":  # the fp32 shards are the masters: flattening keeps all there is
            set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=options)
            assert run(mp2, model2, range(3, 6)) == straight
        else:  # the wrapper's own entry (compensation, noise) does not survive flattening: said, with the fix
            with pytest.raises(ValueError, match="flatten_optimizer_state_dict"):
                set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=options)


@pytest.mark.distributed
def test_flattened_dcp_optimizer_state_resumes_master_plans_and_refuses_the_wrappers_with_the_fix(tmp_path):
    """torch.distributed.checkpoint with StateDictOptions(flatten_optimizer_state_dict=True): the
    fp32-master plan resumes bit for bit; a Kahan wrapper's entry, which travels in the first
    param group, is dropped by flattening, and the load says so instead of resuming without it."""
    reason = _fsdp2_available()
    if reason is not None:
        pytest.skip(reason)
    run_ranks(_flatten_worker, WORLD, str(tmp_path))


def _generic_zero_step_worker(rank: int, world: int, out: str) -> None:
    """torch.distributed.checkpoint's zero step over FSDP2 shards where the wrapper takes its
    generic path (a fused AdamW, Adagrad): it creates the state a real step would, in its dtypes,
    and changes no weight; a full optimizer state dict then resumes bit for bit."""
    import copy

    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from mixprec.distributed import fully_shard_model

    full = StateDictOptions(full_state_dict=True)
    results = {}
    for plan_name, make in (("bf16-kahan", lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)),
                            ("bf16-sr", lambda ps: torch.optim.Adagrad(ps, lr=1e-2))):
        def session(plan_name=plan_name, make=make):
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
            net = fully_shard_model(net, plan_name)
            mp = MixedPrecision(plan_name)
            net, opt = mp.prepare(net, make(net.parameters()))
            return mp, net, opt

        def steps(mp, net, first: int) -> list[float]:
            losses = []
            for i in range(first, first + 3):
                x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
                with mp.autocast():
                    loss = net(x).float().pow(2).mean()
                mp.backward(loss)
                mp.step()
                losses.append(float(loss.detach()))
            return losses

        mp, net, opt = session()
        steps(mp, net, 0)
        # (copies, as from a file: the state dicts hold the optimizer's own step counters)
        model_sd = copy.deepcopy(get_model_state_dict(net, options=full))
        optim_sd = copy.deepcopy(get_optimizer_state_dict(net, opt, options=full))
        straight = steps(mp, net, 3)
        mp2, net2, opt2 = session()
        set_model_state_dict(net2, model_sd, options=full)
        weights = {n: p.full_tensor().clone() for n, p in net2.named_parameters()}
        get_optimizer_state_dict(net2, opt2)  # the zero step on a fresh optimizer
        kinds = sorted({f"{p.dtype}:{k}:{v.dtype}" for p, st in opt2.optimizer.state.items() for k, v in st.items()
                        if isinstance(v, torch.Tensor)})
        unchanged = all(torch.equal(p.full_tensor(), weights[n]) for n, p in net2.named_parameters())
        set_optimizer_state_dict(net2, opt2, optim_sd, options=full)
        resumed = steps(mp2, net2, 3)
        same = all(torch.equal(p.full_tensor(), q.full_tensor()) for p, q in zip(net2.parameters(), net.parameters(),
                                                                                  strict=True))
        results[plan_name] = {"kinds": kinds, "unchanged": unchanged, "resumed": resumed == straight, "same": same}
    torch.save(results, os.path.join(out, "generic.pt"))


@pytest.mark.distributed
def test_the_checkpoint_zero_step_creates_the_generic_paths_state_and_changes_no_weight(tmp_path):
    reason = _fsdp2_available()
    if reason is not None:
        pytest.skip(reason)
    run_ranks(_generic_zero_step_worker, 1, str(tmp_path))
    found = torch.load(tmp_path / "generic.pt", weights_only=True)
    kahan, sr = found["bf16-kahan"], found["bf16-sr"]
    assert kahan["unchanged"] and sr["unchanged"]
    assert kahan["resumed"] and kahan["same"] and sr["resumed"] and sr["same"], found  # bit for bit
    # the bf16 weights' moments in the wrapper's state dtype, as its first real step makes them
    assert "torch.bfloat16:exp_avg:torch.bfloat16" in kahan["kinds"], kahan["kinds"]
    assert "torch.float32:exp_avg:torch.float32" in kahan["kinds"], kahan["kinds"]  # the LayerNorm's
    assert any(k.startswith("torch.bfloat16:sum:") for k in sr["kinds"]), sr["kinds"]

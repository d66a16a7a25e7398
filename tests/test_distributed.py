"""mixprec.distributed on two gloo ranks (CPU): one skip decision, DDP in the reduce dtype, FSDP2, restarts.

References: a single-process run on the same global batch (DDP and FSDP2 must match it
within the stated tolerances), an uninterrupted torchrun run (a killed and restarted one
must end bit for bit equal), and exact expected scale sequences for injected overflows.
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
from tests._dist import run_ranks

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2


# ------------------------------------------------------------------------- helpers
def _rank_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def _global_batch(task, step: int, size: int):
    return task.batch(size, torch.Generator().manual_seed(100 + step))


# Tolerance against one process on the global batch, after 4 SGD-momentum steps (lr 0.05):
# |diff| <= ATOL + RTOL * |reference|, i.e. within two bf16 ulps (plus a little). The runs
# differ only in rounding: each rank's weight gradients come out of bf16 GEMMs over fewer
# examples (partial sums rounded to bf16 in another grouping), a bf16 reduce rounds each
# rank's gradient to bf16 once more, and bf16 weights (master plans) round every update.
# Measured worst cases: DDP 6e-4 (bf16-mixed), 9.8e-4 = one bf16 ulp (bf16-master);
# FSDP2 8e-5 (bf16-mixed), 5e-4 (bf16-master).
ATOL, RTOL = 1e-3, 2.0**-7


def _check_close(a: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], label: str) -> None:
    """Every tensor of ``a`` within ATOL + RTOL * |ref|; the message names the worst element."""
    worst, where = 0.0, ""
    for name, ta in a.items():
        diff = (ta.float() - ref[name].float()).abs()
        ratio = (diff / (ATOL + RTOL * ref[name].float().abs())).max().item()
        if ratio > worst:
            worst, where = ratio, f"{name} (max |diff| {diff.max().item():.3g})"
    assert worst <= 1.0, f"{label}: {worst:.2f}x the tolerance at {where}"


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from mixprec.checkpoint import unwrap_model

    return {n: p.detach().clone() for n, p in unwrap_model(model).named_parameters()}


# ------------------------------------------------- one skip decision for every rank
def _inf_on_rank0(rank: int, world: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    # A model the user wrapped in DDP cannot be cast afterwards: refused, with the fix.
    with pytest.raises(ValueError, match=re.escape("Pass the unwrapped model and let mixprec wrap it")):
        MixedPrecision("bf16-master").prepare(DistributedDataParallel(torch.nn.Linear(2, 2)))

    task = build_task("mlp", size="tiny", seed=0)
    mp = MixedPrecision(get_plan("fp16-mixed", init_scale=2.0**10, growth_interval=2))
    opt = torch.optim.SGD(task.model.parameters(), lr=0.05)
    model, opt, criterion = mp.prepare(task.model, opt, criterion=task.criterion, ddp=True)
    records = []
    for step in range(6):
        x, y = task.batch(8, torch.Generator().manual_seed(1000 * rank + step))
        with mp.autocast():
            loss = criterion(model(x), y)
        if step == 3 and rank == 0:
            loss = loss * float("inf")  # a forward overflow on rank 0 only
        mp.backward(loss)
        if step == 1 and rank == 0:  # after DDP's all-reduce: only rank 0 sees it
            next(model.module.parameters()).grad[0, 0] = float("inf")
        result = mp.step()
        records.append(
            {"stepped": result.stepped, "reason": result.skip_reason, "scale": result.scale, "params": _params(model)}
        )
    torch.save(records, os.path.join(out, f"rank{rank}.pt"))
    torch.save(_fp8_amax_after_step(rank), os.path.join(out, f"fp8-rank{rank}.pt"))


def _fp8_amax_after_step(rank: int) -> torch.Tensor:
    """fp8-mixed under DDP, rank 1's inputs 6x larger: the latest amaxes after step()."""
    from mixprec.fp8 import fp8_layers

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    mp = MixedPrecision("fp8-mixed")
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), ddp=True)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)) * (1 + 5 * rank)
    with mp.autocast():
        loss = model(x).float().square().mean()
    mp.backward(loss)
    assert mp.step().stepped
    return torch.cat([layer.fp8_amax_history[:, 0] for layer in fp8_layers(model).values()])


@pytest.mark.distributed
def test_inf_on_rank0_only_every_rank_skips(tmp_path):
    run_ranks(_inf_on_rank0, WORLD, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD))
    for records in (r0, r1):
        assert [r["stepped"] for r in records] == [True, False, True, False, True, True]
        assert [r["reason"] for r in records] == [None, "overflow", None, "nonfinite_loss", None, None]
        # overflow halves the scale, a non-finite loss keeps it, 2 clean steps double it
        assert [r["scale"] for r in records] == [1024.0, 512.0, 512.0, 512.0, 1024.0, 1024.0]
    for step, (a, b) in enumerate(zip(r0, r1, strict=True)):
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), (step, name)
    # the skipped steps left the parameters alone
    for skipped in (1, 3):
        for name in r0[skipped]["params"]:
            assert torch.equal(r0[skipped]["params"][name], r0[skipped - 1]["params"][name])
    # fp8 plans: every rank ends the step with the same (MAX-reduced) amaxes
    amax0, amax1 = (torch.load(tmp_path / f"fp8-rank{r}.pt", weights_only=True) for r in range(WORLD))
    assert torch.equal(amax0, amax1) and amax0[0] > 5.0  # the input amax is rank 1's


# -------------------------------------------------------- DDP in the reduce dtype
DDP_STEPS, ACCUM, MICRO = 4, 2, 4  # global batch: WORLD * ACCUM * MICRO = 16 examples


def _train_ddp(plan_name: str, reduce_dtype: torch.dtype, rank: int, world: int, *, ddp: bool):
    """DDP (accumulating ACCUM micro-batches per rank) or one process on the whole global batch."""
    task = build_task("mlp", size="tiny", seed=0)
    mp = MixedPrecision(get_plan(plan_name, reduce_dtype=reduce_dtype), grad_accum_steps=ACCUM if ddp else 1)
    opt = torch.optim.SGD(task.model.parameters(), lr=0.05, momentum=0.9)
    model, opt, criterion = mp.prepare(task.model, opt, criterion=task.criterion, ddp=ddp)
    eval_x, eval_y = task.eval_batch(128)
    with torch.no_grad(), mp.autocast():
        first_eval = criterion(model(eval_x), eval_y).item()
    calls = []
    for step in range(DDP_STEPS):
        x, y = _global_batch(task, step, world * ACCUM * MICRO)
        if ddp:
            micro = zip(_rank_slice(x, rank, world).chunk(ACCUM), _rank_slice(y, rank, world).chunk(ACCUM), strict=True)
        else:
            micro = iter([(x, y)])
        for mx, my in micro:
            with mp.autocast():
                loss = criterion(model(mx), my)
            mp.backward(loss)
            if ddp:
                from mixprec.distributed import reduce_stats

                calls.append(reduce_stats(model).calls)
            result = mp.step()
        assert result.stepped
    with torch.no_grad(), mp.autocast():
        last_eval = criterion(model(eval_x), eval_y).item()
    out = {"params": _params(model), "evals": [first_eval, last_eval], "calls": calls}
    if ddp:
        from mixprec.distributed import reduce_stats

        out["stats"] = reduce_stats(model).as_dict()
    return out


def _ddp_worker(rank: int, world: int, plan_name: str, out: str) -> None:
    results = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        results[name] = _train_ddp(plan_name, dtype, rank, world, ddp=True)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.distributed
@pytest.mark.parametrize("plan_name", ["bf16-mixed", "bf16-master"])
def test_ddp_matches_single_process_and_bf16_halves_bytes(tmp_path, plan_name):
    run_ranks(_ddp_worker, WORLD, plan_name, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD))
    for reduce_name in ("fp32", "bf16"):
        a, b = r0[reduce_name], r1[reduce_name]
        # ranks bit-identical
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), (reduce_name, name)
        # it trains
        first, last = a["evals"]
        assert last < first, (reduce_name, a["evals"])
        # equal to one process on the global batch, within the stated tolerance
        reference = _train_ddp(plan_name, getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[reduce_name]),
                               0, WORLD, ddp=False)
        _check_close(a["params"], reference["params"], f"DDP {plan_name}, {reduce_name} reduce")
        # no all-reduce on the micro-batch that is not an accumulation boundary
        c = a["calls"]
        per_step = c[1]
        assert per_step >= 1
        assert c == [k * per_step for step in range(DDP_STEPS) for k in (step, step + 1)]
    fp32, bf16 = r0["fp32"]["stats"], r0["bf16"]["stats"]
    assert bf16["elements"] == fp32["elements"] > 0
    assert bf16["payload_bytes"] * 2 == fp32["payload_bytes"]
    assert bf16["wire_bytes"] * 2 == fp32["wire_bytes"]


# ------------------------------------------------------------------------- FSDP2
FSDP_STEPS, FSDP_INF_STEP = 4, 2


def _train_fsdp(plan_name: str, rank: int, world: int, *, shard: bool):
    from mixprec.distributed import fully_shard_model, local_tensor

    task = build_task("mlp", size="tiny", seed=0)
    mp = MixedPrecision(plan_name, clip_grad_norm=1.0)
    model = task.model
    if shard:
        model = fully_shard_model(model, mp.plan, units=(type(model.blocks[0]),))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt, criterion = mp.prepare(model, opt, criterion=task.criterion)
    norms, stepped = [], []
    for step in range(FSDP_STEPS):
        x, y = _global_batch(task, step, 16)
        if shard:
            x, y = _rank_slice(x, rank, world), _rank_slice(y, rank, world)
        with mp.autocast():
            loss = criterion(model(x), y)
        mp.backward(loss)
        if step == FSDP_INF_STEP and rank == 0:  # rank 0's local shard only
            first = next(iter(model.parameters()))  # the model's gradient (masters get theirs at step time)
            local_tensor(first.grad).view(-1)[0] = float("inf")
        result = mp.step()
        norms.append(result.grad_norm)
        stepped.append(result.stepped)
    if shard:
        params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    else:
        params = _params(model)
    return {"params": params, "norms": norms, "stepped": stepped, "plan": type(mp.plan).__name__}


def _fsdp_worker(rank: int, world: int, out: str) -> None:
    results = {name: _train_fsdp(name, rank, world, shard=True) for name in ("bf16-mixed", "bf16-master")}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def _fsdp2_available() -> str | None:
    """None if FSDP2 runs here with gloo on CPU, else why not."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2 needs torch >= 2.6)"
    if not torch.distributed.is_gloo_available():
        return "this torch build has no gloo backend"
    return None


@pytest.mark.distributed
def test_fsdp2_sharded_grads_skip_clip_and_norm_match_single_process(tmp_path):
    reason = _fsdp2_available()
    if reason is not None:
        pytest.skip(reason)
    run_ranks(_fsdp_worker, WORLD, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD))
    for plan_name in ("bf16-mixed", "bf16-master"):
        a, b = r0[plan_name], r1[plan_name]
        assert a["plan"] == "ShardedPlan"
        expected = [step != FSDP_INF_STEP for step in range(FSDP_STEPS)]
        assert a["stepped"] == b["stepped"] == expected
        assert a["norms"] == b["norms"]  # one norm, all-reduced over the shards
        reference = _train_fsdp(plan_name, 0, WORLD, shard=False)
        for step in range(FSDP_STEPS):
            if step == FSDP_INF_STEP:
                assert a["norms"][step] == float("inf") and reference["norms"][step] == float("inf")
                continue
            # the whole gradient's norm, not a shard's (a shard's would be ~1/sqrt(2) of it)
            assert a["norms"][step] == pytest.approx(reference["norms"][step], rel=2e-3), (plan_name, step)
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name])
        _check_close(a["params"], reference["params"], f"FSDP2 {plan_name}")


# ------------------------------------------------------------- torchrun, restarts
def _torchrun(args: list[str], ckpt_dir: Path, out: Path, *, max_restarts: int = 0) -> subprocess.CompletedProcess[str]:
    # A fresh store per restart: with the agent's shared store (torch's default since 2.5),
    # restarted workers can read the previous attempt's gloo/NCCL addresses (pytorch#135712).
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # stay on the loopback interface
    with socket.socket() as s:  # a free port on 127.0.0.1 for the rendezvous store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=1", f"--nproc-per-node={WORLD}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--local-addr=127.0.0.1",
        f"--max-restarts={max_restarts}", "--monitor-interval=0.1",
        str(ROOT / "examples" / "train_ddp.py"),
        *args, "--ckpt-dir", str(ckpt_dir), "--out", str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _leaves(obj):
    if isinstance(obj, dict):
        return [x for k in sorted(obj, key=str) for x in _leaves(obj[k])]
    if isinstance(obj, list | tuple):
        return [x for v in obj for x in _leaves(v)]
    return [obj]


@pytest.mark.long
@pytest.mark.distributed
def test_torchrun_killed_worker_resumes_bit_for_bit(tmp_path):
    args = ["--plan", "bf16-master", "--reduce-dtype", "bf16", "--grad-accum", "2", "--steps", "12",
            "--ckpt-every", "4", "--batch-size", "8", "--dataset-size", "128"]
    clean = _torchrun(args, tmp_path / "clean", tmp_path / "clean.pt")
    assert "start at step 0" in clean.stdout
    killed = _torchrun([*args, "--kill-at-step", "6"], tmp_path / "killed", tmp_path / "killed.pt", max_restarts=1)
    assert "rank 1: killing myself before step 6" in killed.stdout
    assert "[attempt 1] world 2, plan bf16-master, reduce bf16, start at step 4 (resumed from ckpt-000004.pt)" in killed.stdout
    a = torch.load(tmp_path / "clean.pt", weights_only=True)
    b = torch.load(tmp_path / "killed.pt", weights_only=True)
    assert a["extra"]["step"] == b["extra"]["step"] == 12
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    la, lb = _leaves(a["optimizers"]), _leaves(b["optimizers"])  # with the fp32 master weights
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    assert sorted(p.name for p in (tmp_path / "killed").iterdir()) == ["ckpt-000008.pt", "ckpt-000012.pt"]


# --------------------------------------------------------------- single process
def test_fsdp_policy_follows_the_plan():
    from mixprec.distributed import fsdp_policy, sharded_plan

    assert (fsdp_policy("bf16-mixed").param_dtype, fsdp_policy("bf16-mixed").reduce_dtype) == (None, torch.float32)
    master = fsdp_policy("bf16-master")
    assert (master.param_dtype, master.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fsdp_policy(get_plan("bf16-master", reduce_dtype=torch.bfloat16)).reduce_dtype == torch.bfloat16
    assert sharded_plan("bf16-master").fingerprint()["family"] == "fsdp2-master"
    assert sharded_plan("fp8-mixed").fingerprint()["family"] == "fsdp2-fp8"


def test_plan_for_ddp_gathers_master_grads_at_step_time():
    from mixprec.distributed import plan_for_ddp

    assert plan_for_ddp("bf16-master").accumulate_grads_in_fp32_hooks is False
    assert plan_for_ddp("bf16-mixed") == get_plan("bf16-mixed")


def test_wrap_ddp_without_process_group_says_how():
    from mixprec.distributed import wrap_ddp

    with pytest.raises(RuntimeError, match=re.escape("wrap_ddp() needs an initialised process group")):
        wrap_ddp(torch.nn.Linear(2, 2), "bf16-mixed")


def test_reduce_hook_refuses_8bit():
    from mixprec.distributed import GradReduceHook

    with pytest.raises(ValueError, match=re.escape("gradients cannot be reduced in e4m3")):
        GradReduceHook(torch.float8_e4m3fn)


def test_epoch_batches_reshuffle_every_epoch_and_resume_mid_epoch():
    from torch.utils.data import TensorDataset

    from mixprec.distributed import distributed_loader, epoch_batches

    data = TensorDataset(torch.arange(40))
    shards = []
    for rank in range(WORLD):
        loader = distributed_loader(data, 4, num_replicas=WORLD, rank=rank, seed=3)
        assert len(loader) == 5  # 20 examples per rank
        full = [(s.step, s.epoch, s.batch[0].tolist()) for s, _ in zip(epoch_batches(loader), range(12), strict=False)]
        resumed = [(s.step, s.epoch, s.batch[0].tolist())
                   for s, _ in zip(epoch_batches(loader, start_step=7), range(5), strict=False)]
        assert resumed == full[7:]
        assert [e for _, e, _ in full] == [0] * 5 + [1] * 5 + [2] * 2
        shards.append([[i for _, e, b in full if e == epoch for i in b] for epoch in (0, 1)])
    for epoch in (0, 1):  # each epoch: disjoint shards that cover the dataset
        a, b = (set(shards[rank][epoch]) for rank in range(WORLD))
        assert a.isdisjoint(b) and a | b == set(range(40))
    assert shards[0][0] != shards[0][1]  # a new shuffle every epoch


def _shard_after_prepare_worker(rank: int, world: int, out: str) -> None:
    """The order a framework's setup produces: optimizer built and prepared, then the model sharded."""
    from torch.distributed.fsdp import fully_shard

    results = {}
    for plan_name in ("bf16-mixed", "bf16-master", "bf16-kahan"):
        torch.manual_seed(0)  # no norm layer: one parameter dtype under every plan, as FSDP requires
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        mp = MixedPrecision(plan_name)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        model, opt = mp.prepare(model, opt)
        fully_shard(model)  # every parameter swapped for a DTensor shard; the optimizer holds the old ones
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        with mp.autocast():
            loss = model(x).float().pow(2).mean()
        mp.backward(loss)
        try:
            mp.step()
            results[plan_name] = "stepped"
        except RuntimeError as exc:
            results[plan_name] = str(exc)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.distributed
def test_an_optimizer_left_holding_pre_shard_parameters_is_an_error_not_a_silent_no_op(tmp_path):
    """Sharding after the optimizer was built (Fabric's joint setup under ModelParallelStrategy)
    left the optimizer stepping tensors the model no longer uses: nothing trained, nothing said."""
    reason = _fsdp2_available()
    if reason is not None:
        pytest.skip(reason)
    run_ranks(_shard_after_prepare_worker, WORLD, str(tmp_path))
    for rank in range(WORLD):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for plan_name, outcome in results.items():
            assert "no longer has" in outcome and "fully_shard_model" in outcome, (rank, plan_name, outcome)


class _Wrapper(torch.nn.Module):
    """As Lightning's configure_model pattern leaves a model: FSDP2 inside, not at the root."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _sharded_inside_worker(rank: int, world: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from mixprec.distributed import fsdp_policy

    results: dict[str, object] = {}
    for key, plan_name, with_policy in (
        ("mixed", "bf16-mixed", False), ("master-no-policy", "bf16-master", False), ("master", "bf16-master", True),
    ):
        model = _Wrapper()
        kwargs = {"mp_policy": fsdp_policy(plan_name)} if with_policy else {}
        for layer in (model.net[0], model.net[2], model.net):
            fully_shard(layer, **kwargs)
        mp = MixedPrecision(plan_name)
        try:
            model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        except ValueError as exc:
            results[key] = str(exc)
            continue
        losses = []
        for _ in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))  # one batch: the loss falls
            with mp.autocast():
                loss = model(x).float().pow(2).mean()
            mp.backward(loss)
            assert mp.step().stepped
            losses.append(float(loss))
        results[key] = {"plan": type(mp.plan).__name__, "losses": losses,
                        "params": [p.full_tensor().detach().clone() for p in model.parameters()]}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.distributed
def test_fsdp2_inside_a_wrapper_is_seen_and_a_missing_gather_dtype_is_named(tmp_path):
    """Sharded inside a wrapper (not at the root): the plan runs as on FSDP2; a master plan over
    units that gather in fp32 would compute in fp32 under a bf16 plan, so it is refused."""
    reason = _fsdp2_available()
    if reason is not None:
        pytest.skip(reason)
    run_ranks(_sharded_inside_worker, WORLD, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD))
    for key in ("mixed", "master"):
        assert r0[key]["plan"] == r1[key]["plan"] == "ShardedPlan", key
        assert r0[key]["losses"][-1] < r0[key]["losses"][0], key  # it trains
        for a, b in zip(r0[key]["params"], r1[key]["params"], strict=True):
            assert torch.equal(a, b), key
    for result in (r0, r1):
        message = result["master-no-policy"]
        assert "fp32: no param_dtype" in message and "fsdp_policy" in message, message

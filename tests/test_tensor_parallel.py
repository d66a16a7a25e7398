"""Every plan on PyTorch's own tensor and pipeline parallelism, against one process (two gloo ranks).

Layouts (each a cell run in sequence inside one launch of two ranks, so the suite pays for two
process starts in all):

- **TP**: ``parallelize_module`` with column/row-parallel attention (q, k, v / o) and MLP (up /
  down), the LayerNorms replicated plain parameters; every rank sees the whole batch.
- **2-D**: the same TP plan on a mesh's ``"tp"`` dimension inside FSDP2 on its ``"dp"`` dimension
  (``fully_shard_model``), as 1 x 2 and 2 x 1 meshes (with two ranks one of them is 1).
- **PP**: the two blocks as two ``PipelineStage``s, ``ScheduleGPipe`` (stages built without
  static shapes: torch infers them at the first step) and ``Schedule1F1B`` (static shapes), two
  micro-batches; the last stage's loss goes through ``mp.stage_loss``, every stage calls
  ``mp.stage_backward_done``.

Each cell trains ``STEPS`` steps with clipping (``CLIP`` is below the gradients' norm, so every
step clips), saves a checkpoint at ``SAVE_AT``, then: a fresh model loads it and trains the rest
(bit for bit the same state), and one more step gets an inf in rank 1's own gradient shard (TP,
2-D) or in stage 0's gradient (PP): every rank skips, the scale backs off everywhere, nothing
changes. The one-process reference runs the same plan, optimizer, clipping and batches on the
unsharded model. The issue's cases 1-7 have a test each (they failed before the fix).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests._dist import assert_same, run_ranks, whole

PLANS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-pure", "bf16-kahan", "bf16-sr")
FP16 = ("fp16-mixed", "fp16-master")
D, HEADS, HIDDEN, BATCH, SEQ = 16, 2, 32, 4, 8
STEPS, SAVE_AT, CLIP, LR = 6, 3, 0.05, 0.05
#: relative difference from one process allowed per plan (losses, weights, gradient norms): the
#: parallel runs add the row-parallel partial sums (and FSDP's gradient halves) in the plan's
#: compute dtype, so low-precision plans differ by the rounding of those sums
TOLERANCE = {"fp32": 1e-5, "bf16-mixed": 3e-2, "fp16-mixed": 5e-3, "bf16-master": 3e-2, "fp16-master": 5e-3,
             "bf16-pure": 5e-2, "bf16-kahan": 5e-2, "bf16-sr": 5e-2}
WATCHDOG_S = 600  # a launch that hangs (a collective one rank never reaches) fails instead


# ------------------------------------------------------------------ the model
class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm(x)
        q, k, v = (f(h).view(b, t, -1, D // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))  # local heads
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(a.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, HIDDEN)
        self.down = nn.Linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Attention(), MLP())


def _tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"0.q": ColwiseParallel(), "0.k": ColwiseParallel(), "0.v": ColwiseParallel(), "0.o": RowwiseParallel(),
            "1.up": ColwiseParallel(), "1.down": RowwiseParallel()}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, SEQ, D, generator=g), 0.5 * torch.randn(BATCH, SEQ, D, generator=g)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).square().mean()


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # SGD with momentum: a difference in the gradients stays proportional in the weights (Adam would
    # turn the rounding noise of a gradient that is zero in exact arithmetic, k's bias, into +-lr)
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def _fused_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """Fused AdamW, an optimizer that skips from a device flag (DTensor has a sharding rule for it,
    none for fused SGD): torch's fused kernels take DTensors or plain tensors, not both in one
    call, so a TP model's DTensors and its replicated plain parameters (the LayerNorms) go in two
    groups (one group fails in torch itself)."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if hasattr(p, "to_local")]},
              {"params": [p for p in params if not hasattr(p, "to_local")]}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=LR, fused=True)


def _session(plan: str, **kwargs: Any) -> Any:
    from mixprec import MixedPrecision

    return MixedPrecision(plan, clip_grad_norm=CLIP, **kwargs)


def _rel(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def _weights_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(_rel(got[k].float(), want[k].float()) for k in want)


def _scale(mp: Any) -> float:
    return float(mp.scaler.get_scale()) if mp.scaler.is_enabled() else 1.0


# ------------------------------------------------------------------ one process
def _reference(plan: str) -> dict[str, Any]:
    """The plan on the whole model and batch (each rank runs it alike; the decision's all-reduce
    over the default group sees equal flags)."""
    mp = _session(plan)
    model = _net()
    model, opt = mp.prepare(model, _optimizer(model))
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _batch(step)
        with mp.autocast():
            loss = _mse(model(x), y)
        mp.backward(loss)
        result = mp.step()
        losses.append(float(loss))
        norms.append(result.grad_norm)
    return {"losses": losses, "norms": norms, "weights": whole(model.state_dict())}


# ------------------------------------------------------------------ TP and 2-D
def _parallel_model(layout: str, plan: str) -> tuple[nn.Module, Any]:
    """The model parallelised for ``layout`` ("tp", "2d-1x2", "2d-2x1"), and its data-parallel coordinates."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from mixprec.distributed import fully_shard_model

    world = dist.get_world_size()
    if layout == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        return parallelize_module(_net(), mesh, _tp_plan()), (0, 1)
    dp = 1 if layout == "2d-1x2" else world
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(_net(), mesh["tp"], _tp_plan())
    model = fully_shard_model(model, plan, mesh=mesh["dp"], units=(Attention, MLP))
    return model, (mesh["dp"].get_local_rank(), dp)


def _rank_batch(step: int, where: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch(step)
    index, parts = where
    n = BATCH // parts
    return x[index * n:(index + 1) * n], y[index * n:(index + 1) * n]


def _mean_over_ranks(value: float, where: tuple[int, int]) -> float:
    """A data-parallel run's loss: the mean of the ranks' losses (TP ranks see one batch)."""
    t = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _local_grad(p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    assert g is not None
    return g.to_local() if hasattr(g, "to_local") else g


def _train_parallel(layout: str, plan: str, model: nn.Module, opt: Any, mp: Any, where: tuple[int, int],
                    start: int, stop: int, save: Callable[[int], None] | None = None) -> dict[str, Any]:
    losses, norms = [], []
    for step in range(start, stop):
        x, y = _rank_batch(step, where)
        with mp.autocast():
            loss = _mse(model(x), y)
        mp.backward(loss)
        result = mp.step()
        losses.append(_mean_over_ranks(float(loss), where))
        norms.append(result.grad_norm)
        if save is not None:
            save(step)
    return {"losses": losses, "norms": norms}


def _grid_cell(layout: str, plan: str, ref: dict[str, Any], folder: str) -> dict[str, Any]:
    from mixprec import load_checkpoint, save_checkpoint

    rank = dist.get_rank()
    path = os.path.join(folder, f"{layout}-{plan}.pt")
    mp = _session(plan)
    model, where = _parallel_model(layout, plan)
    model, opt = mp.prepare(model, _optimizer(model))
    out: dict[str, Any] = {}
    # case 1: every DTensor's local shard has the dtype the parameter says
    out["local_dtypes_match"] = all(
        (p.to_local().dtype if hasattr(p, "to_local") else p.dtype) == p.dtype for p in model.parameters())

    def save(step: int) -> None:
        if step == SAVE_AT - 1:
            save_checkpoint(path, model=model, optimizers=[opt], mp=mp)

    run = _train_parallel(layout, plan, model, opt, mp, where, 0, STEPS, save)
    weights = whole(model.state_dict())
    out["loss_rel"] = max(_rel(a, b) for a, b in zip(run["losses"], ref["losses"], strict=True))
    out["norm_rel"] = max(_rel(a, b) for a, b in zip(run["norms"], ref["norms"], strict=True))
    out["weight_rel"] = _weights_rel(weights, ref["weights"])
    out["clipped_every_step"] = all(n > CLIP for n in run["norms"])
    # an inf in rank 1's own gradient shard: skipped on every rank, the scale backs off on every rank
    before, scale = whole(model.state_dict()), _scale(mp)
    x, y = _rank_batch(STEPS, where)
    with mp.autocast():
        loss = _mse(model(x), y)
    mp.backward(loss)
    if rank == 1:
        _local_grad(model[1].up.weight).view(-1)[0] = float("inf")
    result = mp.step()
    after = whole(model.state_dict())
    out["inf_skipped"] = result.skipped and result.skip_reason == "overflow"
    out["inf_scale"] = [scale, _scale(mp)]
    out["inf_unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    # the checkpoint: a fresh model loads it and trains the rest, bit for bit
    mp2 = _session(plan)
    model2, _ = _parallel_model(layout, plan)
    model2, opt2 = mp2.prepare(model2, _optimizer(model2))
    load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2)
    _train_parallel(layout, plan, model2, opt2, mp2, where, SAVE_AT, STEPS)
    try:
        assert_same(whole(model2.state_dict()), weights, "model")
        out["resumed_bit_for_bit"] = True
    except AssertionError as e:
        out["resumed_bit_for_bit"] = f"differs at {e}"
    return out


# ------------------------------------------------------------------ PP
def _stage(plan: str, schedule_name: str, rank: int, *, loss: Callable[..., torch.Tensor] = _mse,
           fused: bool = False) -> tuple[Any, ...]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    mp = _session(plan)
    module = _net()[rank]
    module, opt = mp.prepare(module, (_fused_optimizer if fused else _optimizer)(module))
    static = schedule_name == "1f1b"  # GPipe's stages infer their shapes at the first step
    kwargs: dict[str, Any] = {}
    if static:
        dtype = torch.bfloat16 if plan == "bf16-pure" else torch.float32  # what stage 0 sends
        kwargs["input_args"] = (torch.empty(BATCH // 2, SEQ, D, dtype=torch.float32 if rank == 0 else dtype),)
    stage = PipelineStage(module, rank, dist.get_world_size(), torch.device("cpu"), **kwargs)
    cls = Schedule1F1B if static else ScheduleGPipe
    schedule = cls(stage, n_microbatches=2, loss_fn=mp.stage_loss(loss))  # (every rank: the schedule runs backward)
    return mp, module, opt, stage, schedule


def _pipeline_step(mp: Any, stage: Any, schedule: Any, step: int, inject: bool = False) -> tuple[Any, float | None]:
    x, y = _batch(step)
    losses: list[torch.Tensor] = []
    scale = _scale(mp)  # what the last stage's losses are multiplied by (a host read: the test's, not mixprec's)
    with mp.autocast(), mp.backward_context():
        if stage.is_first:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
    if inject and stage.is_first:
        next(p for p in stage.submod.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
    mp.stage_backward_done(stage, losses if stage.is_last else None)
    result = mp.step()
    return result, (sum(float(v) for v in losses) / len(losses) / scale) if losses else None


def _pipeline_cell(schedule_name: str, plan: str, ref: dict[str, Any], folder: str) -> dict[str, Any]:
    from mixprec import load_checkpoint, save_checkpoint

    rank = dist.get_rank()
    path = os.path.join(folder, f"pp-{schedule_name}-{plan}-stage{rank}.pt")
    mp, module, opt, stage, schedule = _stage(plan, schedule_name, rank)
    losses, norms = [], []
    for step in range(STEPS):
        result, loss = _pipeline_step(mp, stage, schedule, step)
        norms.append(result.grad_norm)
        losses.append(loss)
        if step == SAVE_AT - 1:
            save_checkpoint(path, model=module, optimizers=[opt], mp=mp)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [loss for loss in losses])
    losses = gathered[-1]  # the last stage's
    weights = {f"{rank}.{k}": v for k, v in whole(module.state_dict()).items()}
    out: dict[str, Any] = {"step0_stepped": True}
    out["loss_rel"] = max(_rel(a, b) for a, b in zip(losses, ref["losses"], strict=True))
    out["norm_rel"] = max(_rel(a, b) for a, b in zip(norms, ref["norms"], strict=True))
    out["weight_rel"] = _weights_rel(weights, {k: v for k, v in ref["weights"].items() if k in weights})
    out["clipped_every_step"] = all(n > CLIP for n in norms)
    before, scale = whole(module.state_dict()), _scale(mp)
    result, _ = _pipeline_step(mp, stage, schedule, STEPS, inject=True)  # an inf in stage 0's gradient
    out["inf_skipped"] = result.skipped and result.skip_reason == "overflow"
    out["inf_scale"] = [scale, _scale(mp)]
    out["inf_unchanged"] = all(torch.equal(before[k], v) for k, v in whole(module.state_dict()).items())
    mp2, module2, opt2, stage2, schedule2 = _stage(plan, schedule_name, rank)
    load_checkpoint(path, model=module2, optimizers=[opt2], mp=mp2)
    for step in range(SAVE_AT, STEPS):
        _pipeline_step(mp2, stage2, schedule2, step)
    try:
        assert_same(whole(module2.state_dict()), {k.split(".", 1)[1]: v for k, v in weights.items()}, "stage")
        out["resumed_bit_for_bit"] = True
    except AssertionError as e:
        out["resumed_bit_for_bit"] = f"differs at {e}"
    return out


def _case6_cell(plan: str) -> dict[str, Any]:
    """A stage built without static shapes: torch's schedule calls the loss function once on
    uninitialised data at its first step (here: a loss that is NaN on that first call)."""
    rank = dist.get_rank()
    calls = [0]

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        loss = _mse(out, y)
        return loss * float("nan") if calls[0] == 1 else loss

    mp, _, _, stage, schedule = _stage(plan, "gpipe", rank, loss=loss_fn)
    result, _ = _pipeline_step(mp, stage, schedule, 0)
    return {"step0_stepped": result.stepped, "loss_calls": calls[0]}


def _case5_micro_batch_done(plan: str) -> dict[str, Any]:
    """The documented composable route on a stage without a loss: micro_batch_done() still refuses
    (no loss was scaled here); stage_backward_done() is the entry that counts the schedule's backward."""
    rank = dist.get_rank()
    mp, _, _, stage, schedule = _stage(plan, "gpipe", rank)
    x, y = _batch(0)
    losses: list[torch.Tensor] = []
    with mp.autocast(), mp.backward_context():
        schedule.step(x) if stage.is_first else schedule.step(target=y, losses=losses)
    refused = ""
    if not stage.is_last:
        try:
            mp.micro_batch_done()
        except RuntimeError as e:
            refused = str(e)
    mp.stage_backward_done(stage, losses if stage.is_last else None)
    result = mp.step()
    return {"refused": refused, "stepped": result.stepped, "norm": result.grad_norm}


# ------------------------------------------------------------------ the cases on TP alone
def _tp_case_cells(folder: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from mixprec import MixedPrecision

    out: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    rank = dist.get_rank()
    # case 2: master plans on a TP model cast by torch itself (model.to(bf16) is correct), then prepared
    for plan, dtype in (("bf16-master", torch.bfloat16), ("fp16-master", torch.float16)):
        model = parallelize_module(_net().to(dtype), mesh, _tp_plan())
        mp = _session(plan)
        model, opt = mp.prepare(model, _optimizer(model))
        for step in range(2):
            x, y = _batch(step)
            with mp.autocast():
                loss = _mse(model(x.to(dtype)), y)
            mp.backward(loss)
            result = mp.step()
        out[f"case2-{plan}"] = {"stepped": result.stepped, "masters": type(opt).__name__,
                                "master_is_dtensor": hasattr(opt.master_of(model[1].up.weight), "to_local")}
    # case 3: the tracer and the explainer read local shards
    for plan, trace in (("bf16-mixed", True), ("bf16-pure", False), ("fp16-mixed", True)):
        model = parallelize_module(_net(), mesh, _tp_plan())
        mp = MixedPrecision(plan, trace_overflow=trace, max_consecutive_skips=50)
        model, opt = mp.prepare(model, _optimizer(model))
        big = 1e38 if plan.startswith("bf16") else 6e4
        if rank == 1:  # rank 1's shard of up's weight overflows up's output in the compute dtype
            with torch.no_grad():
                model[1].up.weight.to_local().fill_(big)
        findings = []
        for step in range(4):
            x, y = _batch(step)
            with mp.autocast():
                loss = _mse(model(x), y)
            mp.backward(loss)
            result = mp.step()
            finding = result.overflow
            findings.append(None if finding is None else (finding.module, finding.direction))
        out[f"case3-{plan}"] = {"skipped": result.skipped, "findings": findings,
                                "diagnosis": mp._explainer.diagnosis() if mp._explainer is not None else None}
    # case 7: prepared before parallelize_module: refused, naming parallelize_module
    for plan in ("bf16-mixed", "bf16-master"):
        model = _net()
        mp = _session(plan)
        model, opt = mp.prepare(model, _optimizer(model))
        model = parallelize_module(model, mesh, _tp_plan())
        x, y = _batch(0)
        with mp.autocast():
            loss = _mse(model(x), y)
        message = ""
        try:
            mp.backward(loss)
            mp.step()
        except RuntimeError as e:
            message = str(e)
        out[f"case7-{plan}"] = {"message": message}
    return out


# ------------------------------------------------------------------ the launches
def _guarded(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one cell on every rank; an error in it is the cell's result (every rank runs the same code,
    so they fail alike), and the ranks agree on the outcome before the next cell."""
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as e:
        result = {"error": f"{type(e).__name__}: {e}"[:2000], "where": traceback.format_exc(limit=-4)[-3000:]}
    result["seconds"] = round(time.perf_counter() - t0, 2)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    return {"rank0": gathered[0], "rank1": gathered[1]}


def _watchdog() -> None:
    timer = threading.Timer(WATCHDOG_S, lambda: os._exit(3))
    timer.daemon = True
    timer.start()


def _write(rank: int, path: str, results: dict[str, Any]) -> None:
    if rank == 0:
        with open(path, "w") as f:
            json.dump(results, f, default=str)


#: the plans whose steady step reads nothing back (the device-first step); the pure, Kahan and SR
#: wrappers still read one flag per step (docs/performance.md), here as without parallelism
DEVICE_FIRST = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master")


def _reads_cell(layout: str, plan: str) -> dict[str, Any]:
    """Host reads of a steady step's mixprec calls (backward and step: the decisions are device
    all-reduces over the mesh), counted on the third step."""
    from tests._syncs import count_syncs

    mp = _session(plan)
    model, coordinates = _parallel_model(layout, plan)
    model, opt = mp.prepare(model, _fused_optimizer(model))
    reads: dict[str, int] = {}
    where: dict[str, str] = {}
    for step in range(3):
        x, y = _rank_batch(step, coordinates)
        with mp.autocast():
            loss = _mse(model(x), y)
        with count_syncs() as counter:
            mp.backward(loss)
            mp.step()
        reads, where = dict(counter.counts), dict(counter.where)
    return {"reads": reads, "where": where}


def _pipeline_reads_cell(plan: str) -> dict[str, Any]:
    from tests._syncs import count_syncs

    mp, _, _, stage, schedule = _stage(plan, "1f1b", dist.get_rank(), fused=True)
    reads: dict[str, int] = {}
    where: dict[str, str] = {}
    for step in range(3):
        x, y = _batch(step)
        losses: list[torch.Tensor] = []
        with mp.autocast(), mp.backward_context():
            schedule.step(x) if stage.is_first else schedule.step(target=y, losses=losses)
        with count_syncs() as counter:
            mp.stage_backward_done(stage, losses if stage.is_last else None)
            mp.step()
        reads, where = dict(counter.counts), dict(counter.where)
    return {"reads": reads, "where": where}


def _grid_worker(rank: int, world: int, path: str, folder: str) -> None:
    _watchdog()
    results: dict[str, Any] = {}
    results["cases"] = _guarded("cases", lambda: _tp_case_cells(folder))
    for plan in DEVICE_FIRST:
        for layout in ("tp", "2d-1x2"):
            results[f"reads-{layout}/{plan}"] = _guarded("reads", lambda layout=layout, plan=plan: _reads_cell(
                layout, plan))
    for i, plan in enumerate(PLANS):
        ref = _reference(plan)
        for layout in ("tp", "2d-1x2" if i % 2 else "2d-2x1"):
            results[f"{layout}/{plan}"] = _guarded(layout, lambda layout=layout, ref=ref, plan=plan: _grid_cell(
                layout, plan, ref, folder))
    _write(rank, path, results)


def _pipeline_worker(rank: int, world: int, path: str, folder: str) -> None:
    _watchdog()
    results: dict[str, Any] = {}
    results["case5"] = _guarded("case5", lambda: _case5_micro_batch_done("bf16-mixed"))
    results["case6"] = _guarded("case6", lambda: _case6_cell("bf16-mixed"))
    for plan in DEVICE_FIRST:
        results[f"reads-pp/{plan}"] = _guarded("reads", lambda plan=plan: _pipeline_reads_cell(plan))
    for i, plan in enumerate(PLANS):
        ref = _reference(plan)
        schedule = "gpipe" if i % 2 == 0 else "1f1b"
        results[f"pp-{schedule}/{plan}"] = _guarded("pp", lambda plan=plan, ref=ref, schedule=schedule: _pipeline_cell(
            schedule, plan, ref, folder))
    _write(rank, path, results)


def _launch(worker: Callable[..., None], tmp: Path) -> dict[str, Any]:
    path = tmp / "results.json"
    folder = tmp / "ckpt"
    folder.mkdir()
    t0 = time.perf_counter()
    run_ranks(worker, 2, str(path), str(folder))
    results: dict[str, Any] = json.loads(path.read_text())
    results["wall_s"] = time.perf_counter() - t0
    return results


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _launch(_grid_worker, tmp_path_factory.mktemp("tp"))


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _launch(_pipeline_worker, tmp_path_factory.mktemp("pp"))


def _cell(results: dict[str, Any], key: str) -> dict[str, Any]:
    both = results[key]
    for rank in ("rank0", "rank1"):
        assert "error" not in both[rank], f"{key} on {rank}: {both[rank]['error']}\n{both[rank].get('where', '')}"
    return both  # type: ignore[no-any-return]


def _grid_keys() -> list[str]:
    return [f"{'tp' if j == 0 else ('2d-1x2' if i % 2 else '2d-2x1')}/{plan}" for i, plan in enumerate(PLANS) for j in (0, 1)]


def _pipeline_keys() -> list[str]:
    return [f"pp-{'gpipe' if i % 2 == 0 else '1f1b'}/{plan}" for i, plan in enumerate(PLANS)]


def _check_trained(both: dict[str, Any], key: str) -> None:
    plan = key.split("/")[1]
    tol = TOLERANCE[plan]
    for rank in ("rank0", "rank1"):
        r = both[rank]
        assert r["loss_rel"] <= tol and r["weight_rel"] <= tol and r["norm_rel"] <= tol, (key, rank, r)
        assert r["clipped_every_step"], (key, rank, r)


def _check_inf(both: dict[str, Any], key: str) -> None:
    plan = key.split("/")[1]
    scales = [both[rank]["inf_scale"] for rank in ("rank0", "rank1")]
    for rank in ("rank0", "rank1"):
        r = both[rank]
        assert r["inf_skipped"] and r["inf_unchanged"], (key, rank, r)
    assert scales[0] == scales[1], (key, scales)
    want = scales[0][0] / 2 if plan in FP16 else scales[0][0]
    assert scales[0][1] == want, (key, scales)


# ------------------------------------------------------------------ TP and 2-D tests
@pytest.mark.distributed
@pytest.mark.parametrize("key", _grid_keys())
def test_every_plan_on_tp_and_2d_trains_as_one_process_skips_together_and_resumes(grid: dict[str, Any], key: str) -> None:
    both = _cell(grid, key)
    _check_trained(both, key)
    _check_inf(both, key)
    for rank in ("rank0", "rank1"):
        assert both[rank]["resumed_bit_for_bit"] is True, (key, rank, both[rank]["resumed_bit_for_bit"])


@pytest.mark.distributed
@pytest.mark.parametrize("plan", ["bf16-master", "fp16-master", "bf16-pure", "bf16-kahan", "bf16-sr"])
def test_case1_prepare_casts_the_local_shards_of_a_tp_model(grid: dict[str, Any], plan: str) -> None:
    """Case 1: the cast of a DTensor parameter casts its local shard (it stayed fp32 under the
    bf16 label, and the first forward failed with mixed dtypes)."""
    both = _cell(grid, f"tp/{plan}")
    assert both["rank0"]["local_dtypes_match"] and both["rank1"]["local_dtypes_match"]


@pytest.mark.distributed
@pytest.mark.parametrize("plan", ["bf16-master", "fp16-master"])
def test_case2_master_plans_step_a_tp_model_cast_by_torch(grid: dict[str, Any], plan: str) -> None:
    """Case 2: master gradients and masters follow the shards (the foreach copy got DTensors and
    plain tensors mixed); the masters are DTensors sharded like their weights."""
    both = _cell(grid, "cases")
    for rank in ("rank0", "rank1"):
        r = both[rank][f"case2-{plan}"]
        assert r == {"stepped": True, "masters": "MasterWeightOptimizer", "master_is_dtensor": True}, r


@pytest.mark.distributed
@pytest.mark.parametrize("plan", ["bf16-mixed", "bf16-pure", "fp16-mixed"])
def test_case3_the_tracer_and_explainer_name_the_module_on_tp(grid: dict[str, Any], plan: str) -> None:
    """Case 3: the overflow tracer (trace_overflow=True) and the explainer (armed by recurring
    skips) read the local shards: rank 1, whose shard of ``1.up`` overflows, names that module."""
    both = _cell(grid, "cases")
    for rank in ("rank0", "rank1"):
        r = both[rank][f"case3-{plan}"]
        assert r["skipped"], r
        named = [f for f in r["findings"] if f is not None] + ([r["diagnosis"]] if r["diagnosis"] else [])
        assert named, r
        if rank == "rank1":
            # bf16 (1e38): up's output overflows in the forward. fp16 (6e4): up's output stays
            # finite (its input is layer-normed, so each row of the filled weight sums it to about
            # 0); the first non-finite value is a scaled gradient, which the tracer places in the
            # backward at 1.down, the module that hands it to up
            first = "1.down" if plan.startswith("fp16") else "1.up"
            assert any(first in str(f) for f in named), r


@pytest.mark.distributed
@pytest.mark.parametrize("plan", ["bf16-pure", "bf16-kahan"])
def test_case4_plans_without_masters_run_on_2d(grid: dict[str, Any], plan: str) -> None:
    """Case 4: under 2-D, bf16-pure / bf16-kahan were refused with a message telling the user to call
    fully_shard_model, which they had (the cast of the TP model had left its local shards fp32)."""
    key = next(k for k in _grid_keys() if k.startswith("2d") and k.endswith(f"/{plan}"))
    both = _cell(grid, key)
    _check_trained(both, key)


@pytest.mark.distributed
@pytest.mark.parametrize("plan", ["bf16-mixed", "bf16-master"])
def test_case7_preparing_before_parallelize_module_names_parallelize_module(grid: dict[str, Any], plan: str) -> None:
    """Case 7: the refusal names what happened (parallelize_module after prepare) and the order that works."""
    both = _cell(grid, "cases")
    for rank in ("rank0", "rank1"):
        message = both[rank][f"case7-{plan}"]["message"]
        assert "parallelize_module" in message and "fully_shard" not in message.split("Parallelise first")[0], message


# ------------------------------------------------------------------ PP tests
@pytest.mark.distributed
@pytest.mark.parametrize("key", _pipeline_keys())
def test_every_plan_on_two_pipeline_stages_trains_as_one_process_skips_together_and_resumes(
    pipeline: dict[str, Any], key: str
) -> None:
    both = _cell(pipeline, key)
    _check_trained(both, key)
    _check_inf(both, key)
    for rank in ("rank0", "rank1"):
        assert both[rank]["resumed_bit_for_bit"] is True, (key, rank, both[rank]["resumed_bit_for_bit"])


@pytest.mark.distributed
def test_case5_a_stage_without_a_loss_counts_its_backward_and_clips_on_the_whole_norm(pipeline: dict[str, Any]) -> None:
    """Case 5: a stage without a loss has a documented entry (stage_backward_done), and the norm is
    over both stages: equal on both, the one-process norm (within the plan's tolerance, in the
    pipeline cells), not each stage's own."""
    both = _cell(pipeline, "case5")
    assert "without a backward" in both["rank0"]["refused"]  # micro_batch_done() still counts only a scaled loss
    assert both["rank0"]["stepped"] and both["rank1"]["stepped"]
    assert both["rank0"]["norm"] == both["rank1"]["norm"]
    for key in _pipeline_keys():
        cell = _cell(pipeline, key)
        assert cell["rank0"]["norm_rel"] <= TOLERANCE[key.split("/")[1]], (key, cell["rank0"])


@pytest.mark.distributed
def test_case6_the_loss_of_torchs_shape_inference_is_not_counted(pipeline: dict[str, Any]) -> None:
    """Case 6: a stage built without static shapes calls the loss function once on uninitialised
    data (NaN here); that call is not this step's loss, so step 0 steps."""
    both = _cell(pipeline, "case6")
    assert both["rank1"]["loss_calls"] == 3  # shape inference, then the two micro-batches
    assert both["rank0"]["step0_stepped"] and both["rank1"]["step0_stepped"]


@pytest.mark.distributed
@pytest.mark.parametrize("plan", DEVICE_FIRST)
def test_a_steady_step_reads_nothing_back_on_tp_2d_and_pipeline_stages(
    grid: dict[str, Any], pipeline: dict[str, Any], plan: str
) -> None:
    """The device-first step's promise under TP, 2-D and PP: the skip decision, the loss scale and
    the norm over every group are device all-reduces, so mixprec's backward and step read nothing."""
    for results, layout in ((grid, "tp"), (grid, "2d-1x2"), (pipeline, "pp")):
        both = _cell(results, f"reads-{layout}/{plan}")
        for rank in ("rank0", "rank1"):
            assert both[rank]["reads"] == {}, (layout, plan, rank, both[rank]["reads"], both[rank]["where"])


def test_the_tolerances_cover_every_plan() -> None:
    assert set(TOLERANCE) == set(PLANS) and all(0 < t < 0.1 for t in TOLERANCE.values())
    assert not math.isnan(sum(TOLERANCE.values()))


# ------------------------------------------------------------------ the examples
def _torchrun(tmp: Path, script: str, *args: str) -> str:
    """``torchrun --nproc_per_node=2 examples/<script> ...`` on localhost (gloo)."""
    import socket
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root / "src"), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}",
           "--master-addr=127.0.0.1", str(root / "examples" / script), *args]
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:]
    return done.stdout


@pytest.mark.distributed
def test_the_tp_and_pipeline_examples_train(tmp_path: Path) -> None:
    """docs/distributed.md's examples run as written: 2-D bf16-master and a 1F1B fp16-mixed pipeline
    lower the loss; both pipeline stages end with finite weights."""
    _torchrun(tmp_path, "train_tp.py", "--plan", "bf16-master", "--dp", "1", "--steps", "8",
              "--out", str(tmp_path / "tp.pt"))
    tp = torch.load(tmp_path / "tp.pt", weights_only=True)
    assert tp["losses"][-1] < tp["losses"][0], tp["losses"]
    _torchrun(tmp_path, "train_pipeline.py", "--plan", "fp16-mixed", "--steps", "8", "--out", str(tmp_path / "pp"))
    last = torch.load(tmp_path / "pp.stage1", weights_only=True)
    assert last["losses"][-1] < last["losses"][0], last["losses"]
    for k in (0, 1):
        weights = torch.load(tmp_path / f"pp.stage{k}", weights_only=True)["weights"]
        assert weights and all(torch.isfinite(w).all() for w in weights.values())

"""Pipeline parallelism (``torch.distributed.pipelining``) under a precision plan: the stage facts.

A pipeline schedule (``ScheduleGPipe``, ``Schedule1F1B``, ...) runs every micro-batch's forward
and backward of a stage inside ``schedule.step(...)``; only the last stage has a loss. What
mixprec needs to know of a stage, and what it adds across stages:

- the stage's process group (``PipelineStage(..., group=...)``, the default group by default):
  the gradient norm of the whole model is the norm over every stage,
  ``sqrt(sum of each stage's squared norm)`` (one device all-reduce, :func:`norm_over_stages`),
  so clipping on every stage uses the same factor a single process would;
- whether a stage is the last (it passes the schedule's losses, so a non-finite loss skips every
  stage without shrinking the loss scale);
- that the skip decision spans every stage: the session's process group must hold every rank
  of the pipeline group (:func:`check_decision_covers`); the default group does.

The loss scale is one for the whole pipeline: every rank's scaler learns the same agreed flag at
every step, so the scale the last stage multiplies its losses by is the scale every stage
unscales its gradients with.

>>> from mixprec.distributed.pipeline import pipeline_stages
>>> pipeline_stages(object(), "stage_backward_done()")
Traceback (most recent call last):
...
TypeError: stage_backward_done() expects the torch.distributed.pipelining stage (a PipelineStage) this rank runs, or a list of them, got object
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from mixprec.plans import Plan
from mixprec.process_groups import resolve_group

__all__ = ["check_decision_covers", "check_stage_plan", "norm_over_stages", "pipeline_stages", "stage_group"]


def _is_stage(obj: Any) -> bool:
    return all(hasattr(obj, name) for name in ("is_last", "is_first", "stage_index", "num_stages", "submod"))


def pipeline_stages(stage: Any, caller: str) -> list[Any]:
    """``stage`` (one ``PipelineStage``, or a list of them: the stages of one rank under an
    interleaved schedule) as a list; a ``TypeError`` naming what is expected otherwise."""
    stages = list(stage) if isinstance(stage, list | tuple) else [stage]
    if not stages or not all(_is_stage(s) for s in stages):
        bad = next((s for s in stages if not _is_stage(s)), stage)
        raise TypeError(
            f"{caller} expects the torch.distributed.pipelining stage (a PipelineStage) this rank runs, or a list "
            f"of them, got {type(bad).__name__}"
        )
    return stages


def stage_group(stages: Sequence[Any]) -> Any:
    """The process group the stages communicate over (their ``group``; None: the default group)."""
    groups = {id(getattr(s, "group", None)): getattr(s, "group", None) for s in stages}
    if len(groups) > 1:
        raise ValueError("the stages of one rank belong to different pipeline process groups; pass stages of one pipeline")
    group = next(iter(groups.values()))
    return group if group is not None else dist.group.WORLD


def check_stage_plan(plan: Plan, caller: str) -> None:
    """Refuse a plan whose step agrees on values that differ per stage: fp8 all-reduces every fp8
    layer's amax over the session's group, and stages hold different layers."""
    family = getattr(plan, "base_family", None) or plan.family
    if family == "fp8":
        raise ValueError(
            f"{caller}: plan {plan.name!r} under pipeline parallelism is not supported: its step all-reduces every "
            "fp8 layer's amax over all ranks, and each stage holds other layers. Train the stages in 'bf16-mixed' "
            "(or 'bf16-master'), or use fp8-mixed under DDP or FSDP2 without pipeline stages"
        )


def check_decision_covers(process_group: Any, pipeline_group: Any, caller: str) -> None:
    """Refuse a session group that does not hold every rank of the pipeline group: the skip
    decision and the loss scale would then differ between stages (stage 0 skipping while stage 1
    steps). The default group (``process_group=None``) holds every rank."""
    group = resolve_group(process_group)
    if group is None or group is dist.group.WORLD or pipeline_group is None:
        return
    outer = set(dist.get_process_group_ranks(group))
    inner = set(dist.get_process_group_ranks(pipeline_group))
    if not inner <= outer:
        raise ValueError(
            f"{caller}: MixedPrecision(process_group=...) holds ranks {sorted(outer)}, but this pipeline's stages run on "
            f"ranks {sorted(inner)}: the skip decision and the loss scale would not be agreed between the stages. Use "
            "MixedPrecision(process_group=None) (the default group spans every stage and replica) or a group holding "
            "every rank of the pipeline"
        )


def norm_over_stages(norm: torch.Tensor, group: Any) -> torch.Tensor:
    """The 2-norm over every stage: each stage's ``norm`` squared, summed over ``group`` (one device
    all-reduce, no host read), square-rooted. inf and NaN stay non-finite."""
    squared = norm.detach().to(torch.float32).square()
    dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=group)
    return squared.sqrt()

"""The halves of a training step, for frameworks that own the loop.

:class:`ComposableSteps` is the part of :class:`mixprec.MixedPrecision` a framework's
loop calls instead of ``mp.backward`` and friends: :meth:`~ComposableSteps.scale_loss`,
:meth:`~ComposableSteps.backward_context`, :meth:`~ComposableSteps.micro_batch_done`,
:meth:`~ComposableSteps.unscale_`, :meth:`~ComposableSteps.grad_norm`,
:meth:`~ComposableSteps.clip_grad_norm_`. ``MixedPrecision`` builds on it (the one-line
path calls these too); the state it reads is set up by ``MixedPrecision.__init__`` and
``prepare``. Each goes through the step's state machine (:class:`mixprec.phases.StepPhases`):
a call out of order raises an error naming the order.

>>> import torch
>>> from mixprec import MixedPrecision
>>> _ = torch.manual_seed(0)
>>> model = torch.nn.Linear(4, 2)
>>> mp = MixedPrecision("fp16-mixed")
>>> model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
>>> with mp.autocast():
...     loss = model(torch.randn(3, 4)).float().mean()
>>> with mp.backward_context():
...     mp.scale_loss(loss).backward()   # the framework runs backward itself
>>> mp.micro_batch_done()
>>> norm = mp.clip_grad_norm_(1.0)      # true gradients: unscaled first
>>> mp.step().stepped
True
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mixprec.composable.stages import StageLoss
from mixprec.distributed.pipeline import (
    check_decision_covers,
    check_stage_plan,
    norm_over_stages,
    pipeline_stages,
    stage_group,
)
from mixprec.nested import by_device_dtype
from mixprec.optim import InBackwardOptimizer
from mixprec.options import check_ready
from mixprec.phases import Phase, StepPhases
from mixprec.plans import Plan
from mixprec.process_groups import world_size
from mixprec.scaling import LossScaler
from mixprec.scaling.grads import grad_tensors
from mixprec.step import (
    NormMemo,
    SkipDecision,
    StepResult,
    call_hook,
    check_loss,
    clip_,
    total_norm,
    unscale_all,
)

__all__ = ["ComposableSteps"]


def _first_parameter(module: torch.nn.Module) -> list[tuple[dict[str, Any], str, Any]] | None:
    """Where ``next(iter(module.parameters()), None)`` sits: the (dict, key, value) links from
    ``module`` down to it (``_modules`` entries, then one ``_parameters`` entry), or None."""
    for name, p in module._parameters.items():
        if p is not None:
            return [(module._parameters, name, p)]
    for name, child in module._modules.items():
        if child is not None and (below := _first_parameter(child)) is not None:
            return [(module._modules, name, child), *below]
    return None


@contextlib.contextmanager
def _guarded(
    context: contextlib.AbstractContextManager[Any], in_backward: InBackwardOptimizer, on_undo: Callable[[], None]
) -> Iterator[Any]:
    """``context`` inside ``in_backward.guard()``: a backward an exception stops is undone, and
    ``on_undo`` drops it from the step."""
    with in_backward.guard(on_undo), context as value:
        yield value


class FirstParameter:
    """The model's first parameter, found once and then checked with a few dict lookups.

    The device is read a few times a step, and a walk down the module tree costs ~30 us
    once a backward has left the caches cold. The parameter found stays the answer while
    every link from the model down to it still holds (``model.to()`` keeps the parameter
    objects); a framework that replaces it or a module above it makes the next read walk again.
    A parameter added after it was found, earlier in ``parameters()`` order, is not seen: it
    matters only if it sits on another device than the rest of the model.
    """

    def __init__(self) -> None:
        self._model: torch.nn.Module | None = None
        self._links: list[tuple[dict[str, Any], str, Any]] | None = None

    def of(self, model: torch.nn.Module) -> torch.nn.Parameter | None:
        links = self._links
        if model is self._model and links is not None:
            for d, k, v in links:
                if d.get(k) is not v:
                    break
            else:
                return links[-1][2]
        self._model, self._links = model, _first_parameter(model)
        return None if self._links is None else self._links[-1][2]


class ComposableSteps:
    """Loss scaling, backward bookkeeping, unscaling and clipping: one step's halves.

    A base of :class:`mixprec.MixedPrecision`, not used alone: the attributes below are
    set up by ``MixedPrecision.__init__`` and ``prepare``.
    """

    plan: Plan
    scaler: LossScaler
    model: torch.nn.Module | None
    optimizers: list[torch.optim.Optimizer]
    _device: torch.device | None  # the device= argument, if any
    process_group: Any
    grad_accum_steps: int
    last_result: StepResult | None
    clip_grad_norm: float | None
    _decision: SkipDecision
    _norm_memo: NormMemo
    _phases: StepPhases  # where the step stands: every half goes through it
    _ddp: bool
    _first: FirstParameter
    _in_backward: InBackwardOptimizer | None  # optimizer_in_backward=True: the updates run inside backward
    _pipeline_group: Any = None  # a pipeline stage's group (stage_backward_done): the norm is over every stage
    _stage_losses_list: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def _stage_losses(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(scaled, unscaled) of each stage loss since the last :meth:`stage_backward_done`."""
        if self._stage_losses_list is None:
            self._stage_losses_list = []
        return self._stage_losses_list

    @property
    def device(self) -> torch.device | None:
        """``device=`` if given, else where the model's parameters are now: a framework may
        move the model after :meth:`~mixprec.MixedPrecision.prepare` (Lightning, Accelerate)."""
        if self._device is not None or self.model is None:
            return self._device
        first = self._first.of(self.model)
        return None if first is None else first.device

    @property
    def device_type(self) -> str:
        device = self.device
        return "cpu" if device is None else device.type

    @property
    def _micro(self) -> int:
        """Backwards counted since the last step."""
        return self._phases.micro

    @property
    def phase(self) -> Phase:
        """Where the current step stands (:class:`mixprec.phases.Phase`): ``IDLE``,
        ``ACCUMULATING``, ``BACKWARD_DONE``, ``UNSCALED``, ``CLIPPED``, then ``STEPPED`` or
        ``SKIPPED``. A call out of order raises an error naming the order. Right after a step
        decided on the device, telling ``STEPPED`` from ``SKIPPED`` reads its outcome."""
        if self._phases.undecided:
            self.settle_outcome()
        return self._phases.phase

    def is_accumulating(self) -> bool:
        """True when the next backward() is not at an accumulation boundary."""
        return (self._phases.micro + 1) % self.grad_accum_steps != 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``.backward()`` on, for frameworks that run backward themselves.

        Keeps the loss for the skip decision and multiplies it by the loss scale (fp16
        plans); it does not divide by ``grad_accum_steps``. Run the backward inside
        :meth:`backward_context`, then call :meth:`micro_batch_done` (:meth:`backward` does all three).
        """
        return self._scale_loss(loss, "scale_loss()")

    def _scale_loss(self, loss: torch.Tensor, caller: str) -> torch.Tensor:
        check_loss(loss, caller)
        if self._in_backward is not None:  # one backward per step; undo one an exception stopped
            self._in_backward.begin(caller)
        phases = self._phases
        phases.check_backward(caller, self.grad_accum_steps)
        self._decision.record_loss(loss)
        if (phases.loose or phases.pending) and not self.is_ddp and world_size() == 1:
            # another backward in this step (manual accumulation: Lightning's manual optimisation,
            # Fabric, two backward() calls, or two before one micro_batch_done()): move the last one's
            # gradients into the wrappers' wide accumulators first, so micro-batches add up in fp32
            # however the loop marks boundaries.
            # Not across ranks: a DDP / FSDP wrapper a framework put around the model reduces .grad.
            call_hook(self.optimizers, "accumulate_grads")
        phases.loose = False
        scaled = self.scaler.scale(loss)
        phases.pending += 1
        return scaled

    def backward_context(self) -> contextlib.AbstractContextManager[Any]:
        """The context a backward runs in (the plan's): a custom op policy also holds where
        backward recomputes the forward (activation checkpointing); tf32 stays on. Under
        ``optimizer_in_backward=True``, a backward that an exception stops inside it is undone."""
        if self._in_backward is not None:
            return _guarded(self.plan.backward_context(self.device_type), self._in_backward, self._phases.backward_failed)
        return self.plan.backward_context(self.device_type)

    def micro_batch_done(self, boundary: bool | None = None) -> None:
        """Count one finished backward; between accumulation boundaries, let the optimizer
        wrappers move low-precision gradients into wider accumulators (not under DDP).

        ``boundary`` says whether this backward ends the accumulation window; by default
        ``grad_accum_steps`` decides. A framework that decides the boundary itself passes it:
        ``step()`` then steps there (after 2 of 4 micro-batches too), and more backwards
        before that ``step()`` add to the same step. Called without a backward since the last
        one (no :meth:`scale_loss`), it is an error: nothing is counted without a backward.
        Under ``optimizer_in_backward=True`` every backward is a boundary, and this reads
        whether its updates stood (one host read).
        """
        self._phases.check_done("micro_batch_done()", boundary)
        if self._in_backward is not None:
            if boundary is False:
                raise ValueError(
                    "micro_batch_done(boundary=False) under optimizer_in_backward=True: each backward already "
                    "updated the weights, so gradients cannot accumulate over micro-batches; call step() after "
                    "each backward, or use optimizer_in_backward=False to accumulate"
                )
            self._in_backward.finish(hold=True, caller="micro_batch_done()")  # step() reads the outcome
        if not self._phases.backward_done(boundary, self.grad_accum_steps) and not self.is_ddp:
            call_hook(self.optimizers, "accumulate_grads")
        else:
            self._phases.loose = True

    def stage_loss(self, loss_fn: Callable[..., torch.Tensor]) -> StageLoss:
        """The ``loss_fn`` to give a pipeline schedule (``torch.distributed.pipelining``) on the last
        stage: it returns ``loss_fn``'s loss times the loss scale (fp16 plans), which the schedule
        backpropagates through every stage. ``schedule.step(..., losses=losses)`` then hands back
        these scaled losses (divide by ``mp.scaler.get_scale()`` to log them); pass them to
        :meth:`stage_backward_done`. See docs/distributed.md, "Pipeline parallelism"."""
        if not callable(loss_fn):
            raise TypeError(f"stage_loss() expects the loss function (output, target) -> loss, got {loss_fn!r}")
        return StageLoss(self, loss_fn)

    def stage_backward_done(self, stage: Any, losses: list[torch.Tensor] | None = None, *,
                            boundary: bool | None = None) -> None:
        """Count the backward a pipeline schedule ran on this rank's stage(s) in ``schedule.step(...)``:
        what :meth:`micro_batch_done` is for a loop that runs its own backward, for every stage, with
        or without a loss (the schedule backpropagates the last stage's loss through all of them).

        ``stage``: the ``PipelineStage`` this rank runs (or a list, under an interleaved schedule).
        Its process group (``PipelineStage(group=...)``, the default group by default) is where the
        gradient norm is summed from now on: ``grad_norm()``, clipping and ``StepResult.grad_norm``
        are the whole model's norm, as one process measures it (every stage must then call them,
        as every stage calls ``step()``). ``losses``: on the last stage, the list that
        ``schedule.step(..., losses=losses)`` filled from :meth:`stage_loss`: a non-finite loss then
        skips the step on every stage without shrinking the loss scale (without it, such a loss
        shows as an overflow of the gradients). The skip decision spans every stage: the session's
        process group must hold every rank of the pipeline (the default group does).
        ``boundary``: as for :meth:`micro_batch_done`.
        """
        caller = "stage_backward_done()"
        stages = pipeline_stages(stage, caller)
        if self._in_backward is not None:
            raise RuntimeError(
                f"{caller} under optimizer_in_backward=True: a pipeline schedule runs several backwards per step, "
                "and each stage's update would need the decision of every stage before it. Use optimizer_in_backward=False"
            )
        check_stage_plan(self.plan, caller)
        group = stage_group(stages)
        check_decision_covers(self.process_group, group, caller)
        last = any(s.is_last for s in stages)
        if losses is not None and not last:
            raise ValueError(
                f"{caller} got losses= on a stage that is not the last: only the last stage computes the loss. Pass "
                "losses= on the last stage only"
            )
        if losses is not None and (isinstance(losses, torch.Tensor) or not isinstance(losses, list | tuple)):
            raise TypeError(f"{caller}: losses= must be the list schedule.step(..., losses=...) filled, got {type(losses).__name__}")
        phases = self._phases
        phases.check_backward(caller, self.grad_accum_steps)
        unscaled = {id(scaled): value for scaled, value in self._stage_losses}
        for loss in losses or ():
            check_loss(loss, caller)
            self._decision.record_loss(unscaled.get(id(loss), loss))  # (not the schedule's call on shapes alone)
        self._stage_losses.clear()
        self._pipeline_group = group
        phases.pending += 1  # the schedule ran this stage's backward
        self.micro_batch_done(boundary)

    @property
    def is_ddp(self) -> bool:
        """Whether DDP reduces the model's gradients (its reducer owns ``.grad``): after
        ``prepare(..., ddp=True)``, for a DDP-wrapped model, or set by a framework that wraps it."""
        return self._ddp

    @is_ddp.setter
    def is_ddp(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"is_ddp must be True or False, got {value!r}")
        self._ddp = value

    def _grads(self) -> list[torch.Tensor]:
        return [g for opt in self.optimizers for g in grad_tensors(opt)]

    def unscale_(self) -> None:
        """Gather and unscale every optimizer's gradients once for this step (idempotent).

        Afterwards the optimizers' and the model's parameters hold true gradients (a
        master-weight wrapper copies them back), for a framework's clipping, logging and
        hooks; :meth:`step` does not unscale again and gathers in-place changes. Only at the
        accumulation boundary (between the last backward and :meth:`step`): anywhere else it
        is an error naming the order.
        """
        if self._in_backward is not None:
            self._in_backward.refuse_gradients("unscale_()")
        self._unscale("unscale_()")
        if not self._phases.published:
            call_hook(self.optimizers, "publish_grads")
            self._phases.published = True

    def _unscale(self, caller: str) -> None:
        phases = self._phases
        if phases.phase is Phase.UNSCALED or phases.phase is Phase.CLIPPED:  # (checked when it was set)
            return
        check_ready(self.model, self.optimizers, caller)
        phases.gradients_ready(caller, self.grad_accum_steps)
        again, phases.unscale_started = phases.unscale_started, True  # again: an earlier call was interrupted
        unscale_all(self.plan, self.model, self.optimizers, self.scaler, self.process_group, again=again)  # type: ignore[arg-type]
        phases.unscaled()

    def grad_norm(self) -> torch.Tensor:
        """The true (unscaled) total 2-norm of every optimizer's gradients (unscales first);
        after :meth:`clip_grad_norm_`, the norm before clipping (what ``step()`` reports)."""
        if self._in_backward is not None:
            self._in_backward.refuse_gradients("grad_norm()")
        self._unscale("grad_norm()")
        return self._norm(self._grads(), remember=True)

    def _norm(self, grads: list[torch.Tensor], *, remember: bool) -> torch.Tensor:
        """The total norm of ``grads``, measured once a step while they stay unchanged
        (clipping, logging and the skip decision then read the gradients once).
        ``remember``: keep it for a later reader this step (the skip decision is the last)."""
        norm = self._norm_memo.get(grads)
        if norm is None:
            # gradients changed since a clip a wrapper deferred (remainder masters apply it in fp32
            # inside the step): it goes into .grad now, before they are measured or clipped again
            call_hook(self.optimizers, "apply_pending_grad_scales")
            norm = total_norm(grads, None if grads else self.device)  # the device only places an empty total
            if self._pipeline_group is not None:  # a pipeline stage: the norm of every stage's gradients together
                norm = norm_over_stages(norm, self._pipeline_group)
            if remember:
                self._norm_memo.remember(grads, norm)
        return norm

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Unscale, then clip the true gradients to a total norm of ``max_norm``; returns the norm
        before clipping (as ``torch.nn.utils.clip_grad_norm_``). A non-finite norm clips nothing:
        the step will be skipped.

        Once per step: called again with the same (or a larger) ``max_norm`` it changes nothing
        (the gradients are within it already) and returns the same norm; a smaller one would
        clip a second time and is an error, as is a ``max_norm`` above
        ``MixedPrecision(clip_grad_norm=...)``, which ``step()`` would clip again. Gradients
        changed in place after the clip are measured and clipped again as new gradients.
        """
        if self._in_backward is not None:
            self._in_backward.refuse_gradients("clip_grad_norm_()")
        if not isinstance(max_norm, int | float) or isinstance(max_norm, bool) or not max_norm > 0:
            raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
        limit = self.clip_grad_norm
        if limit is not None and max_norm > limit:
            raise ValueError(
                f"clip_grad_norm_({max_norm!r}) with MixedPrecision(clip_grad_norm={limit!r}): step() would clip "
                f"these gradients a second time, to {limit!r}. Clip in one place: drop one of the two, or pass "
                f"max_norm <= {limit!r}"
            )
        self._unscale("clip_grad_norm_()")
        norm = self._clip(self._grads(), float(max_norm), "clip_grad_norm_()", None)
        self._phases.clipped_by_caller()
        return norm

    def _clip(self, grads: list[torch.Tensor], max_norm: float, caller: str, norm: torch.Tensor | None,
              skip: torch.Tensor | None = None) -> torch.Tensor:
        """Clip ``grads`` to ``max_norm`` once per step; returns their norm before any clipping.

        ``norm``: their norm, when the caller measured it (the skip decision); None: from the
        memo, or measured now. Gradients already clipped to ``max_norm`` or less are left as
        they are; a tighter second clip is refused (it would clip twice)."""
        memo = self._norm_memo
        before = memo.get(grads)
        if before is not None and memo.clipped_to is not None:
            if max_norm >= memo.clipped_to:
                return before
            raise RuntimeError(
                f"{caller} would clip this step's gradients to {max_norm:g} after they were clipped to "
                f"{memo.clipped_to:g}: a second clip. Clip once per step, with the smallest max_norm "
                "(MixedPrecision(clip_grad_norm=...) clips in step(), after any clip_grad_norm_())"
            )
        if before is None:
            before = norm if norm is not None else self._norm(grads, remember=False)  # (_norm settles deferred clips)
        clip_(grads, before, max_norm, self.optimizers, skip)
        if norm is None:  # a framework's clip: step() reads the norm, and knows they are clipped
            memo.remember(grads, before, clipped_to=max_norm)  # finite exactly when the norm is
        return before

    def clip_grad_value_(self, clip_value: float) -> None:
        """Unscale, then clamp every true gradient to ``[-clip_value, clip_value]`` (as
        ``torch.nn.utils.clip_grad_value_``; inf/NaN gradients still skip the step)."""
        if self._in_backward is not None:
            self._in_backward.refuse_gradients("clip_grad_value_()")
        if (
            not isinstance(clip_value, int | float)
            or isinstance(clip_value, bool)
            or not 0 < clip_value < math.inf
        ):
            raise ValueError(f"clip_value must be a positive finite number, got {clip_value!r}")
        self._unscale("clip_grad_value_()")
        call_hook(self.optimizers, "apply_pending_grad_scales")  # a deferred norm clip comes first
        for gs in by_device_dtype(self._grads()).values():
            torch._foreach_clamp_min_(gs, -float(clip_value))
            torch._foreach_clamp_max_(gs, float(clip_value))

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last :meth:`step` at an accumulation boundary skipped the update (right
        after that step it waits for the device: the decision is made there)."""
        return self.last_result is not None and self.last_result.skipped

    def settle_outcome(self) -> None:
        """The host bookkeeping of the last decided step (see :class:`mixprec.stepping.StepRunner`)."""

"""The front door: :class:`MixedPrecision` runs a training loop under a precision plan.

>>> import torch
>>> from mixprec import MixedPrecision
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
>>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
>>> mp = MixedPrecision("bf16-mixed")
>>> model, opt, criterion = mp.prepare(model, opt, criterion=torch.nn.CrossEntropyLoss())
>>> x, y = torch.randn(4, 8), torch.tensor([0, 1, 0, 1])
>>> with mp.autocast():
...     loss = criterion(model(x), y)
>>> mp.backward(loss)
>>> result = mp.step()
>>> result.stepped, loss.dtype
(True, torch.float32)
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from mixprec.buffers import BufferGuard
from mixprec.compiling import check_environment
from mixprec.composable import FirstParameter
from mixprec.distributed.ddp import is_ddp
from mixprec.distributed.fsdp import has_fsdp
from mixprec.explainer import OverflowExplainer
from mixprec.optim import InBackwardOptimizer
from mixprec.options import (
    check_collapse_options,
    check_in_backward,
    check_session_options,
)
from mixprec.phases import StepPhases
from mixprec.plans import Plan, get_plan, plan_names
from mixprec.plans.auto import is_auto
from mixprec.prepare import (
    Fp32Criterion,
    PreparedModel,
    check_optimizers,
    check_shared,
    prepare_model,
    wrap_optimizers,
)
from mixprec.process_groups import check_group, is_distributed, resolve_group
from mixprec.resume import fp32_state_dict, session_state, validated_scaler_state
from mixprec.scaling import ConstantLossScaler, LossScaler
from mixprec.step import (
    NormMemo,
    SkipDecision,
    StepLedger,
    StepResult,
)
from mixprec.stepping import StepRunner

__all__ = ["MixedPrecision", "StepResult"]

# The session that prepared each module (by id: the module the loop calls, its DDP wrapper, the model
# inside), weak on both sides: it keeps neither alive, and a copy or an unpickled model is no session's.
_PREPARED_BY: dict[int, tuple[weakref.ref[torch.nn.Module], weakref.ref[MixedPrecision]]] = {}


def session_of(model: torch.nn.Module) -> MixedPrecision | None:
    """The :class:`MixedPrecision` whose ``prepare`` / ``prepare_model`` prepared ``model`` (the module
    it returned, its DDP wrapper or the model inside), while both are alive; None for any other module
    (a copy of a prepared model included). :func:`mixprec.diagnostics.audit` reads it: a loop mixprec
    runs scales its fp16 losses with the session's own scaler."""
    entry = _PREPARED_BY.get(id(model))
    if entry is None or entry[0]() is not model:
        return None
    return entry[1]()


def _remember(session: MixedPrecision, *modules: torch.nn.Module) -> None:
    """Record ``session`` as the one that prepared ``modules`` (:func:`session_of`)."""
    for module in {id(m): m for m in modules}.values():
        key = id(module)

        def forget(ref: weakref.ref[torch.nn.Module], key: int = key) -> None:
            if _PREPARED_BY.get(key, (None,))[0] is ref:  # (not a later module's entry under a reused id)
                del _PREPARED_BY[key]

        _PREPARED_BY[key] = (weakref.ref(module, forget), weakref.ref(session))


class MixedPrecision(StepRunner):
    """Run any model and any torch optimizer under a precision plan.

    Args:
        plan: a plan name ("bf16-mixed", "fp16-master", "O2", ...) or a :class:`Plan`;
            ``"auto"`` measures the device and chooses (again at :meth:`prepare`, on the
            model's device and with its Linear widths): ``mp.plan.explain()`` says why.
        grad_accum_steps: micro-batches per optimizer step; ``backward`` divides each
            micro-batch loss by it, so accumulating equals one big batch.
        clip_grad_norm: clip the total gradient norm (the true, unscaled norm) to this.
        scaler: a loss scaler to use instead of the plan's (an explicit opt-in, also for bf16).
        device: device of the model (default: where its parameters are).
        compile: ``torch.compile`` the prepared model.
        max_consecutive_skips: raise after this many consecutive skipped steps, naming
            the cause, instead of looping forever.
        process_group: group for the cross-rank skip decision (default: the default group
            when torch.distributed runs more than one rank).
        trace_overflow: install an :class:`~mixprec.diagnostics.OverflowTracer` on the
            model; a skipped step's ``StepResult.overflow`` then names the first module
            whose output or gradient became inf/NaN (a few percent slower; off by default).
        explain_overflow: when skips recur (not a loss scale settling), trace the next
            overflowing step by itself and warn once with the module and the fp32 island
            that fixes it (:mod:`mixprec.explainer`; no hooks while nothing overflows).
        optimizer_in_backward: update each parameter inside backward as soon as its
            gradient is complete and free the gradient (peak memory drops by the gradient
            bytes); plans with ``supports_optimizer_in_backward``, one optimizer, one process,
            no accumulation or clipping. An inf/NaN step is still skipped exactly
            (:class:`mixprec.optim.InBackwardOptimizer`), whichever entry runs the backward
            (:meth:`backward` or the halves); one backward per step, and a backward an
            exception stops is undone.
        max_zero_grad_steps: a loss scale that collapsed (overflows backed it off below 1
            until the fp16 gradients underflow to zero) is caught after this many consecutive
            optimizer steps on all-zero gradients (None: only a warning at the first one).
        on_scale_collapse: then ``"raise"`` a RuntimeError with the diagnosis, or ``"reset"``:
            warn with it and restart the loss scale at the scale it had when this
            MixedPrecision was created.

    The one-line path is :meth:`prepare`, :meth:`autocast`, :meth:`backward`, :meth:`step`.
    Frameworks that own the loop use the halves: :meth:`prepare_model`,
    :meth:`prepare_optimizers`, :meth:`scale_loss` (or :meth:`backward`), :meth:`unscale_`
    (then clip or log true gradients) and :meth:`step`; :attr:`last_step_skipped` tells a
    scheduler or logger whether the update happened. One state machine
    (:class:`mixprec.phases.StepPhases`, :attr:`phase`) orders them all: a call out of
    order raises an error naming the order. An exception or Ctrl-C inside :meth:`step`
    leaves a state from which :meth:`state_dict` saves the last finished step and
    :meth:`step` again finishes the interrupted one exactly; an exception inside
    :meth:`backward` discards the step's gradients (the next backward starts it again).
    """

    def __init__(
        self,
        plan: str | Plan = "bf16-mixed",
        *,
        grad_accum_steps: int = 1,
        clip_grad_norm: float | None = None,
        scaler: LossScaler | None = None,
        device: str | torch.device | None = None,
        compile: bool = False,
        max_consecutive_skips: int = 50,
        process_group: Any = None,
        trace_overflow: bool = False,
        optimizer_in_backward: bool = False,
        max_zero_grad_steps: int | None = 20,
        on_scale_collapse: str = "raise",
        explain_overflow: bool = True,
    ) -> None:
        check_group(process_group)  # before "auto" broadcasts over it
        self._auto = is_auto(plan)
        self.plan = self._rank0_choice(get_plan(plan, device=device), process_group) if self._auto else get_plan(plan)
        check_session_options(
            grad_accum_steps, clip_grad_norm, max_consecutive_skips, scaler,
            {"compile": compile, "trace_overflow": trace_overflow, "optimizer_in_backward": optimizer_in_backward,
             "explain_overflow": explain_overflow},
        )
        check_collapse_options(max_zero_grad_steps, on_scale_collapse)
        check_environment()  # MIXPREC_COMPILE is read at the first compilation: refuse a bad value now
        self.grad_accum_steps = grad_accum_steps
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.max_consecutive_skips = max_consecutive_skips
        self.process_group = process_group
        self.scaler: LossScaler = scaler if scaler is not None else self.plan.make_scaler(process_group)
        self._scaler_from_plan = scaler is None
        self._device = None if device is None else torch.device(device)
        self._first = FirstParameter()
        self.compile = compile
        self.trace_overflow = trace_overflow
        self.explain_overflow = explain_overflow
        self._explainer: OverflowExplainer | None = None
        self._step_serial = 0
        self.optimizer_in_backward = optimizer_in_backward
        self.model: torch.nn.Module | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.scheduler: Any = None
        self.tracer: Any = None
        self.last_result: StepResult | None = None
        self._prepared: PreparedModel | None = None
        self._decision = SkipDecision(process_group)
        self._norm_memo = NormMemo()
        self._buffers = BufferGuard()
        self._ledger = StepLedger(max_zero_grad_steps, on_scale_collapse, self.scaler.get_scale())
        self._phases = StepPhases()
        self._ddp = False
        self._in_backward: InBackwardOptimizer | None = None
        if optimizer_in_backward:
            check_in_backward(self.plan, self.scaler, grad_accum_steps, self.clip_grad_norm)

    # ---------------------------------------------------------------- prepare
    def prepare(
        self,
        model: torch.nn.Module,
        *optimizers: torch.optim.Optimizer,
        scheduler: Any = None,
        criterion: Any = None,
        ddp: bool | Mapping[str, Any] = False,
    ) -> Any:
        """Convert ``model`` for the plan and wrap ``optimizers``.

        Returns a flat tuple: the model, each optimizer, then ``scheduler`` and
        ``criterion`` when given (a lone model is returned as is). Use the returned
        objects from then on.

        ``ddp=True`` (or a dict of DistributedDataParallel arguments) wraps the converted
        model in DDP with gradients reduced in ``plan.reduce_dtype``
        (:func:`mixprec.distributed.wrap_ddp`). An FSDP2 model (``fully_shard``) is
        recognised and run as :func:`mixprec.distributed.sharded_plan` describes.
        """
        for opt in optimizers:  # before anything is converted
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(
                    f"prepare() expects torch optimizers after the model, got {type(opt).__name__}; "
                    "pass scheduler= and criterion= by keyword"
                )
        check_shared(model, optimizers, "prepare()")
        prepared = self.prepare_model(model, ddp=ddp)
        wrapped = self._wrap_optimizers(optimizers, "prepare()")
        self.scheduler = scheduler
        out: list[Any] = [prepared, *wrapped]
        if scheduler is not None:
            out.append(scheduler)
        if criterion is not None:
            out.append(Fp32Criterion(criterion))
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(self, model: torch.nn.Module, *, ddp: bool | Mapping[str, Any] = False) -> Any:
        """The model half of :meth:`prepare`: convert ``model`` for the plan and return it.

        For frameworks that convert the model before they see the optimizer: the fp32
        values that seed master weights are kept until :meth:`prepare_optimizers`.
        A framework may wrap the returned model in DistributedDataParallel itself.
        """
        if self.model is not None:
            raise RuntimeError("prepare() was already called on this MixedPrecision; create one per model")
        if self._auto:
            self._choose_for(model)
        prepared = self._prepared = prepare_model(
            model, self.plan, device=self._device, ddp=ddp, process_group=self.process_group,
            compile=self.compile, trace_overflow=self.trace_overflow,
        )
        self.plan, self.model, self.tracer = prepared.plan, prepared.model, prepared.tracer
        self._ddp = prepared.ddp
        inner: torch.nn.Module = prepared.model.module if is_ddp(prepared.model) else prepared.model  # type: ignore[assignment]
        # a scale that never moves has no room to back off into: its first overflow counts
        min_scale = self.scaler.get_scale() / 2 if isinstance(self.scaler, ConstantLossScaler) else getattr(
            self.scaler, "min_scale", None)  # (the explainer arms within 2x of it)
        self._explainer = OverflowExplainer(
            inner, self.plan, enabled=self.explain_overflow and self.tracer is None and not self.compile,
            min_scale=min_scale, known_plans=plan_names(),
        )
        weakref.finalize(self, self._explainer.remove)  # no hooks left on the model after this session
        # A skipped step must not keep what its forward wrote into buffers (BatchNorm statistics).
        self._buffers.install(prepared.module, prepared.model)
        _remember(self, prepared.module, prepared.model, inner)  # (session_of: the audit finds the session)
        return prepared.module

    def _choose_for(self, model: torch.nn.Module) -> None:
        """``"auto"`` again, now on the model's own device and with its Linear widths."""
        first = next(iter(model.parameters()), None)
        if first is not None and first.device.type == "meta":
            where = repr(str(self._device) if self._device is not None else "cuda" if torch.cuda.is_available() else "cpu")
            raise ValueError(
                "MixedPrecision('auto') chooses from the device the model trains on and the model's widths, but "
                "the model's parameters are on 'meta' (not materialized yet). Choose the plan for that device "
                f"first and prepare the meta model with it: MixedPrecision(get_plan('auto', device={where}, "
                "model=model))"
            )
        device = self._device or (first.device if first is not None else None)
        plan = self._rank0_choice(get_plan("auto", device=device, model=model), self.process_group)
        if plan.scaling.kind != self.plan.scaling.kind and self._scaler_from_plan:
            self.scaler = plan.make_scaler(self.process_group)
            self._ledger.restart_scale = self.scaler.get_scale()
        self.plan = plan

    @staticmethod
    def _rank0_choice(plan: Plan, process_group: Any) -> Plan:
        """Under torch.distributed, every rank takes rank 0's ``"auto"`` choice: ranks time their
        GEMMs apart, and two ranks training under two plans would compute different things."""
        if not is_distributed():
            return plan
        group = resolve_group(process_group)
        first = 0 if group is None else torch.distributed.get_global_rank(group, 0)
        chosen: list[Any] = [plan.name, plan.auto_reason]
        torch.distributed.broadcast_object_list(chosen, src=first, group=group)
        if chosen[0] == plan.name:
            return plan
        return dataclasses.replace(get_plan(str(chosen[0])), auto_reason=f"as rank 0 chose (this rank measured otherwise):\n{chosen[1]}")

    def prepare_optimizers(self, *optimizers: torch.optim.Optimizer) -> Any:
        """The optimizer half of :meth:`prepare`: wrap ``optimizers`` for the plan.

        Call it after :meth:`prepare_model`, once or several times (each optimizer once).
        Returns the wrapped optimizer, or a tuple of them when several were given; use
        these from then on.
        """
        if self._prepared is None:
            raise RuntimeError(
                "prepare_optimizers() called before prepare_model(); convert the model first, "
                "then wrap the optimizers over its parameters"
            )
        wrapped = self._wrap_optimizers(optimizers, "prepare_optimizers()")
        return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)

    def _wrap_optimizers(self, optimizers: tuple[torch.optim.Optimizer, ...], caller: str) -> list[Any]:
        assert self._prepared is not None
        check_optimizers(self._prepared, optimizers, self.optimizers, caller)
        if self.optimizer_in_backward and optimizers and (self.optimizers or len(optimizers) > 1 or self._ddp):
            raise ValueError(
                "optimizer_in_backward=True takes one optimizer on a model without DDP; pass a single "
                "optimizer (one param group per learning rate) to prepare()"
            )
        if self.optimizer_in_backward and has_fsdp(self._prepared.model):
            raise ValueError(
                "optimizer_in_backward=True does not run on an FSDP2 model (its gradients are reduce-scattered "
                "after the backward hooks that would step them); drop optimizer_in_backward, or train unsharded"
            )
        wrapped = wrap_optimizers(self._prepared, optimizers, self.optimizers, caller)
        if self.optimizer_in_backward and wrapped:
            self._in_backward = InBackwardOptimizer(wrapped[0])
        self.optimizers.extend(wrapped)
        return wrapped

    # --------------------------------------------------------------- forward
    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The context the forward pass (and the loss) runs in.

        Under DDP it also skips the gradient all-reduce on micro-batches that are
        not accumulation boundaries.
        """
        if self._prepared is not None:  # a model cast since prepare() would fail inside torch
            self._prepared.check_dtypes("autocast()")
        if not (self.is_accumulating() and self.model is not None and hasattr(self.model, "no_sync")):
            with self.plan.autocast(self.device_type):
                yield
            return
        with self.model.no_sync(), self.plan.autocast(self.device_type):  # type: ignore[operator]
            yield

    # -------------------------------------------------------------- backward
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward of one micro-batch's mean loss (scaled, and divided by grad_accum_steps)."""
        scaled = self._scale_loss(loss, "backward()")
        if self.grad_accum_steps > 1:
            scaled = scaled / self.grad_accum_steps
        try:
            with self.backward_context():  # under optimizer_in_backward, undoes a backward an exception stops
                scaled.backward(**kwargs)
        except BaseException:
            self._discard_step()  # partial gradients: a retry starts this step again
            raise
        self.micro_batch_done()  # under optimizer_in_backward: one host read, did the updates stand?

    # ------------------------------------------------------------ checkpoint
    def state_dict(self, *, mid_accumulation: bool = False) -> dict[str, Any]:
        """Scaler state, counters, plan fingerprint and the scheduler given to prepare().

        Master weights and compensation buffers are in the wrapped optimizers' own
        ``state_dict()``: save the model, each optimizer and this, then load in that order.
        Between a backward and its step it refuses (the partial gradients would be lost),
        unless ``mid_accumulation=True``: for a framework that owns accumulation and saves
        anywhere (Accelerate's ``save_state``), it is then the state as of the last step.
        """
        if self._in_backward is not None:
            if self._in_backward.settle():  # a backward an exception stopped is undone before anything is saved
                self._phases.backward_failed()
            if self._micro != 0 or self._phases.pending:
                raise RuntimeError(
                    "state_dict() called between a backward and its step() under optimizer_in_backward=True: the "
                    "weights already hold that backward's update; call step() first, then save"
                )
        phases = self._phases
        if (unfinished := phases.mid_update()) is not None:
            raise RuntimeError(f"state_dict(): {unfinished}")
        self.settle_outcome()  # the last step counted and its scheduler step taken (a read of its outcome)
        if (phases.micro or phases.pending) and not mid_accumulation and not phases.interrupted:
            done = phases.micro + phases.pending
            raise RuntimeError(
                f"state_dict() called in the middle of gradient accumulation ({done} backward(s) since the last "
                "step()); save after step(), or pass mid_accumulation=True for the state as of the last step "
                "(the partial gradients are not in it)"
            )
        return session_state(self.plan, self.scaler, self._ledger, self.scheduler)

    def load_state_dict(self, state_dict: dict[str, Any], *, allow_plan_change: bool = False) -> None:
        """Restore what :meth:`state_dict` saved; all or nothing (a failure changes nothing).

        A checkpoint from another plan, or whose loss-scaler settings differ from this
        run's (``hysteresis``, ``growth_interval``, ...), is refused unless
        ``allow_plan_change=True``: then the loss-scaler state is kept only if the scaling
        kind matches, and this run's scaler settings win over the saved ones.
        """
        scaler_state = validated_scaler_state(state_dict, self.plan, self.scaler, self.scheduler, allow_plan_change)
        self.settle_outcome()  # a step decided before the load is counted (into the state the load replaces)
        if scaler_state is not None:
            self.scaler.load_state_dict(scaler_state)
        self._ledger.load(state_dict)
        self._reset_step()
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])

    def validate_state_dict(self, state_dict: Any, *, allow_plan_change: bool = False) -> None:
        """Raise ValueError/TypeError if :meth:`load_state_dict` would refuse ``state_dict``; change nothing."""
        validated_scaler_state(state_dict, self.plan, self.scaler, self.scheduler, allow_plan_change)

    def export_fp32_state_dict(self) -> dict[str, Any]:
        """The prepared model's ``state_dict()`` in fp32: what an "fp32 master" run trained.

        Keys are those of ``model.state_dict()`` of the model given to :meth:`prepare` (no
        DDP ``module.`` or ``torch.compile`` prefix). Each low-precision weight is replaced
        by its fp32 master where the plan keeps one (``*-master`` plans), and upcast to
        fp32 elsewhere (pure, Kahan and stochastic-rounding plans: exactly the weight the
        model computes with). Floating buffers are upcast to fp32; fp32 tensors, integer
        buffers and extra state are as in ``state_dict()``, sharing storage with the model
        as it does. Load it into an fp32 copy of the model (or save it for
        ``from_pretrained``) to get the masters exactly; loading it back into the prepared
        model rounds the weights and the masters take the fp32 values.
        See :func:`mixprec.resume.fp32_state_dict`.
        """
        if self.model is None:
            raise RuntimeError(
                "export_fp32_state_dict() called before prepare(); prepare the model (and its optimizers) first"
            )
        return fp32_state_dict(self.model, self.optimizers)

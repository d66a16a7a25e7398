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
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mixprec.buffers import BufferGuard
from mixprec.dtypes import cast_floating
from mixprec.plans import Plan, get_plan
from mixprec.scaling import LossScaler
from mixprec.scaling.base import grad_tensors

__all__ = ["MixedPrecision", "StepResult"]

_STATE_FORMAT = "mixprec.MixedPrecision/1"
# Loss-scaler settings a resumed run must agree on (the counters are state, these are configuration).
_SCALER_SETTINGS = (
    "growth_factor", "backoff_factor", "growth_interval", "hysteresis", "hysteresis_mode", "min_scale", "max_scale",
)


@dataclass(frozen=True)
class StepResult:
    """What :meth:`MixedPrecision.step` did.

    Attributes:
        stepped: the optimizers updated the parameters.
        skipped: an accumulation boundary was reached but the update was skipped
            (``skip_reason`` says why: ``"overflow"`` for inf/NaN gradients,
            ``"nonfinite_loss"`` for an inf/NaN loss, ``"nonfinite_plan"`` for an inf/NaN
            value only the plan saw (an fp8 layer's input or output gradient),
            ``"nonfinite_weights"`` for an update that would have written inf/NaN into
            low-precision weights; a skipped step changes nothing).
        scale: the loss scale after this step (what ``get_scale()`` returns next).
        grad_norm: the true (unscaled) gradient norm before clipping; None while
            accumulating.
        accumulating: not an accumulation boundary; nothing was done.
        optimizer_steps: real optimizer steps taken so far.
        overflow: diagnostics of the first non-finite module when overflow tracing is on.
    """

    stepped: bool
    skipped: bool
    scale: float
    grad_norm: float | None
    skip_reason: str | None = None
    accumulating: bool = False
    optimizer_steps: int = 0
    overflow: Any = None


class _Fp32Criterion(torch.nn.Module):
    """Computes a loss in fp32 from low-precision outputs (autocast off, floating inputs upcast)."""

    def __init__(self, criterion: Any) -> None:
        super().__init__()
        self.criterion = criterion

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args = cast_floating(args, torch.float32)
        kwargs = cast_floating(kwargs, torch.float32)
        device_type = _first_device_type(args) or "cpu"
        with torch.autocast(device_type, enabled=False):
            return self.criterion(*args, **kwargs)


def _first_device_type(args: Sequence[Any]) -> str | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    return None


class MixedPrecision:
    """Run any model and any torch optimizer under a precision plan.

    Args:
        plan: a plan name ("bf16-mixed", "fp16-master", "O2", ...) or a :class:`Plan`.
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
        optimizer_in_backward: update each parameter inside backward, as soon as its
            gradient is complete, and free the gradient at once (peak memory drops by the
            gradient bytes). For the bf16 pure, Kahan and stochastic-rounding plans with one
            optimizer, on one process, without accumulation or clipping (a global-norm clip
            needs every gradient before the first update). A step whose gradients hold
            inf/NaN anywhere is still skipped exactly: every parameter updated during that
            backward is restored (:class:`mixprec.optim.InBackwardOptimizer`).

    The one-line path is :meth:`prepare`, :meth:`autocast`, :meth:`backward`, :meth:`step`.
    Frameworks that own the loop use the halves: :meth:`prepare_model`,
    :meth:`prepare_optimizers`, :meth:`scale_loss` (or :meth:`backward`), :meth:`unscale_`
    (then clip or log true gradients) and :meth:`step`; :attr:`last_step_skipped` tells a
    scheduler or logger whether the update happened.
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
    ) -> None:
        self.plan = get_plan(plan)
        if not isinstance(grad_accum_steps, int) or isinstance(grad_accum_steps, bool) or grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be an integer >= 1, got {grad_accum_steps!r}")
        if clip_grad_norm is not None and (
            not isinstance(clip_grad_norm, int | float)
            or isinstance(clip_grad_norm, bool)
            or not clip_grad_norm > 0
            or not math.isfinite(clip_grad_norm)
        ):
            raise ValueError(f"clip_grad_norm must be a positive finite number or None, got {clip_grad_norm!r}")
        if (
            not isinstance(max_consecutive_skips, int)
            or isinstance(max_consecutive_skips, bool)
            or max_consecutive_skips < 1
        ):
            raise ValueError(f"max_consecutive_skips must be an integer >= 1, got {max_consecutive_skips!r}")
        if scaler is not None and not isinstance(scaler, LossScaler):
            raise TypeError(
                f"scaler must be a mixprec LossScaler (DynamicLossScaler, ConstantLossScaler, NoOpScaler), "
                f"got {type(scaler).__name__}"
            )
        for name, flag in (
            ("compile", compile), ("trace_overflow", trace_overflow), ("optimizer_in_backward", optimizer_in_backward)
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}= must be True or False, got {flag!r}")
        self.grad_accum_steps = grad_accum_steps
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.max_consecutive_skips = max_consecutive_skips
        self.process_group = process_group
        self.scaler: LossScaler = scaler if scaler is not None else self.plan.make_scaler(process_group)
        self.device = None if device is None else torch.device(device)
        self.compile = compile
        self.model: torch.nn.Module | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.scheduler: Any = None
        self.last_result: StepResult | None = None
        self._micro = 0
        self._optimizer_steps = 0
        self._consecutive_skips = 0
        self._last_skip_reason: str | None = None
        self._loss_nonfinite: torch.Tensor | None = None
        self._unscaled = False
        self._published = False
        self._fp32_values: dict[torch.Tensor, torch.Tensor] = {}
        self._model_params: set[torch.Tensor] = set()
        self._uncovered: list[torch.Tensor] = []
        self._ddp = False
        self._buffers = BufferGuard()
        self._warned_zero_grads = False
        self._hooks: list[Any] = []
        self.trace_overflow = trace_overflow
        self.optimizer_in_backward = optimizer_in_backward
        self._in_backward: Any = None
        self._in_backward_ok = True
        if optimizer_in_backward:
            self._check_in_backward_options()
        self.tracer: Any = None

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
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(
                    f"prepare() expects torch optimizers after the model, got {type(opt).__name__}; "
                    "pass scheduler= and criterion= by keyword"
                )
        prepared = self.prepare_model(model, ddp=ddp)
        wrapped = self._wrap_optimizers(optimizers)
        self.scheduler = scheduler
        out: list[Any] = [prepared, *wrapped]
        if scheduler is not None:
            out.append(scheduler)
        if criterion is not None:
            out.append(_Fp32Criterion(criterion))
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(self, model: torch.nn.Module, *, ddp: bool | Mapping[str, Any] = False) -> Any:
        """The model half of :meth:`prepare`: convert ``model`` for the plan and return it.

        For frameworks that convert the model before they see the optimizer: the fp32
        values that seed master weights are kept until :meth:`prepare_optimizers`.
        A framework may wrap the returned model in DistributedDataParallel itself.
        """
        if self.model is not None:
            raise RuntimeError("prepare() was already called on this MixedPrecision; create one per model")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"prepare() expects an nn.Module first, got {type(model).__name__}")
        first = next(iter(model.parameters()), None)
        if self.device is None:
            self.device = first.device if first is not None else torch.device("cpu")
        elif first is not None and first.device.type != self.device.type:
            raise ValueError(
                f"MixedPrecision(device={str(self.device)!r}) but the model's parameters are on "
                f"{str(first.device)!r}: autocast would not apply to them. Move the model first "
                f"(model.to({str(self.device)!r})) or drop device="
            )
        from mixprec.distributed.frontdoor import ddp_arguments, plan_for_model

        ddp_kwargs = ddp_arguments(ddp, self.process_group) if ddp is not False else None
        plan = self.plan = plan_for_model(self.plan, model, ddp=ddp_kwargs is not None)
        fp32_values = plan.convert_model(model)
        if plan.policy is not None and plan.policy.fp32_modules:
            from mixprec.islands import apply_fp32_islands

            # After the conversion: islands turn their own parameters back to fp32.
            apply_fp32_islands(model, plan.policy)
            fp32_values = {p: v for p, v in fp32_values.items() if p.dtype != torch.float32}
        self._fp32_values = fp32_values
        self._model_params = {p for p in model.parameters()}
        # Parameters no optimizer holds (frozen ones, say): their gradients are cleared too.
        self._uncovered = [p for p in model.parameters() if p.requires_grad]
        if self.trace_overflow:  # on the inner model, before DDP/compile wrap it
            from mixprec.diagnostics import OverflowTracer

            self.tracer = OverflowTracer(model)
        if not plan.uses_autocast and plan.weight_dtype != torch.float32:
            from mixprec.islands import install_input_cast

            self._hooks.extend(install_input_cast(model, plan.weight_dtype))
        from mixprec.distributed.ddp import is_ddp

        self._ddp = ddp_kwargs is not None or is_ddp(model)
        if ddp_kwargs is not None:  # after the conversion: DDP must see the final dtypes
            from mixprec.distributed.ddp import wrap_ddp

            model = wrap_ddp(model, plan, **ddp_kwargs)
        self.model = model
        prepared: Any = torch.compile(model) if self.compile else model
        # A skipped step must not keep what its forward wrote into buffers (BatchNorm statistics).
        self._buffers.install(prepared, model)
        return prepared

    def prepare_optimizers(self, *optimizers: torch.optim.Optimizer) -> Any:
        """The optimizer half of :meth:`prepare`: wrap ``optimizers`` for the plan.

        Call it after :meth:`prepare_model`, once or several times (each optimizer once).
        Returns the wrapped optimizer, or a tuple of them when several were given; use
        these from then on.
        """
        if self.model is None:
            raise RuntimeError(
                "prepare_optimizers() called before prepare_model(); convert the model first, "
                "then wrap the optimizers over its parameters"
            )
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"prepare_optimizers() expects torch optimizers, got {type(opt).__name__}")
        wrapped = self._wrap_optimizers(optimizers)
        return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)

    def _check_in_backward_options(self) -> None:
        problems = []
        if self.grad_accum_steps != 1:
            problems.append(f"grad_accum_steps={self.grad_accum_steps} (each micro-batch would update the weights)")
        if self.clip_grad_norm is not None:
            problems.append(f"clip_grad_norm={self.clip_grad_norm} (the global norm needs every gradient first)")
        if self.scaler.is_enabled():
            problems.append(f"a loss scaler ({type(self.scaler).__name__}; use a bf16 plan)")
        if self.plan.family not in ("pure", "lowbit"):
            problems.append(f"plan {self.plan.name!r} (use bf16-pure, bf16-kahan or bf16-sr)")
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            problems.append("several ranks (each rank would update before the others' gradients arrive)")
        if problems:
            raise ValueError("optimizer_in_backward=True does not work with " + "; ".join(problems))

    def _wrap_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
        seen = {id(o) for o in self.optimizers} | {id(getattr(o, "optimizer", o)) for o in self.optimizers}
        for opt in optimizers:
            if id(opt) in seen:
                raise ValueError(
                    f"the same {type(opt).__name__} was passed twice to prepare(); it would step twice per "
                    "iteration. Pass each optimizer once"
                )
            seen.add(id(opt))
            foreign = [p for g in opt.param_groups for p in g["params"] if p not in self._model_params]
            if foreign:
                raise ValueError(
                    f"{len(foreign)} parameter(s) of the {type(opt).__name__} passed to prepare() are not "
                    "parameters of the prepared model (was the optimizer built over another model or a copy?). "
                    "Build the optimizer over model.parameters() of the model you pass to prepare()"
                )
        covered = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
        self._uncovered = [p for p in self._uncovered if id(p) not in covered]
        wrapped = [self.plan.wrap_optimizer(opt, self._fp32_values) for opt in optimizers]
        if self.optimizer_in_backward and wrapped:
            from mixprec.optim import InBackwardOptimizer

            if self.optimizers or len(wrapped) > 1 or self._ddp:
                raise ValueError(
                    "optimizer_in_backward=True takes one optimizer on a model without DDP; pass a single "
                    "optimizer (one param group per learning rate) to prepare()"
                )
            self._in_backward = InBackwardOptimizer(wrapped[0])  # type: ignore[arg-type]
        self.optimizers.extend(wrapped)
        if wrapped:  # the fp32 seeds are used; do not keep a second copy of the model alive
            self._fp32_values = {}
        return wrapped

    # --------------------------------------------------------------- forward
    @property
    def device_type(self) -> str:
        return (self.device or torch.device("cpu")).type

    def is_accumulating(self) -> bool:
        """True when the next backward() is not at an accumulation boundary."""
        return (self._micro + 1) % self.grad_accum_steps != 0

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The context the forward pass (and the loss) runs in.

        Under DDP it also skips the gradient all-reduce on micro-batches that are
        not accumulation boundaries.
        """
        if not (self.is_accumulating() and self.model is not None and hasattr(self.model, "no_sync")):
            with self.plan.autocast(self.device_type):
                yield
            return
        with self.model.no_sync(), self.plan.autocast(self.device_type):  # type: ignore[operator]
            yield

    # -------------------------------------------------------------- backward
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``.backward()`` on, for frameworks that run backward themselves.

        Records whether the loss is finite (a non-finite loss skips the step), then
        multiplies by the loss scale (fp16 plans). Unlike :meth:`backward` it does not
        divide by ``grad_accum_steps``: a framework that accumulates divides itself. Run
        the backward inside :meth:`backward_context` and call :meth:`micro_batch_done`
        after it (or use :meth:`backward`, which does all three).
        """
        return self._scale_loss(loss, "scale_loss()")

    def _scale_loss(self, loss: torch.Tensor, caller: str) -> torch.Tensor:
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"{caller} expects the loss tensor, got {type(loss).__name__}")
        if loss.numel() != 1:
            raise ValueError(
                f"{caller} expects a scalar loss, got shape {tuple(loss.shape)}; reduce it (e.g. loss.mean()) first"
            )
        if self._unscaled:
            raise RuntimeError(
                "a backward after unscale_() in the same step would mix scaled and unscaled gradients; "
                "call step() first"
            )
        with torch.no_grad():
            bad = ~torch.isfinite(loss.detach().float())
            self._loss_nonfinite = bad if self._loss_nonfinite is None else self._loss_nonfinite | bad
        return self.scaler.scale(loss)

    def backward_context(self) -> contextlib.AbstractContextManager[Any]:
        """The context a backward runs in (the plan's): a custom op policy also holds where
        backward recomputes the forward (activation checkpointing); tf32 stays on."""
        return self.plan.backward_context(self.device_type)

    def micro_batch_done(self, boundary: bool | None = None) -> None:
        """Count one finished backward; between accumulation boundaries, let the optimizer
        wrappers move low-precision gradients into wider accumulators (not under DDP).

        ``boundary`` says whether this backward ends the accumulation window; by default
        ``grad_accum_steps`` decides. A framework that decides the boundary itself passes it.
        """
        self._micro += 1
        if boundary is None:
            boundary = self._micro % self.grad_accum_steps == 0
        if not boundary and not self.is_ddp:
            for opt in self.optimizers:
                accumulate = getattr(opt, "accumulate_grads", None)
                if accumulate is not None:
                    accumulate()

    @property
    def is_ddp(self) -> bool:
        """Whether the model's gradients are reduced by DDP (whose reducer owns ``.grad``).

        True after ``prepare(..., ddp=True)`` or for a model that arrived DDP-wrapped; a
        framework that wraps the prepared model in DDP itself sets it to True.
        """
        return self._ddp

    @is_ddp.setter
    def is_ddp(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"is_ddp must be True or False, got {value!r}")
        self._ddp = value

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward of one micro-batch's mean loss (scaled, and divided by grad_accum_steps)."""
        scaled = self._scale_loss(loss, "backward()")
        if self.grad_accum_steps > 1:
            scaled = scaled / self.grad_accum_steps
        with self.backward_context():
            scaled.backward(**kwargs)
        if self._in_backward is not None:  # the updates ran in backward; one host read: did they stand?
            self._in_backward_ok = self._in_backward.finish()
        self.micro_batch_done()

    # ------------------------------------------------------------------ step
    def _grads(self) -> list[torch.Tensor]:
        return [g for opt in self.optimizers for g in grad_tensors(opt)]

    def _total_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), device=self.device)
        from mixprec.distributed.fsdp import has_dtensor, total_grad_norm

        if has_dtensor(grads):  # FSDP2 shards: sum squared norms across the shard group
            return total_grad_norm(grads)
        target = grads[0].device
        # One norm per (device, dtype) group, then the norm of those: few small tensors.
        group_norms = [
            torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs, 2.0, dtype=torch.float32)), 2.0).to(target)
            for gs in _by_device_dtype(grads).values()
        ]
        return group_norms[0] if len(group_norms) == 1 else torch.linalg.vector_norm(torch.stack(group_norms), 2.0)

    def _all_ranks_max(self, flag: torch.Tensor) -> torch.Tensor:
        group = self.process_group
        if group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            group = dist.group.WORLD
        if group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return flag

    def _check_ready(self, what: str) -> None:
        if self.model is None:
            raise RuntimeError(f"{what} called before prepare(); call mp.prepare(model, optimizer) first")
        if not self.optimizers:
            raise RuntimeError(
                f"{what} called with no optimizer: nothing would train. Pass the optimizer to "
                "mp.prepare(model, optimizer) or mp.prepare_optimizers(optimizer)"
            )

    def unscale_(self) -> None:
        """Gather and unscale every optimizer's gradients once for this step (idempotent).

        Afterwards ``.grad`` of the optimizers' parameters hold true gradients, and so do
        the model's own parameters (a master-weight wrapper copies the unscaled fp32
        gradients back into them), so a framework's clipping, logging and hooks can run on
        either; :meth:`step` does not unscale again and gathers in-place changes.
        """
        self._unscale()
        if not self._published:
            for opt in self.optimizers:
                publish = getattr(opt, "publish_grads", None)
                if publish is not None:
                    publish()
            self._published = True

    def _unscale(self) -> None:
        self._check_ready("unscale_()")
        if self._unscaled:
            return
        if self._micro == 0:
            raise RuntimeError("unscale_() called before any backward(); call mp.backward(loss) first")
        # e.g. fp8: every rank computes the next scales from the same amaxes
        self.plan.before_unscale(self.model, self.process_group)  # type: ignore[arg-type]
        for opt in self.optimizers:
            prepare_grads = getattr(opt, "prepare_grads", None)
            if prepare_grads is not None:  # e.g. masters: the model's gradients into the fp32 masters
                prepare_grads()
        for opt in self.optimizers:
            self.scaler.unscale_(opt)
        self._unscaled = True

    def grad_norm(self) -> torch.Tensor:
        """The true (unscaled) total 2-norm of every optimizer's gradients (unscales first)."""
        self._unscale()
        return self._total_norm(self._grads())

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Unscale, then clip the true gradients to a total norm of ``max_norm``; returns the norm
        before clipping (as ``torch.nn.utils.clip_grad_norm_``). A non-finite norm clips nothing:
        the step will be skipped."""
        if not isinstance(max_norm, int | float) or isinstance(max_norm, bool) or not max_norm > 0:
            raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
        norm = self.grad_norm()
        self._clip(self._grads(), norm, float(max_norm))
        return norm

    @staticmethod
    def _clip(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
        if not grads:
            return
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        coef = torch.where(torch.isfinite(coef), coef, torch.ones_like(coef))
        for (device, _), gs in _by_device_dtype(grads).items():
            torch._foreach_mul_(gs, coef.to(device))

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last :meth:`step` at an accumulation boundary skipped the update."""
        return self.last_result is not None and self.last_result.skipped

    def step(self, *, zero_grad: bool = True) -> StepResult:
        """At an accumulation boundary: unscale, check, clip, step every optimizer (or none), clear grads.

        ``zero_grad=False`` leaves the gradients for a framework that clears them itself at
        its own point of the loop (Lightning does, before the next backward): freeing them
        here as well changes when the allocator gets the memory back, which on CPU cost
        Lightning loops several percent in page faults.
        """
        if not isinstance(zero_grad, bool):
            raise TypeError(f"zero_grad= must be True or False, got {zero_grad!r}")
        self._check_ready("step()")
        if self._micro == 0 or self._micro % self.grad_accum_steps != 0:
            if self._micro == 0:
                raise RuntimeError("step() called before any backward(); call mp.backward(loss) first")
            return StepResult(
                stepped=False, skipped=False, scale=self.scaler.get_scale(), grad_norm=None,
                accumulating=True, optimizer_steps=self._optimizer_steps,
            )
        if self._in_backward is not None:
            return self._step_in_backward(zero_grad)
        self._unscale()
        grads = self._grads()
        norm = self._total_norm(grads)
        reason = self._skip_reason(norm)
        if reason is None:
            if self.clip_grad_norm is not None:
                self._clip(grads, norm, self.clip_grad_norm)
            reason = self._apply_update()
        result = self._finish(reason, norm, zero_grad)
        self.last_result = result
        return result

    def _step_in_backward(self, zero_grad: bool) -> StepResult:
        """The parameters were updated (or restored) during backward: account for it."""
        if self._in_backward_ok:
            reason = None
        else:
            loss_bad = self._loss_nonfinite is not None and bool(self._loss_nonfinite)
            reason = "nonfinite_loss" if loss_bad else "overflow"
        result = self._finish(reason, None, zero_grad)
        self.last_result = result
        return result

    def _skip_reason(self, norm: torch.Tensor) -> str | None:
        """The one skip decision for every optimizer and rank: one collective, one host read.

        Reasons, first match wins: ``"nonfinite_loss"`` (the forward overflowed; the scale
        is kept), ``"overflow"`` (inf/NaN gradients; a dynamic scale backs off),
        ``"nonfinite_plan"`` (the plan saw a non-finite value the gradients do not show,
        e.g. an inf input or output gradient of an fp8 layer; the scale is kept).
        """
        device = norm.device
        loss_bad = self._loss_nonfinite if self._loss_nonfinite is not None else torch.zeros((), dtype=torch.bool)
        plan_flag = self.plan.nonfinite_flag(self.model)  # type: ignore[arg-type]
        flags = torch.stack([
            loss_bad.to(device).float(),
            (~torch.isfinite(norm)).float(),
            torch.zeros((), device=device) if plan_flag is None else plan_flag.to(device).float(),
        ])
        if self.scaler.is_enabled():
            combined = self.scaler.sync_found_inf(self.optimizers)
            flags[1] = torch.maximum(flags[1], combined.to(device))
        nonfinite_loss, overflow, plan_bad = (bool(v) for v in self._all_ranks_max(flags).tolist())
        if nonfinite_loss:
            return "nonfinite_loss"
        if overflow:
            return "overflow"
        return "nonfinite_plan" if plan_bad else None

    def _apply_update(self) -> str | None:
        """Step every optimizer; undo them all if one refused a non-finite low-precision weight."""
        # The decision is made and gradients are unscaled: step directly (scaler.step() would
        # read each optimizer's found-inf flag on the host once more).
        for opt in self.optimizers:
            opt.step()
        refusals = [f for opt in self.optimizers if (f := _step_nonfinite(opt)) is not None]
        if not refusals:
            return None
        refused = torch.stack([f.reshape(()).float().to(refusals[0].device) for f in refusals]).amax()
        if not bool(self._all_ranks_max(refused)):
            return None
        for opt in self.optimizers:
            flag = _step_nonfinite(opt)
            if flag is None or not bool(flag):
                opt.undo_step()  # type: ignore[attr-defined]
        return "nonfinite_weights"

    def _finish(self, reason: str | None, norm: torch.Tensor | None, zero_grad: bool = True) -> StepResult:
        scaler = self.scaler
        overflow_info = None
        if reason is None:
            if scaler.is_enabled():
                scaler.update()
            self._optimizer_steps += 1
            self._consecutive_skips = 0
            if self.scheduler is not None:
                self.scheduler.step()
            if self.tracer is not None:
                self.tracer.reset()
        else:
            if self.tracer is not None:
                overflow_info = self.tracer.first_overflow()
            if reason == "overflow" and scaler.is_enabled():
                scaler.update()
            else:
                scaler.skip()  # scaling cannot fix a forward overflow: keep the scale
            self._buffers.restore()
            self._consecutive_skips += 1
            self._last_skip_reason = reason
        self.plan.after_step(self.model)  # type: ignore[arg-type]
        self._buffers.commit()
        self._micro = 0
        self._loss_nonfinite = None
        self._unscaled = False
        self._published = False
        if zero_grad:
            self._clear_grads()
        grad_norm = None if norm is None else float(norm)  # no norm when the update ran in backward
        if reason is not None:
            self._check_skips(reason, grad_norm)
        elif grad_norm == 0.0 and scaler.is_enabled() and not self._warned_zero_grads:
            self._warn_zero_grads()
        return StepResult(
            stepped=reason is None, skipped=reason is not None, scale=scaler.get_scale(), grad_norm=grad_norm,
            skip_reason=reason, optimizer_steps=self._optimizer_steps, overflow=overflow_info,
        )

    def _warn_zero_grads(self) -> None:
        self._warned_zero_grads = True
        warnings.warn(
            f"an optimizer step ran on all-zero gradients with loss scale {self.scaler.get_scale():g}: "
            "with fp16 the gradients may have underflowed (the scale is too small or the loss is zero). "
            "Check the loss, raise min_scale= of the DynamicLossScaler, or use a bf16 plan.",
            RuntimeWarning,
            stacklevel=3,
        )

    def _clear_grads(self) -> None:
        for opt in self.optimizers:  # the wrappers also clear the model gradients they stand for
            opt.zero_grad(set_to_none=True)
        for p in self._uncovered:
            p.grad = None

    def _check_skips(self, reason: str, norm: float | None) -> None:
        if self._consecutive_skips < self.max_consecutive_skips:
            return
        n = self._consecutive_skips
        if reason == "nonfinite_loss":
            raise RuntimeError(
                f"{n} consecutive steps were skipped because the loss itself was inf/NaN: the forward pass "
                "overflows, which loss scaling cannot fix. Look for activations beyond the dtype's range "
                "(mixprec.trace_overflow names the first module), keep that part in fp32 with "
                "OpPolicy(fp32_modules=...), or lower the learning rate."
            )
        if reason == "nonfinite_plan":
            raise RuntimeError(
                f"{n} consecutive steps were skipped because the plan's layers saw inf/NaN values (for "
                "fp8-mixed: an input, weight or output gradient of an fp8 linear layer). Look for the first "
                "non-finite activation (MixedPrecision(trace_overflow=True)), check the data, or keep that "
                "layer out of fp8 (convert_to_fp8(module_filter=...))."
            )
        if reason == "nonfinite_weights":
            raise RuntimeError(
                f"{n} consecutive steps were skipped because the update would have written inf/NaN into "
                "the low-precision weights: they outgrow the dtype's range. Lower the learning rate, add "
                "weight decay, or use a bf16 or master-weight plan."
            )
        raise RuntimeError(
            f"{n} consecutive steps were skipped because the gradients were inf/NaN (last norm {norm}); "
            f"the loss scale is now {self.scaler.get_scale():g}. The gradients overflow whatever the scale: "
            "check the learning rate and the data, or use a bf16 plan."
        )

    # ------------------------------------------------------------ checkpoint
    @property
    def optimizer_steps(self) -> int:
        return self._optimizer_steps

    def state_dict(self) -> dict[str, Any]:
        """Scaler state, counters, plan fingerprint and the scheduler given to prepare().

        Master weights and compensation buffers are in the wrapped optimizers' own
        ``state_dict()``: save the model, each optimizer and this, then load in that order.
        """
        if self._micro != 0:
            raise RuntimeError(
                f"state_dict() called in the middle of gradient accumulation ({self._micro} of "
                f"{self.grad_accum_steps} micro-batches); save after step()"
            )
        sd: dict[str, Any] = {
            "format": _STATE_FORMAT,
            "plan": self.plan.name,
            "fingerprint": self.plan.fingerprint(),
            "scaler": self.scaler.state_dict(),
            "optimizer_steps": self._optimizer_steps,
            "consecutive_skips": self._consecutive_skips,
        }
        if self.scheduler is not None:
            sd["scheduler"] = self.scheduler.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any], *, allow_plan_change: bool = False) -> None:
        """Restore what :meth:`state_dict` saved; all or nothing (a failure changes nothing).

        A checkpoint from another plan, or whose loss-scaler settings differ from this
        run's (``hysteresis``, ``growth_interval``, ...), is refused unless
        ``allow_plan_change=True``: then the loss-scaler state is kept only if the scaling
        kind matches, and this run's scaler settings win over the saved ones.
        """
        scaler_state = self._validated_scaler_state(state_dict, allow_plan_change)
        if scaler_state is not None:
            self.scaler.load_state_dict(scaler_state)
        self._optimizer_steps = int(state_dict.get("optimizer_steps", 0))
        self._consecutive_skips = int(state_dict.get("consecutive_skips", 0))
        self._micro = 0
        self._loss_nonfinite = None
        self._unscaled = False
        self._published = False
        self._in_backward_ok = True
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])

    def validate_state_dict(self, state_dict: Any, *, allow_plan_change: bool = False) -> None:
        """Raise ValueError/TypeError if :meth:`load_state_dict` would refuse ``state_dict``; change nothing."""
        self._validated_scaler_state(state_dict, allow_plan_change)

    def _validated_scaler_state(self, state_dict: Any, allow_plan_change: bool) -> dict[str, Any] | None:
        """Check everything ``load_state_dict`` needs; return the scaler state to load (or None)."""
        if not isinstance(state_dict, Mapping) or state_dict.get("format") != _STATE_FORMAT:
            raise ValueError(
                "not a MixedPrecision state_dict (missing or wrong 'format'); pass what MixedPrecision.state_dict() returned"
            )
        saved_fp, ours = state_dict.get("fingerprint"), self.plan.fingerprint()
        if saved_fp != ours and not allow_plan_change:
            if isinstance(saved_fp, dict):
                diffs = ", ".join(
                    f"{k}: saved {saved_fp.get(k)!r} vs now {v!r}" for k, v in ours.items() if saved_fp.get(k) != v
                )
            else:
                diffs = "no fingerprint"
            raise ValueError(
                f"this checkpoint was made under plan {state_dict.get('plan')!r}, but this run uses "
                f"{self.plan.name!r} ({diffs}). Resuming would silently change numerics; to convert on "
                "purpose, load the model weights, start the optimizer fresh, and call "
                "load_state_dict(sd, allow_plan_change=True)."
            )
        for key in ("optimizer_steps", "consecutive_skips"):
            value = state_dict.get(key, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"state_dict[{key!r}] must be a non-negative integer, got {value!r}")
        has_saved = "scheduler" in state_dict
        if has_saved and self.scheduler is None:
            raise ValueError(
                "this checkpoint holds LR scheduler state, but no scheduler was given to prepare(): it would be "
                "dropped and the learning rate would restart. Pass scheduler= to prepare() (or set mp.scheduler) "
                "before loading"
            )
        if self.scheduler is not None and not has_saved:
            raise ValueError(
                "a scheduler was given to prepare(), but this checkpoint holds no scheduler state: the learning "
                "rate would restart from its first value. Load a checkpoint saved with the scheduler, or load "
                "without one"
            )
        if has_saved and not isinstance(state_dict["scheduler"], Mapping):
            raise ValueError(f"state_dict['scheduler'] must be a dict, got {type(state_dict['scheduler']).__name__}")
        saved = state_dict.get("scaler", {})
        if not isinstance(saved, Mapping):
            raise ValueError(f"state_dict['scaler'] must be a dict, got {type(saved).__name__}")
        if allow_plan_change and (saved_fp or {}).get("scaling") != ours["scaling"]:
            return None
        saved = dict(saved)
        current = self.scaler.state_dict()
        changed = {
            k: (saved[k], v) for k, v in current.items() if k in _SCALER_SETTINGS and k in saved and saved[k] != v
        }
        if changed:
            if not allow_plan_change:
                diffs = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in changed.items())
                raise ValueError(
                    f"this checkpoint's loss scaler was configured differently ({diffs}); resuming would "
                    "silently replace this run's settings with the saved ones. Use the saved settings, or call "
                    "load_state_dict(sd, allow_plan_change=True) to keep this run's settings and the saved counters"
                )
            saved.update({k: current[k] for k in changed})
            interval = saved.get("growth_interval")
            if isinstance(interval, int) and isinstance(saved.get("_growth_tracker"), int):
                saved["_growth_tracker"] = min(saved["_growth_tracker"], interval - 1)
        validate = getattr(self.scaler, "validate_state_dict", None)
        if validate is not None:
            validate(saved)
        return saved


def _by_device_dtype(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def _step_nonfinite(opt: torch.optim.Optimizer) -> torch.Tensor | None:
    check = getattr(opt, "step_nonfinite", None)
    return check() if check is not None else None

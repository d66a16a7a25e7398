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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mixprec.dtypes import cast_floating
from mixprec.plans import Plan, get_plan
from mixprec.scaling import LossScaler

__all__ = ["MixedPrecision", "StepResult"]

_STATE_FORMAT = "mixprec.MixedPrecision/1"


@dataclass(frozen=True)
class StepResult:
    """What :meth:`MixedPrecision.step` did.

    Attributes:
        stepped: the optimizers updated the parameters.
        skipped: an accumulation boundary was reached but the update was skipped
            (``skip_reason`` says why: ``"overflow"`` for inf/NaN gradients,
            ``"nonfinite_loss"`` for an inf/NaN loss).
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


def _input_caster(dtype: torch.dtype) -> Any:
    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        return cast_floating(args, dtype, include_float64=True), cast_floating(kwargs, dtype, include_float64=True)

    return hook


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
    ) -> None:
        self.plan = get_plan(plan)
        if not isinstance(grad_accum_steps, int) or isinstance(grad_accum_steps, bool) or grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be an integer >= 1, got {grad_accum_steps!r}")
        if clip_grad_norm is not None and (
            not isinstance(clip_grad_norm, int | float) or not clip_grad_norm > 0 or not math.isfinite(clip_grad_norm)
        ):
            raise ValueError(f"clip_grad_norm must be a positive finite number or None, got {clip_grad_norm!r}")
        if not isinstance(max_consecutive_skips, int) or max_consecutive_skips < 1:
            raise ValueError(f"max_consecutive_skips must be an integer >= 1, got {max_consecutive_skips!r}")
        if scaler is not None and not isinstance(scaler, LossScaler):
            raise TypeError(
                f"scaler must be a mixprec LossScaler (DynamicLossScaler, ConstantLossScaler, NoOpScaler), "
                f"got {type(scaler).__name__}"
            )
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
        self._micro = 0
        self._optimizer_steps = 0
        self._consecutive_skips = 0
        self._last_skip_reason: str | None = None
        self._loss_nonfinite: torch.Tensor | None = None
        self._hooks: list[Any] = []
        self.trace_overflow = bool(trace_overflow)
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
        if self.model is not None:
            raise RuntimeError("prepare() was already called on this MixedPrecision; create one per model")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"prepare() expects an nn.Module first, got {type(model).__name__}")
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(
                    f"prepare() expects torch optimizers after the model, got {type(opt).__name__}; "
                    "pass scheduler= and criterion= by keyword"
                )
        if self.device is None:
            first = next(iter(model.parameters()), None)
            self.device = first.device if first is not None else torch.device("cpu")
        from mixprec.distributed.frontdoor import ddp_arguments, plan_for_model

        ddp_kwargs = ddp_arguments(ddp, self.process_group) if ddp is not False else None
        plan = self.plan = plan_for_model(self.plan, model, ddp=ddp_kwargs is not None)
        fp32_values = plan.convert_model(model)
        if plan.policy is not None and plan.policy.fp32_modules:
            from mixprec.islands import apply_fp32_islands

            # After the conversion: islands turn their own parameters back to fp32.
            apply_fp32_islands(model, plan.policy)
            fp32_values = {p: v for p, v in fp32_values.items() if p.dtype != torch.float32}
        self.optimizers = [plan.wrap_optimizer(opt, fp32_values) for opt in optimizers]
        if self.trace_overflow:  # on the inner model, before DDP/compile wrap it
            from mixprec.diagnostics import OverflowTracer

            self.tracer = OverflowTracer(model)
        if not plan.uses_autocast and plan.weight_dtype != torch.float32:
            self._hooks.append(model.register_forward_pre_hook(_input_caster(plan.weight_dtype), with_kwargs=True))
        if ddp_kwargs is not None:  # after the conversion: DDP must see the final dtypes
            from mixprec.distributed.ddp import wrap_ddp

            model = wrap_ddp(model, plan, **ddp_kwargs)
        self.model = model
        self.scheduler = scheduler
        prepared: Any = torch.compile(model) if self.compile else model
        out: list[Any] = [prepared, *self.optimizers]
        if scheduler is not None:
            out.append(scheduler)
        if criterion is not None:
            out.append(_Fp32Criterion(criterion))
        return out[0] if len(out) == 1 else tuple(out)

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
        with contextlib.ExitStack() as stack:
            if self.is_accumulating() and self.model is not None and hasattr(self.model, "no_sync"):
                stack.enter_context(self.model.no_sync())  # type: ignore[operator]
            stack.enter_context(self.plan.autocast(self.device_type))
            yield

    # -------------------------------------------------------------- backward
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward of one micro-batch's mean loss (scaled, and divided by grad_accum_steps)."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"backward() expects the loss tensor, got {type(loss).__name__}")
        if loss.numel() != 1:
            raise ValueError(
                f"backward() expects a scalar loss, got shape {tuple(loss.shape)}; reduce it (e.g. loss.mean()) first"
            )
        with torch.no_grad():
            bad = ~torch.isfinite(loss.detach().float())
            self._loss_nonfinite = bad if self._loss_nonfinite is None else self._loss_nonfinite | bad
        if self.grad_accum_steps > 1:
            loss = loss / self.grad_accum_steps
        with self._backward_context():
            self.scaler.scale(loss).backward(**kwargs)
        self._micro += 1

    def _backward_context(self) -> contextlib.AbstractContextManager[Any]:
        # A custom op policy must also hold where backward recomputes the forward
        # (activation checkpointing); without one, torch restores autocast itself.
        if self.plan.policy is None or not self.plan.uses_autocast:
            return contextlib.nullcontext()
        from mixprec.autocast import autocast_backward

        return autocast_backward(self.plan.policy)

    # ------------------------------------------------------------------ step
    def _grads(self) -> list[torch.Tensor]:
        grads = []
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        grads.append(p.grad._values() if p.grad.is_sparse else p.grad)
        return grads

    def _total_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), device=self.device)
        from mixprec.distributed.fsdp import has_dtensor, total_grad_norm

        if has_dtensor(grads):  # FSDP2 shards: sum squared norms across the shard group
            return total_grad_norm(grads)
        norms: list[torch.Tensor] = []
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            groups.setdefault((g.device, g.dtype), []).append(g)
        target = grads[0].device
        for gs in groups.values():
            norms.extend(n.to(target) for n in torch._foreach_norm(gs, 2.0, dtype=torch.float32))
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)

    def _all_ranks_max(self, flag: torch.Tensor) -> torch.Tensor:
        group = self.process_group
        if group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            group = dist.group.WORLD
        if group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return flag

    def step(self) -> StepResult:
        """At an accumulation boundary: unscale, check, clip, step every optimizer (or none), clear grads."""
        if self.model is None:
            raise RuntimeError("step() called before prepare(); call mp.prepare(model, optimizer) first")
        if self._micro == 0 or self._micro % self.grad_accum_steps != 0:
            if self._micro == 0:
                raise RuntimeError("step() called before any backward(); call mp.backward(loss) first")
            return StepResult(
                stepped=False, skipped=False, scale=self.scaler.get_scale(), grad_norm=None,
                accumulating=True, optimizer_steps=self._optimizer_steps,
            )
        self._micro = 0
        scaler = self.scaler
        loss_bad = self._loss_nonfinite if self._loss_nonfinite is not None else torch.zeros((), dtype=torch.bool)
        self._loss_nonfinite = None
        if self.plan.family == "fp8":  # every rank computes the next fp8 scales from the same amaxes
            from mixprec.fp8 import all_reduce_amax

            all_reduce_amax(self.model, self.process_group)
        for opt in self.optimizers:
            gather = getattr(opt, "gather_grads", None)
            if gather is not None:  # master weights without grad hooks (DDP): grads into the fp32 masters
                gather()
        # One flag for every rank: [non-finite loss, non-finite gradients].
        for opt in self.optimizers:
            scaler.unscale_(opt)
        grads = self._grads()
        norm = self._total_norm(grads)
        flags = torch.stack([loss_bad.to(norm.device).float(), (~torch.isfinite(norm)).float()])
        if scaler.is_enabled():
            combined = scaler.sync_found_inf(self.optimizers) if self.optimizers else None
            if combined is not None:
                flags[1] = torch.maximum(flags[1], combined.to(flags.device))
        flags = self._all_ranks_max(flags)
        nonfinite_loss, overflow = (bool(v) for v in flags.tolist())

        overflow_info = None
        if nonfinite_loss or overflow:
            reason = "nonfinite_loss" if nonfinite_loss else "overflow"
            if self.tracer is not None:
                overflow_info = self.tracer.first_overflow()
            if nonfinite_loss:
                scaler.skip()  # scaling cannot fix a forward overflow: keep the scale
            elif scaler.is_enabled():
                scaler.update()
            else:
                scaler.skip()
            self._clear_grads()
            self._consecutive_skips += 1
            self._last_skip_reason = reason
            self._check_skips(reason, float(norm))
            return StepResult(
                stepped=False, skipped=True, scale=scaler.get_scale(), grad_norm=float(norm),
                skip_reason=reason, optimizer_steps=self._optimizer_steps, overflow=overflow_info,
            )

        if self.clip_grad_norm is not None and grads:
            coef = (self.clip_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for g in grads:
                groups.setdefault((g.device, g.dtype), []).append(g)
            for (device, _), gs in groups.items():
                torch._foreach_mul_(gs, coef.to(device))
        # The decision is made (finite everywhere) and gradients are unscaled: step directly.
        # scaler.step() would read each optimizer's found-inf flag on the host once more.
        for opt in self.optimizers:
            opt.step()
        if scaler.is_enabled():
            scaler.update()
        self._optimizer_steps += 1
        self._consecutive_skips = 0
        if self.scheduler is not None:
            self.scheduler.step()
        self._clear_grads()
        if self.tracer is not None:
            self.tracer.reset()
        return StepResult(
            stepped=True, skipped=False, scale=scaler.get_scale(), grad_norm=float(norm),
            optimizer_steps=self._optimizer_steps,
        )

    def _clear_grads(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        if self.model is not None:
            self.model.zero_grad(set_to_none=True)

    def _check_skips(self, reason: str, norm: float) -> None:
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
        """Restore what :meth:`state_dict` saved. A checkpoint from another plan is refused
        unless ``allow_plan_change=True`` (then the loss-scaler state is kept only if compatible)."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != _STATE_FORMAT:
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
        scaler_state = state_dict.get("scaler", {})
        if not allow_plan_change or (saved_fp or {}).get("scaling") == ours["scaling"]:
            self.scaler.load_state_dict(scaler_state)
        self._optimizer_steps = int(state_dict.get("optimizer_steps", 0))
        self._consecutive_skips = int(state_dict.get("consecutive_skips", 0))
        self._micro = 0
        self._loss_nonfinite = None
        if self.scheduler is not None and "scheduler" in state_dict:
            self.scheduler.load_state_dict(state_dict["scheduler"])

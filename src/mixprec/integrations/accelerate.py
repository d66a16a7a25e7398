"""mixprec under a Hugging Face Accelerate training loop.

Accelerate keeps its loop (``accumulate()``, ``backward``, ``clip_grad_norm_``,
``optimizer.step()``, ``scheduler.step()``, ``save_state``); mixprec owns the precision.
:func:`prepare` does the two ``prepare`` calls in the one correct order (mixprec
converts the model and wraps the optimizers, then Accelerate wraps them) and hands
the accelerator's precision hooks to mixprec:

- ``accelerator.backward(loss)`` divides by the accumulation steps as Accelerate does,
  scales the loss (fp16 plans) and runs backward under the plan's backward policy
  (custom op lists stay in force while activation checkpointing recomputes);
- ``accelerator.clip_grad_norm_`` / ``clip_grad_value_`` / ``unscale_gradients`` act on
  the true (unscaled, gathered) gradients and return the true norm;
- ``optimizer.step()`` is :meth:`mixprec.MixedPrecision.step` at the steps where
  ``accelerator.sync_gradients`` is True (inside ``accelerator.accumulate()``) and does
  nothing in between; with several optimizers the first ``step()`` of an iteration
  steps all of them or none (one skip decision) and the others' ``step()`` is a no-op;
- ``optimizer.step_was_skipped`` / ``accelerator.optimizer_step_was_skipped`` report
  mixprec's skip (reading them waits for the device right after a step). Accelerate's
  scheduler wrapper holds the learning rate on skipped steps without asking: it steps at
  once and is put back one step late if the step was skipped
  (:mod:`mixprec.integrations.schedules`), so every update uses the learning rate it would
  use if the host had waited;
- the prepared model's ``forward`` runs under the plan's autocast and stays an ordinary
  module: ``copy.deepcopy`` (EMA, evaluation copies) and ``torch.save`` keep the plan's
  precision with the copy's own weights (:class:`~mixprec.integrations.forward.AutocastForward`);
- the MixedPrecision state is saved by ``save_state`` and restored by ``load_state``, also
  between accumulation boundaries: see :class:`SessionCheckpoint`.

>>> import torch
>>> from accelerate import Accelerator
>>> from accelerate.state import AcceleratorState, GradientState
>>> from mixprec import MixedPrecision
>>> from mixprec.integrations.accelerate import prepare
>>> AcceleratorState._reset_state(True); GradientState._reset_state()  # (as in a fresh process)
>>> accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
>>> mp = MixedPrecision("bf16-mixed")
>>> model = torch.nn.Linear(4, 1)
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> model, opt = prepare(accelerator, mp, model, opt)
>>> for _ in range(4):
...     with accelerator.accumulate(model):
...         loss = model(torch.randn(8, 4)).pow(2).mean()
...         accelerator.backward(loss)
...         opt.step()
...         opt.zero_grad()
>>> mp.optimizer_steps  # 4 micro-batches, accumulation 2
2
>>> AcceleratorState._reset_state(True); GradientState._reset_state()
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from mixprec.integrations import as_mixed_precision, check_framework_session, require_framework
from mixprec.integrations.accelerate_fsdp2 import check_fsdp2_plugin, fsdp2_plugin, shard_for_fsdp2

require_framework("accelerate", "accelerate", "mixprec.integrations.accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.scheduler import AcceleratedScheduler  # noqa: E402

from mixprec.integrations.forward import AutocastForward  # noqa: E402
from mixprec.integrations.schedules import HeldSchedules  # noqa: E402
from mixprec.optim.shards import is_zero_step  # noqa: E402
from mixprec.session import MixedPrecision, StepResult  # noqa: E402

__all__ = ["MixprecAcceleratedOptimizer", "SessionCheckpoint", "attach", "fsdp2_plugin", "prepare"]


def _plain_module(model: torch.nn.Module) -> torch.nn.Module:
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def _check_accelerator(accelerator: Any) -> None:
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
    state = getattr(accelerator, "state", None)
    if getattr(state, "deepspeed_plugin", None) is not None:
        raise ValueError(
            "this Accelerator runs DeepSpeed, which mixprec's Accelerate integration does not support: its engine "
            "owns the optimizer and applies its own precision. Use an Accelerator without it (DDP), or one with an "
            "FSDP2 plugin (FullyShardedDataParallelPlugin(fsdp_version=2)); docs/distributed.md says how a DeepSpeed "
            "fp16/bf16 config maps to a plan"
        )
    plugin = getattr(state, "fsdp_plugin", None)
    asked = plugin is not None or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
    if asked and fsdp2_plugin(accelerator) is None:
        kind = str(getattr(state, "distributed_type", "")).split(".")[-1]
        why = (f"fsdp_version={plugin.fsdp_version}: mixprec runs its plans on FSDP2 shards only; pass "
               "FullyShardedDataParallelPlugin(fsdp_version=2)" if plugin is not None and kind == "FSDP" else
               "this process was not launched as one of several (accelerate launch or torchrun), so Accelerate runs "
               "it alone, without FSDP. Launch it distributed" if kind == "NO" else
               "Accelerate ignores an FSDP plugin on this device and runs DDP instead, without a word (it shards on "
               "GPUs only). Use an Accelerator without it (DDP) here, or shard with "
               "mixprec.distributed.fully_shard_model in your own loop")
        raise ValueError(f"this Accelerator was asked for FSDP, which mixprec does not run here: {why}")
    if plugin is not None and asked:
        check_fsdp2_plugin(plugin)
        config = getattr(accelerator, "parallelism_config", None)
        if config is not None and (getattr(config, "tp_enabled", False) or getattr(config, "cp_enabled", False)):
            raise ValueError(
                "this Accelerator's parallelism_config asks for tensor or context parallelism beside FSDP2; mixprec "
                "shards the model with FSDP2 alone (data parallel). Drop tp_size/cp_size, or shard in your own loop"
            )
    mixed = str(getattr(accelerator, "mixed_precision", "no"))
    if mixed != "no":
        raise ValueError(
            f"Accelerator(mixed_precision={mixed!r}) and mixprec would both run the precision; "
            "create the Accelerator with mixed_precision='no' and choose the plan in MixedPrecision(...)"
        )


class _Link:
    """What an accelerator knows about its MixedPrecision between calls."""

    def __init__(self, mp: MixedPrecision) -> None:
        self.mp = mp
        self.pending = False  # a backward happened since the last step
        self.dropped = False  # load_state dropped the gradients of a window: its step() is a skipped step
        self.distributed = False
        self.schedules = HeldSchedules()  # the prepared schedulers' steps, put back one step late on skips
        self.taken = False  # a held scheduler steps: the optimizers' last step counts as taken for now

    def step(self) -> StepResult | None:
        if not self.pending:
            return None
        self.pending = False
        self.dropped = False
        self.schedules.settle()  # the last step's scheduler steps, before this update (its outcome: free now)
        return self.mp.step()


class SessionCheckpoint:
    """The MixedPrecision as ``accelerator.save_state`` / ``load_state`` see it (:func:`attach` registers it).

    ``save_state`` may run wherever Accelerate allows it, also between accumulation
    boundaries (a checkpoint every N micro-batches). The state saved is then the
    MixedPrecision's as of its last step (loss scale, counters, plan: they change only at
    steps); Accelerate saves its own place in the accumulation window
    (``accelerator.step``) and, as always, no gradients.

    ``load_state`` restores both and drops the gradients this process holds from before
    the load (they belong to the run being replaced, maybe at another loss scale; a
    window's ``optimizer.step()`` left with none does nothing and reports a skip, so the
    scheduler holds too). A run resumed from a checkpoint taken between boundaries
    therefore goes on as plain Accelerate does: the next step comes where it would have
    come, and sums only the micro-batches after the resume (each still divided by the
    accumulation steps). For a bit-exact resume, save where ``accelerator.sync_gradients``
    is True, after ``optimizer.step()``.
    """

    def __init__(self, mp: MixedPrecision, link: _Link) -> None:
        self.mp = mp
        self._link = link

    def state_dict(self) -> dict[str, Any]:
        self._link.schedules.settle()
        return self.mp.state_dict(mid_accumulation=True)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.mp.load_state_dict(state_dict)  # all or nothing; resets the step in progress
        self._link.schedules.drop()  # the held scheduler steps belong to the run being replaced
        # a window in progress loses its gradients: its optimizer.step() does nothing and
        # reports a skip, so Accelerate's scheduler does not advance for it either
        self._link.dropped, self._link.pending = self._link.pending, False
        for opt in self.mp.optimizers:  # also the fp32 accumulation buffers of master plans
            opt.zero_grad(set_to_none=True)
        if self.mp.model is not None:
            self.mp.model.zero_grad(set_to_none=True)


class MixprecAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper whose ``step()`` is :meth:`MixedPrecision.step`.

    ``step()`` runs only where ``sync_gradients`` is True; ``step_was_skipped`` is
    mixprec's skip decision (so ``AcceleratedScheduler`` holds the learning rate).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, link: _Link, device_placement: bool = True) -> None:
        super().__init__(optimizer, device_placement=device_placement, scaler=None)
        self._link = link

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError(
                "optimizer.step(closure) is not supported under mixprec: compute the loss, call "
                "accelerator.backward(loss), then optimizer.step()"
            )
        if not self._link.pending and not self.optimizer.state and is_zero_step(self.optimizer.param_groups):
            # torch.distributed.checkpoint's zero step (Accelerate's FSDP2 load_state): it gives an
            # optimizer without state the tensors to load into; the plan's optimizer creates them
            self.optimizer.step()
        elif self.gradient_state.sync_gradients:
            self._link.step()

    def state_dict(self) -> dict[str, Any]:
        self._link.schedules.settle()  # a held scheduler step of a skipped step is put back first (its lr)
        return super().state_dict()

    @property
    def step_was_skipped(self) -> bool:
        return self._link.dropped or (not self._link.taken and bool(self._link.mp.last_step_skipped))

    @property
    def last_result(self) -> StepResult | None:
        """The StepResult of the last mixprec step (None before the first)."""
        return self._link.mp.last_result


class MixprecAcceleratedScheduler(AcceleratedScheduler):
    """Accelerate's scheduler wrapper that holds on mixprec's skipped steps without waiting for the
    device (:class:`~mixprec.integrations.schedules.HeldSchedules`); ``get_last_lr`` and
    ``state_dict`` settle first."""

    _mixprec: _Link

    def step(self, *args: Any, **kwargs: Any) -> None:
        link = self._mixprec
        if args or kwargs or link.dropped or not self.step_with_optimizer or not self.gradient_state.sync_gradients:
            return super().step(*args, **kwargs)  # (its own rules; a dropped window is known on the host)
        link.schedules.step(self.scheduler, lambda _: self._step_taken(), link.mp.last_result)

    def _step_taken(self) -> None:
        self._mixprec.taken = True
        try:
            super().step()
        finally:
            self._mixprec.taken = False

    def get_last_lr(self) -> Any:
        self._mixprec.schedules.settle()
        return super().get_last_lr()

    def state_dict(self) -> Any:
        self._mixprec.schedules.settle()
        return super().state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        self._mixprec.schedules.loaded_scheduler(self.scheduler)  # a skip puts back none of what is loaded
        super().load_state_dict(state_dict)


class _MixprecAcceleratorMixin:
    """Methods an attached accelerator takes from mixprec (see :func:`attach`)."""

    _mixprec: _Link

    @property
    def mixed_precision_session(self) -> MixedPrecision:
        return self._mixprec.mp

    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        """Accelerate's prepare; under an FSDP2 plugin, mixprec first shards the model with the
        plan's policy and prepares it and its optimizers on the shards (as :func:`prepare` does):
        the path of a caller that prepares through the accelerator itself (the Trainer)."""
        mp = self._mixprec.mp
        models = [a for a in args if isinstance(a, torch.nn.Module)]
        if models and mp.model is None and fsdp2_plugin(self) is not None:
            if not any(isinstance(a, torch.optim.Optimizer) for a in args):
                raise ValueError(
                    "under FSDP2 the model is prepared with its optimizer, in one prepare() call (mixprec shards the "
                    "model and points the optimizer at the shards); pass both (with the Trainer: train() before "
                    "evaluate())"
                )
            return prepare(self, mp, *args, device_placement=device_placement)
        kwargs = {} if device_placement is None else {"device_placement": device_placement}
        return super().prepare(*args, **kwargs)  # type: ignore[misc]

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        if getattr(optimizer, "_is_accelerate_prepared", False) or isinstance(optimizer, AcceleratedOptimizer):
            if optimizer not in self._optimizers:  # type: ignore[attr-defined]
                self._optimizers.append(optimizer)  # type: ignore[attr-defined]
            return optimizer
        mp = self._mixprec.mp
        if not any(optimizer is o for o in mp.optimizers):
            if mp.model is None:
                raise RuntimeError(
                    "an optimizer reached accelerator.prepare() before mixprec converted the model: "
                    "use mixprec.integrations.accelerate.prepare(accelerator, mp, model, optimizer, ...)"
                )
            optimizer = mp.prepare_optimizers(optimizer)
        if device_placement is None:
            device_placement = self.device_placement  # type: ignore[attr-defined]
        wrapped = MixprecAcceleratedOptimizer(optimizer, self._mixprec, device_placement=device_placement)
        self._optimizers.append(wrapped)  # type: ignore[attr-defined]
        return wrapped

    def prepare_scheduler(self, scheduler: Any) -> Any:
        wrapped = super().prepare_scheduler(scheduler)  # type: ignore[misc]
        if type(wrapped) is AcceleratedScheduler:
            wrapped.__class__ = MixprecAcceleratedScheduler
            wrapped._mixprec = self._mixprec
            if self._mixprec.mp.model is not None:
                self._mixprec.schedules.settle_before_saving(self._mixprec.mp.model)
        return wrapped

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        mp = self._mixprec.mp
        loss = loss / self.gradient_accumulation_steps  # type: ignore[attr-defined]
        with mp.backward_context():
            mp.scale_loss(loss).backward(**kwargs)
        # micro-batches add up where the plan says (fp32 for master plans; not under DDP)
        mp.micro_batch_done(boundary=bool(self.sync_gradients))  # type: ignore[attr-defined]
        self._mixprec.pending = True

    def _check_boundary(self, what: str) -> None:
        if not self.sync_gradients:  # type: ignore[attr-defined]
            raise RuntimeError(
                f"accelerator.{what} was called in the middle of gradient accumulation "
                "(accelerator.sync_gradients is False): the gradients are partial sums. Call it only when "
                "accelerator.sync_gradients is True, right before optimizer.step()"
            )

    def unscale_gradients(self, optimizer: Any = None) -> None:
        self._check_boundary("unscale_gradients()")
        self._mixprec.mp.unscale_()

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2) -> torch.Tensor:
        if norm_type != 2:
            raise ValueError(f"mixprec clips by the 2-norm; got norm_type={norm_type!r}: pass norm_type=2")
        self._check_boundary("clip_grad_norm_()")
        _check_parameters(self._mixprec.mp, parameters)
        return self._mixprec.mp.clip_grad_norm_(float(max_norm))

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        self._check_boundary("clip_grad_value_()")
        _check_parameters(self._mixprec.mp, parameters)
        self._mixprec.mp.clip_grad_value_(float(clip_value))


def _check_parameters(mp: MixedPrecision, parameters: Iterable[torch.Tensor]) -> None:
    """mixprec clips every gradient of the prepared optimizers (the masters' under master plans)."""
    if mp.model is None:
        return
    given = {id(p) for p in parameters}
    trainable = {id(p) for p in _plain_module(mp.model).parameters() if p.requires_grad}
    optimized = {id(p) for opt in mp.optimizers for g in opt.param_groups for p in g["params"]}
    if not (trainable <= given or optimized <= given):
        raise ValueError(
            "mixprec clips all gradients of the prepared model together (the true norm of the whole model); "
            "a subset of the parameters was passed. Pass model.parameters()"
        )


_ATTACHED: dict[type, type] = {}


def attach(accelerator: Any, mp: MixedPrecision | str | Any) -> MixedPrecision:
    """Hand ``accelerator``'s precision hooks to mixprec; returns the MixedPrecision.

    The accelerator must have ``mixed_precision='no'``. :func:`prepare` calls this; use it
    directly only when another library creates and prepares through the accelerator
    (``MixprecTrainer`` does). Attaching twice with the same MixedPrecision is a no-op.
    """
    _check_accelerator(accelerator)
    existing: _Link | None = getattr(accelerator, "_mixprec", None)
    if existing is not None:
        if mp is existing.mp:
            return existing.mp
        raise ValueError("this Accelerator already runs under another MixedPrecision; use one per accelerator")
    session = as_mixed_precision(mp) if not isinstance(mp, MixedPrecision) else mp
    check_framework_session(session)
    cls = type(accelerator)
    sub = _ATTACHED.get(cls)
    if sub is None:
        sub = type(f"Mixprec{cls.__name__}", (_MixprecAcceleratorMixin, cls), {"__module__": __name__})
        _ATTACHED[cls] = sub
    link = _Link(session)
    link.distributed = bool(getattr(accelerator, "use_distributed", False))
    link.mp.is_ddp = link.mp.is_ddp or (link.distributed and fsdp2_plugin(accelerator) is None)
    accelerator._mixprec = link
    accelerator.__class__ = sub
    accelerator.register_for_checkpointing(SessionCheckpoint(session, link))
    return session


def prepare(accelerator: Any, mp: MixedPrecision | str | Any, *args: Any, device_placement: Any = None) -> Any:
    """mixprec's prepare, then ``accelerator.prepare``, for the same objects.

    ``args`` are what ``accelerator.prepare`` takes (one model, optimizers, schedulers,
    data loaders, in any order); returns them prepared, in the same order (one object
    alone is returned as is). The model's forward then runs under the plan's autocast,
    so the loop needs no ``with mp.autocast()``; copies and pickles of the model keep
    that, with their own weights (:class:`~mixprec.integrations.forward.AutocastForward`).
    """
    session = attach(accelerator, mp)
    models = [a for a in args if isinstance(a, torch.nn.Module)]
    if len(models) > 1:
        raise ValueError(
            f"prepare() got {len(models)} models; a MixedPrecision converts one model: "
            "wrap them in one nn.Module or use one Accelerator per model"
        )
    optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer) and not isinstance(a, AcceleratedOptimizer)]
    if optimizers and not models and session.model is None:
        raise ValueError("prepare() got optimizers but no model; pass the model in the same call (mixprec converts it first)")
    replaced: dict[int, Any] = {}
    if models and session.model is None and fsdp2_plugin(accelerator) is not None:
        shard_for_fsdp2(accelerator, session, models[0], [o for o in optimizers if not any(o is p for p in
                                                                                        session.optimizers)])
    for model in models:
        if session.model is None:
            replaced[id(model)] = session.prepare_model(model)  # torch.compile(model) with compile=True
        # after prepare_model: "auto" has chosen the plan; torch.compile's wrapper calls this forward
        AutocastForward.install(model, session.plan)
    fresh = [o for o in optimizers if not any(o is p for p in session.optimizers)]
    if fresh:
        out = session.prepare_optimizers(*fresh)
        out = out if isinstance(out, tuple) else (out,)
        replaced.update({id(o): w for o, w in zip(fresh, out, strict=True)})
    converted = [replaced.get(id(a), a) for a in args]
    kwargs = {} if device_placement is None else {"device_placement": device_placement}
    if fsdp2_plugin(accelerator) is None:
        return accelerator.prepare(*converted, **kwargs)
    # Accelerate's FSDP2 prepare swaps every optimizer parameter out and back by its shard's data
    # pointer, which two empty shards on one rank share (0): the parameters are put back as they were
    groups = [(o, [list(g["params"]) for g in o.param_groups]) for o in session.optimizers]
    out = accelerator.prepare(*converted, **kwargs)
    for opt, params in groups:
        for group, mine in zip(opt.param_groups, params, strict=True):
            group["params"] = mine
    return out

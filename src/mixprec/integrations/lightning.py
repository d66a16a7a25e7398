"""Any mixprec plan in the Lightning ``Trainer`` and in Fabric, as a precision plugin.

Lightning ``Trainer``::

    from mixprec.integrations.lightning import MixprecPrecision
    trainer = L.Trainer(plugins=[MixprecPrecision("fp16-mixed")], gradient_clip_val=1.0, ...)

Fabric (``setup`` wraps the optimizers for the plan before Fabric sees them)::

    from mixprec.integrations.lightning import MixprecPrecision, setup
    fabric = L.Fabric(plugins=[MixprecPrecision("bf16-master")], accelerator="cpu")
    model, optimizer = setup(fabric, model, optimizer)

What the plugin guarantees:

- the model is converted for the plan (``convert_module``) and the optimizers are wrapped
  (``connect``, or :func:`setup` under Fabric); the forward runs under the plan's autocast;
- plans whose model takes low-precision inputs (``plan.input_dtype``: bf16-pure, fp16-pure)
  run as Lightning's own ``bf16-true`` / ``16-true``: ``convert_input`` casts the floating
  tensors of every batch (training, validation, test and predict steps; each Fabric forward)
  to the plan's dtype, so submodules a step calls directly (``self.net(x)``) get them too,
  and inside the step the plan's dtype is the default dtype (``torch.randn`` in a step is
  bf16). Integer tensors (token ids) stay integer; fp32 islands compute on fp32 inputs
  (the unrounded batch values, where the batch is not moved to another device after
  conversion) and create fp32 tensors;
- ``backward`` scales the loss (fp16 plans) and runs under the plan's backward policy
  (custom op lists hold during activation-checkpoint recomputation);
  ``on_before_backward`` sees the true loss;
- at the optimizer step the gradients are unscaled (and gathered into fp32 masters)
  *before* ``on_before_optimizer_step`` and before gradient clipping
  (``gradient_clip_val`` / ``self.clip_gradients`` / ``fabric.clip_gradients``), so hooks,
  loggers and clipping see true gradients;
- one skip decision per step; step-interval LR schedulers are held on skipped steps, without
  waiting for the device: a scheduler steps at once and is put back one step late if the step
  was skipped (:mod:`mixprec.integrations.schedules`), so every update uses the learning rate
  it would use if the host had waited;
- ``accumulate_grad_batches`` is Lightning's, with micro-batches added up in fp32 under
  master plans;
- several optimizers (manual optimisation): each ``opt.step()`` is one mixprec step of
  that optimizer alone: its gradients are unscaled and checked, it steps or skips, and
  the loss scale is updated, exactly as ``torch.amp.GradScaler`` is used in Lightning's
  own AMP plugin (one ``scaler.step(opt)`` + ``update()`` per ``opt.step()``);
- the MixedPrecision state is saved in Lightning / Fabric checkpoints and restored on resume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from mixprec.inputs import cast_inputs, input_originals
from mixprec.integrations import as_mixed_precision, check_framework_session, require_framework
from mixprec.integrations.lightning_binding import ParamBinding
from mixprec.integrations.schedules import HeldSchedules
from mixprec.islands import FP32Island

require_framework("lightning", "lightning", "mixprec.integrations.lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.fabric.wrappers import _FabricOptimizer  # noqa: E402
from lightning.pytorch.core.optimizer import LightningOptimizer  # noqa: E402
from lightning.pytorch.plugins.precision import Precision  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

from mixprec.session import MixedPrecision, StepResult  # noqa: E402

__all__ = ["MixprecPrecision", "setup", "setup_optimizers"]

_Binding = ParamBinding  # (its earlier name here)


def _inner(optimizer: Any) -> Any:
    """The optimizer under Lightning's / Fabric's wrappers."""
    while isinstance(optimizer, LightningOptimizer | _FabricOptimizer):
        optimizer = optimizer._optimizer
    return optimizer


class MixprecPrecision(Precision):
    """Precision plugin running a mixprec plan (Lightning ``Trainer`` and Fabric).

    Args:
        precision: a plan name ("bf16-mixed", "fp16-mixed", "bf16-master", ...), a
            :class:`mixprec.Plan` or a :class:`mixprec.MixedPrecision` (with
            ``grad_accum_steps=1``: accumulation is the Trainer's ``accumulate_grad_batches``).

    ``plugin.mp`` is the MixedPrecision; ``plugin.last_result`` the last step's
    :class:`mixprec.StepResult`.
    """

    def __init__(self, precision: str | Any = "bf16-mixed") -> None:
        self.mp: MixedPrecision = as_mixed_precision(precision)
        check_framework_session(self.mp)
        # Lightning reads this string for its model summary; it also changes how its loop runs
        # (a "32-true" plugin around a bf16 forward measured ~10% slower), so name the compute dtype.
        compute = self.mp.plan.compute_dtype
        self.precision = "bf16-mixed" if compute == torch.bfloat16 else "16-mixed" if compute == torch.float16 else "32-true"
        self._results: dict[int, StepResult] = {}  # id(wrapped optimizer) -> its last step's result
        self._schedules = HeldSchedules()  # step-interval schedulers, held one step late on skips
        self._swapped: list[Any] = []  # the schedulers it held or made settle first (given back at teardown)
        self._pending = False
        self.last_result: StepResult | None = None
        # Input-dtype plans: the fp32 originals of the last converted batch (models with fp32
        # islands only: an island fed a batch tensor gets its unrounded value), and the
        # default dtype outside each step context being run.
        self._islands = False
        self._originals: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._outer_dtypes: list[torch.dtype] = []
        self._defer = False  # set by setup() while Fabric shards the model

    # ------------------------------------------------------------ setup
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if getattr(self, "_defer", False):  # Fabric shards in setup: prepared after (see setup())
            return module
        if self.mp.model is None:
            module = self.mp.prepare_model(module)
        elif self.mp.model is not module:
            raise ValueError(
                "this MixprecPrecision already converted another model; use one plugin per model"
            )
        self._islands = any(isinstance(m, FP32Island) for m in module.modules())
        return module

    def _wrap(self, optimizers: Iterable[Any]) -> list[Any]:
        out = []
        for opt in optimizers:
            if any(opt is o for o in self.mp.optimizers):
                out.append(opt)
                continue
            if self.mp.model is None:
                raise RuntimeError("optimizers reached the mixprec plugin before the model was converted")
            out.append(self.mp.prepare_optimizers(opt))
        return out

    def connect(self, model: torch.nn.Module, optimizers: list[Any], lr_schedulers: list[Any]) -> tuple[Any, list[Any], list[Any]]:
        wrapped = self._wrap(optimizers)
        for config in lr_schedulers:
            # step-interval schedulers: held on skipped steps (stepped at once, put back one step late
            # if the step was skipped); the others settle those first (at an epoch's end: a read then)
            if getattr(config, "interval", "step") == "step":
                self._schedules.hold(config.scheduler, self._result_for)
                self._schedules.settle_before_saving(model)
            else:
                self._schedules.settle_before_stepping(config.scheduler)
            self._swapped.append(config.scheduler)
        return model, wrapped, lr_schedulers

    def _result_for(self, scheduler: Any) -> StepResult | None:
        target = getattr(scheduler, "optimizer", None)
        for opt in self.mp.optimizers:
            if opt is target or getattr(opt, "optimizer", None) is target:
                return self._results.get(id(opt))
        return self.mp.last_result

    # ---------------------------------------------------------- forward
    def convert_input(self, data: Any) -> Any:
        """The batch (Trainer) or the forward's ``(args, kwargs)`` (Fabric) with its floating
        tensors in ``plan.input_dtype``; unchanged for plans that leave inputs to autocast.

        The model's own input cast (a hook on its ``forward``) does not see what a
        LightningModule's steps pass to its submodules; this is where Lightning's
        ``bf16-true`` casts them too.
        """
        dtype = self.mp.plan.input_dtype
        if dtype is None:
            return data
        self._originals = {}
        return cast_inputs(data, dtype, self._originals if self._islands else None)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:  # type: ignore[override]
        # Lightning runs DDP's no_sync itself: the plan's autocast is all the forward needs,
        # and for input-dtype plans the default dtype of Lightning's bf16-true / 16-true.
        autocast = self.mp.plan.autocast(self.mp.device_type)
        dtype = self.mp.plan.input_dtype
        return autocast if dtype is None else self._low_default_dtype(autocast, dtype)

    @contextlib.contextmanager
    def _low_default_dtype(self, autocast: contextlib.AbstractContextManager[Any], dtype: torch.dtype) -> Iterator[None]:
        self._outer_dtypes.append(torch.get_default_dtype())
        try:
            with autocast, input_originals(self._originals), _default_dtype(dtype):
                yield
        finally:
            self._outer_dtypes.pop()

    def _outside_step(self) -> contextlib.AbstractContextManager[Any]:
        """The default dtype of the loop while mixprec's backward and step machinery runs
        (manual optimisation calls them inside ``training_step``, under the plan's dtype)."""
        if not self._outer_dtypes:
            return contextlib.nullcontext()
        return _default_dtype(self._outer_dtypes[0])

    # --------------------------------------------------------- backward
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        if isinstance(module, pl.LightningModule):
            super().pre_backward(tensor, module)  # on_before_backward sees the true loss
        return tensor  # scaled in backward(): Fabric ignores what pre_backward returns

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        # Lightning: backward(tensor, model, optimizer, *args); Fabric: backward(tensor, model, *args)
        with self._outside_step():
            self._run_backward(tensor, model, *args, **kwargs)

    def _run_backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        scaled = self.mp.scale_loss(tensor)
        with self.mp.backward_context():
            if isinstance(model, pl.LightningModule):
                rest = args[1:]  # args[0] is the optimizer (None in manual optimisation)
                model.backward(scaled, *rest, **kwargs)
            else:
                scaled.backward(*args, **kwargs)
        self.mp.micro_batch_done(boundary=not self._accumulating(model))
        self._pending = True

    def post_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        if isinstance(module, pl.LightningModule):
            return super().post_backward(tensor, module)  # on_after_backward
        return tensor.detach()

    def _accumulating(self, model: Any) -> bool:
        """True for a Lightning micro-batch that is not an accumulation boundary (automatic optimisation)."""
        if not isinstance(model, pl.LightningModule) or not model.automatic_optimization:
            return False
        trainer = model._trainer
        if trainer is None or trainer.accumulate_grad_batches == 1 or trainer.world_size > 1:  # DDP's reducer owns .grad
            return False
        return bool(trainer.fit_loop.epoch_loop._should_accumulate())

    # ------------------------------------------------------------- step
    def _only(self, optimizer: Any) -> contextlib.AbstractContextManager[Any]:
        """Narrow the MixedPrecision to one optimizer while it steps (manual optimisation);
        the context gives the optimizer under Lightning's / Fabric's wrappers."""
        target = _inner(optimizer)
        if len(self.mp.optimizers) == 1 and self.mp.optimizers[0] is target:
            return contextlib.nullcontext(target)  # nothing to narrow
        if not any(o is target for o in self.mp.optimizers):
            raise RuntimeError(
                f"the optimizer {type(target).__name__} was not prepared by mixprec: under Fabric create them with "
                "mixprec.integrations.lightning.setup(fabric, model, *optimizers)"
            )
        return self._narrowed(target)

    @contextlib.contextmanager
    def _narrowed(self, target: Any) -> Iterator[Any]:
        everything = self.mp.optimizers
        self.mp.optimizers = [target]
        try:
            yield target
        finally:
            self.mp.optimizers = everything

    def optimizer_step(self, optimizer: Any, model: Any = None, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        if kwargs:
            raise ValueError(f"mixprec steps the optimizer itself; optimizer.step() arguments {sorted(kwargs)} are not supported")
        closure_result = closure() if closure is not None else None
        with self._outside_step():
            return self._run_step(optimizer, model, closure_result)

    def _run_step(self, optimizer: Any, model: Any, closure_result: Any) -> Any:
        lightning = isinstance(model, pl.LightningModule)
        if lightning and closure_result is None and model.automatic_optimization:
            return None  # training_step returned None: no backward, nothing to step
        if not self._pending:
            return closure_result  # manual optimisation: step() without a backward since the last step
        self._schedules.settle()  # the last step's scheduler steps, before this update (its outcome: free now)
        with self._only(optimizer) as target:
            self.mp.unscale_()  # true gradients before the hooks and clipping
            if lightning:
                self._after_closure(model, optimizer)  # on_before_optimizer_step, then configure_gradient_clipping
            # Lightning's automatic optimisation clears the gradients itself before the next backward.
            result = self.mp.step(zero_grad=not (lightning and model.automatic_optimization))
        self._results[id(target)] = result  # (read one step late: see HeldSchedules)
        self._pending = False
        self.last_result = result
        return closure_result

    # -------------------------------------------------------- clipping
    def unscale_gradients(self, optimizer: Any) -> None:
        with self._only(optimizer), self._outside_step():
            self.mp.unscale_()

    def main_params(self, optimizer: Any) -> Iterator[torch.nn.Parameter]:
        for group in _inner(optimizer).param_groups:
            yield from group["params"]

    def clip_gradients(self, optimizer: Any, clip_val: int | float = 0.0, gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        if clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.NORM:
            self.clip_grad_by_norm(optimizer, clip_val)
        else:
            self.clip_grad_by_value(optimizer, clip_val)

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        self.clip_grad_norm_(optimizer, clip_val)

    def clip_grad_norm_(self, optimizer: Any, max_norm: int | float) -> torch.Tensor:
        """Unscale ``optimizer``'s gradients and clip them by their true total norm (computed
        in fp32); returns the norm before clipping.

        Under Fabric, ``fabric.clip_gradients`` unscales through this plugin but computes the
        norm with ``torch.nn.utils.clip_grad_norm_``, in the gradients' dtype: with bf16
        weights (bf16-pure, bf16-kahan, bf16-sr) call ``plugin.clip_grad_norm_(optimizer, max_norm)``
        for the fp32 norm mixprec's own loop uses.
        """
        with self._only(optimizer), self._outside_step():
            return self.mp.clip_grad_norm_(float(max_norm))

    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        with self._only(optimizer), self._outside_step():
            self.mp.clip_grad_value_(float(clip_val))

    # ------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        # Lightning saves wherever a callback asks, between micro-batches too: the state as
        # of the last optimizer step (Lightning's checkpoints hold no gradients either)
        self._schedules.settle()
        return self.mp.state_dict(mid_accumulation=True)

    def teardown(self) -> None:
        self._schedules.settle()  # the schedulers as the run left them, of their own classes again
        for scheduler in self._swapped:
            self._schedules.release(scheduler)
        self._swapped.clear()
        super().teardown()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.mp.load_state_dict(state_dict)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def setup(fabric: Any, module: torch.nn.Module, *optimizers: torch.optim.Optimizer, **kwargs: Any) -> Any:
    """``fabric.setup(module, *optimizers)`` with the optimizers wrapped for the plan first.

    Fabric gives a precision plugin the model but never the optimizers; this converts the
    model, wraps the optimizers (fp32 masters, Kahan / stochastic rounding) and then lets
    Fabric set them up. Returns what ``fabric.setup`` returns.

    Under a strategy that shards the model in ``fabric.setup`` (``ModelParallelStrategy``)
    the model is prepared after Fabric sharded it, so the plan runs on the shards (FSDP2
    plans, :mod:`mixprec.distributed.fsdp`). Its ``parallelize_fn`` shards with
    ``mixprec.distributed.fully_shard_model(model, plan, mesh=device_mesh["data_parallel"])``
    (or passes ``mp_policy=fsdp_policy(plan)`` to ``fully_shard``). Optimizers built before
    (``setup(fabric, model, opt)``) are re-bound to the sharded parameters that replaced
    theirs, group by group, by parameter name (by position where the names changed but the
    parameters' number and shapes did not), then wrapped for the plan: the same steps as
    Fabric's documented order, ``setup(fabric, model)`` then the optimizer over
    ``model.parameters()`` through :func:`setup_optimizers`. Refused, naming that order: an
    optimizer that already holds state (it is for the unsharded tensors), or one holding
    parameters that are not the model's, or a sharded model whose parameters cannot be
    matched to the old ones one for one.
    """
    plugin = _plugin(fabric, "setup()")
    if _shards_in_setup(fabric):
        # where the optimizers' parameters sit, read before sharding replaces them
        binding = ParamBinding(module, optimizers, type(fabric.strategy).__name__) if optimizers else None
        scheduler = kwargs.pop("scheduler", None) if optimizers else None  # (Fabric returns it with optimizers only)
        plugin._defer = True
        try:
            out = fabric.setup(module, **kwargs)
        finally:
            plugin._defer = False
        plugin.convert_module(getattr(out, "_forward_module", module))  # now sharded: the plan runs on the shards
        if binding is None:
            return out
        binding.rebind(getattr(out, "_forward_module", module))
        wrapped = setup_optimizers(fabric, *optimizers)
        wrapped = list(wrapped) if isinstance(wrapped, tuple) else [wrapped]
        return (out, *wrapped) if scheduler is None else (out, *wrapped, scheduler)
    plugin.convert_module(module)
    wrapped = plugin._wrap(optimizers)
    out = fabric.setup(module, *wrapped, **kwargs)
    prepared = plugin.mp._prepared
    if prepared is not None and wrapped:  # a strategy that sharded in fabric.setup left them stale: say so now
        prepared.check_bound(plugin.mp.optimizers, "setup()")
    return out




def setup_optimizers(fabric: Any, *optimizers: torch.optim.Optimizer) -> Any:
    """``fabric.setup_optimizers(*optimizers)`` with the optimizers wrapped for the plan first:
    for a model set up alone with :func:`setup` (Fabric's order under sharding strategies)."""
    plugin = _plugin(fabric, "setup_optimizers()")
    if plugin.mp.model is None:
        raise RuntimeError("setup_optimizers(): set the model up first with mixprec's setup(fabric, model)")
    wrapped = plugin._wrap(optimizers)
    prepared = plugin.mp._prepared
    if prepared is not None:
        prepared.check_bound(plugin.mp.optimizers, "setup_optimizers()")
    return fabric.setup_optimizers(*wrapped)


def _shards_in_setup(fabric: Any) -> bool:
    """Whether ``fabric``'s strategy shards the model inside ``fabric.setup`` (FSDP2 through ``ModelParallelStrategy``)."""
    try:
        from lightning.fabric.strategies import ModelParallelStrategy
    except ImportError:  # pragma: no cover - Lightning without it
        return False
    return isinstance(getattr(fabric, "strategy", None), ModelParallelStrategy)


def _plugin(fabric: Any, caller: str) -> MixprecPrecision:
    plugin = getattr(fabric, "_precision", None)
    if not isinstance(plugin, MixprecPrecision):
        raise ValueError(
            f"{caller} needs a Fabric created with plugins=[MixprecPrecision(...)]; "
            f"this one runs {type(plugin).__name__}"
        )
    return plugin

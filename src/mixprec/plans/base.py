"""The ``Plan`` base class: one frozen dataclass per precision mode, with hook methods.

A plan says, tensor class by tensor class, which dtype is used, and implements
the few hooks the front door (:class:`mixprec.MixedPrecision`) calls:

- :meth:`Plan.convert_model`: cast the model's parameters in place;
- :meth:`Plan.wrap_optimizer`: add master weights / compensated updates;
- :meth:`Plan.make_scaler`: the loss scaler;
- :meth:`Plan.autocast`: the context the forward pass runs in.

Adding a mode means adding a small subclass in a file of its own, and one line
in :mod:`mixprec.plans.registry`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from mixprec.dtypes import cast_module_, dtype_name, frozen_low_ids
from mixprec.formatting import Text
from mixprec.optim.kinds import StateKind
from mixprec.scaling import ConstantLossScaler, DynamicLossScaler, LossScaler, NoOpScaler

if TYPE_CHECKING:
    from mixprec.policy import OpPolicy

__all__ = ["NORM_LAYERS", "Plan", "ScalingConfig", "cast_module_"]

NORM_LAYERS: tuple[type[torch.nn.Module], ...] = (
    torch.nn.modules.batchnorm._NormBase,  # BatchNorm*, InstanceNorm*, SyncBatchNorm
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.RMSNorm,
    torch.nn.LocalResponseNorm,
)

ScalingKind = Literal["dynamic", "constant", "none"]


@dataclass(frozen=True)
class ScalingConfig:
    """How the loss is scaled: ``"dynamic"`` (DynamicLossScaler), ``"constant"`` or ``"none"``."""

    kind: ScalingKind = "none"
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    hysteresis_mode: Literal["consecutive", "since_growth", "deepspeed"] = "consecutive"
    min_scale: float | None = None
    max_scale: float | None = None

    def __post_init__(self) -> None:
        if self.init_scale is None:  # as torch.amp.GradScaler(init_scale=None): the default
            object.__setattr__(self, "init_scale", 2.0**16)
        if self.kind not in ("dynamic", "constant", "none"):
            raise ValueError(f"loss scaling kind must be 'dynamic', 'constant' or 'none', got {self.kind!r}")
        if self.kind != "none":
            self.make()  # validate every setting now, with the scaler's own messages

    def make(self, process_group: Any = None) -> LossScaler:
        if self.kind == "dynamic":
            return DynamicLossScaler(
                init_scale=self.init_scale,
                growth_factor=self.growth_factor,
                backoff_factor=self.backoff_factor,
                growth_interval=self.growth_interval,
                hysteresis=self.hysteresis,
                hysteresis_mode=self.hysteresis_mode,
                min_scale=self.min_scale,
                max_scale=self.max_scale,
                process_group=process_group,
            )
        if self.kind == "constant":
            return ConstantLossScaler(self.init_scale, process_group=process_group)
        return NoOpScaler()

    def describe(self) -> str:
        if self.kind == "dynamic":
            extra = ""
            if self.hysteresis != 1:
                extra = f", hysteresis {self.hysteresis} ({self.hysteresis_mode})"
            return f"dynamic (init {self.init_scale:g}, x{self.growth_factor:g} every {self.growth_interval} clean steps, x{self.backoff_factor:g} on overflow{extra})"
        if self.kind == "constant":
            return f"constant {self.init_scale:g}"
        return "none"


@dataclass(frozen=True)
class Plan:
    """A precision plan. Subclasses set the dtypes and implement the hooks they need.

    Create plans with :func:`mixprec.get_plan`; ``dataclasses.replace`` makes variants.
    """

    name: str
    compute_dtype: torch.dtype = torch.float32
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    policy: OpPolicy | None = None
    reduce_dtype: torch.dtype = torch.float32
    #: Frozen (``requires_grad=False``) parameters, a LoRA base: False (default) refuses, at
    #: ``prepare()`` and with the options, a cast that would round them for good (they get no
    #: fp32 master or compensation): fp16 to bf16 or back under any plan, fp32 to half under
    #: the master and Kahan plans, which keep trainable weights' fp32 values; and it does not
    #: widen half-precision ones under the autocast plans with fp32 weights (``*-mixed``,
    #: ``fp8-mixed``: autocast computes with them per op; norm layers are widened, exactly). True casts them as the plan casts trainable ones,
    #: warning once, naming them, where that rounds.
    convert_frozen: bool = False
    #: Why ``precision="auto"`` chose this plan here (None: the plan was named). Not part of
    #: the plan's identity: an auto-chosen bf16-mixed equals a named one.
    auto_reason: str | None = field(default=None, compare=False, repr=False)

    family: ClassVar[str] = "base"
    summary: ClassVar[str] = ""
    #: FSDP2 can shard a model under this plan (its layers and optimizer work on DTensor shards).
    supports_fsdp: ClassVar[bool] = False
    #: ``MixedPrecision(optimizer_in_backward=True)`` works: the plan's optimizer wrapper can
    #: update one parameter at a time inside backward.
    supports_optimizer_in_backward: ClassVar[bool] = False
    #: Sparse gradients (``nn.Embedding(sparse=True)``) of the low-precision weights train:
    #: False where the optimizer wrapper expands gradients to fp32 densely, so ``prepare``
    #: refuses such a model with the fix.
    supports_sparse_grads: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.policy is not None and self.policy.dtype != self.compute_dtype and self.uses_autocast:
            raise ValueError(
                f"plan {self.name!r} computes in {dtype_name(self.compute_dtype)} but its policy lowers ops to "
                f"{dtype_name(self.policy.dtype)}; build the policy with OpPolicy(dtype={self.compute_dtype})"
            )

    # ------------------------------------------------------------ dtype facts
    @property
    def weight_dtype(self) -> torch.dtype:
        """dtype of the model's weights after :meth:`convert_model`."""
        return torch.float32

    @property
    def uses_autocast(self) -> bool:
        return self.compute_dtype != torch.float32

    @property
    def master_dtype(self) -> torch.dtype | None:
        return None

    @property
    def input_dtype(self) -> torch.dtype | None:
        """dtype the model's floating inputs are cast to before its forward (None: left as they are).

        Plans without autocast whose weights are low precision need their inputs in that
        dtype; autocast plans leave inputs to autocast.
        """
        if self.uses_autocast or self.weight_dtype == torch.float32:
            return None
        return self.weight_dtype

    @property
    def optimizer_state_dtype(self) -> torch.dtype:
        return self.master_dtype or self.weight_dtype

    @property
    def grad_accum_dtype(self) -> torch.dtype:
        return self.master_dtype or self.weight_dtype

    def tensor_dtypes(self) -> dict[str, str]:
        """dtype per tensor class, as short names (``plan.explain()`` prints them)."""
        compute = dtype_name(self.compute_dtype)
        return {
            "weights": dtype_name(self.weight_dtype),
            "compute": compute + (" (autocast op lists)" if self.uses_autocast else ""),
            "activations": compute + (" / fp32 for fp32-list ops" if self.uses_autocast else ""),
            "grads": dtype_name(self.weight_dtype),
            "grad accumulation": dtype_name(self.grad_accum_dtype),
            "master weights": dtype_name(self.master_dtype) if self.master_dtype else "none",
            "optimizer state": dtype_name(self.optimizer_state_dtype),
            "all-reduce": dtype_name(self.reduce_dtype),
            "loss scaling": self.scaling.describe(),
        }

    def state_kinds(self) -> tuple[StateKind, ...]:
        """What the plan's optimizer wrapper keeps per low-precision weight beside the
        optimizer's own state (:mod:`mixprec.optim.kinds`); ``explain()`` lists them."""
        return ()

    def _kind_rows(self) -> dict[str, str]:
        kinds = self.state_kinds()
        if not kinds:
            return {}
        text = []
        for kind in kinds:
            dtype = kind.dtype or self.weight_dtype
            size = "a few int64 indices" if kind.sparse else f"{dtype_name(dtype)}, {dtype.itemsize} B/weight"
            text.append(f"{kind.name} ({size}: {kind.describe})")
        return {"kept per weight": "; ".join(text)}

    def explain(self) -> Text:
        """A table of the dtype each tensor class uses under this plan (at an interactive
        prompt it prints as the table).

        >>> from mixprec import get_plan
        >>> print(get_plan("bf16-master").explain().splitlines()[0])
        plan bf16-master: low-precision weights and compute, fp32 master weights, norm layers and gradient accumulation
        """
        rows = {**self.tensor_dtypes(), **self._kind_rows()}
        width = max(len(k) for k in rows)
        lines = [f"plan {self.name}: {self.summary}", ""]
        lines += [f"  {k.ljust(width)}  {v}" for k, v in rows.items()]
        if self.policy is not None:
            lines += ["", "op policy:", *("  " + line for line in self.policy.explain().splitlines())]
        if self.auto_reason:
            lines += ["", "why (precision='auto'):", *("  " + line for line in self.auto_reason.splitlines())]
        return Text("\n".join(lines))

    def fingerprint(self) -> dict[str, str]:
        """What a checkpoint must agree on to be resumed under this plan."""
        return {
            "family": self.family,
            "weights": dtype_name(self.weight_dtype),
            "master": dtype_name(self.master_dtype) if self.master_dtype else "none",
            "optimizer": type(self).optimizer_kind(),
            "scaling": self.scaling.kind,
        }

    @classmethod
    def optimizer_kind(cls) -> str:
        return "plain"

    # ------------------------------------------------------------------ hooks
    def convert_model(self, model: torch.nn.Module) -> dict[torch.Tensor, torch.Tensor]:
        """Cast ``model`` in place for this plan; returns fp32 values of what was cast down.

        The default (fp32 weights) upcasts any bf16/fp16 parameters and buffers, so a model
        loaded in half precision trains with fp32 weights as the plan says; frozen ones stay
        as loaded unless :attr:`convert_frozen` (autocast computes with them per op), but for
        norm layers.
        """
        # a frozen half-precision base stays as loaded (autocast computes with it per op), but for
        # its norm layers, small, which CPU kernels want in fp32 beside low-precision inputs
        keep = self.uses_autocast and not self.convert_frozen  # (fp32 / tf32: no autocast to cast per op)
        kept = frozen_low_ids(model, except_in=NORM_LAYERS) if keep else set()
        return cast_module_(model, torch.float32, only_from=(torch.float16, torch.bfloat16), skip=kept)

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, fp32_values: dict[torch.Tensor, torch.Tensor]
    ) -> torch.optim.Optimizer:
        """The optimizer the training loop steps (the same one unless the plan adds masters etc.)."""
        return optimizer

    def make_scaler(self, process_group: Any = None) -> LossScaler:
        return self.scaling.make(process_group)

    def backward_context(self, device_type: str = "cpu") -> contextlib.AbstractContextManager[Any]:
        """The context a backward runs in.

        A custom op policy must also hold where backward recomputes the forward
        (activation checkpointing); without one, torch restores plain autocast itself.
        """
        if self.policy is None or not self.uses_autocast:
            return contextlib.nullcontext()
        from mixprec.amp import autocast_backward

        return autocast_backward(self.policy)

    def autocast(self, device_type: str = "cpu") -> contextlib.AbstractContextManager[Any]:
        """The context the forward pass runs in (a new context manager per call)."""
        if not self.uses_autocast:
            return contextlib.nullcontext()
        if self.policy is None:  # no custom op lists: exactly torch.autocast, nothing added
            return torch.autocast(device_type, dtype=self.compute_dtype)
        from mixprec.amp import autocast

        return autocast(self.compute_dtype, device_type=device_type, policy=self.policy)

    def before_unscale(self, model: torch.nn.Module, process_group: Any) -> None:
        """Called by the front door at each step boundary, before gradients are unscaled.

        The default does nothing; the fp8 plan all-reduces its layers' latest amaxes.
        """

    def nonfinite_flag(self, model: torch.nn.Module) -> torch.Tensor | None:
        """A 0-dim bool tensor: did the plan's own layers see an inf/NaN since the last step?

        Read (with the loss and gradient flags, one host sync) for the skip decision. The
        default, None, means the plan keeps no such flag.
        """
        return None

    def after_step(self, model: torch.nn.Module) -> None:
        """Called after each step's decision (stepped or skipped); the fp8 plan resets its flag."""

    def replace(self, **changes: Any) -> Plan:
        return dataclasses.replace(self, **changes)

"""Any mixprec plan inside a Hugging Face ``transformers.Trainer``.

:class:`MixprecTrainer` is a ``Trainer`` with one more argument, ``precision`` (a plan
name, a :class:`mixprec.Plan` or a :class:`mixprec.MixedPrecision`). The Trainer keeps
its loop; mixprec runs the precision at the points the Trainer goes through its
``Accelerator`` (see :mod:`mixprec.integrations.accelerate`):

- the model is converted for the plan when the Trainer is created, and the optimizer
  the Trainer creates (or the one passed in ``optimizers=``) is wrapped for the plan
  (fp32 master weights, Kahan / stochastic-rounding updates);
- the forward and the loss run under the plan's autocast (also in evaluation);
- ``backward`` scales the loss (fp16 plans, also on CPU) and runs under the plan's
  backward policy, so custom op lists work with ``gradient_checkpointing=True``;
- ``max_grad_norm`` clips the true (unscaled, fp32-master) gradients, and the logged
  ``grad_norm`` is mixprec's true norm;
- the optimizer step is :meth:`mixprec.MixedPrecision.step` (one skip decision); the
  Trainer's scheduler is held on skipped steps without waiting for the device: it steps at
  once and is put back one step late if the step was skipped
  (:mod:`mixprec.integrations.schedules`; before the next update, a checkpoint's optimizer and
  scheduler state, ``get_last_lr()`` and the end of ``train()``), so the Trainer's own question
  ``accelerator.optimizer_step_was_skipped``, right before it steps the scheduler, reads
  nothing. (The Trainer's loop still reads the loss every step unless
  ``logging_nan_inf_filter=False``, and at each logging step.) With a ``ReduceLROnPlateau``
  (stepped with a metric at evaluation, not held) the Trainer's question reads the skip as before;
- gradient accumulation is the Trainer's (``gradient_accumulation_steps``), with
  micro-batches added up in fp32 under master plans;
- the MixedPrecision state (loss scale, counters, plan fingerprint) is saved in every
  checkpoint as ``mixprec.pt`` and restored by ``train(resume_from_checkpoint=...)``; a
  checkpoint of another plan is refused before anything is loaded, naming both plans;
  a checkpoint without ``mixprec.pt`` (a plain ``Trainer``'s) resumes under any plan:
  its optimizer state is loaded into the plan's optimizer, fp32 masters and Kahan
  compensation start from its weights (exactly where they are fp32), with one warning;
- ``save_model()`` and every checkpoint write :meth:`mixprec.MixedPrecision.export_fp32_state_dict`
  (fp32 masters, fp32 everywhere) with ``dtype: float32`` in ``config.json``, so a plain
  ``from_pretrained(folder)`` gives exactly the masters (``save_fp32=False``: the model's
  own tensors, as a plain Trainer writes them);
- ``predict()`` / ``evaluate()`` hand fp32 logits and losses to metrics and callers under
  every plan, as the Trainer's own ``fp16=True`` / ``bf16=True`` do.

>>> from mixprec.integrations.transformers import MixprecTrainer  # doctest: +SKIP
>>> trainer = MixprecTrainer(model=model, args=args, train_dataset=ds, precision="fp16-mixed")  # doctest: +SKIP
>>> trainer.train()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from mixprec.integrations import as_mixed_precision, require_framework

require_framework("transformers", "transformers", "mixprec.integrations.transformers")
require_framework("accelerate", "transformers", "mixprec.integrations.transformers")

from transformers import PreTrainedModel, Trainer, TrainingArguments  # noqa: E402
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME  # noqa: E402
from transformers.trainer_callback import CallbackHandler, TrainerControl, TrainerState  # noqa: E402
from transformers.trainer_pt_utils import reissue_pt_warnings  # noqa: E402

from mixprec.dtypes import cast_floating  # noqa: E402
from mixprec.integrations.accelerate import attach, fsdp2_plugin  # noqa: E402
from mixprec.optim import KahanOptimizer, MasterWeightOptimizer, WrappedOptimizer  # noqa: E402
from mixprec.resume import STATE_FORMAT, fingerprint_diffs, load_plain_optimizer_state  # noqa: E402
from mixprec.session import MixedPrecision  # noqa: E402

__all__ = ["MIXPREC_STATE_NAME", "MixprecTrainer"]

MIXPREC_STATE_NAME = "mixprec.pt"
"""File name of the MixedPrecision state inside each Trainer checkpoint folder."""


class MixprecTrainer(Trainer):
    """A ``transformers.Trainer`` that trains under a mixprec plan.

    Args:
        precision: a plan name ("bf16-mixed", "fp16-mixed", "bf16-master", ...), a
            :class:`mixprec.Plan` (for example with a custom op list) or a
            :class:`mixprec.MixedPrecision` (to choose its scaler and other options; it
            must have ``grad_accum_steps=1``: accumulation is the Trainer's).
        save_fp32: ``save_model()`` and checkpoints write the fp32 export
            (:meth:`mixprec.MixedPrecision.export_fp32_state_dict`: fp32 masters, other
            weights and floating buffers upcast) with ``dtype: float32`` in ``config.json``,
            so ``from_pretrained`` of the folder gives exactly the masters (default). False:
            the model's own tensors (the plan's low-precision weights, fp32 norm layers) and
            its dtype, as a plain Trainer writes them.
        *args, **kwargs: what ``transformers.Trainer`` takes. ``TrainingArguments`` must
            not set ``fp16``/``bf16`` (mixprec runs the precision).

    The MixedPrecision is ``trainer.mp``; ``trainer.mp.last_result`` is the last step's
    :class:`mixprec.StepResult`.
    """

    def __init__(
        self, *args: Any, precision: str | Any = "bf16-mixed", save_fp32: bool = True, **kwargs: Any
    ) -> None:
        if not isinstance(save_fp32, bool):
            raise TypeError(f"save_fp32 must be True or False, got {save_fp32!r}")
        self.mp: MixedPrecision = as_mixed_precision(precision)
        self.save_fp32 = save_fp32
        super().__init__(*args, **kwargs)
        if self.model is None:
            raise ValueError("MixprecTrainer needs model=...; model_init is not supported")
        if type(self.callback_handler) is CallbackHandler:
            self.callback_handler.__class__ = _SkipQueryWindow
            self.callback_handler._mixprec_trainer = self  # type: ignore[attr-defined]
        if fsdp2_plugin(self.accelerator) is None:  # (under FSDP2 the model is sharded first, at prepare)
            self.mp.prepare_model(self.model)

    # -------------------------------------------------------------- wiring
    def create_accelerator_and_postprocess(self) -> None:
        if getattr(self.args, "deepspeed", None):
            raise ValueError(
                "TrainingArguments(deepspeed=...) asks the Trainer for DeepSpeed, which MixprecTrainer does not "
                "integrate: its engine owns the optimizer and applies its own precision. Shard with FSDP2 instead "
                "(fsdp=..., fsdp_config={'fsdp_version': 2}), or at load time (from_pretrained(..., "
                "distributed_config=...)); drop deepspeed= here"
            )
        for flag in ("fp16", "bf16", "fp16_full_eval", "bf16_full_eval"):
            if getattr(self.args, flag, False):
                raise ValueError(
                    f"TrainingArguments({flag}=True) and MixprecTrainer(precision={self.mp.plan.name!r}) would "
                    f"both run the precision; drop {flag}=True (the plan decides the dtypes)"
                )
        super().create_accelerator_and_postprocess()
        if getattr(self.args, "fsdp", None) and fsdp2_plugin(self.accelerator) is None:
            raise ValueError(
                "TrainingArguments(fsdp=...) asks the Trainer for FSDP, which MixprecTrainer runs as FSDP2 where "
                "Accelerate shards (GPUs, with fsdp_config={'fsdp_version': 2}); here Accelerate would run DDP "
                "instead, without a word (on CPU), or FSDP1. Drop fsdp= here, or shard the model at load time "
                "(from_pretrained(..., distributed_config=...))"
            )
        attach(self.accelerator, self.mp)

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        if self.mp.model is None:  # FSDP2: prepared with the model once it is sharded (accelerator.prepare)
            return optimizer
        if optimizer is not None and not any(optimizer is o for o in self.mp.optimizers):
            inner = getattr(optimizer, "optimizer", None)  # already through Accelerate
            if not any(inner is o for o in self.mp.optimizers):
                self.optimizer = self.mp.prepare_optimizers(optimizer)
        return self.optimizer  # type: ignore[return-value]

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """The Trainer's scheduler (or the one passed in ``optimizers=``), held on skipped steps
        without waiting for the device (see the module's notes); a ``ReduceLROnPlateau`` or another
        scheduler that is not a torch ``LRScheduler`` is left as it is."""
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        link = self._mixprec_link()
        if (link is not None and isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)
                and not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            link.schedules.hold(scheduler, lambda _: self.mp.last_result)
        return scheduler

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            link = self._mixprec_link()
            if link is not None:
                link.taken = False  # (a step that raised inside the window: the question reads again)
                link.schedules.settle()  # the optimizer's lr as the run left it, and the scheduler of its own class
                link.schedules.release(self.lr_scheduler)

    def _mixprec_link(self) -> Any:
        """The attached accelerator's link to the MixedPrecision (its held schedules; None before
        the accelerator exists). A checkpoint needs no settling here: the optimizer's and the held
        scheduler's ``state_dict`` settle first."""
        return getattr(getattr(self, "accelerator", None), "_mixprec", None)

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> contextlib.AbstractContextManager:
        return self.mp.autocast()

    def prediction_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> tuple[Any, Any, Any]:
        """The Trainer's step, with bf16/fp16 losses and logits upcast to fp32: a precision
        plan is not a model dtype (the Trainer's own fp16/bf16 mixed precision does the same)."""
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        return cast_floating(loss, torch.float32), cast_floating(logits, torch.float32), labels

    # ---------------------------------------------------------- checkpoints
    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        if not self.save_fp32 or state_dict is not None:
            super()._save(output_dir, state_dict=state_dict)
            return
        output_dir = output_dir if output_dir is not None else str(self.args.output_dir)
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        config = getattr(model, "config", None)
        dtype_before = getattr(config, "dtype", None)
        super()._save(output_dir, state_dict=self.mp.export_fp32_state_dict())
        if (
            self.args.should_save
            and isinstance(model, PreTrainedModel)
            and not getattr(model, "_hf_peft_config_loaded", False)
        ):
            # save_pretrained wrote the model's dtype (the plan's weight dtype) into config.json,
            # and into the live config; the weights it saved are fp32
            saved = copy.deepcopy(model.config)
            saved.dtype = torch.float32
            saved.save_pretrained(output_dir)
            model.config.dtype = dtype_before

    def _save_scaler(self, output_dir: str) -> None:
        super()._save_scaler(output_dir)
        if self.args.should_save:
            torch.save(self.mp.state_dict(), os.path.join(output_dir, MIXPREC_STATE_NAME))

    def _mixprec_state(self, checkpoint: str) -> Any:
        path = os.path.join(checkpoint, MIXPREC_STATE_NAME)
        return torch.load(path, map_location="cpu", weights_only=True) if os.path.isfile(path) else None

    def _check_plan(self, state: Any, checkpoint: str) -> None:
        """Refuse a checkpoint of another plan (or any state :meth:`MixedPrecision.load_state_dict`
        would refuse) before the optimizer state is loaded: nothing changes."""
        plan = self.mp.plan
        if isinstance(state, Mapping) and state.get("format") == STATE_FORMAT and state.get("fingerprint") != plan.fingerprint():
            saved = state.get("plan")
            auto = " (this run's plan was chosen by precision='auto' on this hardware)" if plan.auto_reason else ""
            raise ValueError(
                f"checkpoint {checkpoint!r} was saved under plan {saved!r}, but this MixprecTrainer runs plan "
                f"{plan.name!r}{auto} ({fingerprint_diffs(state.get('fingerprint'), plan)}). Resuming would silently "
                f"change numerics. Resume it with MixprecTrainer(precision={saved!r}); to convert on purpose, "
                f"start from its weights (from_pretrained({checkpoint!r})) under {plan.name!r} without "
                "resume_from_checkpoint (a fresh optimizer, loss scale and learning-rate schedule)"
            )
        self.mp.validate_state_dict(state)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        state = self._mixprec_state(checkpoint)
        if state is not None:
            self._check_plan(state, checkpoint)
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        self._resume_without_mixprec_state(checkpoint)

    def _resume_without_mixprec_state(self, checkpoint: str) -> None:
        """A checkpoint without ``mixprec.pt`` (a plain Trainer's, or saved with ``save_only_model``):
        its optimizer state goes into the plan's optimizer, which keeps its own masters /
        compensation, started from the checkpoint's weights."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # inside Accelerate's wrapper
        if fsdp2_plugin(self.accelerator) is not None and isinstance(optimizer, WrappedOptimizer):
            raise ValueError(
                f"checkpoint {checkpoint!r} has no {MIXPREC_STATE_NAME} (a plain Trainer's, or saved with "
                f"save_only_model=True), and under FSDP2 its sharded optimizer state cannot go into plan "
                f"{self.mp.plan.name!r}'s optimizer (its compensation or noise is not there). Resume it under a "
                "'*-master' or '*-mixed' plan, or start from its weights without resume_from_checkpoint"
            )
        found = all(os.path.isfile(os.path.join(checkpoint, name)) for name in (OPTIMIZER_NAME, SCHEDULER_NAME))
        if not isinstance(optimizer, WrappedOptimizer):
            super()._load_optimizer_and_scheduler(checkpoint)
        elif found:  # as the Trainer loads them, with the plan's optimizer taking a plain state_dict
            sd = torch.load(os.path.join(checkpoint, OPTIMIZER_NAME), map_location="cpu", weights_only=True)
            load_plain_optimizer_state(optimizer, sd)
            if self.lr_scheduler is not None:
                with warnings.catch_warnings(record=True) as caught:
                    self.lr_scheduler.load_state_dict(
                        torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True)
                    )
                reissue_pt_warnings(caught)
        done = [
            f"resuming under plan {self.mp.plan.name!r} with a fresh loss scale and step counters",
            f"the optimizer state of its {OPTIMIZER_NAME} (into {type(optimizer).__name__})" if found
            else f"a fresh optimizer state (it has no {OPTIMIZER_NAME})",
        ]
        if isinstance(optimizer, KahanOptimizer):
            # The Trainer loaded the weights before this optimizer existed; loading them again now
            # gives each Kahan compensation the residual of a wider (fp32) checkpoint value.
            self._load_from_checkpoint(checkpoint)
            done.append("Kahan compensation from its weights (their fp32 residual where they are fp32)")
        elif isinstance(optimizer, MasterWeightOptimizer):  # seeded by the Trainer's load into the model
            done.append("fp32 master weights from its weights (exactly where they are fp32)")
        warnings.warn(
            f"checkpoint {checkpoint!r} has no {MIXPREC_STATE_NAME} (a plain Trainer's, or saved with "
            f"save_only_model=True): {', '.join(done)}",
            stacklevel=2,
        )

    def _load_scaler(self, checkpoint: str | None) -> None:
        if getattr(self.accelerator, "scaler", None) is not None:  # never: mixprec runs the precision
            super()._load_scaler(checkpoint)  # (a plain fp16 checkpoint's scaler.pt has nothing to go into)
        if checkpoint is None:
            return
        state = self._mixprec_state(checkpoint)
        if state is None:
            return  # _load_optimizer_and_scheduler warned: the scale and counters start fresh
        self.mp.load_state_dict(state)


class _SkipQueryWindow(CallbackHandler):
    """The Trainer's callbacks, and between its optimizer step's callbacks and its step's end the
    window in which the Trainer's own loop asks ``accelerator.optimizer_step_was_skipped`` before it
    steps the scheduler: where that scheduler is held (:meth:`MixprecTrainer.create_scheduler`),
    the answer is "taken" without a read, and the held scheduler puts itself back one step late if
    the step was skipped. Callbacks asking in ``on_optimizer_step`` or later get the true answer."""

    _mixprec_trainer: MixprecTrainer

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any:
        control = super().on_optimizer_step(args, state, control, **kwargs)
        link = self._mixprec_trainer._mixprec_link()
        if link is not None and getattr(type(self._mixprec_trainer.lr_scheduler), "_mixprec_held", False):
            link.taken = True
        return control

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any:
        link = self._mixprec_trainer._mixprec_link()
        if link is not None:
            link.taken = False
        return super().on_step_end(args, state, control, **kwargs)

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
  Trainer's scheduler is held on skipped steps;
- gradient accumulation is the Trainer's (``gradient_accumulation_steps``), with
  micro-batches added up in fp32 under master plans;
- the MixedPrecision state (loss scale, counters, plan fingerprint) is saved in every
  checkpoint as ``mixprec.pt`` and restored by ``train(resume_from_checkpoint=...)``.

>>> from mixprec.integrations.transformers import MixprecTrainer  # doctest: +SKIP
>>> trainer = MixprecTrainer(model=model, args=args, train_dataset=ds, precision="fp16-mixed")  # doctest: +SKIP
>>> trainer.train()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch

from mixprec.integrations import as_mixed_precision, require_framework

require_framework("transformers", "transformers", "mixprec.integrations.transformers")
require_framework("accelerate", "transformers", "mixprec.integrations.transformers")

from transformers import Trainer  # noqa: E402

from mixprec.integrations.accelerate import attach  # noqa: E402
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
        *args, **kwargs: what ``transformers.Trainer`` takes. ``TrainingArguments`` must
            not set ``fp16``/``bf16`` (mixprec runs the precision).

    The MixedPrecision is ``trainer.mp``; ``trainer.mp.last_result`` is the last step's
    :class:`mixprec.StepResult`.
    """

    def __init__(self, *args: Any, precision: str | Any = "bf16-mixed", **kwargs: Any) -> None:
        self.mp: MixedPrecision = as_mixed_precision(precision)
        super().__init__(*args, **kwargs)
        if self.model is None:
            raise ValueError("MixprecTrainer needs model=...; model_init is not supported")
        self.mp.prepare_model(self.model)

    # -------------------------------------------------------------- wiring
    def create_accelerator_and_postprocess(self) -> None:
        for flag in ("fp16", "bf16", "fp16_full_eval", "bf16_full_eval"):
            if getattr(self.args, flag, False):
                raise ValueError(
                    f"TrainingArguments({flag}=True) and MixprecTrainer(precision={self.mp.plan.name!r}) would "
                    f"both run the precision; drop {flag}=True (the plan decides the dtypes)"
                )
        super().create_accelerator_and_postprocess()
        attach(self.accelerator, self.mp)

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        if optimizer is not None and not any(optimizer is o for o in self.mp.optimizers):
            inner = getattr(optimizer, "optimizer", None)  # already through Accelerate
            if not any(inner is o for o in self.mp.optimizers):
                self.optimizer = self.mp.prepare_optimizers(optimizer)
        return self.optimizer  # type: ignore[return-value]

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> contextlib.AbstractContextManager:
        return self.mp.autocast()

    # ---------------------------------------------------------- checkpoints
    def _save_scaler(self, output_dir: str) -> None:
        super()._save_scaler(output_dir)
        if self.args.should_save:
            torch.save(self.mp.state_dict(), os.path.join(output_dir, MIXPREC_STATE_NAME))

    def _load_scaler(self, checkpoint: str | None) -> None:
        super()._load_scaler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, MIXPREC_STATE_NAME)
        if not os.path.isfile(path):
            warnings.warn(
                f"checkpoint {checkpoint!r} has no {MIXPREC_STATE_NAME} (it was not saved by MixprecTrainer): "
                "the loss scale and step counters start fresh",
                stacklevel=2,
            )
            return
        self.mp.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

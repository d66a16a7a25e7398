"""Run mixprec inside the training loops of other frameworks.

Each submodule imports its framework when it is imported, and only then:

- :mod:`mixprec.integrations.transformers`: :class:`~mixprec.integrations.transformers.MixprecTrainer`,
  a ``transformers.Trainer`` that trains under any plan (``pip install mixprec[transformers]``);
- :mod:`mixprec.integrations.lightning`: ``MixprecPrecision``, a precision plugin for the
  Lightning ``Trainer`` and for Fabric (``pip install mixprec[lightning]``);
- :mod:`mixprec.integrations.accelerate`: ``prepare(accelerator, mp, ...)``, mixprec under an
  Accelerate loop (``pip install mixprec[accelerate]``).

Every integration uses the composable front door (``mp.prepare_model``,
``mp.prepare_optimizers``, ``mp.scale_loss``, ``mp.backward_context``, ``mp.unscale_``,
``mp.clip_grad_norm_``, ``mp.step``) and changes nothing in the framework's own
classes: the framework keeps its loop, mixprec owns the precision.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["as_mixed_precision", "check_framework_session", "require_framework"]


def require_framework(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` or raise an ImportError that names the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{what} needs the {module!r} package, which is not installed: "
            f"pip install mixprec[{extra}]"
        ) from exc


def as_mixed_precision(precision: Any, **kwargs: Any) -> Any:
    """A :class:`mixprec.MixedPrecision` from a plan name, a :class:`mixprec.Plan` or one already made.

    ``kwargs`` are MixedPrecision arguments, only allowed when a name or a plan is given.
    """
    from mixprec.plans import Plan
    from mixprec.session import MixedPrecision

    if isinstance(precision, MixedPrecision):
        if kwargs:
            raise ValueError(
                f"precision is already a MixedPrecision, so {sorted(kwargs)} cannot be applied; "
                "pass them to MixedPrecision(...) instead"
            )
        if precision.model is not None:
            raise ValueError(
                "precision is a MixedPrecision that already prepared a model; create one MixedPrecision per model"
            )
        return precision
    if isinstance(precision, str | Plan):
        return MixedPrecision(precision, **kwargs)
    raise TypeError(
        f"precision must be a plan name such as 'bf16-mixed', a mixprec.Plan or a mixprec.MixedPrecision, "
        f"got {type(precision).__name__}"
    )


def check_framework_session(mp: Any) -> None:
    """Refuse session options a framework loop cannot honour (its own backward and accumulation)."""
    if mp.optimizer_in_backward:
        raise ValueError(
            "MixedPrecision(optimizer_in_backward=True) needs mixprec's own backward(); a framework runs its "
            "own backward and step, so use optimizer_in_backward=False under a framework"
        )
    if mp.grad_accum_steps != 1:
        raise ValueError(
            f"MixedPrecision(grad_accum_steps={mp.grad_accum_steps}) under a framework loop would divide the "
            "loss twice; the framework accumulates: use MixedPrecision(grad_accum_steps=1) and set the "
            "framework's own accumulation (Accelerator(gradient_accumulation_steps=...), "
            "TrainingArguments(gradient_accumulation_steps=...), Trainer(accumulate_grad_batches=...))"
        )

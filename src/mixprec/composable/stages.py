"""The loss of a pipeline schedule's last stage: :class:`StageLoss` (see
:meth:`mixprec.composable.ComposableSteps.stage_loss`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from mixprec.step import check_loss

if TYPE_CHECKING:
    from mixprec.composable import ComposableSteps

__all__ = ["STAGE_LOSSES_KEPT", "StageLoss"]

STAGE_LOSSES_KEPT = 4096  # stage losses remembered until stage_backward_done() (micro-batches of a step)


class StageLoss:
    """The loss function of a pipeline schedule's last stage (:meth:`ComposableSteps.stage_loss`):
    ``loss_fn``'s loss times the loss scale, which the schedule backpropagates. It counts nothing:
    torch's schedule also calls it once on shapes alone (a stage built without static shapes infers
    them at the first ``step``, on uninitialised data); :meth:`ComposableSteps.stage_backward_done`
    counts the step and checks the losses the schedule hands back (``losses=``), not that call."""

    def __init__(self, steps: ComposableSteps, loss_fn: Callable[..., torch.Tensor]) -> None:
        self.steps, self.loss_fn = steps, loss_fn

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        steps = self.steps
        loss = self.loss_fn(*args, **kwargs)
        check_loss(loss, "the stage loss (mp.stage_loss)")
        if steps._in_backward is not None:
            raise RuntimeError(
                "mp.stage_loss() under optimizer_in_backward=True: a pipeline runs several backwards per step; use "
                "optimizer_in_backward=False"
            )
        steps._phases.check_backward("the stage loss (mp.stage_loss)", steps.grad_accum_steps)
        scaled = steps.scaler.scale(loss)
        # (its unscaled value, for the non-finite check of the losses stage_backward_done() is handed)
        kept = steps._stage_losses
        if len(kept) >= STAGE_LOSSES_KEPT:  # (evaluation runs the loss too, and counts no step)
            del kept[: len(kept) // 2]
        kept.append((scaled, loss.detach().to(torch.float32, copy=True).reshape(())))
        return scaled  # type: ignore[no-any-return]

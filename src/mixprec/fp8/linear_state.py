"""The options and the fp8 state of :class:`mixprec.fp8.Fp8Linear`.

What ``cast`` and ``scale_update`` take (:data:`CASTS`, :data:`SCALE_UPDATES`) and their
check, the per-kind view of a layer's state (:class:`Fp8TensorState`), and the stacked
scale update that folds the pending amaxes of many layers at once (:func:`fold_scales`,
what :func:`mixprec.fp8.update_scales` runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mixprec.dtypes import Format
from mixprec.fp8.fused import FUSED_CASTS
from mixprec.fp8.recipe import DelayedScaling, Fp8Recipe
from mixprec.fp8.scaling import FP32_MAX, MIN_SCALE, history_amax

__all__ = ["CASTS", "SCALE_UPDATES", "Fp8TensorState", "check_cast", "fold_scales"]

#: What ``Fp8Linear(cast=...)`` takes: "auto" (a fused cast where the native fp8 GEMM runs,
#: "triton" where Triton is installed, else "compile"; "eager" elsewhere), "eager" (the
#: unfused quantiser), or one of the fused casts of :data:`mixprec.fp8.fused.FUSED_CASTS`.
CASTS: tuple[str, ...] = ("auto", "eager", *FUSED_CASTS)

#: What ``Fp8Linear(scale_update=...)`` takes: "layer" (a fused layer folds its pending
#: amaxes itself at its next forward: the eager quantiser's numbers) or "step" (the owner
#: calls :func:`update_scales` once per step for all layers; micro-batches of one step
#: share the step's scales and their amaxes are reduced, TransformerEngine's convention).
SCALE_UPDATES: tuple[str, ...] = ("layer", "step")


@dataclass(frozen=True)
class Fp8TensorState:
    """fp8 state of one tensor kind of one layer (tensors are live views of the buffers).

    Attributes:
        format: the fp8 format this tensor is quantised to.
        scale: the scale used at the most recent training iteration (1.0 before any).
        amax_history: past amaxes, most recent first (length ``recipe.history_len``).
        next_scale: the scale the next iteration will use (delayed scaling), or None
            where it depends on the next tensor (current scaling).
        saturation: fraction of elements clamped at ``±fmt_max`` in the last iteration.
        underflow: fraction of non-zero elements flushed to zero in the last iteration.
    """

    format: Format
    scale: torch.Tensor
    amax_history: torch.Tensor
    next_scale: torch.Tensor | None
    saturation: torch.Tensor
    underflow: torch.Tensor


def check_cast(cast: object, scale_update: object, owner: str) -> None:
    """TypeError / ValueError naming ``owner``'s bad ``cast`` or ``scale_update`` and what works."""
    if not isinstance(cast, str) or cast not in CASTS:
        raise (ValueError if isinstance(cast, str) else TypeError)(
            f"{owner}(cast={cast!r}): expected one of {CASTS} ('auto': fused where the native fp8 GEMM "
            "runs, 'eager' elsewhere)"
        )
    if not isinstance(scale_update, str) or scale_update not in SCALE_UPDATES:
        raise (ValueError if isinstance(scale_update, str) else TypeError)(
            f"{owner}(scale_update={scale_update!r}): expected 'layer' (each fused layer folds its amaxes "
            "at its next forward) or 'step' (mixprec.fp8.update_scales once per step)"
        )



_NUMERATORS: dict[tuple[torch.device, tuple[float, ...]], torch.Tensor] = {}


def _numerator(device: torch.device, values: tuple[float, ...]) -> torch.Tensor:
    """``fmt_max / 2**margin`` per tensor kind on ``device``, made once (no copy to the device per step)."""
    key = (device, values)
    out = _NUMERATORS.get(key)
    if out is None:
        out = _NUMERATORS[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return out


def fold_scales(
    recipe: Fp8Recipe,
    formats: Sequence[Format],
    histories: list[torch.Tensor],
    scales: list[torch.Tensor],
    pending: list[torch.Tensor] | None,
) -> None:
    """Fold the pending amaxes of layers sharing ``recipe`` on one device into their amax
    ``histories`` (unless ``pending`` is None) and compute their next ``scales`` (delayed
    scaling): a fixed number of ops for all of them, on stacked copies of their buffers."""
    device = scales[0].device
    with torch.no_grad():
        history = torch.stack(histories)  # (layers, kinds, history_len)
        if pending is not None:
            latest = torch.stack(pending)
            seen = ~(latest < 0)  # a kind quantised since the last fold (NaN: seen, not finite)
            latest = torch.where(torch.isfinite(latest), latest, torch.zeros_like(latest))  # as record_amax
            rolled = torch.cat([latest.unsqueeze(-1), history[..., :-1]], dim=-1)
            history = torch.where(seen.unsqueeze(-1), rolled, history)
            torch._foreach_copy_(histories, list(history.unbind(0)))
            torch._foreach_copy_(pending, list(torch.full_like(latest, -1.0).unbind(0)))
        if isinstance(recipe, DelayedScaling):
            reduced = history_amax(history, recipe.amax_compute_algo)  # (layers, kinds)
            numerator = _numerator(device, tuple(f.max / 2.0**recipe.margin for f in formats))
            prev = torch.stack(scales)
            # compute_scale's arithmetic (one division, the clamps, the previous scale kept)
            new = torch.clamp(numerator / reduced, min=MIN_SCALE, max=FP32_MAX)
            new = torch.where(torch.isfinite(reduced) & (reduced > 0), new, prev)
            torch._foreach_copy_(scales, list(new.unbind(0)))

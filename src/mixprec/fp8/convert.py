"""Model-level fp8: convert ``nn.Linear`` layers, all-reduce their amaxes, read their diagnostics.

>>> import torch
>>> from mixprec.fp8 import DelayedScaling, convert_to_fp8, stats
>>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
>>> model = convert_to_fp8(model, DelayedScaling(amax_history_len=16))
>>> [type(m).__name__ for m in model]  # 10 outputs is not a multiple of 16: kept
['Fp8Linear', 'ReLU', 'Linear']
>>> model(torch.randn(4, 16)).sum().backward()
>>> sorted(stats(model)["0"])
['grad_output', 'input', 'weight']
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mixprec.fp8.formats import TENSOR_KINDS
from mixprec.fp8.gemm import native_fp8_available
from mixprec.fp8.linear import Fp8Linear, check_cast
from mixprec.fp8.recipe import DelayedScaling, Fp8Recipe

__all__ = [
    "all_reduce_amax",
    "convert_to_fp8",
    "default_module_filter",
    "fp8_layers",
    "nonfinite_flag",
    "reset_nonfinite",
    "stats",
]

ModuleFilter = Callable[[str, nn.Module], bool]

_FP8_MULTIPLE = 16


def default_module_filter(name: str, module: nn.Module) -> bool:
    """Eligible for fp8: an exact ``nn.Linear`` with in and out features positive multiples of 16.

    Subclasses of ``nn.Linear`` are left alone: they may not call their own ``forward``
    (``nn.MultiheadAttention`` reads ``out_proj.weight`` directly). So are empty layers
    (0 in or out features): there is no GEMM to speed up.

    >>> import torch
    >>> default_module_filter("head", torch.nn.Linear(64, 10))
    False
    """
    return (
        type(module) is nn.Linear
        and module.in_features % _FP8_MULTIPLE == 0
        and module.out_features % _FP8_MULTIPLE == 0
        and module.in_features > 0
        and module.out_features > 0
    )


def convert_to_fp8(
    model: nn.Module,
    recipe: Fp8Recipe | None = None,
    module_filter: ModuleFilter | None = None,
    emulate: bool | None = None,
    *,
    track_stats: bool = True,
    cast: str = "auto",
    scale_update: str = "layer",
) -> nn.Module:
    """Swap eligible ``nn.Linear`` layers of ``model`` for :class:`Fp8Linear`, in place.

    The new layers keep the original ``weight`` and ``bias`` Parameters (an optimizer built
    before the conversion keeps working) and their ``state_dict`` keys, adding
    ``fp8_scale`` and ``fp8_amax_history`` buffers.

    Args:
        model: the model; returned (the return value matters only when ``model`` itself is
            an ``nn.Linear``).
        recipe: :class:`DelayedScaling` (default: ``DelayedScaling()``) or
            :class:`CurrentScaling`; shared by every converted layer.
        module_filter: ``(qualified_name, module) -> bool``; a layer is converted when it is
            eligible (:func:`default_module_filter`) and this returns True. Use it to keep
            e.g. the first and last layers in bf16.
        emulate: None: native fp8 GEMMs on CUDA devices that have them, emulation
            elsewhere (decided per call, so the model may move devices later). True: always
            emulate. False: native only; an error here if this machine has no fp8 GEMM.
        track_stats: record saturation / underflow diagnostics at every training iteration
            (see :func:`stats`); False saves a few elementwise passes per tensor.
        cast, scale_update: the quantiser of the new layers and who folds a fused cast's
            amaxes (see :class:`Fp8Linear`; with ``scale_update="step"`` call
            :func:`~mixprec.fp8.update_scales` once per step).

    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    >>> m = convert_to_fp8(m, module_filter=lambda name, mod: name != "1")
    >>> [type(x).__name__ for x in m]
    ['Fp8Linear', 'Linear']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"convert_to_fp8(model={model!r}): expected a torch.nn.Module whose nn.Linear layers "
            "are to be converted"
        )
    if recipe is None:
        recipe = DelayedScaling()
    if not isinstance(recipe, Fp8Recipe):
        raise TypeError(
            f"convert_to_fp8(recipe={recipe!r}): expected a mixprec.fp8.DelayedScaling or "
            "CurrentScaling instance, e.g. DelayedScaling(fmt='hybrid')"
        )
    if module_filter is not None and not callable(module_filter):
        raise TypeError(
            f"convert_to_fp8(module_filter={module_filter!r}): expected None or a callable "
            "(qualified_name, module) -> bool, e.g. lambda name, m: name != 'head'"
        )
    if emulate is not None and not isinstance(emulate, bool):
        raise TypeError(f"convert_to_fp8(emulate={emulate!r}): expected None (automatic), True or False")
    if not isinstance(track_stats, bool):
        raise TypeError(f"convert_to_fp8(track_stats={track_stats!r}): expected True or False")
    check_cast(cast, scale_update, "convert_to_fp8")
    if emulate is False and not native_fp8_available():
        raise RuntimeError(
            "convert_to_fp8(emulate=False) needs native fp8 GEMMs (torch._scaled_mm on a CUDA GPU "
            "of compute capability >= 8.9, e.g. Ada or Hopper), and this machine has none; "
            "pass emulate=None to emulate fp8 where the hardware lacks it"
        )

    replaced: dict[int, Fp8Linear] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not default_module_filter(name, module):
            continue
        if module_filter is not None and not module_filter(name, module):
            continue
        replaced[id(module)] = Fp8Linear.from_linear(module, recipe, emulate, track_stats, cast, scale_update)
    if id(model) in replaced:
        return replaced[id(model)]
    # Walk every parent (shared layers may have several) and swap the registered children.
    for parent in model.modules():
        for child_name, child in list(parent._modules.items()):
            if child is not None and id(child) in replaced:
                setattr(parent, child_name, replaced[id(child)])
    return model


def fp8_layers(model: nn.Module) -> dict[str, Fp8Linear]:
    """The :class:`Fp8Linear` layers of ``model`` by qualified name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}


def nonfinite_flag(model: nn.Module) -> torch.Tensor | None:
    """Whether any fp8 layer of ``model`` saw an inf/NaN amax since the last :func:`reset_nonfinite`.

    A 0-dim bool tensor on the first layer's device, computed without a host sync (the
    caller reads it once, with its other skip flags), or None when ``model`` has no fp8
    layers. Input, weight and output-gradient amaxes all count, in training mode.

    >>> import torch
    >>> layer = convert_to_fp8(torch.nn.Linear(16, 16))
    >>> layer(torch.full((2, 16), float("inf"))).isnan().all().item(), nonfinite_flag(layer)
    (True, tensor(True))
    >>> reset_nonfinite(layer); nonfinite_flag(layer)
    tensor(False)
    >>> nonfinite_flag(torch.nn.ReLU()) is None
    True
    """
    flags = [layer.fp8_nonfinite for layer in fp8_layers(model).values()]
    if not flags:
        return None
    device = flags[0].device
    return torch.stack([f.to(device, non_blocking=True) for f in flags]).any()


def reset_nonfinite(model: nn.Module) -> None:
    """Clear the non-finite flag of every fp8 layer of ``model`` (after each step's decision)."""
    for layer in fp8_layers(model).values():
        layer.fp8_nonfinite.zero_()


def all_reduce_amax(model: nn.Module, group: object = None) -> None:
    """MAX all-reduce the latest amax of every fp8 layer across ranks (one collective).

    Call it between iterations (after backward, before the next forward), so that every
    rank computes the same next scales from the same history: with a fused cast, before
    :func:`~mixprec.fp8.update_scales` (the pending amaxes are reduced). A no-op when
    torch.distributed is not initialised or the group has a single rank.
    """
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    if torch.distributed.get_world_size(group) == 1:  # type: ignore[arg-type]
        return
    layers = list(fp8_layers(model).values())
    if not layers:
        return
    # A fused cast's amaxes still wait in fp8_pending (reduced before update_scales folds
    # them); an eager layer's are entry 0 of its history.
    slots = [layer.fp8_pending if layer._pending else layer.fp8_amax_history[:, 0] for layer in layers]
    latest = torch.cat(slots)
    torch.distributed.all_reduce(latest, op=torch.distributed.ReduceOp.MAX, group=group)  # type: ignore[arg-type]
    with torch.no_grad():
        torch._foreach_copy_(slots, list(latest.split(len(TENSOR_KINDS))))


def stats(model: nn.Module) -> dict[str, dict[str, dict[str, float]]]:
    """Per fp8 layer and tensor kind: scale, latest amax, saturation and underflow fractions.

    Values are those of the last training iteration, copied to the host (a sync: call it
    for logging, not inside the step).
    ``saturation`` is the fraction of elements clamped at the format's max; ``underflow``
    the fraction of non-zero elements flushed to zero.
    """
    layers = fp8_layers(model)
    if not layers:
        return {}
    for layer in layers.values():
        layer.fold_pending()  # a fused cast's latest amaxes into the histories first
    rows = torch.stack(
        [
            torch.stack(
                [layer.fp8_scale, layer.fp8_amax_history[:, 0], layer.fp8_stats[:, 0], layer.fp8_stats[:, 1]],
                dim=1,
            ).cpu()
            for layer in layers.values()
        ]
    ).tolist()
    keys = ("scale", "amax", "saturation", "underflow")
    return {
        name: {kind: dict(zip(keys, values, strict=True)) for kind, values in zip(TENSOR_KINDS, per_layer, strict=True)}
        for name, per_layer in zip(layers, rows, strict=True)
    }

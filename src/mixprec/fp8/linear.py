"""``Fp8Linear``: an ``nn.Linear`` whose three GEMMs run in fp8 with fp32 accumulation.

Forward: input and weight are quantised to the recipe's forward format (E4M3), the output
comes back in the compute dtype (the autocast dtype inside autocast, else the input dtype).
Backward: the output gradient is quantised to the backward format (E5M2 for "hybrid");
the input gradient (``grad_out @ W``) and the weight gradient (``grad_out.T @ x``) reuse the
fp8 input and weight saved by the forward. The bias gradient is the fp32 sum of the
unquantised output gradient.

Scales and amax histories are registered persistent buffers (``fp8_scale``,
``fp8_amax_history``, one row per tensor kind: input, weight, grad_output), so they are
checkpointed in ``state_dict()``, follow ``.to()``, and are all the state that a later
iteration computes from: restoring them undoes an iteration. As BatchNorm's running
statistics, they are updated only in training mode (``module.train()``); in eval mode the
layer quantises with the scale the next training iteration would use and changes nothing.

Non-finite values are never saturated silently. When the input, the weight or the output
gradient holds an inf or NaN (its amax is not finite), that tensor quantises to all NaN,
so the output (forward) or the input and weight gradients (backward) are NaN; in training
mode the layer also sets its ``fp8_nonfinite`` flag (a 0-dim bool buffer on the device, no
host sync; see :func:`mixprec.fp8.nonfinite_flag`), records 0 instead of the non-finite
amax, and keeps its previous scale.

>>> import torch
>>> from mixprec.fp8 import DelayedScaling, Fp8Linear
>>> layer = Fp8Linear(16, 32, recipe=DelayedScaling(amax_history_len=4))
>>> y = layer(torch.randn(8, 16))
>>> y.shape, y.dtype
(torch.Size([8, 32]), torch.float32)
>>> float(layer.fp8_state()["input"].amax_history[0]) > 0
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.dtypes import Format
from mixprec.fp8.formats import TENSOR_KINDS
from mixprec.fp8.gemm import native_fp8_available, scaled_mm
from mixprec.fp8.quantize import Quantized, fused_quantize, quantize, quantize_with_stats
from mixprec.fp8.recipe import DelayedScaling, Fp8Recipe
from mixprec.fp8.scaling import record_amax

__all__ = ["Fp8Linear", "Fp8TensorState"]

_INPUT, _WEIGHT, _GRAD = range(3)
_PERSISTENT_STATE = ("fp8_scale", "fp8_amax_history")


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


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def _no_autocast(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """The fp8 GEMM picks its own dtypes: autocast must not recast its fp32 emulation."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _amax(t: torch.Tensor) -> torch.Tensor:
    """max |t| as a 0-dim fp32 tensor (one pass: aminmax; NaN propagates; 0 when empty)."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    lo, hi = torch.aminmax(t)
    return torch.maximum(-lo, hi).float()


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        layer: Fp8Linear,
        out_dtype: torch.dtype,
        native: bool,
        update: bool,
    ) -> torch.Tensor:
        with _no_autocast(x.device.type):
            x2 = x.reshape(x.shape[:-1].numel(), x.shape[-1])  # (not -1: a dimension may be 0)
            qx, wide_x = layer._quantize(_INPUT, x2, update, wide=not native)
            qw, wide_w = layer._quantize(_WEIGHT, weight, update, wide=not native)
            a = qx.data if wide_x is None else wide_x
            b = qw.data if wide_w is None else wide_w
            out = scaled_mm(a, b.t(), qx.inv_scale, qw.inv_scale, out_dtype, bias, native=native)
        # The fp8 input is needed only for the weight gradient (a frozen weight needs none).
        ctx.save_for_backward(qx.data if weight.requires_grad else None, qx.inv_scale, qw.data, qw.inv_scale)
        ctx.layer, ctx.native, ctx.update = layer, native, update
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        qx_data, qx_inv, qw_data, qw_inv = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        with _no_autocast(grad_out.device.type):
            g2 = grad_out.reshape(grad_out.shape[:-1].numel(), grad_out.shape[-1])
            if need_x or need_w:
                qg, wide_g = ctx.layer._quantize(_GRAD, g2, ctx.update, wide=not ctx.native)
                # The emulation widens the fp8 gradient once for both GEMMs (exact either way).
                g_data = qg.data if wide_g is None else wide_g
                if need_x:
                    grad_x = scaled_mm(g_data, qw_data, qg.inv_scale, qw_inv, ctx.x_dtype, native=ctx.native)
                    grad_x = grad_x.reshape(*grad_out.shape[:-1], grad_x.shape[-1])
                if need_w:
                    grad_w = scaled_mm(g_data.t(), qx_data, qg.inv_scale, qx_inv, ctx.w_dtype, native=ctx.native)
            if need_b:
                grad_b = g2.sum(0, dtype=torch.float32).to(ctx.b_dtype)  # fp32 sum, no fp32 copy
        return grad_x, grad_w, grad_b, None, None, None, None


class Fp8Linear(nn.Linear):
    """``nn.Linear`` computed with fp8 GEMMs (native on CUDA fp8 hardware, emulated elsewhere).

    Usually made by :func:`mixprec.fp8.convert_to_fp8`, or from an existing layer with
    :meth:`from_linear` (which keeps its ``weight`` and ``bias`` Parameters).

    Args:
        in_features, out_features, bias, device, dtype: as for ``nn.Linear``.
        recipe: a :class:`DelayedScaling` (default) or :class:`CurrentScaling`.
        emulate: None chooses per call (native on CUDA devices with fp8 GEMMs, else the
            emulation); True always emulates; False requires the native GEMM.
        track_stats: record saturation and underflow fractions at every training
            iteration (a few extra elementwise passes per quantised tensor; False skips
            them and leaves the diagnostics at zero).
    """

    fp8_scale: torch.Tensor
    fp8_amax_history: torch.Tensor
    fp8_stats: torch.Tensor
    fp8_nonfinite: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        recipe: Fp8Recipe | None = None,
        emulate: bool | None = None,
        track_stats: bool = True,
    ) -> None:
        if recipe is not None and not isinstance(recipe, Fp8Recipe):
            raise TypeError(
                f"Fp8Linear(recipe={recipe!r}): expected a mixprec.fp8.DelayedScaling or "
                "CurrentScaling instance, e.g. DelayedScaling(fmt='hybrid')"
            )
        if emulate is not None and not isinstance(emulate, bool):
            raise TypeError(f"Fp8Linear(emulate={emulate!r}): expected None (automatic), True or False")
        if not isinstance(track_stats, bool):
            raise TypeError(f"Fp8Linear(track_stats={track_stats!r}): expected True or False")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = DelayedScaling() if recipe is None else recipe
        self.emulate = emulate
        self.track_stats = track_stats
        fmt = self.recipe.fp8_format
        self._formats = tuple(fmt.for_kind(kind) for kind in TENSOR_KINDS)
        self._register_fp8_buffers(device)

    def _register_fp8_buffers(self, device: torch.device | str | None) -> None:
        n = len(TENSOR_KINDS)
        self.register_buffer("fp8_scale", torch.ones(n, dtype=torch.float32, device=device))
        self.register_buffer(
            "fp8_amax_history", torch.zeros(n, self.recipe.history_len, dtype=torch.float32, device=device)
        )
        # Diagnostics of the last iteration: (saturation, underflow) per kind; not checkpointed.
        self.register_buffer("fp8_stats", torch.zeros(n, 2, dtype=torch.float32, device=device), persistent=False)
        # Set when an amax was inf/NaN since the last reset_nonfinite(); not checkpointed.
        self.register_buffer("fp8_nonfinite", torch.zeros((), dtype=torch.bool, device=device), persistent=False)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        recipe: Fp8Recipe | None = None,
        emulate: bool | None = None,
        track_stats: bool = True,
    ) -> Fp8Linear:
        """An ``Fp8Linear`` sharing ``linear``'s weight and bias Parameters (same objects).

        >>> import torch
        >>> lin = torch.nn.Linear(16, 16)
        >>> f = Fp8Linear.from_linear(lin)
        >>> f.weight is lin.weight, sorted(f.state_dict())
        (True, ['bias', 'fp8_amax_history', 'fp8_scale', 'weight'])
        """
        new = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            recipe=recipe,
            emulate=emulate,
            track_stats=track_stats,
        )
        new.weight = linear.weight
        new.bias = linear.bias
        new._register_fp8_buffers(linear.weight.device)
        new.train(linear.training)
        return new

    def _use_native(self, x: torch.Tensor) -> bool:
        if self.emulate is True or self.weight.numel() == 0:  # an empty layer: no GEMM to run natively
            return False
        available = native_fp8_available(x.device)
        if self.emulate is False and not available:
            raise RuntimeError(
                f"Fp8Linear(emulate=False) got an input on {x.device}, which has no native fp8 GEMM "
                "(needs a CUDA GPU of compute capability >= 8.9); move the model to such a GPU or "
                "pass emulate=None to emulate where fp8 GEMMs are unavailable"
            )
        return available

    def _quantize(
        self, kind: int, t: torch.Tensor, update: bool, *, wide: bool = False
    ) -> tuple[Quantized, torch.Tensor | None]:
        """Quantise one tensor kind with the recipe's scale; in training, record amax and stats.

        ``wide``: also return the fp8 values widened to fp32, for the emulated GEMM (on
        CPU one compiled kernel quantises, widens and counts: :func:`fused_quantize`);
        otherwise the second item is None.
        """
        fmt = self._formats[kind]
        history, prev = self.fp8_amax_history[kind], self.fp8_scale[kind]
        with torch.no_grad():
            t = t.detach()
            amax = _amax(t)
            finite = torch.isfinite(amax)
            scale = self.recipe.select_scale(history, amax, fmt.max, prev)
            stats = update and self.track_stats
            wide_t = fractions = None
            if wide:
                q, wide_t, fractions = fused_quantize(t, scale, fmt, finite=finite, stats=stats)
            elif stats:
                q, fractions = quantize_with_stats(t, scale, fmt, finite=finite)
            else:
                q = quantize(t, scale, fmt, finite=finite)
            if update:
                if fractions is not None:
                    self.fp8_stats[kind] = fractions
                self.fp8_nonfinite.logical_or_(~finite)
                self.fp8_scale[kind] = scale
                record_amax(history, amax)  # a non-finite amax is recorded as 0
        return q, wide_t

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out_dtype = _compute_dtype(input)
        native = self._use_native(input)
        out = _Fp8LinearFunction.apply(
            input, self.weight, self.bias, self, out_dtype, native, self.training
        )
        return out  # type: ignore[no-any-return]

    def fp8_state(self) -> dict[str, Fp8TensorState]:
        """Scales, amax histories and last-iteration diagnostics per tensor kind.

        >>> import torch
        >>> layer = Fp8Linear(16, 16)
        >>> list(layer.fp8_state()), float(layer.fp8_state()["grad_output"].format.max)
        (['input', 'weight', 'grad_output'], 57344.0)
        """
        state = {}
        for i, kind in enumerate(TENSOR_KINDS):
            fmt = self._formats[i]
            history, scale = self.fp8_amax_history[i], self.fp8_scale[i]
            state[kind] = Fp8TensorState(
                format=fmt,
                scale=scale,
                amax_history=history,
                next_scale=self.recipe.next_scale(history, fmt.max, scale),
                saturation=self.fp8_stats[i, 0],
                underflow=self.fp8_stats[i, 1],
            )
        return state

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        # A checkpoint of the unconverted model (weight and bias only) loads: fp8 state starts fresh.
        for name in _PERSISTENT_STATE:
            key = prefix + name
            if key not in state_dict and key in missing_keys:
                missing_keys.remove(key)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # ``.to(dtype)``, ``.half()`` and ``.bfloat16()`` move the fp8 state with the module
        # but keep it fp32: scales and amaxes rounded to bf16 would no longer be exact.
        before = {name: self._buffers.get(name) for name in (*_PERSISTENT_STATE, "fp8_stats")}
        result = super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers.get(name)
            if old is not None and new is not None and new.dtype != torch.float32:
                self._buffers[name] = old.to(device=new.device, dtype=torch.float32)
        return result

    def extra_repr(self) -> str:
        mode = {None: "auto", True: "emulated", False: "native"}[self.emulate]
        return f"{super().extra_repr()}, recipe={self.recipe!r}, gemm={mode}"

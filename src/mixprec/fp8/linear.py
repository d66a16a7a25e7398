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

The quantiser is chosen by ``cast`` (see :class:`Fp8Linear`): ``"eager"`` (the exact
quantiser, one op at a time), or a fused cast (:mod:`mixprec.fp8.fused`: one kernel per
tensor per pass writes the fp8 codes, their transpose and the amax). With a fused cast a
training pass folds each tensor's amax into a *pending* amax (``fp8_pending``, not
checkpointed) instead of the history; :func:`update_scales` turns the pending amaxes of
all layers into history entries and next scales at once (the fp8-mixed plan calls it once
per step). A layer whose pending amaxes nobody folded folds its own at its next forward,
which gives the eager quantiser's numbers exactly.

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

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mixprec.fp8.formats import TENSOR_KINDS
from mixprec.fp8.fused import CastSlots, fused_cast, fused_scale, triton_available
from mixprec.fp8.gemm import native_fp8_available
from mixprec.fp8.linear_autograd import (
    Fp8FusedLinearFunction,
    Fp8LinearFunction,
    compute_dtype,
    tensor_amax,
)
from mixprec.fp8.linear_state import CASTS, SCALE_UPDATES, Fp8TensorState, check_cast, fold_scales
from mixprec.fp8.quantize import Quantized, fused_quantize, quantize, quantize_with_stats
from mixprec.fp8.recipe import CurrentScaling, DelayedScaling, Fp8Recipe
from mixprec.fp8.scaling import record_amax

__all__ = ["CASTS", "SCALE_UPDATES", "Fp8Linear", "Fp8TensorState", "update_scales"]

_PERSISTENT_STATE = ("fp8_scale", "fp8_amax_history")


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
        cast: how tensors are quantised, one of :data:`CASTS`. ``"auto"`` (default): a
            fused cast where the native fp8 GEMM runs (``"triton"`` where Triton is
            installed, else ``"compile"``), the eager quantiser elsewhere (the CPU
            emulation keeps its exact, compiled quantiser). ``"eager"``: the unfused
            quantiser. ``"triton"`` / ``"compile"``: the fused cast of
            :mod:`mixprec.fp8.fused` (on CPU through Triton's interpreter, or torch ops
            compiled, for checking: both give the eager numbers bit for bit).
        scale_update: with a fused cast, who folds the pending amaxes into the history
            (:data:`SCALE_UPDATES`): ``"layer"`` (default; at the layer's next forward) or
            ``"step"`` (:func:`update_scales`, once per step for all layers; the fp8-mixed
            plan does this).
    """

    fp8_scale: torch.Tensor
    fp8_amax_history: torch.Tensor
    fp8_stats: torch.Tensor
    fp8_nonfinite: torch.Tensor
    fp8_pending: torch.Tensor
    fp8_scratch: torch.Tensor

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
        cast: str = "auto",
        scale_update: str = "layer",
    ) -> None:
        check_cast(cast, scale_update, "Fp8Linear")
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
        self.cast = cast
        self.scale_update = scale_update
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
        # The fused cast's: the largest amax per kind since the last fold (update_scales; -1:
        # none, that kind's history does not move), and its kernels' counters (zero between
        # calls); not checkpointed.
        self.register_buffer("fp8_pending", torch.full((n,), -1.0, dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("fp8_scratch", torch.zeros(n, 8, dtype=torch.int32, device=device), persistent=False)
        self._fresh_fused_state()

    def _fresh_fused_state(self) -> None:
        """Host flags of the fused cast: ``_pending`` (amaxes wait in ``fp8_pending``),
        ``_stale`` (``fp8_scale`` must be recomputed from the history before a fused cast
        uses it) and ``_maybe_empty`` (the history may hold no amax yet: ``amax_init``
        scales from the tensor's own amax, one extra pass)."""
        self._pending = False
        self._stale = True
        self._maybe_empty = True

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        recipe: Fp8Recipe | None = None,
        emulate: bool | None = None,
        track_stats: bool = True,
        cast: str = "auto",
        scale_update: str = "layer",
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
            cast=cast,
            scale_update=scale_update,
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
            amax = tensor_amax(t)
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
                self._stale = True  # (a fused cast later recomputes the next scale from the history)
        return q, wide_t

    def _resolve_cast(self, native: bool, device: torch.device) -> str:
        """The cast this call runs: ``cast``, with "auto" resolved for ``device``."""
        if self.cast != "auto":
            return self.cast
        if not native:
            return "eager"
        return "triton" if triton_available(device) else "compile"

    def _fused(
        self,
        kind: int,
        t: torch.Tensor,
        update: bool,
        backend: str,
        *,
        rows: bool = True,
        cols: bool = False,
        bias: torch.Tensor | None = None,
        dbias: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One tensor kind through the fused cast (:func:`mixprec.fp8.fused.fused_cast`).

        Delayed scaling reads the scale that :func:`update_scales` left (a second pass, the
        amax, only while the history may be empty and ``amax_init`` asks for the tensor's own
        amax); current scaling computes it from one amax pass. In training the amax goes to
        the pending amax, the non-finite flag and the statistics.
        """
        fmt = self._formats[kind]
        slots = CastSlots(self.fp8_pending[kind], self.fp8_nonfinite, self.fp8_stats[kind], self.fp8_scratch[kind])
        with torch.no_grad():
            t = t.detach()
            stored = self.fp8_scale[kind]
            margin = self.recipe.margin
            fallback = self.cast == "auto"  # (a failing Triton kernel: the torch implementation, one warning)
            if isinstance(self.recipe, CurrentScaling):
                scale = fused_scale(t, stored, fmt, margin, slots, backend=backend, fallback=fallback)
                if update:
                    stored.copy_(scale)
            elif self._maybe_empty and isinstance(self.recipe, DelayedScaling) and self.recipe.amax_init:
                own = fused_scale(t, stored, fmt, margin, slots, backend=backend, fallback=fallback)
                scale = torch.where((self.fp8_amax_history[kind] == 0).all(), own, stored)
                if update:
                    stored.copy_(scale)
            else:
                scale = stored
            result = fused_cast(
                t, scale, fmt, slots, rows=rows, cols=cols, update=update,
                stats=update and self.track_stats, bias=bias, dbias=dbias, backend=backend, fallback=fallback,
            )
        if update:
            self._pending = True
        return result

    def _prepare_fused(self) -> None:
        """Before a fused forward: fold the pending amaxes (unless the step owner folds them)
        and recompute a stale scale, for this layer alone."""
        if self._pending:
            if self.scale_update == "step" and self.training:
                return
            _update([self], fold=True)
        elif self._stale:
            _update([self], fold=False)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out_dtype = compute_dtype(input)
        native = self._use_native(input)
        backend = self._resolve_cast(native, input.device)
        if backend == "eager" or input.dim() == 0 or self.weight.numel() == 0 or input.shape[:-1].numel() == 0:
            if self._pending:  # (a switch from a fused cast: its amaxes first)
                _update([self], fold=True)
            out = Fp8LinearFunction.apply(
                input, self.weight, self.bias, self, out_dtype, native, self.training
            )
        else:
            self._prepare_fused()
            out = Fp8FusedLinearFunction.apply(
                input, self.weight, self.bias, self, out_dtype, native, self.training, backend
            )
        return out  # type: ignore[no-any-return]

    def fold_pending(self) -> None:
        """Fold this layer's pending amaxes (a fused cast's) into its history now and compute
        its next scales: what its next forward or :func:`update_scales` would do."""
        if self._pending:
            _update([self], fold=True)

    def fp8_state(self) -> dict[str, Fp8TensorState]:
        """Scales, amax histories and last-iteration diagnostics per tensor kind.

        >>> import torch
        >>> layer = Fp8Linear(16, 16)
        >>> list(layer.fp8_state()), float(layer.fp8_state()["grad_output"].format.max)
        (['input', 'weight', 'grad_output'], 57344.0)

        With a fused cast, pending amaxes are folded first (:meth:`fold_pending`).
        """
        self.fold_pending()
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
        # A fused cast recomputes its next scale from the loaded history (and drops what was pending).
        self.fp8_pending.fill_(-1.0)
        self._fresh_fused_state()
        # A checkpoint of the unconverted model (weight and bias only) loads: fp8 state starts fresh.
        for name in _PERSISTENT_STATE:
            key = prefix + name
            if key not in state_dict and key in missing_keys:
                missing_keys.remove(key)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        self.fold_pending()  # a checkpoint holds every amax seen (no pending one is lost)
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # ``.to(dtype)``, ``.half()`` and ``.bfloat16()`` move the fp8 state with the module
        # but keep it fp32: scales and amaxes rounded to bf16 would no longer be exact.
        before = {name: self._buffers.get(name) for name in (*_PERSISTENT_STATE, "fp8_stats", "fp8_pending")}
        result = super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers.get(name)
            if old is not None and new is not None and new.dtype != torch.float32:
                self._buffers[name] = old.to(device=new.device, dtype=torch.float32)
        return result

    def extra_repr(self) -> str:
        mode = {None: "auto", True: "emulated", False: "native"}[self.emulate]
        return f"{super().extra_repr()}, recipe={self.recipe!r}, gemm={mode}, cast={self.cast}"


def _update(layers: list[Fp8Linear], *, fold: bool) -> None:
    """Fold the pending amaxes of ``layers`` (all with the same recipe, on one device) into
    their histories (``fold``) and compute their next scales (delayed scaling): a fixed
    number of ops for all of them, on stacked copies of their buffers (:func:`fold_scales`)."""
    histories = [layer.fp8_amax_history for layer in layers]
    scales = [layer.fp8_scale for layer in layers]
    pending = [layer.fp8_pending for layer in layers] if fold else None
    fold_scales(layers[0].recipe, layers[0]._formats, histories, scales, pending)
    for layer in layers:
        layer._stale = False
        if fold:
            layer._pending = False
            layer._maybe_empty = False


def update_scales(model: nn.Module | list[Fp8Linear]) -> None:
    """Fold every fp8 layer's pending amaxes into its history and compute its next scales, in
    one call for all layers (a fixed number of ops per recipe and device, however many
    layers): the per-step update of a fused cast (``Fp8Linear(cast=...)``). Layers without
    pending amaxes (eager casts, or nothing run since the last call) are left alone, so a
    second call in the same step changes nothing.

    >>> import torch
    >>> from mixprec.fp8 import DelayedScaling
    >>> layer = Fp8Linear(16, 16, recipe=DelayedScaling(amax_history_len=4), cast="compile", scale_update="step")
    >>> _ = layer(torch.ones(4, 16))
    >>> float(layer.fp8_amax_history[0, 0]), float(layer.fp8_pending[0])
    (0.0, 1.0)
    >>> update_scales(layer)
    >>> float(layer.fp8_amax_history[0, 0]), float(layer.fp8_scale[0]), float(layer.fp8_pending[0])
    (1.0, 448.0, -1.0)
    """
    if isinstance(model, nn.Module):
        layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    else:
        layers = list(model)
        bad = [layer for layer in layers if not isinstance(layer, Fp8Linear)]
        if bad:
            raise TypeError(
                f"update_scales() takes a model or a list of Fp8Linear layers, got {type(bad[0]).__name__} "
                f"{bad[0]!r} in the list; pass the model itself to update every fp8 layer in it"
            )
    groups: dict[tuple[Any, torch.device], list[Fp8Linear]] = {}
    for layer in layers:
        if layer._pending:
            groups.setdefault((layer.recipe, layer.fp8_scale.device), []).append(layer)
    for group in groups.values():
        _update(group, fold=True)

"""The autograd functions of :class:`mixprec.fp8.Fp8Linear`: its three GEMMs in fp8.

:class:`Fp8LinearFunction` quantises with the eager quantiser, :class:`Fp8FusedLinearFunction`
with one fused cast per tensor per pass (:mod:`mixprec.fp8.fused`). Both call back into the
layer for the quantisation of each tensor kind (``INPUT``, ``WEIGHT``, ``GRAD``: the rows of
its ``fp8_scale`` and ``fp8_amax_history``), which records its amaxes and statistics.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch

from mixprec.fp8.gemm import scaled_mm
from mixprec.fp8.quantize import Quantized

__all__ = ["GRAD", "INPUT", "WEIGHT", "Fp8FusedLinearFunction", "Fp8Layer", "Fp8LinearFunction",
           "compute_dtype", "no_autocast", "tensor_amax"]

#: the tensor kinds of a layer, in the order of :data:`mixprec.fp8.formats.TENSOR_KINDS`
INPUT, WEIGHT, GRAD = range(3)


class Fp8Layer(Protocol):
    """What the autograd functions call on their layer (an :class:`mixprec.fp8.Fp8Linear`)."""

    def _quantize(
        self, kind: int, t: torch.Tensor, update: bool, *, wide: bool = False
    ) -> tuple[Quantized, torch.Tensor | None]: ...

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
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]: ...


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The layer's output dtype: the autocast dtype inside autocast, else the input's."""
    device_type = x.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def no_autocast(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """The fp8 GEMM picks its own dtypes: autocast must not recast its fp32 emulation."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def tensor_amax(t: torch.Tensor) -> torch.Tensor:
    """max |t| as a 0-dim fp32 tensor (one pass: aminmax; NaN propagates; 0 when empty)."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    lo, hi = torch.aminmax(t)
    return torch.maximum(-lo, hi).float()


class Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        layer: Fp8Layer,
        out_dtype: torch.dtype,
        native: bool,
        update: bool,
    ) -> torch.Tensor:
        with no_autocast(x.device.type):
            x2 = x.reshape(x.shape[:-1].numel(), x.shape[-1])  # (not -1: a dimension may be 0)
            qx, wide_x = layer._quantize(INPUT, x2, update, wide=not native)
            qw, wide_w = layer._quantize(WEIGHT, weight, update, wide=not native)
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
        with no_autocast(grad_out.device.type):
            g2 = grad_out.reshape(grad_out.shape[:-1].numel(), grad_out.shape[-1])
            if need_x or need_w:
                qg, wide_g = ctx.layer._quantize(GRAD, g2, ctx.update, wide=not ctx.native)
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


class Fp8FusedLinearFunction(torch.autograd.Function):
    """The fp8 linear layer with one fused cast per tensor per pass (:mod:`mixprec.fp8.fused`).

    Natively, each cast also writes the transposed codes the backward GEMMs take (the
    column-major operands of ``_scaled_mm``: no ``contiguous()`` copies) and the output
    gradient's cast writes the bias gradient. Emulated, the GEMMs take the same views as the
    eager function (so the numbers equal it bit for bit) and the bias gradient is the same sum.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        layer: Fp8Layer,
        out_dtype: torch.dtype,
        native: bool,
        update: bool,
        backend: str,
    ) -> torch.Tensor:
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with no_autocast(x.device.type):
            x2 = x.reshape(x.shape[:-1].numel(), x.shape[-1])  # (not -1: a dimension may be 0)
            lowered = native and bias is not None and out_dtype == torch.bfloat16
            xd, xt, x_inv, _, _ = layer._fused(INPUT, x2, update, backend, cols=native and need_w)
            wd, wt, w_inv, bias_low, _ = layer._fused(
                WEIGHT, weight, update, backend, cols=native and need_x, bias=bias if lowered else None
            )
            assert xd is not None and wd is not None
            out = scaled_mm(xd, wd.t(), x_inv, w_inv, out_dtype, bias_low if lowered else bias, native=native)
        if native:  # the transposed codes, row-major: the backward GEMMs' column-major operands
            ctx.save_for_backward(xt, x_inv, wt, w_inv)
        else:
            ctx.save_for_backward(xd if need_w else None, x_inv, wd, w_inv)
        ctx.layer, ctx.native, ctx.update, ctx.backend = layer, native, update, backend
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_saved, x_inv, w_saved, w_inv = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        native = ctx.native
        grad_x = grad_w = grad_b = column_sums = None
        with no_autocast(grad_out.device.type):
            g2 = grad_out.reshape(grad_out.shape[:-1].numel(), grad_out.shape[-1])
            if need_x or need_w:  # (a fused call has tokens: an empty input takes the eager function)
                gd, gt, g_inv, _, column_sums = ctx.layer._fused(
                    GRAD, g2, ctx.update, ctx.backend,
                    rows=need_x or not native, cols=native and need_w, dbias=native and need_b,
                )
                if need_x:
                    b = w_saved.t() if native else w_saved  # (out, in) as a column-major (out, in) operand
                    grad_x = scaled_mm(gd, b, g_inv, w_inv, ctx.x_dtype, native=native)
                    grad_x = grad_x.reshape(*grad_out.shape[:-1], grad_x.shape[-1])
                if need_w:
                    if native:
                        grad_w = scaled_mm(gt, x_saved.t(), g_inv, x_inv, ctx.w_dtype, native=True)
                    else:
                        grad_w = scaled_mm(gd.t(), x_saved, g_inv, x_inv, ctx.w_dtype, native=False)
            if need_b:
                if column_sums is not None:
                    grad_b = column_sums.to(ctx.b_dtype)
                else:
                    grad_b = g2.sum(0, dtype=torch.float32).to(ctx.b_dtype)  # fp32 sum, no fp32 copy
        return grad_x, grad_w, grad_b, None, None, None, None, None


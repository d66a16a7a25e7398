"""The generic path of the low-precision wrappers: any torch optimizer, one parameter at a time.

The inner optimizer steps an fp32 proxy of one low-precision parameter: its value (from the
wrapper's expansion: plus Kahan compensation, or rebuilt from a remainder), its gradient and
its per-element state expanded to fp32 on scratch buffers reused from parameter to
parameter; the result is stored back by the wrapper's rounding and the state in the
wrapper's ``state_dtype`` (8-bit blockwise through :mod:`mixprec.optim.states`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mixprec.optim import states as qstates

__all__ = ["is_param_state", "step_one"]

Scratch = dict[tuple[int, torch.device], torch.Tensor]


def is_param_state(key: Any, value: Any, param: torch.Tensor) -> bool:
    """A per-element state tensor of ``param`` (kept in ``state_dtype``); never the step count
    (8-bit codes count too; their per-block scales do not)."""
    if key == "step" or not isinstance(value, torch.Tensor) or value.shape != param.shape:
        return False
    return value.is_floating_point() or value.dtype == qstates.Q8


def step_one(
    optimizer: torch.optim.Optimizer, p: torch.nn.Parameter, group: dict[str, Any], scratch: Scratch, *,
    expand: Callable[[torch.Tensor, torch.Tensor], None], store: Callable[[torch.Tensor, torch.Tensor], None],
    state_dtype: torch.dtype | None, grad_scales: Sequence[torch.Tensor] = (),
) -> None:
    """The inner ``optimizer`` on an fp32 proxy of ``p`` (its value, gradient and state expanded;
    the fp32 gradient multiplied by each of ``grad_scales`` in turn, as in
    :func:`mixprec.optim.fast.fast_step`)."""

    def buffer(slot: int) -> torch.Tensor:
        key = (slot, p.device)
        buf = scratch.get(key)
        if buf is None or buf.numel() < p.numel():
            buf = torch.empty(p.numel(), dtype=torch.float32, device=p.device)
            scratch[key] = buf
        return buf[: p.numel()].view(p.shape)

    value32 = buffer(0)
    expand(p, value32)
    proxy = torch.nn.Parameter(value32, requires_grad=p.requires_grad)
    proxy.grad = buffer(1).copy_(p.grad)  # type: ignore[arg-type]
    for factor in grad_scales:
        proxy.grad.mul_(factor.to(p.device))
    state = optimizer.state.pop(p, None)
    stored: dict[Any, torch.Tensor] = {}
    scales: dict[Any, torch.Tensor] = {}  # 8-bit states' block scales, kept beside their codes
    if state:
        expanded: dict[Any, Any] = {}
        for slot, (key, value) in enumerate(list(state.items()), start=2):
            if qstates.is_scale_key(key):
                scales[key] = value
            elif is_param_state(key, value, p) and value.dtype == qstates.Q8:
                stored[key] = value
                expanded[key] = qstates.value(state, key, out=buffer(slot))
            elif is_param_state(key, value, p) and value.dtype != torch.float32:
                stored[key] = value
                expanded[key] = buffer(slot).copy_(value)
            else:
                expanded[key] = value
        optimizer.state[proxy] = expanded
    group["params"] = [proxy]
    try:
        optimizer.step()
    finally:
        group["params"] = []
        store(p, value32)
        new = optimizer.state.pop(proxy, None)
        if new is not None:
            scratch_ptrs = {buf.untyped_storage().data_ptr() for buf in scratch.values()}
            out: dict[Any, Any] = {}
            for key, value in list(new.items()):
                if key in stored and stored[key].dtype == qstates.Q8:
                    held = {key: stored[key], f"{key}{qstates.ABSMAX}": scales[f"{key}{qstates.ABSMAX}"]}
                    qstates.put(held, key, value, qstates.Q8)
                    out.update(held)
                elif key in stored:
                    out[key] = stored[key].copy_(value)
                elif is_param_state(key, value, p):
                    target = value.dtype if state_dtype is None else state_dtype
                    if target == qstates.Q8:
                        qstates.put(out, key, value, target)  # created by this step
                    elif value.dtype != target or value.untyped_storage().data_ptr() in scratch_ptrs:
                        out[key] = value.to(target, copy=True)  # created by this step
                    else:
                        out[key] = value
                else:
                    out[key] = value
            optimizer.state[p] = out

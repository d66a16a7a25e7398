"""The generic path of the low-precision wrappers: any torch optimizer, one parameter at a time.

The inner optimizer steps an fp32 proxy of one low-precision parameter: its value (from the
wrapper's expansion: plus Kahan compensation, or rebuilt from a remainder), its gradient and
its per-element state expanded to fp32 on scratch buffers reused from parameter to
parameter; the result is stored back by the wrapper's rounding and the state in the
wrapper's ``state_dtype``, both by the state codecs (:func:`mixprec.optim.states.expand_for_step`,
:func:`~mixprec.optim.states.keep_after_step`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mixprec.optim import states as qstates

__all__ = ["step_one"]

Scratch = dict[tuple[int, torch.device], torch.Tensor]


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
    held = qstates.expand_for_step(state, p, buffer) if state else None
    if held is not None:
        optimizer.state[proxy] = held.expanded
    group["params"] = [proxy]
    try:
        optimizer.step()
    finally:
        group["params"] = []
        store(p, value32)
        new = optimizer.state.pop(proxy, None)
        if new is not None:
            scratch_ptrs = {buf.untyped_storage().data_ptr() for buf in scratch.values()}
            optimizer.state[p] = qstates.keep_after_step(new, held, p, state_dtype, scratch_ptrs)

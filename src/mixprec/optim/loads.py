"""Loading a checked optimizer state_dict (:mod:`mixprec.optim.checks`) into a wrapper.

torch's ``Optimizer.load_state_dict`` replaces the groups and the state first and runs the
optimizer's ``__setstate__`` after: a state it cannot take (an SGD state in AdamW: no
``'step'``) fails *after* the optimizer already holds it. :func:`load_inner` loads inside
:func:`mixprec.optim.snapshot.all_or_nothing`, which puts the previous groups and state
back on any failure. :func:`keep_state_dtype` keeps the low-precision wrappers' state dtype.

>>> import torch
>>> w = torch.nn.Parameter(torch.zeros(2))
>>> adamw = torch.optim.AdamW([w], lr=0.1)
>>> sgd_state = torch.optim.SGD([w], lr=0.1, momentum=0.9).state_dict()
>>> sgd_state["state"] = {0: {"momentum_buffer": torch.ones(2)}}
>>> load_inner(adamw, sgd_state)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: cannot load this optimizer state_dict into AdamW (KeyError: 'step'); nothing was changed...
>>> adamw.param_groups[0]["betas"], adamw.state == {}
((0.9, 0.999), True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mixprec.dtypes import LOW_PRECISION_DTYPES
from mixprec.optim import states as qstates
from mixprec.optim.snapshot import all_or_nothing

__all__ = ["keep_state_dtype", "load_inner"]


def load_inner(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state_dict)``; if it fails, the optimizer's previous groups
    and state are put back and a ValueError (or the ValueError/TypeError raised) says so."""
    with all_or_nothing(optimizer):
        optimizer.load_state_dict(state_dict)


@torch.no_grad()
def keep_state_dtype(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], state_dict: dict[str, Any],
    state_dtype: torch.dtype | None,
) -> None:
    """After torch's load (which casts floating state to each parameter's dtype): the
    per-element state of each low-precision parameter in ``state_dtype`` (fp32 for None; 8-bit
    block-coded for a :class:`~mixprec.optim.states.BlockCodec`'s dtype), taken from the saved tensors: exactly where
    they were saved in that dtype, converted where they were saved in another one (a resume
    under another state dtype). The state of fp32 parameters (norm layers) stays as torch cast
    it: a state saved under a plan that kept those layers in bf16 becomes fp32, which their
    update needs."""
    order = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    dtype = state_dtype or torch.float32
    for index, saved in state_dict["state"].items():
        param = params[order.index(index)]
        if param.dtype not in LOW_PRECISION_DTYPES:
            continue
        live = optimizer.state.get(param, {})
        for key, value in saved.items():
            if qstates.is_scale_key(key) or not qstates.is_param_state(key, value, param):
                continue
            scale_key = f"{key}{qstates.ABSMAX}"
            coded = value.dtype in qstates.BLOCKWISE and scale_key in saved
            if coded and value.dtype == dtype:
                live[key] = value.detach().to(param.device, copy=True)  # exactly as saved
                live[scale_key] = saved[scale_key].detach().to(param.device, torch.float32, copy=True)
                continue
            value32 = qstates.value({key: value, **({scale_key: saved[scale_key]} if scale_key in saved else {})}, key)
            live.pop(scale_key, None)
            if qstates.block_codec(dtype) is not None:
                live.pop(key, None)
                qstates.put(live, key, value32.to(param.device), dtype)
            else:
                source = value if value.is_floating_point() and not coded else value32
                live[key] = source.detach().to(device=param.device, dtype=dtype, copy=True)

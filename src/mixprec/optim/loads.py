"""Loading an optimizer state_dict into a wrapper, all or nothing.

torch's ``Optimizer.load_state_dict`` replaces the groups and the state first and runs the
optimizer's ``__setstate__`` after: a state it cannot take (an SGD state in AdamW: no
``'step'``) fails *after* the optimizer already holds it. :func:`load_inner` puts the
previous groups and state back on any failure. The other helpers take apart and check what
the low-precision wrappers keep beside the inner optimizer's state, before anything changes.

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

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mixprec.dtypes import LOW_PRECISION_DTYPES

__all__ = ["check_rounding_state", "keep_state_dtype", "load_inner", "split_wrapper_state"]


def load_inner(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state_dict)``; if it fails, the optimizer's previous groups
    and state are put back and a ValueError (or the ValueError/TypeError raised) says so."""
    old_state, old_groups = optimizer.state, optimizer.param_groups
    try:
        optimizer.load_state_dict(state_dict)
    except Exception as exc:
        optimizer.state, optimizer.param_groups = old_state, old_groups
        if isinstance(exc, ValueError | TypeError):
            raise
        raise ValueError(
            f"cannot load this optimizer state_dict into {type(optimizer).__name__} ({type(exc).__name__}: {exc}); "
            "nothing was changed. Was it saved from another kind of optimizer?"
        ) from exc


def split_wrapper_state(state_dict: Any, key: str, owner: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``state_dict`` as (the inner optimizer's state_dict, the wrapper's own entry ``key``),
    refused (TypeError/ValueError naming ``owner``) when it is not a dict or lacks the entry."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a dict (from {owner}.state_dict()), got {type(state_dict).__name__}")
    sd = dict(state_dict)
    extra = sd.pop(key, None)
    if extra is None:
        raise ValueError(
            f"this optimizer state_dict has no {key!r} entry: it was not saved by a "
            f"{owner}; load it into the optimizer that saved it"
        )
    if not isinstance(extra, dict):
        raise TypeError(f"the state_dict's {key!r} entry must be a dict, got {type(extra).__name__}")
    return sd, extra


def check_rounding_state(extra: Mapping[str, Any], rounding: str, owner: str) -> None:
    """Refuse to drop Kahan compensation: ``extra`` (a low-precision wrapper's own entry)
    holds compensation buffers, the bits rounding dropped from the weights, and the
    wrapper loading it (of ``rounding``) keeps none."""
    comp = extra.get("compensation")
    if rounding != "kahan" and comp:
        raise ValueError(
            f"this optimizer state_dict holds Kahan compensation for {len(comp)} low-precision weights (the bits "
            f"rounding dropped from them), which a {owner} (rounding {rounding!r}) cannot keep: loading it would "
            "drop them silently. Resume it under the plan that saved it ('bf16-kahan'), or, to change plans on "
            "purpose, load only the model weights and start the optimizer fresh"
        )


@torch.no_grad()
def keep_state_dtype(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], state_dict: dict[str, Any],
    state_dtype: torch.dtype | None,
) -> None:
    """After torch's load (which casts floating state to each parameter's dtype): the
    per-element state of each low-precision parameter in ``state_dtype`` (fp32 for None),
    taken from the saved tensors (exactly, where they were saved in that dtype). The state
    of fp32 parameters (norm layers) stays as torch cast it: a state saved under a plan
    that kept those layers in bf16 becomes fp32, which their update needs."""
    order = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    dtype = state_dtype or torch.float32
    for index, saved in state_dict["state"].items():
        param = params[order.index(index)]
        if param.dtype not in LOW_PRECISION_DTYPES:
            continue
        live = optimizer.state.get(param, {})
        for key, value in saved.items():
            if (
                key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point()
                and value.shape == param.shape
            ):
                live[key] = value.detach().to(device=param.device, dtype=dtype, copy=True)

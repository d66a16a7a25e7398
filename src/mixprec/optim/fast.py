"""Multi-tensor fast paths of the low-precision optimizer wrappers for torch's Adam, AdamW and SGD.

:class:`~mixprec.optim.LowPrecisionOptimizer` and its Kahan / stochastic-rounding
subclasses run any inner optimizer once per low-precision parameter on fp32
expansions (the generic path). For ``torch.optim.Adam``, ``AdamW`` and ``SGD`` this
module does the same arithmetic over all parameters of a group at once, chunk by
chunk: a chunk's weights, gradients and state are expanded into flat fp32 buffers
of at most ``chunk_numel`` elements (or one parameter, when a parameter is larger),
the update runs as a handful of ``torch._foreach_*`` / flat kernels, and the results
are stored back (round to nearest, Kahan residual, or stochastic rounding).

Hyperparameters are read from the inner optimizer's ``param_groups`` at every step
(LR schedulers keep working) and state lives in ``optimizer.state[p]`` under torch's
key names (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``,
``momentum_buffer``) in the wrapper's ``state_dtype``: a state_dict saved by the fast
path loads into the generic path and back.

The fp32 operations are torch's own single-tensor ones in torch's order, so on CPU the
results are bit-identical to the generic path; on CUDA, where torch's own
``foreach``/single-tensor kernels may contract operations differently, they agree to
within fp32 rounding before the final low-precision store (at most one unit in the
last place of the stored dtype, and only for values that fall next to a rounding
boundary).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "DEFAULT_CHUNK_NUMEL",
    "FAST_OPTIMIZERS",
    "chunks",
    "fast_kind",
    "fast_step",
    "fused_available",
    "init_adam_state",
    "scalar_value",
]

DEFAULT_CHUNK_NUMEL = 1 << 20  # 4 MiB per fp32 working buffer: a chunk's temporaries stay near the caches

FAST_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)

# store(params, values32, flat32): write the fp32 results of a chunk into the low-precision parameters
Store = Callable[[list[torch.Tensor], list[torch.Tensor], torch.Tensor], None]
# expand(params, values32): fill the fp32 views with the parameters' values (plus compensation)
Expand = Callable[[list[torch.Tensor], list[torch.Tensor]], None]


def scalar_value(value: Any) -> float:
    """A hyperparameter as a Python float (tensors are read once)."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def fused_available(device: torch.device) -> bool:
    """Whether torch has fused Adam/AdamW kernels for ``device`` (CPU and CUDA)."""
    return device.type in ("cpu", "cuda")


def fast_kind(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> str | None:
    """``"adam"`` or ``"sgd"`` when ``group`` of ``optimizer`` can take the fast path, else None.

    Only the exact torch classes qualify (a subclass may change ``step``), without
    ``capturable``, ``differentiable`` or ``fused`` and with a tensor-free weight decay.
    """
    kind = type(optimizer)
    if kind not in FAST_OPTIMIZERS:
        return None
    if group.get("differentiable") or group.get("fused") or group.get("capturable"):
        return None
    if isinstance(group.get("weight_decay"), torch.Tensor):
        return None
    for p in group["params"]:
        if p.grad is not None and (p.grad.is_sparse or p.is_complex()):
            return None
    return "sgd" if kind is torch.optim.SGD else "adam"


def chunks(params: list[torch.Tensor], key: Callable[[torch.Tensor], Any], chunk_numel: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of parameters with the same ``key`` (device, dtype, step), each up to ``chunk_numel`` elements."""
    out: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    current_key: Any = None
    size = 0
    for p in params:
        k = key(p)
        if current and (k != current_key or size + p.numel() > chunk_numel):
            out.append(current)
            current, size = [], 0
        current.append(p)
        current_key = k
        size += p.numel()
    if current:
        out.append(current)
    return out


def _flat_views(params: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    total = sum(p.numel() for p in params)
    flat = torch.empty(total, dtype=torch.float32, device=device)
    views, offset = [], 0
    for p in params:
        views.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    return flat, views


def _expand_state(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """fp32 working copies of state tensors (the tensors themselves when already fp32)."""
    if all(t.dtype == torch.float32 for t in tensors):
        return tensors
    _, views = _flat_views(tensors, device)
    torch._foreach_copy_(views, tensors)
    return views


def _store_state(tensors: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    if values is not tensors:
        torch._foreach_copy_(tensors, values)


def fast_step(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    params: Sequence[torch.Tensor],
    *,
    kind: str,
    state_dtype: torch.dtype | None,
    expand: Expand,
    store: Store,
    chunk_numel: int,
    fused: bool = False,
    plain_store: bool = False,
) -> None:
    """One step of ``optimizer``'s math for the low-precision ``params`` of ``group``, chunk by chunk.

    ``fused``: Adam/AdamW chunks run torch's fused kernel (``torch._fused_adam(w)_``, fp32
    arithmetic inside) instead of the foreach sequence: one pass over memory instead of
    about ten, results equal within fp32 rounding. With ``plain_store`` (round to
    nearest) and parameters, gradients and state all in one dtype, the kernel runs on the
    low-precision tensors directly, with no fp32 expansion at all.
    """
    active = [p for p in params if p.grad is not None]
    if not active:
        return
    dtype = torch.float32 if state_dtype is None else state_dtype
    if kind == "adam":
        init_adam_state(optimizer, group, active, dtype)
        def key(p: torch.Tensor) -> Any:
            return (p.device, p.dtype, p.grad.dtype if p.grad is not None else None,
                    float(optimizer.state[p]["step"]))
        for chunk in chunks(active, key, chunk_numel):
            _adam_chunk(optimizer, group, chunk, expand, store, fused=fused, plain_store=plain_store)
    else:
        momentum = scalar_value(group["momentum"])
        def sgd_key(p: torch.Tensor) -> Any:
            has_buf = momentum != 0 and optimizer.state.get(p, {}).get("momentum_buffer") is not None
            return (p.device, p.dtype, p.grad.dtype if p.grad is not None else None, has_buf)
        for chunk in chunks(active, sgd_key, chunk_numel):
            _sgd_chunk(optimizer, group, chunk, dtype, expand, store)


def init_adam_state(optimizer: torch.optim.Optimizer, group: dict[str, Any], params: list[torch.Tensor], dtype: torch.dtype) -> None:
    """torch.optim.Adam's lazy state initialisation, with the moments in ``dtype``."""
    for p in params:
        state = optimizer.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        elif not torch.is_tensor(state["step"]):
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)


def _expanded(params: list[torch.Tensor], expand: Expand) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    device = params[0].device
    flat, values = _flat_views(params, device)
    expand(params, values)
    _, grads = _flat_views(params, device)
    torch._foreach_copy_(grads, [p.grad for p in params])  # type: ignore[misc]
    return flat, values, grads


def _adam_chunk(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], params: list[torch.Tensor], expand: Expand, store: Store,
    *, fused: bool, plain_store: bool,
) -> None:
    lr = scalar_value(group["lr"])
    beta1, beta2 = (scalar_value(b) for b in group["betas"])
    eps, weight_decay = float(group["eps"]), float(group["weight_decay"])
    decoupled = bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
    device = params[0].device
    states = [optimizer.state[p] for p in params]
    if fused:
        _adam_fused_chunk(group, params, states, expand, store, plain_store=plain_store,
                          lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, decoupled=decoupled)
        return

    flat, values, grads = _expanded(params, expand)
    if group["maximize"]:
        torch._foreach_neg_(grads)
    steps = [s["step"] for s in states]
    torch._foreach_add_(steps, 1.0)
    if weight_decay != 0:
        if decoupled:
            torch._foreach_mul_(values, 1 - lr * weight_decay)
        else:
            torch._foreach_add_(grads, values, alpha=weight_decay)
    exp_avg_low = [s["exp_avg"] for s in states]
    exp_avg_sq_low = [s["exp_avg_sq"] for s in states]
    exp_avgs = _expand_state(exp_avg_low, device)
    exp_avg_sqs = _expand_state(exp_avg_sq_low, device)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    step = float(steps[0])  # every parameter of a chunk has the same step (see the chunk key)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    if group["amsgrad"]:
        max_low = [s["max_exp_avg_sq"] for s in states]
        maxes = _expand_state(max_low, device)
        torch._foreach_maximum_(maxes, exp_avg_sqs)
        denom = torch._foreach_sqrt(maxes)
        _store_state(max_low, maxes)
    else:
        denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(values, exp_avgs, denom, value=-step_size)
    _store_state(exp_avg_low, exp_avgs)
    _store_state(exp_avg_sq_low, exp_avg_sqs)
    store(params, values, flat)


def _adam_fused_chunk(
    group: dict[str, Any], params: list[torch.Tensor], states: list[dict[Any, Any]], expand: Expand, store: Store, *,
    plain_store: bool, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool,
) -> None:
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    amsgrad = bool(group["amsgrad"])
    steps = [s["step"] for s in states]
    torch._foreach_add_(steps, 1.0)
    if params[0].device.type != "cpu":
        # the kernel reads the step counts on the parameters' device (torch keeps them on
        # the CPU for non-fused Adam); every parameter of a chunk has the same count
        steps = [torch.tensor(float(steps[0]), dtype=torch.float32, device=params[0].device)] * len(params)
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    low_state = {k: [s[k] for s in states] for k in keys}
    dtype = params[0].dtype
    hyper: dict[str, Any] = {"lr": lr, "beta1": beta1, "beta2": beta2, "weight_decay": weight_decay, "eps": eps,
             "amsgrad": amsgrad, "maximize": bool(group["maximize"])}
    if plain_store and all(p.grad is not None and p.grad.dtype == dtype for p in params) and all(
        t.dtype == dtype for ts in low_state.values() for t in ts
    ):
        # round to nearest of fp32 results, in one kernel on the low-precision tensors
        kernel(params, [p.grad for p in params], low_state["exp_avg"], low_state["exp_avg_sq"],  # type: ignore[misc]
               low_state.get("max_exp_avg_sq", []), steps, **hyper)
        return
    device = params[0].device
    flat, values, grads = _expanded(params, expand)
    state32 = {k: _expand_state(v, device) for k, v in low_state.items()}
    kernel(values, grads, state32["exp_avg"], state32["exp_avg_sq"], state32.get("max_exp_avg_sq", []), steps, **hyper)
    for k in keys:
        _store_state(low_state[k], state32[k])
    store(params, values, flat)


def _sgd_chunk(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], params: list[torch.Tensor], dtype: torch.dtype,
    expand: Expand, store: Store,
) -> None:
    lr = scalar_value(group["lr"])
    momentum, dampening = scalar_value(group["momentum"]), scalar_value(group["dampening"])
    weight_decay = float(group["weight_decay"])
    device = params[0].device

    flat, values, grads = _expanded(params, expand)
    if group["maximize"]:
        torch._foreach_neg_(grads)
    if weight_decay != 0:
        torch._foreach_add_(grads, values, alpha=weight_decay)
    if momentum != 0:
        states = [optimizer.state[p] for p in params]
        if states[0].get("momentum_buffer") is None:  # first step: the buffer is the gradient (same for the chunk)
            for s, g in zip(states, grads, strict=True):
                s["momentum_buffer"] = g.to(dtype, copy=True)
            bufs = grads
        else:
            buf_low = [s["momentum_buffer"] for s in states]
            bufs = _expand_state(buf_low, device)
            torch._foreach_mul_(bufs, momentum)
            torch._foreach_add_(bufs, grads, alpha=1 - dampening)
            _store_state(buf_low, bufs)
        if group["nesterov"]:
            torch._foreach_add_(grads, bufs, alpha=momentum)
        else:
            grads = bufs
    torch._foreach_add_(values, grads, alpha=-lr)
    store(params, values, flat)

"""The eager executor (multi-tensor fast path) of the low-precision wrappers for torch's Adam, AdamW and SGD.

:class:`~mixprec.optim.LowPrecisionOptimizer` and its Kahan / stochastic-rounding
subclasses run any inner optimizer once per low-precision parameter on fp32
expansions (the generic path). For ``torch.optim.Adam``, ``AdamW`` and ``SGD`` this
module does the same arithmetic over all parameters of a group at once, chunk by
chunk: a chunk's weights, gradients and state are expanded into flat fp32 buffers
of at most ``chunk_numel`` elements (a larger parameter is cut into pieces) by their
codecs (:mod:`mixprec.optim.codecs`), the update rule (:mod:`mixprec.optim.rule`, its
``FOREACH`` backend: a handful of ``torch._foreach_*`` kernels) or torch's fused kernel
runs on them, and the results are stored back (round to nearest, Kahan residual,
stochastic rounding or remainder masters).

Hyperparameters are read from the inner optimizer's ``param_groups`` at every step
(LR schedulers keep working) and state lives in ``optimizer.state[p]`` under torch's
key names (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``,
``momentum_buffer``) in the wrapper's ``state_dtype``: a state_dict saved by the fast
path loads into the generic path and back.

The rule's fp32 operations are torch's own single-tensor ones in torch's order, so on CPU the
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

from mixprec.lagged import host_float
from mixprec.optim import codecs, rule
from mixprec.optim import states as qstates
from mixprec.optim.rule import scalar_value

__all__ = [
    "CPU_CHUNK_NUMEL",
    "DEVICE_CHUNK_NUMEL",
    "FAST_OPTIMIZERS",
    "Piece",
    "chunks",
    "default_chunk_numel",
    "fast_kind",
    "fast_step",
    "fused_available",
    "init_adam_state",
    "prefer_fast_update",
    "scalar_value",
]

CPU_CHUNK_NUMEL = 1 << 17  # 512 KiB per fp32 working buffer: a chunk's temporaries stay in the CPU caches
DEVICE_CHUNK_NUMEL = 1 << 22  # accelerators: fewer, larger kernels (a chunk costs a dozen launches)

INPLACE_CHUNK_NUMEL = 1 << 22  # chunks of torch's fused kernel running in place (no temporaries)

FAST_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)

# store(pieces, values32, flat32): write the fp32 results of a chunk into the low-precision parameters
Store = Callable[[list["Piece"], list[torch.Tensor], torch.Tensor], None]
# expand(pieces, values32): fill the fp32 views with the parameters' values (plus compensation)
Expand = Callable[[list["Piece"], list[torch.Tensor]], None]


def default_chunk_numel(device: torch.device) -> int:
    """Elements the fast path expands to fp32 at a time on ``device`` unless told otherwise.

    >>> default_chunk_numel(torch.device("cpu"))
    131072
    """
    return CPU_CHUNK_NUMEL if device.type == "cpu" else DEVICE_CHUNK_NUMEL


def fused_available(device: torch.device) -> bool:
    """Whether torch has fused Adam/AdamW kernels for ``device`` (CPU and CUDA)."""
    return device.type in ("cpu", "cuda")


def fast_kind(optimizer: torch.optim.Optimizer, group: dict[str, Any], *, fused: bool = False) -> str | None:
    """``"adam"`` or ``"sgd"`` when ``group`` of ``optimizer`` can take the fast path, else None.

    Only the exact torch classes qualify (a subclass may change ``step``), without
    ``capturable`` or ``differentiable`` and with a tensor-free weight decay; a ``fused`` group
    only where the fast path runs torch's fused kernel itself (``fused``: Adam/AdamW chunks).
    """
    kind = type(optimizer)
    if kind not in FAST_OPTIMIZERS:
        return None
    if group.get("fused") and not (fused and kind is not torch.optim.SGD):
        return None
    if group.get("differentiable") or group.get("capturable"):
        return None
    if isinstance(group.get("weight_decay"), torch.Tensor):
        return None
    for p in group["params"]:
        if p.grad is not None and (p.grad.is_sparse or p.is_complex()):
            return None
    return "sgd" if kind is torch.optim.SGD else "adam"


class Piece:
    """A run of consecutive elements of one parameter: the unit the fast path expands.

    A parameter larger than a chunk is cut into pieces, so a chunk's fp32 temporaries
    stay small enough for the caches; its state and compensation are cut the same way
    (:meth:`of`). A piece covering the whole parameter keeps the parameter's shape.
    """

    __slots__ = ("end", "param", "start", "whole")

    def __init__(self, param: torch.Tensor, start: int, end: int) -> None:
        self.param, self.start, self.end = param, start, end
        self.whole = start == 0 and end == param.numel()

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The same run of ``tensor`` (shaped like the parameter; a view, writes go through)."""
        return tensor if self.whole else tensor.view(-1)[self.start : self.end]

    @property
    def value(self) -> torch.Tensor:
        return self.of(self.param)

    @property
    def shape(self) -> torch.Size:
        return self.param.shape if self.whole else torch.Size([self.end - self.start])

    @property
    def dtype(self) -> torch.dtype:
        return self.param.dtype

    @property
    def device(self) -> torch.device:
        return self.param.device

    def numel(self) -> int:
        return self.end - self.start


def chunks(
    params: list[torch.Tensor],
    key: Callable[[torch.Tensor], Any],
    chunk_numel: int,
    splittable: Callable[[torch.Tensor], bool] = lambda p: True,
) -> list[list[Piece]]:
    """Consecutive runs of pieces with the same ``key`` (device, dtype, step), each of at most
    ``chunk_numel`` elements; a larger parameter is cut into pieces when ``splittable``
    (its tensors are contiguous), else it goes alone."""
    out: list[list[Piece]] = []
    current: list[Piece] = []
    current_key: Any = None
    size = 0
    for p in params:
        k, n = key(p), p.numel()
        if n > chunk_numel and splittable(p):
            runs = [(s, min(n, s + chunk_numel)) for s in range(0, n, chunk_numel)]
        else:
            runs = [(0, n)]
        for start, end in runs:
            if current and (k != current_key or size + end - start > chunk_numel):
                out.append(current)
                current, size = [], 0
            current.append(Piece(p, start, end))
            current_key = k
            size += end - start
    if current:
        out.append(current)
    return out


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
    grad_scales: Sequence[torch.Tensor] = (),
    found_inf: torch.Tensor | None = None,
) -> None:
    """One step of ``optimizer``'s math for the low-precision ``params`` of ``group``, chunk by chunk.

    ``fused``: Adam/AdamW chunks run torch's fused kernel (``torch._fused_adam(w)_``, fp32
    arithmetic inside) instead of the foreach sequence: one pass over memory instead of
    about ten, results equal within fp32 rounding. With ``plain_store`` (round to
    nearest) and parameters, gradients and state all in one dtype, the kernel runs on the
    low-precision tensors directly, with no fp32 expansion at all. ``grad_scales``: factors
    (a clip's, one-element fp32 tensors) the expanded fp32 gradients are multiplied by, in
    order, before the update: as an fp32-master optimizer multiplies its fp32 gradients.
    ``found_inf`` (fused Adam/AdamW only): torch's kernel writes nothing where this device flag is 1
    (the step counts are counted all the same, see :mod:`mixprec.optim.skipping`).
    """
    if found_inf is not None and not (fused and kind == "adam"):
        raise ValueError("found_inf masks only fused Adam/AdamW chunks")
    active = [p for p in params if p.grad is not None]
    if not active:
        return
    dtype = torch.float32 if state_dtype is None else state_dtype
    for p in (p for p in active if p in optimizer.state):  # state held in another precision: as asked
        qstates.conform(optimizer.state[p], p, state_dtype)
    if kind == "adam":
        init_adam_state(optimizer, group, active, dtype)
        torch._foreach_add_([optimizer.state[p]["step"] for p in active], 1.0)  # once per parameter, not per piece

        def key(p: torch.Tensor) -> Any:
            return (p.device, p.dtype, p.grad.dtype if p.grad is not None else None,
                    host_float(optimizer.state[p]["step"]))

        def splittable(p: torch.Tensor) -> bool:
            return _contiguous(p, p.grad, *(v for v in optimizer.state[p].values() if torch.is_tensor(v) and v.dim()))

        # torch's fused kernel in place on the low-precision tensors needs no fp32 temporaries:
        # whole parameters, large chunks (fewer kernel launches)
        inplace = fused and plain_store and not grad_scales and all(p.dtype == dtype and p.grad is not None and p.grad.dtype == p.dtype for p in active)
        if inplace:
            plan = chunks(active, key, max(chunk_numel, INPLACE_CHUNK_NUMEL), lambda p: False)
        else:
            plan = chunks(active, key, chunk_numel, splittable)
        device_steps: dict[tuple[torch.device, float], torch.Tensor] = {}  # one per device and count
        h = rule.adam_hyper(optimizer, group)
        for chunk in plan:
            _adam_chunk(h, [optimizer.state[pc.param] for pc in chunk], chunk, expand, store, fused=fused,
                        plain_store=plain_store, device_steps=device_steps, grad_scales=grad_scales, found_inf=found_inf)
    else:
        first = {p: scalar_value(group["momentum"]) != 0 and optimizer.state.get(p, {}).get("momentum_buffer") is None for p in active}

        def sgd_key(p: torch.Tensor) -> Any:
            return (p.device, p.dtype, p.grad.dtype if p.grad is not None else None, first[p])

        def sgd_splittable(p: torch.Tensor) -> bool:
            buf = optimizer.state.get(p, {}).get("momentum_buffer")
            return _contiguous(p, p.grad, *(() if buf is None else (buf,)))

        for chunk in chunks(active, sgd_key, chunk_numel, sgd_splittable):
            _sgd_chunk(optimizer, group, chunk, dtype, expand, store, first=first[chunk[0].param],
                       grad_scales=grad_scales)


def _contiguous(*tensors: Any) -> bool:
    return all(t is None or t.is_contiguous() for t in tensors)


def init_adam_state(optimizer: torch.optim.Optimizer, group: dict[str, Any], params: list[torch.Tensor], dtype: torch.dtype) -> None:
    """torch.optim.Adam's lazy state initialisation, with the moments in ``dtype`` (8-bit: :mod:`~mixprec.optim.states`)."""
    for p in params:
        state = optimizer.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
            for key in keys:
                codecs.new_state(state, key, p, dtype)
        elif not torch.is_tensor(state["step"]):
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)


def _expanded(
    pieces: list[Piece], expand: Expand, grad_scales: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    device = pieces[0].device
    flat, values = codecs.flat_views(pieces, device)
    expand(pieces, values)
    _, grads = codecs.flat_views(pieces, device)
    torch._foreach_copy_(grads, [pc.of(pc.param.grad) for pc in pieces])  # type: ignore[arg-type]
    for factor in grad_scales:
        torch._foreach_mul_(grads, factor.to(device))
    return flat, values, grads


def _adam_chunk(
    h: rule.AdamHyper, states: list[dict[Any, Any]], pieces: list[Piece], expand: Expand, store: Store,
    *, fused: bool, plain_store: bool, device_steps: dict[tuple[torch.device, float], torch.Tensor],
    grad_scales: Sequence[torch.Tensor], found_inf: torch.Tensor | None = None,
) -> None:
    """One chunk of Adam/AdamW: its codecs' fp32 values, the rule (or torch's fused kernel), stored back."""
    device = pieces[0].device
    if fused:
        _adam_fused_chunk(h, pieces, states, expand, store, plain_store=plain_store, device_steps=device_steps,
                          grad_scales=grad_scales, found_inf=found_inf)
        return
    flat, values, grads = _expanded(pieces, expand, grad_scales)
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if h.amsgrad else [])
    loaded = [codecs.load_state(pieces, states, k, device) for k in keys]
    moments = [v for v, _ in loaded] + [None] * (3 - len(keys))
    step_size, bc2_sqrt = rule.bias_corrections(h, host_float(states[0]["step"]))  # one step per chunk (its key)
    rule.adam(rule.FOREACH, h, step_size, bc2_sqrt, values, grads, *moments)
    for value, put in loaded:
        put(value)
    store(pieces, values, flat)


def _adam_fused_chunk(
    h: rule.AdamHyper, pieces: list[Piece], states: list[dict[Any, Any]], expand: Expand, store: Store, *,
    plain_store: bool, device_steps: dict[tuple[torch.device, float], torch.Tensor], grad_scales: Sequence[torch.Tensor],
    found_inf: torch.Tensor | None = None,
) -> None:
    kernel = torch._fused_adamw_ if h.decoupled else torch._fused_adam_
    amsgrad = h.amsgrad
    steps = [s["step"] for s in states]  # already counted by fast_step
    device = pieces[0].device
    if device.type != "cpu":
        # the kernel reads the step counts on the parameters' device (torch keeps them on
        # the CPU for non-fused Adam); every parameter of a chunk has the same count
        count = host_float(steps[0])
        if (device, count) not in device_steps:
            device_steps[(device, count)] = torch.tensor(count, dtype=torch.float32, device=device)
        steps = [device_steps[(device, count)]] * len(pieces)
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    low_state = {k: [pc.of(s[k]) for pc, s in zip(pieces, states, strict=True)] for k in keys}
    dtype = pieces[0].dtype
    hyper: dict[str, Any] = {"lr": h.lr, "beta1": h.beta1, "beta2": h.beta2, "weight_decay": h.weight_decay,
                             "eps": h.eps, "amsgrad": amsgrad, "maximize": h.maximize, "found_inf": found_inf}
    if plain_store and not grad_scales and all(pc.param.grad is not None and pc.param.grad.dtype == dtype for pc in pieces) and all(
        t.dtype == dtype for ts in low_state.values() for t in ts
    ):
        # round to nearest of fp32 results, in one kernel on the low-precision tensors
        kernel([pc.value for pc in pieces], [pc.of(pc.param.grad) for pc in pieces],  # type: ignore[arg-type]
               low_state["exp_avg"], low_state["exp_avg_sq"],
               low_state.get("max_exp_avg_sq", []), steps, **hyper)
        return
    flat, values, grads = _expanded(pieces, expand, grad_scales)
    loaded = {k: codecs.load_state(pieces, states, k, device) for k in keys}
    state32 = {k: v for k, (v, _) in loaded.items()}
    kernel(values, grads, state32["exp_avg"], state32["exp_avg_sq"], state32.get("max_exp_avg_sq", []), steps, **hyper)
    for k in keys:
        loaded[k][1](state32[k])
    store(pieces, values, flat)


def _sgd_chunk(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], pieces: list[Piece], dtype: torch.dtype,
    expand: Expand, store: Store, *, first: bool, grad_scales: Sequence[torch.Tensor],
) -> None:
    h = rule.sgd_hyper(group)
    device = pieces[0].device
    flat, values, grads = _expanded(pieces, expand, grad_scales)
    bufs: list[torch.Tensor] | None = None
    store_bufs: Callable[[list[torch.Tensor]], None] = lambda new: None  # noqa: E731 - no momentum: no buffer
    if h.momentum != 0:
        states = [optimizer.state[pc.param] for pc in pieces]
        if first:  # first step: the buffer is the gradient (the same for every piece of the chunk)
            for pc, s in zip(pieces, states, strict=True):
                if s.get("momentum_buffer") is None:
                    codecs.new_state(s, "momentum_buffer", pc.param, dtype, like=False)
            _, store_bufs = codecs.load_state(pieces, states, "momentum_buffer", device)
        else:
            bufs, store_bufs = codecs.load_state(pieces, states, "momentum_buffer", device)
    rule.sgd(rule.FOREACH, h, values, grads, bufs, store_bufs)
    store(pieces, values, flat)


_FUSED_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps"})


#: torch optimizers whose fused kernel takes ``found_inf`` (and skips inside it)
_SKIPPING_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def fused_everywhere(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a torch optimizer whose every param group runs torch's fused kernel,
    which skips a step from a ``found_inf`` flag on the device (as torch's GradScaler gives it),
    and every parameter about to be updated has its state already: a skipped first step must not
    create state (torch's kernel would make it, zeros), so that step is decided on the host."""
    steps = {cls.step for cls in _SKIPPING_FUSED}
    groups = [g for g in optimizer.param_groups if g["params"]]
    if type(optimizer).step not in steps or not groups or not all(g.get("fused") for g in groups):
        return False
    state = optimizer.state
    for g in groups:
        sgd = isinstance(optimizer, torch.optim.SGD)
        if sgd and not g.get("momentum"):
            continue  # plain SGD keeps no state
        for q in g["params"]:
            if q.grad is None:
                continue
            held = state.get(q)
            if not held or (sgd and held.get("momentum_buffer") is None):
                return False
    return True


def prefer_fast_update(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> None:
    """Where ``group`` leaves both ``foreach`` and ``fused`` at torch's default (``None``):
    torch's fused kernel for plain Adam/AdamW over floating parameters on a device that has
    it, else its foreach implementation (the fp32 masters' update; same rule, a few times
    faster than torch's default on CPU)."""
    if "foreach" not in group or group["foreach"] is not None or group.get("fused"):
        return
    fusable = (
        type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
        and "fused" in group
        and not group.get("differentiable", False)
        and all(q.is_floating_point() and q.device.type in _FUSED_DEVICES for q in group["params"])
    )
    if not fusable:
        group["foreach"] = True
        return
    group["fused"] = True
    for q in group["params"]:  # the fused kernel keeps step counters beside the parameter, in fp32
        state = optimizer.state.get(q)
        step = None if not state else state.get("step")
        if isinstance(step, torch.Tensor):
            state["step"] = step.to(device=q.device, dtype=torch.float32)  # type: ignore[index]

"""What an optimizer costs in memory: its state (existing or predicted) and the temporaries of its update.

The optimizer wrappers answer :meth:`~mixprec.optim.WrappedOptimizer.state_bytes` and
:meth:`~mixprec.optim.WrappedOptimizer.step_transient_bytes` with these helpers; the
memory diagnostics call them directly for a plain torch optimizer.

State that does not exist yet (before the first step) is predicted by running one step
of the same optimizer class, with the same hyperparameters, on storage-free ``meta``
copies of the parameters: whatever state the optimizer creates (Adam's moments and step
counter, SGD's momentum buffer, any third-party optimizer's own keys) is then sized, with
no table of optimizer names.

>>> import torch
>>> from mixprec.optim.footprint import optimizer_state_bytes
>>> w = torch.nn.Parameter(torch.zeros(1000))
>>> optimizer_state_bytes(torch.optim.AdamW([w]))  # two fp32 moments and a 4-byte step counter
8004
>>> optimizer_state_bytes(torch.optim.SGD([w], lr=0.1))  # no momentum: no state
0
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any

import torch

from mixprec.dtypes import LOW_PRECISION_DTYPES
from mixprec.nested import local_share, shard_local
from mixprec.optim import codecs, routing
from mixprec.optim import states as qstates
from mixprec.optim.compiled import CompileSetting
from mixprec.optim.fast import chunks, default_chunk_numel, fast_kind, fused_available

__all__ = [
    "StateLayout",
    "local_share",
    "low_precision_state_bytes",
    "low_precision_step_transient",
    "nbytes",
    "optimizer_state_bytes",
    "param_shaped",
    "state_layout",
    "state_tensors",
    "state_tensors_of",
    "unique_tensors",
    "update_temporaries",
    "update_transient_bytes",
]

# key -> (shape, dtype) of every state tensor of one parameter
StateLayout = dict[str, tuple[torch.Size, torch.dtype]]

# torch's Adam-style updates build ``sqrt(v) / c`` temporaries (see update_temporaries)
_ADAM_STYLE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adamax,
)


def nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (a fake or meta tensor too; this rank's shard of a DTensor)."""
    t = shard_local(t)
    return t.numel() * t.element_size()


def unique_tensors(tensors: Iterable[torch.Tensor | None]) -> list[torch.Tensor]:
    """``tensors`` without ``None`` and without repeats (by identity), in order."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        out.append(t)
    return out


def _layout_of(state: dict[Any, Any]) -> StateLayout:
    return {str(k): (v.shape, v.dtype) for k, v in state.items() if isinstance(v, torch.Tensor)}


def _simulated_layouts(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], as_float32: Collection[int]
) -> dict[int, StateLayout]:
    """The state one step of ``optimizer`` creates for ``params`` (by id), run on meta copies.

    Parameters whose id is in ``as_float32`` are stepped as fp32 (the low-precision
    wrappers run the inner optimizer on fp32 expansions). An optimizer that cannot step on
    meta tensors predicts no state.
    """
    wanted = {id(p) for p in params}
    meta: dict[int, torch.Tensor] = {}
    groups = []
    for group in optimizer.param_groups:
        chosen = [q for q in group["params"] if id(q) in wanted]
        if not chosen:
            continue
        copies = []
        for q in chosen:
            dtype = torch.float32 if id(q) in as_float32 else q.dtype
            m = torch.nn.Parameter(torch.empty(q.shape, dtype=dtype, device="meta"), requires_grad=True)
            m.grad = torch.empty(q.shape, dtype=dtype, device="meta")
            meta[id(q)] = m
            copies.append(m)
        sim_group = {**group, "params": copies}
        for key, plain in (("foreach", False), ("fused", None), ("capturable", False), ("differentiable", False)):
            if key in sim_group:
                sim_group[key] = plain  # the single-tensor implementation: same state, runs on meta
        groups.append(sim_group)
    if not groups:
        return {}
    sim = copy.copy(optimizer)  # same class and defaults, own groups, state and hooks
    sim.__dict__.update(
        param_groups=groups,
        state=collections.defaultdict(dict),
        _optimizer_step_pre_hooks=collections.OrderedDict(),
        _optimizer_step_post_hooks=collections.OrderedDict(),
    )
    try:
        with torch.no_grad():
            type(optimizer).step(sim)
    except Exception:  # an optimizer that needs real values (closures, host reads): predict nothing
        return {}
    return {pid: _layout_of(sim.state.get(m, {})) for pid, m in meta.items()}


def state_layout(
    optimizer: torch.optim.Optimizer, *, as_float32: Collection[torch.Tensor] = ()
) -> dict[int, StateLayout]:
    """Per parameter of ``optimizer`` (keyed by ``id``): shape and dtype of each state tensor.

    Existing state is read as it is; a parameter without state gets what one step of the
    optimizer would create (see the module docs). ``as_float32``: parameters whose state
    is predicted as if they were fp32.
    """
    params = unique_tensors(q for g in optimizer.param_groups for q in g["params"])
    layouts: dict[int, StateLayout] = {}
    missing = []
    for q in params:
        state = optimizer.state.get(q)
        if state:
            layouts[id(q)] = _layout_of(state)
        elif not q.requires_grad:
            layouts[id(q)] = {}  # frozen (a LoRA base): a step gives it no gradient, so no state
        else:
            missing.append(q)
    if missing:
        simulated = _simulated_layouts(optimizer, missing, {id(q) for q in as_float32})
        for q in missing:
            layouts[id(q)] = simulated.get(id(q), {})
    return layouts


def param_shaped(layout: StateLayout, param: torch.Tensor) -> int:
    """How many floating-point state tensors of ``layout`` are shaped like ``param`` (moments,
    momentum buffers; not scalar step counters)."""
    return sum(
        1 for shape, dtype in layout.values() if shape == param.shape and (dtype.is_floating_point or dtype in qstates.BLOCKWISE)
    )  # block codes (mixprec.optim.states)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of ``optimizer``'s state: the distinct state tensors it holds, predicted for the
    parameters that have none yet (see :func:`state_layout`)."""
    total = 0
    missing = False
    for group in optimizer.param_groups:
        for q in group["params"]:
            if not optimizer.state.get(q):
                missing = True
    layouts = state_layout(optimizer) if missing else {}
    counted: set[int] = set()
    for q in unique_tensors(q for g in optimizer.param_groups for q in g["params"]):
        state = optimizer.state.get(q)
        if state:
            for v in unique_tensors(state_tensors_of(state)):
                if id(v) not in counted:
                    counted.add(id(v))
                    total += nbytes(v)
        else:
            share = local_share(q)  # per-element state of an FSDP2 shard: this rank's part (a step count: whole)
            total += sum(round(s.numel() * (share if s == q.shape else 1.0)) * dtype.itemsize
                         for s, dtype in layouts.get(id(q), {}).values())
    return total


def state_tensors_of(state: dict[Any, Any]) -> Iterator[torch.Tensor]:
    """The tensors of one parameter's state dict."""
    for v in state.values():
        if isinstance(v, torch.Tensor):
            yield v


def state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every state tensor ``optimizer`` holds now."""
    for state in optimizer.state.values():
        yield from state_tensors_of(state)


def update_temporaries(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> tuple[int, int]:
    """(temporaries of the largest parameter, temporaries per parameter of the group) that
    ``optimizer``'s update of ``group`` allocates, in fp32-parameter units.

    torch's Adam-style single-tensor updates build ``sqrt(v) / c`` (two temporaries of one
    parameter at a time); their foreach updates build one for every parameter at once;
    fused updates, SGD and other optimizers update in place.
    """
    if type(optimizer) not in _ADAM_STYLE or group.get("fused"):
        return 0, 0
    foreach = group.get("foreach")
    if foreach is None:  # torch's default: foreach where every parameter is on a GPU
        foreach = all(q.device.type == "cuda" for q in group["params"])
    return (0, 1) if foreach else (2, 0)


def update_transient_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Peak bytes of the temporaries one ``optimizer.step()`` allocates (see :func:`update_temporaries`)."""
    largest = 0
    transient = 0
    for group in optimizer.param_groups:
        of_largest, per_param = update_temporaries(optimizer, group)
        for q in group["params"]:
            if not q.requires_grad:  # frozen: never stepped
                continue
            largest = max(largest, of_largest * q.numel() * 4)
            transient += per_param * q.numel() * 4
    return largest + transient


def low_precision_state_bytes(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], low: Sequence[torch.Tensor], state_dtype: torch.dtype | None,
) -> int:
    """Bytes of the state of a low-precision wrapper over ``optimizer`` (see
    :meth:`mixprec.optim.LowPrecisionOptimizer.state_bytes`): the per-element state of the ``low``
    parameters in ``state_dtype`` (predicted before the first step), the rest as ``optimizer`` keeps it."""
    low_ids = {id(p) for p in low}
    layouts = state_layout(optimizer, as_float32=low)
    total = 0
    for q in unique_tensors(params):
        state = optimizer.state.get(q)
        if state:  # as it is
            total += sum(nbytes(v) for v in unique_tensors(state_tensors_of(state)))
            continue
        for shape, dtype in layouts.get(id(q), {}).values():
            shaped = id(q) in low_ids and shape == q.shape and dtype.is_floating_point
            per_element = shape == q.shape  # of an FSDP2 shard: this rank's part (a step count: whole)
            numel = round(shape.numel() * local_share(q)) if per_element else shape.numel()
            total += qstates.tensor_bytes(numel, state_dtype) if shaped else numel * dtype.itemsize
    return total


def low_precision_step_transient(
    optimizer: torch.optim.Optimizer,
    *,
    state_dtype: torch.dtype | None,
    fast: bool,
    fused: bool,
    compile: CompileSetting,
    chunk_numel: int | None,
    rounding: str,
    snapshot_extra: int = 0,
) -> int:
    """Peak temporaries of one step of a low-precision wrapper over ``optimizer`` with these
    settings (:meth:`mixprec.optim.LowPrecisionOptimizer.step_transient_bytes`), on the routes
    :func:`mixprec.optim.routing.plan` picks for it:

    - fp32 parameters (norm layers) are stepped by the inner optimizer as usual;
    - low-precision ones on the fast path (:func:`mixprec.optim.fast.fast_step`) are expanded
      chunk by chunk (at most ``chunk_numel`` elements; a larger contiguous parameter is cut into
      pieces, another one goes alone): fp32 values and gradients, fp32 copies of low-precision
      state, the foreach path's denominator, stochastic rounding's noise. Round-to-nearest stores
      with everything in the parameters' dtype run torch's fused kernel in place (no scratch);
      the compiled and native routes materialise nothing in fp32;
    - on the generic path, one parameter at a time on reused fp32 scratch;
    - with fp16 parameters, the step first snapshots every parameter and state tensor and
      ``snapshot_extra`` bytes of its state kinds' tensors (kept for the whole step, so a
      non-finite update can be undone).
    """
    inner = optimizer
    store_dtype = state_dtype or torch.float32
    state_low = store_dtype != torch.float32
    low_params = [p for g in inner.param_groups for p in g["params"] if p.dtype in LOW_PRECISION_DTYPES]
    layouts = state_layout(inner, as_float32=low_params)
    guarded = False
    snapshot = fp32_largest = fp32_all = scratch = 0
    for group in inner.param_groups:
        of_largest, per_param = update_temporaries(inner, group)
        params = group["params"]
        n_state = 0
        for q in params:
            if not q.requires_grad:  # frozen: never stepped, so neither expanded nor copied
                continue
            layout = layouts.get(id(q), {})
            n_state = max(n_state, param_shaped(layout, q))
            low_q = q.dtype in LOW_PRECISION_DTYPES
            snapshot += nbytes(q) + sum(
                shape.numel() * (store_dtype.itemsize if low_q and shape == q.shape else dtype.itemsize)
                for shape, dtype in layout.values()
            )
            guarded = guarded or q.dtype == torch.float16
            if not low_q:
                fp32_largest = max(fp32_largest, of_largest * q.numel() * 4)
                fp32_all += per_param * q.numel() * 4
        low = [q for q in params if q.dtype in LOW_PRECISION_DTYPES and q.requires_grad]
        if not low:
            continue
        kind = fast_kind(inner, group, fused=fused and rounding != "remainder") if fast else None
        n_low_state = n_state if state_low else 0
        if kind == "adam":  # the step's own route decision, predicted (nothing built or compiled)
            routes = routing.plan(rounding, state_dtype, compile, low, predict=True)
            if rounding == "remainder" and routes.compiled:  # one fused loop per parameter; a tie flag and two remainder bytes per element
                scratch = max(scratch, 3 * sum(q.numel() for q in routes.compiled))
            low = routes.eager  # the native kernel steps a 256-element block at a time, on the stack
            if not low:
                continue
        if kind is not None:
            in_fused = kind == "adam" and fused and fused_available(low[0].device)
            limit = chunk_numel or default_chunk_numel(low[0].device)
            for chunk in chunks(low, lambda q: (q.device, q.dtype), limit, lambda q: q.is_contiguous()):
                n = sum(q.numel() for q in chunk)
                if in_fused and rounding == "nearest" and store_dtype == chunk[0].dtype:
                    continue  # torch's fused kernel on the low-precision tensors, in place
                per_element = 8 + 4 * n_low_state  # values, gradients, low-precision state
                if kind == "adam" and not in_fused:
                    per_element += 4  # the denominator
                if rounding == "stochastic":
                    per_element += codecs.noise_bytes(low[0].device)  # the noise (none in the native loop)
                if rounding == "remainder":
                    per_element += 2  # the new remainders, before they are copied out
                if qstates.block_codec(state_dtype) is not None:
                    per_element += 4 * n_state + 22  # block-coded: fp32 state, the padded run, the encoder's scratch
                scratch = max(scratch, n * per_element)
        else:
            largest = max(q.numel() for q in low)
            noise = codecs.noise_bytes(low[0].device) * largest if rounding == "stochastic" else 0  # the whole weight
            scratch = max(scratch, largest * 4 * (2 + n_low_state + of_largest) + per_param * largest * 4 + noise)
    return (snapshot + snapshot_extra if guarded else 0) + max(scratch, fp32_largest + fp32_all)


"""Which executor steps each weight of a low-precision wrapper's Adam/AdamW groups, and the layout keys it records.

:func:`plan` is the one route decision: :class:`~mixprec.optim.LowPrecisionOptimizer`'s step
asks it through :func:`compiled_route` once per param group and step, and the memory estimate
(:func:`mixprec.optim.footprint.low_precision_step_transient`) asks it too; the executors each
device type offers are listed in :data:`EXECUTORS`. The compiled update itself is
:func:`~mixprec.optim.compiled.compiled_adam_step`, the native one
:func:`~mixprec.optim.native.native_adam_step`.
A layout (shapes, dtypes, options, rounding, state dtype, device type) is compiled once and
recorded by its key in the wrapper's ``_compiled_layouts`` (checkpointed, so a resumed run
takes the routes it took before); :func:`upgraded_layout` reads the keys of earlier builds.

>>> import torch
>>> from mixprec.optim import KahanOptimizer
>>> w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
>>> layout_key_suffix(KahanOptimizer(torch.optim.Adam([w])), "cpu")
('kahan', 'torch.bfloat16', 'cpu')
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mixprec.compiling import mark_compile_failed
from mixprec.optim import codecs, native, triton_adam
from mixprec.optim import states as qstates
from mixprec.optim.compiled import (
    CompileRouteFailed,
    CompileSetting,
    LayoutReservation,
    RemainderIO,
    compiled_adam_step,
    compiles_param,
    release_layout,
    reserve_layouts,
    uniform_steps,
    use_compiled_route,
)
from mixprec.optim.fast import Piece, fast_step, fused_available

__all__ = [
    "EXECUTORS", "Routes", "compiled_layout_ok", "compiled_route", "compiled_step", "eager_masks", "executors", "layout_key_suffix",
    "loaded_layouts", "plan", "run_group", "upgraded_layout",
]


class Routed(Protocol):
    """What the routing reads of a :class:`~mixprec.optim.LowPrecisionOptimizer`."""

    optimizer: torch.optim.Optimizer
    compile: CompileSetting
    state_dtype: torch.dtype | None
    _compiled_layouts: set[str]  # layouts the compiled route took (checkpointed)
    _layout_keys: dict[tuple[Any, ...], str]  # (param ids, grad dtypes, options) -> layout

    @property
    def rounding(self) -> str: ...

    def _compiled_rounding_inputs(self) -> Callable[[torch.Tensor], torch.Tensor] | None: ...

    def _noise_for(self, params: list[torch.nn.Parameter]) -> AbstractContextManager[codecs.Noise | None]: ...

    _noise: codecs.Noise | None  # the noise of the call being stepped (stochastic rounding)

    def _compiled_remainder(self) -> RemainderIO | None: ...

    def _pending_grad_scales(self) -> list[torch.Tensor]: ...

    fused: bool

    def _expand_many(self, pieces: list[Piece], values: list[torch.Tensor]) -> None: ...

    def _store_many(self, pieces: list[Piece], values: list[torch.Tensor], flat: torch.Tensor) -> None: ...

    def _chunk_limit(self, device: torch.device) -> int: ...

    def _step_one(self, p: torch.nn.Parameter, group: dict[str, Any], scratch: dict[Any, torch.Tensor]) -> None: ...

    _skip: torch.Tensor | None  # the device flag of a step decided on the device (mixprec.optim.skipping)

    def skip_on_host(self) -> bool: ...


#: the stores the compiled update implements
COMPILED_ROUNDINGS = ("nearest", "kahan", "stochastic", "remainder")

#: the executors an Adam/AdamW group's low-precision weights are offered to on each device type,
#: in order: a weight steps on the first that takes it (``"eager"``: the fast path, which takes all)
EXECUTORS: dict[str, tuple[str, ...]] = {
    "cpu": ("native", "compiled", "eager"),  # native: the C kernel (mixprec.optim.native)
    "cuda": ("triton", "compiled", "eager"),  # triton: the multi-tensor kernel (mixprec.optim.triton_adam)
    "default": ("compiled", "eager"),
}


def executors(device_type: str) -> tuple[str, ...]:
    """The executors of :data:`EXECUTORS` for ``device_type``."""
    return EXECUTORS.get(device_type, EXECUTORS["default"])


def eager_masks(opt: Routed, device: torch.device) -> bool:
    """Whether the eager fast path's Adam/AdamW chunks of ``opt`` skip from a device flag: they run
    torch's fused kernel (``fused``), which writes nothing when the flag is set, and their store gives
    back unchanged values bit for bit (round to nearest, stochastic rounding; float moments). The
    native and compiled executors mask every store themselves."""
    return (opt.fused and fused_available(device) and opt.rounding in ("nearest", "stochastic")
            and qstates.block_codec(opt.state_dtype) is None)


@dataclass(frozen=True)
class Routes:
    """Which executor steps each weight of an Adam/AdamW group (each list in the group's order)."""

    native: list[Any]
    triton: list[Any]
    compiled: list[Any]
    eager: list[Any]  # what is left for the eager fast path when the compiled route runs
    rest: list[Any]  # what is left when it does not: every weight but the native ones


def plan(
    rounding: str, state_dtype: torch.dtype | None, setting: CompileSetting, params: Sequence[torch.Tensor], *,
    whole_step: bool = True, comps: Callable[[torch.Tensor], torch.Tensor] | None = None, predict: bool = False,
    native_first: bool = True,
) -> Routes:
    """The one route decision of an Adam/AdamW group's low-precision ``params``, for the step
    and for the memory estimate (``predict``: nothing is built or compiled to decide, and a weight's
    gradient and compensation are not looked at). A weight goes native where the device's
    :data:`EXECUTORS` list it, :func:`~mixprec.optim.native.use_native_route` allows and
    :func:`~mixprec.optim.native.takes` (predicting: ``takes_param``) admits it; of the others, the
    ones :func:`~mixprec.optim.compiled.compiles_param` admits go compiled if
    :func:`~mixprec.optim.compiled.use_compiled_route` says so; the rest step eagerly. The step
    also asks for one step count and a layout budget (:func:`compiled_layout_ok`) before it
    compiles; ``native_first=False`` plans what the native kernel left. On CUDA the Triton kernel
    takes the place of the native one (:func:`~mixprec.optim.triton_adam.use_triton_route`,
    :func:`~mixprec.optim.triton_adam.takes`, :func:`~mixprec.optim.triton_adam.kernel_works`)."""
    params = list(params)
    if rounding not in COMPILED_ROUNDINGS:
        return Routes([], [], [], params, params)
    native_ids: set[int] = set()
    triton_ids: set[int] = set()
    with_comp = comps is not None and rounding in ("kahan", "remainder")
    if native_first and native.use_native_route(setting, rounding, state_dtype, build=not predict):
        for p in params:
            if "native" not in executors(p.device.type):
                continue
            if native.takes_param(rounding, p) if predict else native.takes(rounding, p, comps(p) if with_comp else None):  # type: ignore[misc]
                native_ids.add(id(p))
    if native_first and triton_adam.use_triton_route(setting, rounding, state_dtype):
        for p in params:
            if "triton" not in executors(p.device.type) or id(p) in native_ids:
                continue
            if triton_adam.takes_param(rounding, state_dtype, p) if predict else (
                triton_adam.takes(rounding, state_dtype, p, comps(p) if with_comp else None)  # type: ignore[misc]
                and triton_adam.kernel_works(p.device)
            ):
                triton_ids.add(id(p))
    left = [p for p in params if id(p) not in native_ids and id(p) not in triton_ids]
    taken = [p for p in left if "compiled" in executors(p.device.type) and compiles_param(rounding, state_dtype, p)]
    compiled: list[Any] = []
    if taken and use_compiled_route(
        setting, rounding, taken, whole_step=whole_step, probe=not predict, state_dtype=state_dtype
    ):
        compiled = taken
    compiled_ids = {id(p) for p in compiled}
    return Routes(
        [p for p in params if id(p) in native_ids], [p for p in params if id(p) in triton_ids], compiled,
        [p for p in left if id(p) not in compiled_ids], left,
    )


def run_group(opt: Routed, group: dict[str, Any], active: list[torch.nn.Parameter], kind: str | None,
              scratch: dict[Any, torch.Tensor], *, whole_step: bool) -> None:
    """Step ``active`` (the low-precision parameters of ``group`` with gradients, which ``group``
    holds now) on their executors: an Adam/AdamW group's on those :func:`plan` picks
    (:func:`compiled_route`), the rest of a fast kind (``"adam"``, ``"sgd"``) on the eager fast path
    (:func:`~mixprec.optim.fast.fast_step`: the codecs' chunks, the rule), any other one parameter
    at a time on the generic path (the inner optimizer on fp32 proxies). In a step decided on the
    device (``opt._skip``) what no executor masks reads the flag on the host and steps only if it is 0.
    Stochastic rounding draws one :class:`~mixprec.optim.codecs.Noise` for the call, whichever
    executors share it (``opt._noise``)."""
    with opt._noise_for(active):
        _run_group(opt, group, active, kind, scratch, whole_step=whole_step)


def _run_group(opt: Routed, group: dict[str, Any], active: list[torch.nn.Parameter], kind: str | None,
               scratch: dict[Any, torch.Tensor], *, whole_step: bool) -> None:
    skip = opt._skip
    if kind == "adam":
        active = group["params"] = compiled_route(opt, group, active, whole_step=whole_step)
    masks = bool(active) and skip is not None and kind == "adam" and eager_masks(opt, active[0].device)
    if active and skip is not None and not masks and opt.skip_on_host():
        return
    if active and kind is not None:
        device = active[0].device
        fast_step(
            opt.optimizer, group, active, kind=kind, state_dtype=opt.state_dtype, expand=opt._expand_many,
            store=opt._store_many, chunk_numel=qstates.chunk_numel(opt._chunk_limit(device), opt.state_dtype),
            fused=opt.fused and fused_available(device), plain_store=opt.rounding == "nearest",
            grad_scales=opt._pending_grad_scales(), found_inf=skip if masks else None,
        )
        return
    for p in active:  # none left when the compiled route stepped them all
        if p.grad is not None:
            opt._step_one(p, group, scratch)


def compiled_route(opt: Routed, group: dict[str, Any], active: list[torch.nn.Parameter], *, whole_step: bool) -> list[torch.nn.Parameter]:
    """Step an Adam/AdamW group's ``active`` parameters on the native or the compiled route
    where :func:`plan` sends them; returns those left for the eager path (``active`` itself when
    neither is taken). The native route goes first, also for a step of some parameters
    (``whole_step=False``: it compiles nothing per layout)."""
    comps = opt._compiled_rounding_inputs()
    routes = plan(opt.rounding, opt.state_dtype, opt.compile, active, whole_step=whole_step, comps=comps)
    if routes.native or routes.triton:
        common: dict[str, Any] = dict(state_dtype=opt.state_dtype, rounding=opt.rounding, comps=comps, noise=opt._noise,
                      grad_scales=opt._pending_grad_scales(), skip=opt._skip)
        left = native.native_adam_step(opt.optimizer, group, routes.native, remainder=opt._compiled_remainder(),
                                       **common) if routes.native else []
        if routes.triton:
            left = left + triton_adam.triton_adam_step(opt.optimizer, group, routes.triton, **common)
        stepped = {id(p) for p in routes.native + routes.triton} - {id(p) for p in left}
        active = [p for p in active if id(p) not in stepped]
        if not active:
            return active
        routes = plan(opt.rounding, opt.state_dtype, opt.compile, active, whole_step=whole_step, native_first=False)
    if routes.compiled and (reserved := compiled_layout_ok(opt, group, routes.compiled)):
        return compiled_step(opt, group, routes.compiled, reserved) + routes.eager
    return active


def compiled_layout_ok(opt: Routed, group: dict[str, Any], active: list[torch.nn.Parameter]) -> LayoutReservation | None:
    """Whether this step of ``active`` may take the compiled route.

    The compiled update takes one step count (a group whose parameters got gradients at
    different times, as in a mixture of experts, steps eagerly) and compiles once per
    layout (shapes, dtypes, options). ``compile="auto"`` compiles at most
    :data:`~mixprec.optim.compiled.AUTO_MAX_LAYOUTS` layouts per wrapper: a set of parameters with gradients
    that keeps changing stays eager instead of compiling again and again. The layouts
    compiled so far are checkpointed, so a resumed run takes the same routes (and, with
    stochastic rounding, draws the same noise) as an uninterrupted one. The process
    also keeps its own budget (:func:`~mixprec.optim.compiled.reserve_layouts`; a layout
    whose compilation fails or is interrupted is given back, not recorded as compiled).
    """
    if not uniform_steps(opt.optimizer, active):
        return None
    options = (
        bool(group["amsgrad"]), bool(group["maximize"]), group["weight_decay"] != 0,
        bool(group.get("decoupled_weight_decay", isinstance(opt.optimizer, torch.optim.AdamW))),
    )
    # the layout of the same parameters with the same options is worked out once; a parameter
    # keeps its shape (its optimizer state has it) but a cast or a move changes dtype or device
    ident = (
        tuple(map(id, active)), tuple(p.dtype for p in active), tuple(p.grad.dtype for p in active if p.grad is not None),
        active[0].device, options,
    )
    key = opt._layout_keys.get(ident)
    if key is None:
        if len(opt._layout_keys) >= 64:  # parameter sets that keep changing (experts)
            opt._layout_keys.clear()
        key = opt._layout_keys[ident] = repr((
            tuple((tuple(p.shape), str(p.dtype), str(p.grad.dtype) if p.grad is not None else "") for p in active),
            *options, *layout_key_suffix(opt, active[0].device.type),
        ))
    return reserve_layouts(opt._compiled_layouts, key, opt.compile == "auto")


def compiled_step(
    opt: Routed, group: dict[str, Any], active: list[torch.nn.Parameter], reserved: LayoutReservation
) -> list[torch.nn.Parameter]:
    """The compiled route for ``active``; returns the parameters it left unstepped
    (none, unless compilation failed under ``compile="auto"``)."""
    try:
        compiled_adam_step(
            opt.optimizer, group, active, state_dtype=opt.state_dtype, rounding=opt.rounding,
            comps=opt._compiled_rounding_inputs(), noise=opt._noise, grad_scales=opt._pending_grad_scales(), remainder=opt._compiled_remainder(),
            skip=opt._skip,
        )
    except BaseException as exc:  # nothing was stepped (an interrupt too): the layout is not compiled
        release_layout(opt._compiled_layouts, reserved)
        if not isinstance(exc, CompileRouteFailed):
            raise
        if opt.compile is True:
            raise exc.cause from None
        mark_compile_failed(active[0].device, exc.cause)
        return active  # nothing was stepped: all go the eager way
    return []


# ------------------------------------------------------------------------ checkpoints
def loaded_layouts(opt: Routed, layouts: Any, params: list[torch.nn.Parameter]) -> set[str]:
    """The compiled layouts of a loaded state_dict (its ``compiled_layouts``), upgraded."""
    if not isinstance(layouts, list | tuple) or not all(isinstance(k, str) for k in layouts):
        raise TypeError(f"the state_dict's compiled_layouts must be a list of str, got {layouts!r}")
    return {upgraded_layout(opt, key, params) for key in layouts}


def upgraded_layout(opt: Routed, key: str, params: list[torch.nn.Parameter]) -> str:
    """A layout key as :func:`compiled_layout_ok` writes it now. Earlier builds of
    mixprec 0.1.0 saved ``(layout, *4 options)`` without the rounding, state dtype and
    device type, which are this wrapper's own: they are appended, so a run resumed from
    such a checkpoint takes the routes it took before. The old key does not say its
    device: with parameters on several device types it is kept as it is (it matches no
    layout, as before)."""
    try:
        parts = ast.literal_eval(key)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return key  # not a key this wrapper wrote: it matches no layout, as before
    if not isinstance(parts, tuple) or len(parts) != 5:
        return key
    device_types = {p.device.type for p in params}
    if len(device_types) != 1:
        return key
    return repr((*parts, *layout_key_suffix(opt, device_types.pop())))


def layout_key_suffix(opt: Routed, device_type: str) -> tuple[str, str, str]:
    """What a layout key holds of the wrapper and the device after the layout and options."""
    return opt.rounding, str(opt.state_dtype), device_type

"""Which Adam/AdamW groups of a low-precision wrapper take the compiled route, and the layout keys it records.

:class:`~mixprec.optim.LowPrecisionOptimizer` asks :func:`compiled_route` once per param
group and step; the compiled update itself is :func:`~mixprec.optim.compiled.compiled_adam_step`.
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
from collections.abc import Callable
from typing import Any, Protocol

import torch

from mixprec.compiling import mark_compile_failed
from mixprec.optim import native
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

__all__ = [
    "compiled_layout_ok", "compiled_route", "compiled_step", "layout_key_suffix", "loaded_layouts", "native_route",
    "upgraded_layout",
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

    def _compiled_rounding_inputs(self) -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, list[int] | None]: ...

    def _compiled_remainder(self) -> RemainderIO | None: ...

    def _pending_grad_scales(self) -> list[torch.Tensor]: ...


#: the stores the compiled update implements
COMPILED_ROUNDINGS = ("nearest", "kahan", "stochastic", "remainder")


def compiled_route(opt: Routed, group: dict[str, Any], active: list[torch.nn.Parameter], *, whole_step: bool) -> list[torch.nn.Parameter]:
    """Step an Adam/AdamW group's ``active`` parameters on the native or the compiled route
    where one is taken; returns those left for the eager path (``active`` itself when
    neither is taken). The native route (:func:`native_route`) goes first, also for a step
    of some parameters (``whole_step=False``: it compiles nothing per layout); of the rest,
    only the weights :func:`~mixprec.optim.compiled.compiles_param` admits take the compiled
    route, the others step eagerly."""
    if opt.rounding not in COMPILED_ROUNDINGS:
        return active
    active = native_route(opt, group, active)
    if not active:
        return active
    taken: list[torch.nn.Parameter] = []
    rest: list[torch.nn.Parameter] = []
    for p in active:
        (taken if compiles_param(opt.rounding, opt.state_dtype, p) else rest).append(p)
    if taken and use_compiled_route(
        opt.compile, opt.rounding, taken, whole_step=whole_step, state_dtype=opt.state_dtype
    ) and (reserved := compiled_layout_ok(opt, group, taken)):
        return compiled_step(opt, group, taken, reserved) + rest
    return active


def native_route(opt: Routed, group: dict[str, Any], active: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Step the parameters of ``active`` that the native kernel takes
    (:func:`~mixprec.optim.native.use_native_route`, :func:`~mixprec.optim.native.takes`);
    returns the others, in order."""
    if not native.use_native_route(opt.compile, opt.rounding, opt.state_dtype):
        return active
    comps, counter = opt._compiled_rounding_inputs()
    with_comp = comps is not None and opt.rounding in ("kahan", "remainder")
    taken = [p for p in active if native.takes(opt.rounding, p, comps(p) if with_comp else None)]  # type: ignore[misc]
    if not taken:
        return active
    left = native.native_adam_step(
        opt.optimizer, group, taken, state_dtype=opt.state_dtype, rounding=opt.rounding, comps=comps,
        counter=counter, grad_scales=opt._pending_grad_scales(), remainder=opt._compiled_remainder(),
    )
    stepped = {id(p) for p in taken} - {id(p) for p in left}
    return [p for p in active if id(p) not in stepped]


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
    comps, counter = opt._compiled_rounding_inputs()
    try:
        compiled_adam_step(
            opt.optimizer, group, active, state_dtype=opt.state_dtype, rounding=opt.rounding,
            comps=comps, counter=counter, grad_scales=opt._pending_grad_scales(), remainder=opt._compiled_remainder(),
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

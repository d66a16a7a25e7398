"""The compiled route of the low-precision optimizer wrappers: Adam/AdamW under ``torch.compile``.

Expansion to fp32, the update and the store back (round to nearest, Kahan residual or
stochastic rounding) fuse into one loop per parameter, so nothing is materialised in
fp32. Selected with ``compile=True`` on :class:`~mixprec.optim.LowPrecisionOptimizer`
and its subclasses, or by ``compile="auto"`` (their default) for the Kahan and
stochastic-rounding stores of large groups, where it is several times faster than the
eager fast path (see :func:`use_compiled_route`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from mixprec.compiling import compile_errors, compile_works, compiled, recompile_headroom
from mixprec.lagged import host_float
from mixprec.optim import codecs, rule
from mixprec.optim import states as qstates
from mixprec.optim.fast import init_adam_state

__all__ = [
    "AUTO_COMPILE_NUMEL",
    "AUTO_MAX_LAYOUTS",
    "CompileSetting",
    "check_compile_setting",
    "use_compiled_route",
]  # the rest (compiled_adam_step, its layout budget and step-count check) is the wrappers' plumbing

#: ``compile`` of the low-precision wrappers: True, False, or "auto" (see :func:`use_compiled_route`)
CompileSetting = bool | Literal["auto"]

#: "auto" compiles the update of a param group holding at least this many low-precision
#: elements: below it the eager step takes a few milliseconds, and the one-off compilation
#: (seconds) would take thousands of steps to pay back.
AUTO_COMPILE_NUMEL = 1 << 20

#: "auto" compiles at most this many layouts (shapes, dtypes, options) per optimizer wrapper
AUTO_MAX_LAYOUTS = 4

#: the compiled update compiles at most this many layouts per process (beyond, eager);
#: dynamo's recompile limit is raised to 64 around the update, so none runs uncompiled
PROCESS_MAX_LAYOUTS = 48
_LAYOUTS: set[str] = set()


def reserve_layout(key: str) -> bool:
    """Whether the compiled update may run layout ``key`` in this process (already
    compiled, or one of the first :data:`PROCESS_MAX_LAYOUTS`)."""
    if key in _LAYOUTS:
        return True
    if len(_LAYOUTS) >= PROCESS_MAX_LAYOUTS:
        return False
    _LAYOUTS.add(key)
    return True


@dataclass(frozen=True)
class LayoutReservation:
    """A layout admitted to the compiled route for one update, and which budgets it took
    anew (the wrapper's checkpointed set, the process's): :func:`release_layout` gives
    those back when the update did not run."""

    key: str
    new_here: bool
    new_in_process: bool


def reserve_layouts(compiled_layouts: set[str], key: str, auto: bool) -> LayoutReservation | None:
    """Admit layout ``key`` of a wrapper whose compiled layouts are ``compiled_layouts``
    (recorded there, and in the process budget); None: it steps eagerly (``auto`` and
    :data:`AUTO_MAX_LAYOUTS` new layouts reached, or the process budget spent)."""
    known = key in compiled_layouts
    if not known and auto and len(compiled_layouts) >= AUTO_MAX_LAYOUTS:
        return None
    new_in_process = key not in _LAYOUTS
    if not reserve_layout(key):
        return None
    compiled_layouts.add(key)
    return LayoutReservation(key, not known, new_in_process)


def release_layout(compiled_layouts: set[str], reservation: LayoutReservation) -> None:
    """The compiled update of ``reservation`` did not run (its compilation failed or was
    interrupted): the layout is no longer recorded as compiled where it was new."""
    if reservation.new_here:
        compiled_layouts.discard(reservation.key)
    if reservation.new_in_process:
        _LAYOUTS.discard(reservation.key)


def check_compile_setting(value: object, owner: str = "compile") -> CompileSetting:
    """``value`` if it is True, False or "auto"; otherwise a ValueError naming it."""
    if value is True or value is False or value == "auto":
        return value  # type: ignore[return-value]
    raise ValueError(
        f"{owner} must be True (always compile the Adam/AdamW update), False (never) or 'auto' "
        f"(compile Kahan / stochastic-rounding updates of large groups), got {value!r}"
    )


def use_compiled_route(
    setting: CompileSetting,
    rounding: str,
    params: Sequence[torch.Tensor],
    *,
    whole_step: bool = True,
    probe: bool = True,
    state_dtype: torch.dtype | None = None,
) -> bool:
    """Whether an Adam/AdamW group of low-precision ``params`` takes the compiled route.

    ``True`` / ``False`` decide. ``"auto"`` compiles where the eager fast path takes several
    passes per element: a Kahan or stochastic-rounding store, 8-bit moments
    (``state_dtype=torch.uint8``) of the other stores, or remainder masters with bf16/fp16
    moments (with fp32 moments the remainder plan keeps torch's fused kernel, bit-identical
    to ``bf16-master``; with 8-bit ones the compiled loop measured no faster than the eager
    one; a round-to-nearest store with float moments runs that one-pass kernel already). It also
    requires that the step update the whole group (``whole_step``: optimizer-in-backward
    steps one parameter at a time, which would compile once per layout), that the group
    hold at least :data:`AUTO_COMPILE_NUMEL` elements of plain tensors (not tensor
    subclasses such as DTensor shards), and that :func:`mixprec.compiling.compile_works` on
    their device. The wrapper also requires one step count across the group and compiles
    at most :data:`AUTO_MAX_LAYOUTS` layouts (a changing set of parameters with gradients,
    as in a mixture of experts, would otherwise compile again and again).

    >>> import torch
    >>> small = [torch.zeros(10, dtype=torch.bfloat16)]
    >>> use_compiled_route("auto", "kahan", small), use_compiled_route(True, "kahan", small)
    (False, True)
    """
    if setting != "auto":
        return bool(setting)
    coded = qstates.block_codec(state_dtype) is not None
    if rounding == "nearest" and not coded:
        return False
    if rounding == "remainder" and (coded or state_dtype in (None, torch.float32)):
        return False  # fp32 moments: torch's fused kernel; 8-bit: compiled no faster (BENCHMARKS.md)
    if not whole_step or not params:
        return False
    if any(type(p) not in (torch.Tensor, torch.nn.Parameter) for p in params):
        return False
    if sum(p.numel() for p in params) < AUTO_COMPILE_NUMEL:
        return False
    return compile_works(params[0].device, probe=probe)


def compiles_param(rounding: str, state_dtype: torch.dtype | None, param: torch.Tensor) -> bool:
    """Whether ``param`` may take the compiled route at all: remainder masters only contiguous
    weights on the CPU (their ties are flat indices; on CUDA the route is not checked yet),
    block-coded moments only weights of whole 256-element blocks (a partial last block came out
    wrong compiled); the others step eagerly."""
    if rounding == "remainder" and (not param.is_contiguous() or param.device.type != "cpu"):
        return False
    return qstates.block_codec(state_dtype) is None or param.numel() % qstates.BLOCK == 0


class CompileRouteFailed(RuntimeError):
    """The compiled route could not compile: no parameter of the call was stepped and
    their step counts are as before, for the caller to step them another way."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


def _adam_lists(
    params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor], comps: list[torch.Tensor], seed: torch.Tensor, firsts: torch.Tensor, hyper: torch.Tensor,
    scales: list[list[torch.Tensor]], tables: list[torch.Tensor], flags: list[list[torch.Tensor]], skip: torch.Tensor,
    *, decoupled: bool, amsgrad: bool, maximize: bool, weight_decay: bool, rounding: str, form: str | None,
) -> None:
    """Adam/AdamW on low-precision tensors, one fused loop per parameter under ``torch.compile``:
    each weight and moment loaded by its codec (the ``fused_*`` ones of :mod:`mixprec.optim.codecs`),
    the rule (:func:`mixprec.optim.rule.adam` on :data:`~mixprec.optim.rule.FUSED`), stored back.

    ``hyper`` holds [lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt,
    grad_scale] (a tensor, so new values do not recompile; ``grad_scale`` multiplies every
    gradient, 1 unless a clip was deferred). ``comps``: the Kahan compensations, or the int16
    remainders viewed as bf16 with ``flags`` for their new bytes and ties
    (:func:`~mixprec.optim.codecs.fused_remainder_inputs`). ``seed``: an int64 holding the call's
    32-bit stochastic-rounding seed, XORed with each element's position in the call (``firsts``:
    each weight's first, :class:`~mixprec.optim.codecs.Noise`).
    ``form``: the moments are block codes of this :class:`~mixprec.optim.states.BlockCodec` (by name),
    their block scales in ``scales`` (one list per moment key), its constant ``tables``. ``skip``: a
    0-dim flag; where it is 1 every stored tensor keeps what it held (a step skipped on the device).
    """
    keep = None if rounding == "remainder" else skip > 0
    lr, beta1, beta2, eps, wd, step_size, bc2_sqrt, gscale = hyper.unbind(0)
    h = rule.AdamHyper(lr, beta1, beta2, eps, wd, decoupled=decoupled, amsgrad=amsgrad, maximize=maximize,
                       decays=weight_decay)
    for i, p in enumerate(params):
        comp = comps[i] if rounding in ("kahan", "remainder") else None
        w = codecs.fused_load_weight(rounding, p, comp)
        sc = [s[i] for s in scales] + [None] * (3 - len(scales))  # 8-bit: each moment's block scales
        m = codecs.fused_load_state(form, exp_avgs[i], sc[0], True, tables)
        v = codecs.fused_load_state(form, exp_avg_sqs[i], sc[1], False, tables)
        vmax = codecs.fused_load_state(form, max_exp_avg_sqs[i], sc[2], False, tables) if amsgrad else None
        w, m, v, vmax = rule.adam(rule.FUSED, h, step_size, bc2_sqrt, w, grads[i].float() * gscale, m, v, vmax)
        if amsgrad:
            codecs.fused_store_state(form, vmax, max_exp_avg_sqs[i], sc[2], False, tables, keep)
        codecs.fused_store_state(form, m, exp_avgs[i], sc[0], True, tables, keep)
        codecs.fused_store_state(form, v, exp_avg_sqs[i], sc[1], False, tables, keep)
        position = None
        if rounding == "stochastic":
            position = (torch.arange(p.numel(), device=p.device, dtype=torch.int64).view(p.shape) + firsts[i]) ^ seed
        codecs.fused_store_weight(rounding, p, w, comp, [f[i] for f in flags], position, keep)


def uniform_steps(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> bool:
    """Whether every parameter of ``params`` has the same step count (unstepped ones count 0).

    The compiled update takes one count for its bias corrections; a group whose parameters
    got gradients at different times (a mixture of experts) is stepped eagerly instead.
    """
    steps = [state.get("step", 0) if (state := optimizer.state.get(p)) else 0 for p in params]
    return len({host_float(s) for s in steps}) <= 1  # (host memory: torch keeps non-fused step counts on the CPU)


@dataclass(frozen=True)
class RemainderIO:
    """What the compiled route needs of :class:`~mixprec.optim.RemainderOptimizer`: the ties
    rounded down of a parameter (flat indices), and where to put its new ones."""

    ties: Callable[[torch.Tensor], torch.Tensor]
    set_ties: Callable[[torch.Tensor, torch.Tensor], None]


def compiled_adam_step(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    params: Sequence[torch.Tensor],
    *,
    state_dtype: torch.dtype | None,
    rounding: str,
    comps: Callable[[torch.Tensor], torch.Tensor] | None = None,
    noise: codecs.Noise | None = None,
    grad_scales: Sequence[torch.Tensor] = (),
    remainder: RemainderIO | None = None,
    skip: torch.Tensor | None = None,
) -> None:
    """Adam/AdamW for the low-precision ``params`` of ``group`` in one ``torch.compile``-d call.

    No fp32 copies are materialised: expansion, update and store fuse into one loop per
    parameter. The first call per group layout compiles (seconds to a minute). Results
    equal the generic path within fp32 rounding (the compiler may reorder and contract
    the fp32 operations). Every parameter must have the same step count (see
    :func:`uniform_steps`). Stochastic rounding draws the call's ``noise``
    (:class:`~mixprec.optim.codecs.Noise`: a hash of each element's position in its group's call
    and a seed mixed from the wrapper's checkpointed call count, the same bits as the other routes):
    no random tensor is drawn or stored. 8-bit moments are dequantized and
    quantized in the same loop, with the eager quantizer's table (the same codes for the
    same values). Remainder masters (``rounding="remainder"``, ``comps`` giving the int16
    remainders, ``remainder`` the ties) are rebuilt and split in the loop; the few ties
    rounded down are raised one unit in the weight before it (so the loop needs no list)
    and found again after it from one flag byte per element, screened a block at a time.
    ``grad_scales`` multiply the gradients in fp32 (a deferred clip). ``skip`` (a 0-dim fp32 device
    flag, not with remainders): where it is 1 nothing is written (the step counts and the wrapper's call
    count advance all the same: :mod:`mixprec.optim.skipping` puts them back).

    A failure while compiling (an error, or an interrupt: nearly all of a first step's
    time) changes nothing (the step counts are counted after the update, raised ties are
    lowered again); a compilation failure raises :class:`CompileRouteFailed`. An interrupt
    in the milliseconds after the loop ran, while remainders, ties and step counts are
    written, is not undone.
    """
    if skip is not None and rounding == "remainder":
        raise ValueError("a remainder step is not masked on the device: decide it on the host")
    active = [p for p in params if p.grad is not None]
    if not active:
        return
    dtype = torch.float32 if state_dtype is None else state_dtype
    codec = qstates.block_codec(dtype)
    init_adam_state(optimizer, group, active, dtype)
    states = [optimizer.state[p] for p in active]
    for p, state in zip(active, states, strict=True):  # state held in another dtype (wrapped later, loaded)
        qstates.conform(state, p, state_dtype)
    steps = [s["step"] for s in states]
    step = host_float(steps[0]) + 1
    h = rule.adam_hyper(optimizer, group)
    # emulate_precision_casts: keep the bf16/fp16 rounding of the stored weight when the
    # Kahan residual reads it back (inductor otherwise folds to(bf16).float() into a no-op);
    # the 8-bit tables' indices are in range by construction (a code, 16 bits, a block)
    options = {"emulate_precision_casts": True, "assert_indirect_indexing": False}
    device = active[0].device
    hyper = torch.tensor(
        [h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, *rule.bias_corrections(h, step)], dtype=torch.float32,
    ).to(device, non_blocking=True)
    scale = torch.ones(1, dtype=torch.float32, device=device)
    for factor in grad_scales:
        scale = scale * factor.to(device=device, dtype=torch.float32).reshape(1)
    hyper = torch.cat([hyper, scale])
    seed, firsts = 0, [0] * len(active)
    if rounding == "stochastic":
        if noise is None:
            raise ValueError("stochastic rounding needs the call's noise (codecs.Noise)")
        seed, firsts = noise.seed, [noise.firsts[id(p)] for p in active]
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
    scales = [[s[f"{key}{qstates.ABSMAX}"] for s in states] for key in keys] if codec else []
    tables = codec.tables(device) if codec else []
    raised: list[tuple[torch.Tensor, torch.Tensor]] = []  # (weight, ties) raised so far
    flags: list[list[torch.Tensor]] = []
    comp_list: list[torch.Tensor] = []
    if rounding == "kahan" and comps is not None:
        comp_list = [comps(p) for p in active]
    if rounding == "remainder":
        if remainder is None or comps is None:
            raise ValueError("the remainder store needs the wrapper's remainders and ties")
        comp_list, flags = codecs.fused_remainder_inputs([comps(p) for p in active])
    try:
        # (an unusable TORCHINDUCTOR_CACHE_DIR raises here: an OSError naming it, a compilation failure)
        fn = compiled(_adam_lists, dynamic=False, options=options)
        for p in active:  # a tie rounded down joins one unit low: raise its weight first
            if remainder is not None and (t := remainder.ties(p)).numel():
                codecs.shift_ties(p, t, 1)
                raised.append((p, t))
        with recompile_headroom():  # past 8 layouts dynamo would run it uncompiled
            fn(
                active, [p.grad for p in active], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else [],
                comp_list,
                torch.tensor(seed, dtype=torch.int64, device=device), torch.tensor(firsts, dtype=torch.int64, device=device),
                hyper, scales, tables, flags,
                torch.zeros((), device=device) if skip is None else skip.reshape(()),
                decoupled=h.decoupled, amsgrad=h.amsgrad, maximize=h.maximize,
                weight_decay=h.decays, rounding=rounding, form=codec.name if codec else None,
            )
    except BaseException as exc:
        # Nearly always while compiling (seconds, before anything ran; a Ctrl-C lands there
        # too): the step counts are counted only after the update, so nothing is half-counted.
        for p, t in raised:
            codecs.shift_ties(p, t, -1)
        if isinstance(exc, compile_errors()):
            raise CompileRouteFailed(exc) from exc
        raise
    if remainder is not None and rounding == "remainder":
        for p, new in zip(active, codecs.fused_remainder_finish(comp_list, flags), strict=True):
            if new.numel() or remainder.ties(p).numel():
                remainder.set_ties(p, new)
    torch._foreach_add_(steps, 1.0)

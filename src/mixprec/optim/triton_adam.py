"""The GPU route of the low-precision wrappers: Adam/AdamW for a param group in a few Triton launches.

:func:`triton_adam_step` steps a set of bf16/fp16 weights with the arithmetic of
:mod:`mixprec.optim.rule` (torch's Adam/AdamW in torch's order, on fp32 values) and the stored
forms of :mod:`mixprec.optim.codecs` (round to nearest, Kahan compensation, stochastic rounding),
in the kernel of :mod:`mixprec.optim._triton_adam_kernels`. Like torch's fused AdamW
(``multi_tensor_apply``) it launches once per combination of (weight, gradient, compensation)
dtypes, however many tensors there are: each program of a launch takes one block of
:data:`BLOCK` elements of one tensor, found in tables built on the host once per call and sent
to the device in one copy (data pointers, sizes, each tensor's position in the call, its step
size and bias correction, the call's hyperparameters and seed). No launch argument is a Python
number, so a new learning rate, step count or seed never recompiles; a learning rate held in a
device tensor (``group["lr"]``) is read by the kernel, never on the host. The table of which
tensor each program steps depends only on the tensors' sizes and is kept on the device for the
next calls (:data:`CACHED_TABLES` layouts).

What it computes, against the eager fast path (the same wrapper with ``compile=False``):

- The update is the rule's fp32 operations in its order, divisions and square roots correctly
  rounded; compiled for the GPU, Triton may contract ``a + b * c`` into fused multiply-adds (as
  torch's own CUDA kernels do). Within fp32 rounding: a moment within a few fp32 units in the
  last place, a stored bf16/fp16 weight the same or one unit apart (where the fp32 value falls
  next to a rounding boundary: a small fraction of the elements).
- The stores are bit for bit the codecs' on the same fp32 values: round to nearest even (bf16 in
  integer arithmetic on the bits, NaN kept NaN), the Kahan residual in the compensation's dtype,
  and stochastic rounding with the noise every route draws: element ``i`` of a weight gets
  ``hash16((first + i) ^ seed)`` (the call's :class:`~mixprec.optim.codecs.Noise`).

It takes (:func:`takes`) plain contiguous tensors on a CUDA device (on CPU tensors only under
Triton's interpreter, where the tests run it): bf16 weights (fp16 ones for round to nearest and
Kahan), fp32/bf16/fp16 gradients of the weight's shape, fp32, bf16 or 8-bit blockwise moments
(:data:`mixprec.optim.states.Q8`: the codes of the compiled and eager routes for the same fp32
values). fp8 moments stay on the compiled route, remainder masters on the eager one (their tie
lists are not in this kernel).

>>> takes("remainder", None, torch.zeros(4, dtype=torch.bfloat16), None)
False
"""

from __future__ import annotations

import struct
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mixprec.compiling import TRITON_ENV, env_switch
from mixprec.lagged import host_floats
from mixprec.optim import _triton_adam_kernels as kernels
from mixprec.optim import rule
from mixprec.optim import states as qstates
from mixprec.optim.checks import conform_raw, fits_raw, raw_moments
from mixprec.optim.codecs import Noise
from mixprec.optim.fast import init_adam_state

__all__ = [
    "BLOCK", "CACHED_TABLES", "ENV", "NUM_WARPS", "ROUNDINGS", "available", "kernel_works", "takes", "takes_param",
    "triton_adam_step", "use_triton_route",
]

#: elements per program (a power of two; with 8-bit moments at least their 256-element blocks)
BLOCK = 2048
#: warps per program on the GPU
NUM_WARPS = 4
#: the stores the kernel implements
ROUNDINGS = {"nearest": kernels.NEAREST, "kahan": kernels.KAHAN, "stochastic": kernels.STOCHASTIC}
#: how many layouts' program tables stay on the device
CACHED_TABLES = 4
#: ``MIXPREC_TRITON=0`` keeps the low-precision optimizers off this kernel (the compiled and eager routes step)
ENV = TRITON_ENV
_WORKS: dict[torch.device, bool] = {}

_KINDS = {torch.float32: kernels.FP32, torch.bfloat16: kernels.BF16, torch.float16: kernels.FP16}
_STATE_KINDS = {torch.float32: kernels.FP32, torch.bfloat16: kernels.BF16, qstates.Q8: kernels.Q8}
_STATE_DTYPES = tuple(_STATE_KINDS)
_TABLES: OrderedDict[tuple[Any, ...], torch.Tensor] = OrderedDict()
_Q8_TABLES: dict[torch.device, tuple[list[torch.Tensor], torch.Tensor]] = {}


def available(device: torch.device | str | None = None) -> bool:
    """Whether the kernel runs for tensors on ``device`` (default: CUDA): Triton is installed and
    the device is a CUDA GPU, or Triton interprets the kernel (``TRITON_INTERPRET=1`` when it was
    first imported) and the device is the CPU."""
    if kernels.ADAM_KERNEL is None:
        return False
    kind = torch.device("cuda" if device is None else device).type
    if kernels.interpreting():
        return kind == "cpu"
    return kind == "cuda" and torch.cuda.is_available()


def use_triton_route(setting: Any, rounding: str, state_dtype: torch.dtype | None) -> bool:
    """Whether ``compile=setting`` steps an Adam/AdamW group of ``rounding`` and ``state_dtype`` with
    this kernel where its tensors allow (:func:`takes`) and :func:`kernel_works` on their device:
    under ``"auto"``, for the stores it implements with fp32, bf16 or 8-bit moments, unless the environment
    says ``MIXPREC_TRITON=0`` (``compile=True`` keeps ``torch.compile``, ``False`` the eager path)."""
    if setting != "auto" or rounding not in ROUNDINGS:
        return False
    if (torch.float32 if state_dtype is None else state_dtype) not in _STATE_DTYPES:
        return False
    return env_switch(ENV, "never use the Triton optimizer kernel")


def kernel_works(device: torch.device) -> bool:
    """Whether the kernel compiles and steps a probe right on ``device``: two bf16 weights stepped
    once (AdamW with weight decay, fp32 moments, round to nearest) give :mod:`mixprec.optim.rule`'s
    values, each stored weight the same or one unit apart, the moments within fp32 rounding.
    Checked once per process and device; a failure warns once, naming it, and the wrappers step
    on the other routes there."""
    ok = _WORKS.get(device)
    if ok is None:
        try:
            why = _probe(device)
        except Exception as exc:  # a compilation or launch error: the other routes step
            why = f"{type(exc).__name__}: {exc}"
        ok = _WORKS[device] = why is None
        if why is not None:
            warnings.warn(f"the Triton optimizer kernel failed its check on {device} ({why}); the low-precision "
                          f"optimizers step on the compiled or eager routes there ({ENV}=0 skips the check)",
                          RuntimeWarning, stacklevel=3)
    return ok


def _probe(device: torch.device) -> str | None:
    """What is wrong with one step of the kernel on ``device`` (None: nothing)."""
    g = torch.Generator().manual_seed(0)
    shapes = (3000, 700)
    weights = [torch.nn.Parameter(torch.randn(n, generator=g).bfloat16().to(device)) for n in shapes]
    for w in weights:
        w.grad = torch.randn(w.shape, generator=g).bfloat16().to(device)
    expect = []
    opt = torch.optim.AdamW(weights, lr=1e-2, weight_decay=0.1)
    h = rule.adam_hyper(opt, opt.param_groups[0])
    for w in weights:
        zeros = torch.zeros(w.shape, device=device)
        expect.append(rule.adam(rule.FUSED, h, *rule.bias_corrections(h, 1.0), w.detach().float(), w.grad.float(),  # type: ignore[union-attr]
                                zeros, zeros, None))
    triton_adam_step(opt, opt.param_groups[0], weights, state_dtype=None, rounding="nearest")
    for w, (w32, m, v, _) in zip(weights, expect, strict=True):
        apart = (w.detach().float() - w32.to(torch.bfloat16).float()).abs()
        unit = w32.abs().clamp_min(1e-30) * 2.0**-7  # a bf16 unit, at most
        if not bool((apart <= unit).all()):
            return f"a weight {float((apart / unit).max()):.1f} bf16 units off"
        for key, want in (("exp_avg", m), ("exp_avg_sq", v)):
            if not torch.allclose(opt.state[w][key], want, rtol=1e-5, atol=0.0):
                return f"{key} off by {float((opt.state[w][key] - want).abs().max()):.3g}"
    return None


def _plain(t: torch.Tensor | None, device: torch.device) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.device == device and t.is_contiguous()  # type: ignore[union-attr]


def takes_param(rounding: str, state_dtype: torch.dtype | None, param: torch.Tensor) -> bool:
    """Whether the weight ``param`` itself can step here (:func:`takes` without its gradient and
    compensation, for a prediction that does not look at them): a plain contiguous tensor where
    :func:`available`, bf16 (or fp16, for round to nearest and Kahan), ``state_dtype`` fp32 (None),
    bf16 or 8-bit and ``rounding`` one of :data:`ROUNDINGS`."""
    if rounding not in ROUNDINGS or (torch.float32 if state_dtype is None else state_dtype) not in _STATE_DTYPES:
        return False
    if not _plain(param, param.device) or not available(param.device):
        return False
    return param.dtype == torch.bfloat16 or (param.dtype == torch.float16 and rounding != "stochastic")


def takes(rounding: str, state_dtype: torch.dtype | None, param: torch.Tensor, comp: torch.Tensor | None) -> bool:
    """Whether ``param``, with its gradient and (Kahan) compensation ``comp``, can step here: a plain
    contiguous tensor where :func:`available`, bf16 (or fp16, for round to nearest and Kahan), its
    gradient plain, contiguous, of its shape and device, fp32/bf16/fp16, the compensation likewise
    (bf16, fp16 or fp32); ``state_dtype`` fp32 (None), bf16 or 8-bit (fp8 moments stay on the compiled
    route) and ``rounding`` one of :data:`ROUNDINGS` (remainder masters stay on the eager one)."""
    if not takes_param(rounding, state_dtype, param) or not _readable(rounding, param):
        return False
    if rounding == "kahan":
        return comp is not None and _plain(comp, param.device) and comp.shape == param.shape and comp.dtype in _KINDS
    return True


def _readable(rounding: str, param: torch.Tensor) -> bool:
    """Whether the kernel reads ``param`` and its gradient rightly through raw pointers: both plain,
    contiguous, on one device and of one shape; the weight bf16 (fp16 but for stochastic rounding),
    the gradient fp32/bf16/fp16."""
    grad = param.grad
    return (_plain(param, param.device) and (param.dtype == torch.bfloat16 or (
        param.dtype == torch.float16 and rounding != "stochastic"))
        and grad is not None and _plain(grad, param.device) and grad.shape == param.shape and grad.dtype in _KINDS)


def _check(rounding: str, param: torch.Tensor) -> None:
    """Refuse, before anything is written, a weight or gradient the kernel would read wrongly
    (:func:`takes` admits none: a caller's bug)."""
    if not _readable(rounding, param):
        raise ValueError(f"a {param.dtype} {tuple(param.shape)} weight (or its gradient) is not one the Triton "
                         "optimizer kernel takes (see takes())")


def _words(values: Sequence[float]) -> list[int]:
    """fp64 ``values`` as the int64 words holding their bits (the kernel reads them as fp64)."""
    return list(struct.unpack(f"<{len(values)}q", struct.pack(f"<{len(values)}d", *values)))


def _blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def _program_tables(device: torch.device, sizes: tuple[tuple[int, ...], ...], block: int) -> torch.Tensor:
    """Each launch's program -> tensor table (int32, the launches' one after the other), for
    launches over tensors of ``sizes``; kept on the device for the next calls of the same sizes."""
    key = (device, block, sizes)
    table = _TABLES.get(key)
    if table is not None:
        _TABLES.move_to_end(key)
        return table
    parts = [torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32),
                                     torch.tensor([_blocks(n, block) for n in numels], dtype=torch.int64))
             for numels in sizes]
    table = _to_device(torch.cat(parts), device)
    _TABLES[key] = table
    while len(_TABLES) > CACHED_TABLES:
        _TABLES.popitem(last=False)
    return table


def _q8_tables(device: torch.device) -> torch.Tensor:
    """The data pointers (int64, on ``device``) of the 8-bit tables the kernel reads
    (:func:`mixprec.optim.states.q8_tables`), made once per device and kept with the tables."""
    held = _Q8_TABLES.get(device)
    if held is None:
        tables = [t.contiguous() for t in qstates.q8_tables(device)]
        held = _Q8_TABLES[device] = (tables, _to_device(torch.tensor([t.data_ptr() for t in tables]), device))
    return held[1]


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One host-to-device copy, from pinned memory without waiting where the device is a GPU."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _launch(kernel: Any, grid: tuple[int], *args: torch.Tensor, **meta: Any) -> None:
    """One launch of the kernel (the tests count them here)."""
    kernel[grid](*args, **meta)


def _lr_on_device(lr: Any) -> bool:
    """Whether the learning rate is a tensor the kernel reads on the device (never on the host)."""
    return isinstance(lr, torch.Tensor) and lr.device.type != "cpu"


def _device_scalar(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    return value.detach().to(device=device, dtype=torch.float32).reshape(())


def triton_adam_step(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    params: Sequence[torch.Tensor],
    *,
    state_dtype: torch.dtype | None,
    rounding: str,
    comps: Callable[[torch.Tensor], torch.Tensor] | None = None,
    noise: Noise | None = None,
    grad_scales: Sequence[torch.Tensor] = (),
    skip: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Adam/AdamW for the low-precision ``params`` of ``group`` in one Triton launch per dtype
    combination (each weight with its own step count); every one must pass :func:`takes`.
    Returns the ones it left for another route: those whose moments are held otherwise (another
    floating dtype than ``state_dtype`` after :func:`mixprec.optim.states.conform`, another size or
    device) and those on another device than the first. State is made lazily as torch's Adam makes
    it (:func:`~mixprec.optim.fast.init_adam_state`); the step counts advance by one after the
    launches. Stochastic rounding draws the call's ``noise`` (:class:`~mixprec.optim.codecs.Noise`:
    element ``i`` of a weight gets ``hash16((noise.firsts[id(weight)] + i) ^ noise.seed)``). ``grad_scales multiply the gradients in fp32,
    one after the other (deferred clips). ``skip`` (a 0-dim fp32 device flag): where it is 1 the
    kernel writes nothing (the step counts and the wrapper's call count advance all the same:
    :mod:`mixprec.optim.skipping` puts them back)."""
    kernel = kernels.ADAM_KERNEL
    if kernel is None:
        raise RuntimeError("the Triton optimizer kernel needs Triton (the 'triton' extra)")
    if rounding not in ROUNDINGS:
        raise ValueError(f"the Triton optimizer kernel stores {sorted(ROUNDINGS)}, not {rounding!r}")
    dtype = torch.float32 if state_dtype is None else state_dtype
    if dtype not in _STATE_DTYPES:
        raise ValueError(f"the Triton optimizer kernel keeps fp32, bf16 or 8-bit moments, not {dtype} (fp8: the compiled route)")
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
    block = BLOCK if dtype != qstates.Q8 else -(-BLOCK // qstates.BLOCK) * qstates.BLOCK
    with_grads = [p for p in params if p.grad is not None]
    for p in with_grads:
        if p.device == with_grads[0].device:  # (the others are left for another route)
            _check(rounding, p)
    init_adam_state(optimizer, group, with_grads, dtype)
    active: list[torch.Tensor] = []
    left: list[torch.Tensor] = []
    for p in with_grads:
        state = optimizer.state[p]
        same_device = p.device == with_grads[0].device
        if same_device and (fits_raw(state, keys, dtype, p) or conform_raw(state, p, state_dtype, keys)):
            active.append(p)
        else:
            left.append(p)
    if not active:
        return left
    device = active[0].device
    states = [optimizer.state[p] for p in active]
    seed, firsts = 0, [0] * len(active)
    if rounding == "stochastic":
        if noise is None:
            raise ValueError("stochastic rounding needs the call's noise (codecs.Noise)")
        seed, firsts = noise.seed, [noise.firsts[id(p)] for p in active]
    comp_list: list[torch.Tensor | None] = [None] * len(active)
    if rounding == "kahan":
        if comps is None:
            raise ValueError("the Kahan store needs the wrapper's compensations")
        comp_list = [comps(p) for p in active]
        for p, c in zip(active, comp_list, strict=True):  # (raw pointers: a wrong one would not fail cleanly)
            if c is None or not _plain(c, device) or c.numel() != p.numel() or c.dtype not in _KINDS:
                raise ValueError(f"the compensation of a {tuple(p.shape)} weight is not one the kernel takes (see takes())")

    lr = group["lr"]
    lr_on_device = _lr_on_device(lr)
    h = rule.adam_hyper(optimizer, {**group, "lr": 1.0} if lr_on_device else group)  # lr: the kernel reads it
    decay = (1 - h.lr * h.weight_decay) if h.decoupled else h.weight_decay
    words = [seed, *_words([1 - h.beta1, h.beta2, 1 - h.beta2, h.eps, decay, h.weight_decay, 0.0])]
    assert len(words) == len(kernels.HEADER)

    launches: dict[tuple[Any, ...], list[int]] = {}  # one per dtype combination
    for i, p in enumerate(active):
        c = comp_list[i]
        launches.setdefault((p.dtype, p.grad.dtype, None if c is None else c.dtype), []).append(i)  # type: ignore[union-attr]
    sections: list[tuple[tuple[Any, ...], int, list[int], bool]] = []  # (dtypes, offset in words, ids, aligned)
    written: list[torch.Tensor] = []
    for kinds, ids in launches.items():
        rows: dict[str, list[int]] = {name: [] for name in kernels.ROWS[:9] + kernels.ROWS[11:]}
        corrections: list[float] = []
        first_block = 0
        corrected: dict[float, tuple[float, float]] = {}  # the step counts' bias corrections (most weights share one)
        scale_keys = [key for key, _, _ in raw_moments(keys, dtype, 1)[len(keys):]]  # block codes: their scales too
        for i, count in zip(ids, host_floats([states[i]["step"] for i in ids]), strict=True):
            p, state, c = active[i], states[i], comp_list[i]
            moments = [state[k] for k in keys] + [None] * (3 - len(keys))
            tensors = [p, p.grad, *moments, c]
            for name, t in zip(kernels.ROWS[:6], tensors, strict=True):
                rows[name].append(0 if t is None else t.data_ptr())
            for name, key in zip(kernels.ROWS[11:], keys, strict=False):  # 8-bit: the block scales
                rows[name].append(state[f"{key}{qstates.ABSMAX}"].data_ptr() if dtype == qstates.Q8 else 0)
            for name in kernels.ROWS[11 + len(keys):]:
                rows[name].append(0)
            rows["numel"].append(p.numel())
            rows["first"].append(firsts[i])
            rows["first_block"].append(first_block)
            first_block += _blocks(p.numel(), block)
            pair = corrected.get(count)
            if pair is None:
                pair = corrected[count] = rule.bias_corrections(h, count + 1)  # each weight its own count
            corrections += pair
            written += [t for t in (p, c, *moments) if t is not None]
            written += [state[key] for key in scale_keys]
        aligned = all(a % 16 == 0 for name in kernels.ROWS[:6] for a in rows[name])
        sections.append((kinds, len(words), ids, aligned))
        words.append(len(ids))
        for name in kernels.ROWS[:9]:
            words += rows[name]
        words += _words(corrections[0::2]) + _words(corrections[1::2])  # step_size, bc2_sqrt rows
        for name in kernels.ROWS[11:]:
            words += rows[name]
        words += [0] * (len(words) % 2)  # each launch's table 16-byte aligned

    meta = _to_device(torch.tensor(words, dtype=torch.int64), device)  # the call's one copy
    programs = _program_tables(device, tuple(tuple(active[i].numel() for i in ids) for _, _, ids, _ in sections), block)
    factors = [f.detach().to(device=device, dtype=torch.float32).reshape(1) for f in grad_scales]
    gscale = meta if not factors else factors[0] if len(factors) == 1 else torch.cat(factors)
    flag = meta if skip is None else _device_scalar(skip, device)
    lr_t = _device_scalar(lr, device) if lr_on_device else meta
    q8t = _q8_tables(device) if dtype == qstates.Q8 else meta
    wd_mode = kernels.NO_DECAY if not h.decays else kernels.DECOUPLED if h.decoupled else kernels.L2_DECAY
    at = 0
    for (w_dtype, g_dtype, c_dtype), offset, ids, aligned in sections:
        n = sum(_blocks(active[i].numel(), block) for i in ids)
        if n:
            _launch(
                kernel, (n,), meta, meta[offset:], programs[at : at + n], flag, gscale, lr_t, q8t,
                W_KIND=_KINDS[w_dtype], G_KIND=_KINDS[g_dtype], C_KIND=_KINDS.get(c_dtype, kernels.FP32),
                S_KIND=_STATE_KINDS[dtype], ROUNDING=ROUNDINGS[rounding], AMSGRAD=h.amsgrad, MAXIMIZE=h.maximize,
                WD_MODE=wd_mode, N_GSCALES=len(factors), HAS_SKIP=skip is not None, LR_ON_DEVICE=lr_on_device,
                ALIGNED=aligned, BLOCK=block, num_warps=NUM_WARPS,
            )
        at += n
    torch.autograd.graph.increment_version(written)  # written through raw pointers: autograd and undo copies see it
    torch._foreach_add_([s["step"] for s in states], 1.0)
    return left

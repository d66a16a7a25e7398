"""The native CPU route of the low-precision wrappers: Adam/AdamW in one C loop per weight.

On the CPU, ``torch.compile`` cannot make the 8-bit moments' table lookups or the remainder
master's bit casts fast (inductor runs them element by element), so those steps come from
:file:`native_adam.c`, the one sanctioned C mirror of :mod:`mixprec.optim.rule` (built and
loaded by :mod:`mixprec.optim.native_build`, called through ``ctypes``). Each weight is stepped 256
elements (one 8-bit block) at a time: the master
(bf16 weight + remainder or + Kahan compensation), the gradient and the moments (fp32, bf16,
fp16 or 8-bit) are expanded into fp32 arrays on the stack, updated with torch's Adam/AdamW
arithmetic (the operations of torch's foreach kernels in their order, with the fused
multiply-adds its x86-64 CPU build makes of ``lerp`` and ``addcmul``, and no others) and stored
back, so nothing is materialised in fp32 and no compilation is needed per layout.

What it computes, against the eager fast path:

- 8-bit moments are dequantized and quantized with the eager quantizer's map, lookup table and
  decision points: the same codes for the same fp32 values.
- Remainder masters are rebuilt and split exactly (the ties rounded down included); the
  weight is torch's round-to-nearest-even cast of the new master.
- Stochastic rounding draws the call's noise (:class:`~mixprec.optim.codecs.Noise`, as every
  route does): the routes give the same weights up to the fp32 rounding of the update.
- The update gives torch's foreach Adam's bits on the same fp32 values (tested against torch
  2.13's x86-64 CPU build), except in the last ``numel % 16`` elements of each tensor torch's
  vector loop steps, which it computes without fused multiply-adds: there within fp32 rounding.
  Another build of torch (another compiler, another architecture) may contract differently:
  within fp32 rounding too.

It runs where the arguments are plain contiguous CPU tensors; anything else steps on the other
routes. ``MIXPREC_NATIVE=0`` turns it off; without a working C compiler it is off by itself
(:func:`status` says why). It is taken by ``compile="auto"`` for the steps the eager path
makes several passes for (see :func:`use_native_route`); ``compile=True`` keeps ``torch.compile``
and ``compile=False`` the eager path.

>>> import torch
>>> status()[0] in (True, False)
True
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.lagged import host_floats
from mixprec.optim import rule
from mixprec.optim import states as qstates
from mixprec.optim.checks import conform_raw, fits_raw
from mixprec.optim.codecs import Noise, compact_q8_tables
from mixprec.optim.compiled import CompileSetting, RemainderIO
from mixprec.optim.fast import init_adam_state
from mixprec.optim.native_build import ENV, FLAGS_ENV, Args, has_f16, library, status

__all__ = ["ENV", "FLAGS_ENV", "status", "use_native_route"]

_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, qstates.Q8: 3}
_ROUNDINGS = {"nearest": 0, "kahan": 1, "stochastic": 2, "remainder": 3}
#: a weight of more elements is cut into ranges stepped on several threads (torch's thread count)
PARALLEL_NUMEL = 1 << 16


def use_native_route(
    setting: CompileSetting, rounding: str, state_dtype: torch.dtype | None, *, build: bool = True
) -> bool:
    """Whether ``compile=setting`` steps an Adam/AdamW group of ``rounding`` and ``state_dtype``
    natively, where its tensors allow (:func:`takes`): under ``"auto"``, for 8-bit moments of
    every store and for remainder masters with bf16/fp16 moments (with fp32 moments the
    remainder plan keeps torch's fused kernel, bit for bit ``bf16-master``), when the
    kernel is available. Kahan and stochastic rounding with float moments keep the compiled
    route, which is fast there already."""
    if setting != "auto" or rounding not in _ROUNDINGS:
        return False
    if state_dtype != qstates.Q8 and not (rounding == "remainder" and state_dtype in (torch.bfloat16, torch.float16)):
        return False
    return status(build)[0] and (state_dtype != torch.float16 or has_f16())


def _plain(t: torch.Tensor | None) -> bool:
    return t is not None and type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.is_contiguous()


def takes_param(rounding: str, param: torch.Tensor) -> bool:
    """Whether the weight ``param`` itself can step natively: a plain contiguous CPU tensor, bf16
    (or fp16, for the round-to-nearest and Kahan stores)."""
    if not _plain(param) or param.dtype not in (torch.bfloat16, torch.float16):
        return False
    return param.dtype == torch.bfloat16 or (rounding in ("nearest", "kahan") and has_f16())


def takes(rounding: str, param: torch.Tensor, comp: torch.Tensor | None) -> bool:
    """Whether ``param``, with its gradient and its compensation or remainder ``comp``, can step
    natively (:func:`takes_param`, and the others plain contiguous CPU tensors of its shape)."""
    grad = param.grad
    if not takes_param(rounding, param) or grad is None or not _plain(grad) or grad.shape != param.shape:
        return False
    if grad.dtype not in (torch.float32, torch.bfloat16) and not (grad.dtype == torch.float16 and has_f16()):
        return False
    if rounding in ("kahan", "remainder"):
        kinds = (torch.int16,) if rounding == "remainder" else (torch.bfloat16, torch.float32) + ((torch.float16,) if has_f16() else ())
        return _plain(comp) and comp.shape == param.shape and comp.dtype in kinds  # type: ignore[union-attr]
    return True


@dataclass
class _Job:
    param: torch.Tensor
    args: Args
    keep: tuple[Any, ...]  # tensors the pointers point into, alive until the call returns


_pool: tuple[ThreadPoolExecutor, int, int] | None = None  # (executor, threads, the process it was made in)
_lock = threading.Lock()


def _after_fork() -> None:
    """A forked child has the parent's lock as it was and none of its threads."""
    global _lock, _pool
    _lock = threading.Lock()
    _pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _executor(threads: int) -> ThreadPoolExecutor:
    """The worker threads (a forked child makes its own: the parent's threads are not in it)."""
    global _pool
    with _lock:
        if _pool is None or _pool[1:] != (threads, os.getpid()):
            if _pool is not None and _pool[2] == os.getpid():
                _pool[0].shutdown(wait=True)
            _pool = (ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mixprec-native"), threads, os.getpid())
        return _pool[0]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def native_adam_step(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    params: Sequence[torch.Tensor],
    *,
    state_dtype: torch.dtype | None,
    rounding: str,
    comps: Callable[[torch.Tensor], torch.Tensor] | None = None,
    noise: Noise | None = None,
    grad_scales: Sequence[torch.Tensor] = (),
    remainder: RemainderIO | None = None,
    skip: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Adam/AdamW for the low-precision ``params`` of ``group`` natively (each with its own
    step count); every one must pass :func:`takes`. Returns the ones it left for another route:
    those whose moments are held in another floating dtype than ``state_dtype`` (wrapped after
    the inner optimizer stepped, say: the eager path reads and keeps them as they are).
    Stochastic rounding draws the call's ``noise``. The kernels run on worker threads (torch's thread count; a weight of more than
    :data:`PARALLEL_NUMEL` elements in ranges) and the call's weights are counted only once
    all of them have finished: an interrupt arriving meanwhile waits for them and is raised
    after the bookkeeping (the groups after this one are then not stepped). ``skip`` (a 0-dim fp32
    flag, not with remainders): where it is 1 the kernel writes nothing (the step counts and the
    wrapper's call count advance all the same: :mod:`mixprec.optim.skipping` puts them back)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the native optimizer kernel is not available: {status()[1]}")
    dtype = torch.float32 if state_dtype is None else state_dtype
    q8 = dtype == qstates.Q8
    amsgrad = bool(group["amsgrad"])
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    with_grads = [p for p in params if p.grad is not None]
    init_adam_state(optimizer, group, with_grads, dtype)
    active: list[torch.Tensor] = []
    left: list[torch.Tensor] = []
    for p in with_grads:
        state = optimizer.state[p]  # held otherwise (loaded, wrapped later): conformed, or left
        if fits_raw(state, keys, dtype, p) or conform_raw(state, p, state_dtype, keys, refuse="native"):
            active.append(p)
        else:
            left.append(p)
    if not active:
        return left
    states = [optimizer.state[p] for p in active]
    h = rule.adam_hyper(optimizer, group)
    if skip is not None and rounding == "remainder":
        raise ValueError("a remainder step is not masked on the device: decide it on the host")
    flag = None if skip is None else skip.detach().to(device="cpu", dtype=torch.float32).reshape(1).contiguous()
    factors = torch.cat([f.detach().to(device="cpu", dtype=torch.float32).reshape(1) for f in grad_scales]) if grad_scales else None
    seed = 0
    if rounding == "stochastic":
        if noise is None:
            raise ValueError("stochastic rounding needs the call's noise (codecs.Noise)")
        seed = noise.seed
    tables = [t.data_ptr() for t in compact_q8_tables(int(lib.mp_compact_e0()))] if q8 else [None] * 8
    threads = max(1, torch.get_num_threads())
    shared = dict(
        smap=tables[0], slookup=tables[1], spoints=tables[2], umap=tables[3], ulookup=tables[4], upoints=tables[5],
        scompact=tables[6], ucompact=tables[7], seed=seed, s_kind=_KINDS[dtype], rounding=_ROUNDINGS[rounding],
        wd_mode=0 if not h.decays else (2 if h.decoupled else 1), amsgrad=int(h.amsgrad),
        maximize=int(h.maximize), lerp_weight=1 - h.beta1, beta2=h.beta2, one_minus_beta2=1 - h.beta2, eps=h.eps,
        decay=(1 - h.lr * h.weight_decay) if h.decoupled else h.weight_decay,
        gscales=_ptr(factors), n_gscales=0 if factors is None else factors.numel(), skip=_ptr(flag),
    )
    jobs: list[_Job] = []
    written: list[torch.Tensor] = []
    corrected: dict[float, tuple[float, float]] = {}  # the step counts' bias corrections (most weights share one)
    for p, state, count in zip(active, states, host_floats([s["step"] for s in states]), strict=True):
        pair = corrected.get(count)
        if pair is None:
            pair = corrected[count] = rule.bias_corrections(h, count + 1)  # each weight its own count
        step_size, bc2_sqrt = pair
        grad = p.grad
        assert grad is not None
        comp = comps(p) if comps is not None and rounding in ("kahan", "remainder") else None
        ties = None
        if remainder is not None and rounding == "remainder":
            # flat, int64 and sorted: the kernel walks them in order (and touches no element outside)
            ties = remainder.ties(p).reshape(-1).to(device="cpu", dtype=torch.int64)
            ties = ties.sort().values if ties.numel() > 1 else ties.contiguous()
        moments = [state[k] for k in keys] + [None] * (3 - len(keys))
        scales = [state[f"{k}{qstates.ABSMAX}"] for k in keys] if q8 else []
        scales += [None] * (3 - len(scales))
        own = dict(
            w=p.data_ptr(), g=grad.data_ptr(), m=_ptr(moments[0]), v=_ptr(moments[1]), vmax=_ptr(moments[2]),
            m_scale=_ptr(scales[0]), v_scale=_ptr(scales[1]), vmax_scale=_ptr(scales[2]), comp=_ptr(comp),
            ties=_ptr(ties), n_ties=0 if ties is None else ties.numel(),
            offset=noise.firsts[id(p)] if noise is not None else 0,
            w_kind=_KINDS[p.dtype], g_kind=_KINDS[grad.dtype],
            comp_kind=_KINDS.get(comp.dtype, 0) if comp is not None else 0,  # (an int16 remainder: unread)
            step_size=step_size, bc2_sqrt=bc2_sqrt,
        )
        keep = (p, grad, comp, ties, factors, flag, *moments, *scales)
        written += [t for t in (p, comp, *moments, *scales) if t is not None]
        n = p.numel()
        pieces = max(1, min(threads, -(-n // PARALLEL_NUMEL)))
        bound = max(qstates.BLOCK, -(-n // pieces // qstates.BLOCK) * qstates.BLOCK)  # ranges of whole 8-bit blocks
        for begin in range(0, n, bound):  # (none for an empty weight: only counted)
            jobs.append(_Job(p, Args(begin=begin, end=min(n, begin + bound), **shared, **own), keep))
    results, interrupt = _run(lib, jobs, threads)
    torch.autograd.graph.increment_version(written)  # written in place: autograd and the undo copies see it
    failed = any(r is None for r in results)
    if remainder is not None and rounding == "remainder":
        found: dict[int, list[torch.Tensor]] = {id(p): [] for p in active}
        for job, ties_found in zip(jobs, results, strict=True):
            if ties_found is not None:
                found[id(job.param)].append(ties_found)
        for p in active:
            parts = found[id(p)]
            new = torch.cat(parts) if len(parts) > 1 else parts[0] if parts else torch.empty(0, dtype=torch.int64)
            if new.numel() or remainder.ties(p).numel():
                remainder.set_ties(p, new)
    torch._foreach_add_([s["step"] for s in states], 1.0)
    if failed:  # pragma: no cover - a few bytes for a tie list could not be allocated
        raise MemoryError("the native optimizer kernel could not allocate a list of remainder ties; "
                          "the step was taken, but those weights' ties are lost (their masters are off by 2**-8 ulp)")
    if interrupt is not None:
        raise interrupt
    return left


def _call(lib: ctypes.CDLL, job: _Job) -> torch.Tensor | None:
    """The job's new ties (an empty tensor for other stores), or None when the kernel could not
    allocate their list (it still took the step)."""
    out = ctypes.c_void_p()
    n = lib.mp_adam(ctypes.byref(job.args), ctypes.byref(out))
    if n == -2:  # pragma: no cover - takes() admits only what the kernel takes
        raise RuntimeError(f"the native optimizer kernel refused a {job.param.dtype} weight's tensors (a mixprec bug)")
    if n <= 0:
        return None if n < 0 else torch.empty(0, dtype=torch.int64)
    try:
        return torch.frombuffer((ctypes.c_int64 * n).from_address(out.value or 0), dtype=torch.int64).clone()
    finally:
        lib.mp_free(out)


def _run(lib: ctypes.CDLL, jobs: list[_Job], threads: int) -> tuple[list[torch.Tensor | None], BaseException | None]:
    """(every job's result, an interrupt that arrived meanwhile): the jobs run on the worker
    threads, in ``threads`` lists of about equal elements, and an interrupt waits for them
    all, for the caller to finish the step's bookkeeping before raising it. Where no thread
    can be started (the interpreter is shutting down) they run here."""
    lists: list[list[int]] = [[] for _ in range(min(threads, len(jobs)))]
    load = [0] * len(lists)
    for i in sorted(range(len(jobs)), key=lambda i: jobs[i].args.begin - jobs[i].args.end):  # largest first
        k = load.index(min(load))
        lists[k].append(i)
        load[k] += jobs[i].args.end - jobs[i].args.begin

    def run(ids: list[int]) -> list[torch.Tensor | None]:
        return [_call(lib, jobs[i]) for i in ids]

    results: list[torch.Tensor | None] = [None] * len(jobs)
    pool = _executor(threads)
    futures = []
    for ids in lists:
        try:
            futures.append((ids, pool.submit(run, ids)))
        except RuntimeError:  # "cannot schedule new futures after interpreter shutdown": here, then
            for i, found in zip(ids, run(ids), strict=True):
                results[i] = found
    interrupt: BaseException | None = None
    while True:
        try:
            wait([f for _, f in futures])
            break
        except BaseException as exc:  # KeyboardInterrupt: the kernels are writing, let them finish
            interrupt = exc
    for ids, future in futures:
        for i, found in zip(ids, future.result(), strict=True):
            results[i] = found
    return results, interrupt

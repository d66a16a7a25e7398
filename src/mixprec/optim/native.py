"""The native CPU route of the low-precision wrappers: Adam/AdamW in one C loop per weight.

On the CPU, ``torch.compile`` cannot make the 8-bit moments' table lookups or the remainder
master's bit casts fast (inductor runs them element by element), so those steps come from
:file:`native_adam.c`: built once per machine with the system's C compiler (``cc -O3
-march=native``, about a second, cached under ``$XDG_CACHE_HOME/mixprec/native``; where that
folder is unusable, in ``mixprec-native-<uid>`` in the temporary directory, a folder only its
user can write to; where even that one is not, in a folder of the process's own, removed
once the kernel is loaded) and called through ``ctypes``. Each weight is stepped 256
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
- Stochastic rounding uses the compiled route's noise (a hash of each element's position and
  the wrapper's checkpointed call count): the two routes give the same weights up to the
  fp32 rounding of the update.
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
import hashlib
import math
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from mixprec.compiling import NATIVE_ENV, env_switch
from mixprec.optim import states as qstates
from mixprec.optim.checks import check_moment_layout
from mixprec.optim.compiled import CompileSetting, RemainderIO, q8_tables, seed32
from mixprec.optim.fast import init_adam_state, scalar_value

__all__ = ["ENV", "FLAGS_ENV", "status", "use_native_route"]

#: set to "0" to turn the native route off
ENV = NATIVE_ENV
#: the target flags the kernel is built with (default ``-march=native``: this machine's
#: instructions; ``-march=x86-64-v3`` builds its AVX2 loops, ``-march=x86-64`` its plain C ones)
FLAGS_ENV = "MIXPREC_NATIVE_TARGET"
_ABI = 6
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, qstates.Q8: 3}
_ROUNDINGS = {"nearest": 0, "kahan": 1, "stochastic": 2, "remainder": 3}
#: a weight of more elements is cut into ranges stepped on several threads (torch's thread count)
PARALLEL_NUMEL = 1 << 16


class _Args(ctypes.Structure):
    """native_adam.c's ``mp_args``, field for field."""

    _fields_ = [
        ("begin", ctypes.c_int64), ("end", ctypes.c_int64),
        ("w", ctypes.c_void_p), ("g", ctypes.c_void_p),
        ("m", ctypes.c_void_p), ("v", ctypes.c_void_p), ("vmax", ctypes.c_void_p),
        ("m_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p), ("vmax_scale", ctypes.c_void_p),
        ("comp", ctypes.c_void_p),
        ("ties", ctypes.c_void_p), ("n_ties", ctypes.c_int64),
        ("smap", ctypes.c_void_p), ("umap", ctypes.c_void_p),
        ("slookup", ctypes.c_void_p), ("ulookup", ctypes.c_void_p),
        ("spoints", ctypes.c_void_p), ("upoints", ctypes.c_void_p),
        ("scompact", ctypes.c_void_p), ("ucompact", ctypes.c_void_p),
        ("seed", ctypes.c_int64), ("offset", ctypes.c_int64),
        ("w_kind", ctypes.c_int32), ("g_kind", ctypes.c_int32), ("s_kind", ctypes.c_int32), ("comp_kind", ctypes.c_int32),
        ("rounding", ctypes.c_int32), ("wd_mode", ctypes.c_int32), ("amsgrad", ctypes.c_int32), ("maximize", ctypes.c_int32),
        ("lerp_weight", ctypes.c_float), ("beta2", ctypes.c_float), ("one_minus_beta2", ctypes.c_float),
        ("eps", ctypes.c_float), ("decay", ctypes.c_float), ("step_size", ctypes.c_float),
        ("bc2_sqrt", ctypes.c_float),
        ("gscales", ctypes.c_void_p), ("n_gscales", ctypes.c_int64),
    ]


_lock = threading.Lock()
_state: dict[str, Any] = {}


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mixprec" / "native"


#: the per-user folder in the temporary directory the kernel is cached in where the user's cache
#: folder is unusable: ``mixprec-native-<uid>``
TEMP_PREFIX = "mixprec-native-"


def _temp_cache_dir() -> Path | None:
    """The per-user cache folder in the temporary directory (None without user ids: Windows)."""
    if not hasattr(os, "getuid"):
        return None
    return Path(tempfile.gettempdir()) / f"{TEMP_PREFIX}{os.getuid()}"


def _private_dir(path: Path, *, shared_parent: bool = False) -> Path | None:
    """``path``, created if missing, when it is this user's and nobody else can write into it (a
    library loaded from a directory others can write to would run their code); else None.
    ``shared_parent``: ``path`` lies in a folder others write to (the temporary directory),
    where it must be a folder itself, not a link another user could point elsewhere."""
    try:
        path.mkdir(parents=not shared_parent, exist_ok=True, mode=0o700)
        st = path.lstat() if shared_parent else path.stat()
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        return None
    return path if os.access(path, os.W_OK | os.X_OK) else None


def _build_dir() -> tuple[Path, bool]:
    """(where the kernel is built and cached, whether that folder is this process's own, to be
    removed once the kernel is loaded): the user's cache folder (``$XDG_CACHE_HOME/mixprec/native``),
    else the per-user one in the temporary directory (reused by the user's later processes),
    else, where neither is usable (another user's folder of that name, say), a fresh one."""
    where = _private_dir(_cache_dir())
    if where is not None:
        return where, False
    temp = _temp_cache_dir()
    where = None if temp is None else _private_dir(temp, shared_parent=True)
    if where is not None:
        return where, False
    return Path(tempfile.mkdtemp(prefix=TEMP_PREFIX)), True


def _own_file(path: Path) -> bool:
    """Whether ``path`` exists, is this user's and is writable by nobody else."""
    try:
        st = path.stat()
    except OSError:
        return False
    return not hasattr(os, "getuid") or (st.st_uid == os.getuid() and not st.st_mode & 0o022)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _turned_off() -> str:
    """Why the route may not be built here ("" when it may): the switch, or the platform."""
    if not env_switch(ENV, "never build or use the native optimizer kernel"):
        return f"turned off by {ENV}={os.environ[ENV]}"
    if platform.system() == "Windows":
        return "not built on Windows (no C compiler is assumed there)"
    return ""


def _compiler() -> list[str]:
    """The C compiler command: ``$CC`` (with its arguments), else cc, gcc or clang on PATH; [] if none."""
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return shlex.split(os.environ.get("CC", "")) or ([found] if found else [])


def _build() -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why not)."""
    if why := _turned_off():
        return None, why
    cc = _compiler()
    if not cc:
        return None, "no C compiler (cc, gcc or clang) on PATH"
    source = resources.files("mixprec.optim").joinpath("native_adam.c").read_bytes()
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{' '.join(cc)} --version failed: {exc}"
    target_flags = os.environ.get(FLAGS_ENV, "-march=native").split()
    key = hashlib.sha256(
        source + version + _cpu_flags().encode() + platform.machine().encode() + " ".join(target_flags).encode()
    ).hexdigest()[:20]
    try:
        where, own = _build_dir()
    except OSError as exc:  # not even a folder of its own in the temporary directory
        return None, f"no folder to build the kernel in: {exc}"
    try:
        return _build_in(where, cc, source, target_flags, key)
    finally:
        if own:  # loaded (a loaded library may be unlinked) or failed: nothing is left behind
            shutil.rmtree(where, ignore_errors=True)


def _build_in(where: Path, cc: list[str], source: bytes, target_flags: list[str], key: str) -> tuple[ctypes.CDLL | None, str]:
    """The library built in (or found in) the private folder ``where``, loaded."""
    target = where / f"native_adam_{key}.so"
    if not _own_file(target):
        try:
            with tempfile.TemporaryDirectory(dir=where) as tmp:
                src = Path(tmp) / "native_adam.c"
                src.write_bytes(source)
                built = Path(tmp) / target.name
                cmd = [*cc, "-O3", *target_flags, "-ffp-contract=off", "-fno-math-errno", "-fno-strict-aliasing",
                       "-fPIC", "-shared", "-o", str(built), str(src)]
                run = subprocess.run(cmd, capture_output=True, timeout=300, check=False)
                if run.returncode != 0:
                    return None, f"{' '.join(cmd[:2])} ... failed: {run.stderr.decode(errors='replace')[-400:]}"
                os.chmod(built, 0o755)
                os.replace(built, target)  # atomic: a concurrent build of the same source gives the same file
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"building {target.name} failed: {exc}"
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        return None, f"loading {target} failed: {exc}"
    lib.mp_abi_version.restype = ctypes.c_int
    if lib.mp_abi_version() != _ABI:
        return None, f"{target} has ABI {lib.mp_abi_version()}, expected {_ABI}"
    lib.mp_compact_e0.restype = ctypes.c_int
    lib.mp_has_f16.restype = ctypes.c_int
    lib.mp_adam.restype = ctypes.c_int64
    lib.mp_adam.argtypes = [ctypes.POINTER(_Args), ctypes.POINTER(ctypes.c_void_p)]
    lib.mp_free.argtypes = [ctypes.c_void_p]
    lib.mp_free.restype = None
    return lib, ""


def _library() -> ctypes.CDLL | None:
    with _lock:
        if "lib" not in _state:
            _state["lib"], _state["why"] = _build()
            _state["f16"] = _state["lib"] is not None and bool(_state["lib"].mp_has_f16())
        return _state["lib"]


def status(build: bool = True) -> tuple[bool, str]:
    """(whether the native route is available, why not); builds the kernel on the first call.
    ``build=False`` builds nothing: before the first build it answers whether a build can be
    tried (not turned off, a C compiler on PATH), as the memory estimate wants."""
    if not build and "lib" not in _state:
        if why := _turned_off():
            return False, why
        return (True, "") if _compiler() else (False, "no C compiler (cc, gcc or clang) on PATH")
    lib = _library()
    return lib is not None, _state.get("why", "")


def _f16() -> bool:
    """Whether the kernel handles fp16 tensors (its compiler has ``_Float16``); True before a build."""
    return bool(_state.get("f16", True))


def _reset() -> None:
    """Forget the loaded library's status (tests: after changing :data:`ENV`)."""
    with _lock:
        _state.clear()


def _after_fork() -> None:
    """A forked child has the parent's lock as it was (held, during a build) and none of its threads."""
    global _lock, _pool
    _lock = threading.Lock()
    _pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


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
    return status(build)[0] and (state_dtype != torch.float16 or _f16())


def _plain(t: torch.Tensor | None) -> bool:
    return t is not None and type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.is_contiguous()


def takes_param(rounding: str, param: torch.Tensor) -> bool:
    """Whether the weight ``param`` itself can step natively: a plain contiguous CPU tensor, bf16
    (or fp16, for the round-to-nearest and Kahan stores)."""
    if not _plain(param) or param.dtype not in (torch.bfloat16, torch.float16):
        return False
    return param.dtype == torch.bfloat16 or (rounding in ("nearest", "kahan") and _f16())


def takes(rounding: str, param: torch.Tensor, comp: torch.Tensor | None) -> bool:
    """Whether ``param``, with its gradient and its compensation or remainder ``comp``, can step
    natively (:func:`takes_param`, and the others plain contiguous CPU tensors of its shape)."""
    grad = param.grad
    if not takes_param(rounding, param) or grad is None or not _plain(grad) or grad.shape != param.shape:
        return False
    if grad.dtype not in (torch.float32, torch.bfloat16) and not (grad.dtype == torch.float16 and _f16()):
        return False
    if rounding in ("kahan", "remainder"):
        kinds = (torch.int16,) if rounding == "remainder" else (torch.bfloat16, torch.float32) + ((torch.float16,) if _f16() else ())
        return _plain(comp) and comp.shape == param.shape and comp.dtype in kinds  # type: ignore[union-attr]
    return True


@dataclass
class _Job:
    param: torch.Tensor
    args: _Args
    keep: tuple[Any, ...]  # tensors the pointers point into, alive until the call returns


_pool: tuple[ThreadPoolExecutor, int, int] | None = None  # (executor, threads, the process it was made in)


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
    counter: list[int] | None = None,
    grad_scales: Sequence[torch.Tensor] = (),
    remainder: RemainderIO | None = None,
) -> list[torch.Tensor]:
    """Adam/AdamW for the low-precision ``params`` of ``group`` natively (each with its own
    step count); every one must pass :func:`takes`. Returns the ones it left for another route:
    those whose moments are held in another floating dtype than ``state_dtype`` (wrapped after
    the inner optimizer stepped, say: the eager path reads and keeps them as they are).
    Stochastic rounding draws the compiled route's noise for ``counter[0]`` (advanced by one
    here). The kernels run on worker threads (torch's thread count; a weight of more than
    :data:`PARALLEL_NUMEL` elements in ranges) and the call's weights are counted only once
    all of them have finished: an interrupt arriving meanwhile waits for them and is raised
    after the bookkeeping (the groups after this one are then not stepped)."""
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the native optimizer kernel is not available: {_state.get('why', '')}")
    dtype = torch.float32 if state_dtype is None else state_dtype
    q8 = dtype == qstates.Q8
    amsgrad = bool(group["amsgrad"])
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    scale_keys = [f"{k}{qstates.ABSMAX}" for k in keys] if q8 else []
    with_grads = [p for p in params if p.grad is not None]
    init_adam_state(optimizer, group, with_grads, dtype)
    active: list[torch.Tensor] = []
    left: list[torch.Tensor] = []
    for p in with_grads:
        state = optimizer.state[p]
        if not _fits(state, keys, scale_keys, dtype, p.numel()):  # held otherwise (loaded, wrapped later)
            qstates.conform(state, p, state_dtype)
            if not _conform_layout(state, p, dtype, keys, scale_keys):
                left.append(p)
                continue
        active.append(p)
    if not active:
        return left
    states = [optimizer.state[p] for p in active]
    lr = scalar_value(group["lr"])
    beta1, beta2 = (scalar_value(b) for b in group["betas"])
    eps, weight_decay = float(group["eps"]), float(group["weight_decay"])
    decoupled = bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
    factors = torch.cat([f.detach().to(device="cpu", dtype=torch.float32).reshape(1) for f in grad_scales]) if grad_scales else None
    seed = 0
    if rounding == "stochastic":
        if counter is None:
            raise ValueError("stochastic rounding needs the wrapper's noise counter")
        seed = seed32(counter[0])
    tables = [t.data_ptr() for t in _q8_tables(int(lib.mp_compact_e0()))] if q8 else [None] * 8
    threads = max(1, torch.get_num_threads())
    shared = dict(
        smap=tables[0], slookup=tables[1], spoints=tables[2], umap=tables[3], ulookup=tables[4], upoints=tables[5],
        scompact=tables[6], ucompact=tables[7], seed=seed, s_kind=_KINDS[dtype], rounding=_ROUNDINGS[rounding],
        wd_mode=0 if weight_decay == 0 else (2 if decoupled else 1), amsgrad=int(amsgrad),
        maximize=int(bool(group["maximize"])), lerp_weight=1 - beta1, beta2=beta2, one_minus_beta2=1 - beta2, eps=eps,
        decay=(1 - lr * weight_decay) if decoupled else weight_decay,
        gscales=_ptr(factors), n_gscales=0 if factors is None else factors.numel(),
    )
    jobs: list[_Job] = []
    written: list[torch.Tensor] = []
    offset = 0
    for p, state in zip(active, states, strict=True):
        step = float(state["step"]) + 1
        grad = p.grad
        assert grad is not None
        comp = comps(p) if comps is not None and rounding in ("kahan", "remainder") else None
        ties = None
        if remainder is not None and rounding == "remainder":
            # flat, int64 and sorted: the kernel walks them in order (and touches no element outside)
            ties = remainder.ties(p).reshape(-1).to(device="cpu", dtype=torch.int64)
            ties = ties.sort().values if ties.numel() > 1 else ties.contiguous()
        moments = [state[k] for k in keys] + [None] * (3 - len(keys))
        scales = [state[k] for k in scale_keys] + [None] * (3 - len(scale_keys))
        own = dict(
            w=p.data_ptr(), g=grad.data_ptr(), m=_ptr(moments[0]), v=_ptr(moments[1]), vmax=_ptr(moments[2]),
            m_scale=_ptr(scales[0]), v_scale=_ptr(scales[1]), vmax_scale=_ptr(scales[2]), comp=_ptr(comp),
            ties=_ptr(ties), n_ties=0 if ties is None else ties.numel(), offset=offset,
            w_kind=_KINDS[p.dtype], g_kind=_KINDS[grad.dtype],
            comp_kind=_KINDS.get(comp.dtype, 0) if comp is not None else 0,  # (an int16 remainder: unread)
            step_size=lr / (1 - beta1**step), bc2_sqrt=math.sqrt(1 - beta2**step),  # as torch's Adam, in double
        )
        keep = (p, grad, comp, ties, factors, *moments, *scales)
        written += [t for t in (p, comp, *moments, *scales) if t is not None]
        n = p.numel()
        pieces = max(1, min(threads, -(-n // PARALLEL_NUMEL)))
        bound = max(qstates.BLOCK, -(-n // pieces // qstates.BLOCK) * qstates.BLOCK)  # ranges of whole 8-bit blocks
        for begin in range(0, n, bound):  # (none for an empty weight: only counted)
            jobs.append(_Job(p, _Args(begin=begin, end=min(n, begin + bound), **shared, **own), keep))
        offset += n
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
    if counter is not None and rounding == "stochastic":
        counter[0] += 1
    if failed:  # pragma: no cover - a few bytes for a tie list could not be allocated
        raise MemoryError("the native optimizer kernel could not allocate a list of remainder ties; "
                          "the step was taken, but those weights' ties are lost (their masters are off by 2**-8 ulp)")
    if interrupt is not None:
        raise interrupt
    return left


def _fits(state: dict[str, Any], keys: list[str], scale_keys: list[str], dtype: torch.dtype, numel: int) -> bool:
    """Whether ``state``'s moments (and 8-bit scales) are already what the kernel writes through raw
    pointers: plain contiguous CPU tensors of ``dtype`` (fp32 scales), one element per weight (one
    scale per block). The common case, checked without building anything."""
    wanted = [(k, dtype, numel) for k in keys] + [(k, torch.float32, -(-numel // qstates.BLOCK)) for k in scale_keys]
    for key, kind, n in wanted:
        t = state.get(key)
        if type(t) is not torch.Tensor or t.dtype != kind or t.numel() != n or not t.is_contiguous() or t.device.type != "cpu":
            return False
    return True


def _conform_layout(
    state: dict[str, Any], param: torch.Tensor, dtype: torch.dtype, keys: list[str], scale_keys: list[str]
) -> bool:
    """Make ``param``'s moments (and 8-bit scales) what :func:`_fits` asks for, copying other
    layouts contiguous; False (nothing changed) when a floating moment is held in another
    floating dtype, for the eager path, which reads and keeps it as it is; anything else (a
    wrong size, a device, a missing key) is refused before a byte is written."""
    for key in keys:
        t = state.get(key)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype and dtype != qstates.Q8:
            return False
    check_moment_layout(state, param, dtype, keys)
    for name in keys + scale_keys:
        t = state[name]
        if not t.is_contiguous() or type(t) is not torch.Tensor:
            state[name] = t.detach().contiguous().as_subclass(torch.Tensor)
    return True


@cache
def _q8_tables(e0: int) -> list[torch.Tensor]:
    """[signed map, lookup, points, unsigned map, lookup, points, signed compact lookup, unsigned
    compact lookup] (see ``COMPACT_E0`` in :file:`native_adam.c`), the compact ones checked
    against the full lookup and decision points at every run's ends and around every point."""
    out = q8_tables(torch.device("cpu"))
    compact = []
    for first, points in (out[1:3], out[4:6]):
        table = _compact(first, points, e0)
        _compact_agrees(table, first, points, e0)
        compact.append(table)
    return out + compact


def _compact(first: torch.Tensor, points: torch.Tensor, e0: int) -> torch.Tensor:
    runs = torch.arange(1 << 16, dtype=torch.int64)
    code = first.to(torch.int64)
    point = points[first.long()].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    inside = (point >> 16) == runs  # the decision point above the run's first code lies in the run
    negative = (runs >> 15) == 1
    low = point & 0xFFFF
    threshold = torch.where(inside, torch.where(negative, low ^ 0xFFFF, low), torch.full_like(low, 1 << 16))
    entry = (code | (threshold << 8)).view(2, 256, 128)  # sign, exponent, the top 7 bits of the mantissa
    return entry[:, e0:128].contiguous().view(-1).to(torch.int32)


def _compact_codes(table: torch.Tensor, e0: int, x: torch.Tensor) -> torch.Tensor:
    """The codes the compact lookup gives fp32 values ``x`` in [-1, 1] (the kernel's arithmetic)."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    exponent = ((bits >> 23) & 0xFF).clamp(min=e0) - e0
    at = (bits >> 31) * ((128 - e0) * 128) + exponent * 128 + ((bits >> 16) & 0x7F)
    entry = table.to(torch.int64)[at]
    key = (bits & 0xFFFF) ^ torch.where((bits >> 31) == 1, 0xFFFF, 0)
    return (entry & 0xFF) + (key >= (entry >> 8)).to(torch.int64)


def _compact_agrees(table: torch.Tensor, first: torch.Tensor, points: torch.Tensor, e0: int) -> None:
    ends = torch.arange(1 << 16, dtype=torch.int64) << 16
    near = points[:-1].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = torch.cat([ends, ends | 0xFFFF, ends | 0x7FFF, near - 1, near, near + 1])
    x = (bits & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    x = x[(x.abs() <= 1.0)]  # the scaled values of a finite block
    expect = first.long()[(x.view(torch.int32).to(torch.int64) >> 16) & 0xFFFF]
    expect = expect + (x >= points[expect]).to(torch.int64)
    if not torch.equal(_compact_codes(table, e0, x), expect):  # pragma: no cover - a property of the map
        raise AssertionError("the native kernel's compact 8-bit lookup disagrees with mixprec.optim.quant's")


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

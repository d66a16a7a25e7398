"""Whether ``torch.compile`` works here: one cached probe per device type, one warning on failure.

mixprec compiles a few small, hot functions of its own (the Kahan / stochastic-rounding
optimizer update, the fp8 emulation's quantiser) when that is several times faster than
eager torch. On a machine without a working compiler (no C++ compiler for inductor's CPU
code, no triton on CUDA) those fall back to eager code. ``MIXPREC_COMPILE=0`` in the
environment turns every automatic compilation off (an optimizer's explicit
``compile=True`` still compiles).

torch's compiler is imported on first use, not with mixprec: importing it makes its disk
cache (``TORCHINDUCTOR_CACHE_DIR``), and where that directory is unusable (a file, a path
inside a file, a read-only folder) ``import mixprec`` still works and mixprec's kernels run
eagerly. The probe checks the cache folder (creatable, writable) before each answer, so a
folder that becomes unusable later (the variable changed mid-run) also falls back, with one
warning naming the variable, its value and the fix; an explicit ``compile=True`` raises that
message instead (:func:`check_compiler`).

>>> compile_works("meta")
False
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

__all__ = [
    "CACHE_ENV",
    "MAX_SPECIALISATIONS",
    "call_compiled",
    "check_compiler",
    "check_environment",
    "compile_errors",
    "compile_works",
    "compiled",
    "compiles_for",
    "eager_only",
    "mark_compile_failed",
    "recompile_headroom",
]

R = TypeVar("R")

#: what :func:`call_compiled` compiles per function at most (dtypes, ranks, size-0/1 dims,
#: constants); further combinations run eagerly. Dynamo's own limit is 8 per function,
#: past which it would run the function uncompiled and slower than the eager code.
MAX_SPECIALISATIONS = 16

#: the environment variable naming torch's compiler cache folder (inductor's, dynamo's)
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def _cache_message(reason: object, value: str | None) -> str:
    """What is wrong with the cache folder ``value`` (``reason``: the OSError), and the fix."""
    if value is None:  # torch's default folder in the temp directory
        return (f"{reason} (torch's compiler cache folder, {CACHE_ENV}, must be a writable folder: it is unset "
                f"and torch's default one is not; point {CACHE_ENV} at a writable directory)")
    return (f"{reason} (torch's compiler cache folder, {CACHE_ENV}, must be a writable folder: {CACHE_ENV}={value!r} "
            f"is not; point {CACHE_ENV} at a writable directory, or unset it)")


@functools.cache
def _compiler_error() -> Exception | None:
    """Import torch's compiler (once); what prevents it, or None. Its import makes the
    inductor cache directory, so an unusable ``TORCHINDUCTOR_CACHE_DIR`` fails here."""
    value = os.environ.get(CACHE_ENV)
    try:
        import torch._dynamo
        import torch._dynamo.exc
        import torch._inductor.exc  # noqa: F401
    except OSError as exc:  # the cache folder cannot be made
        return OSError(_cache_message(exc, value))
    except Exception as exc:  # e.g. a second try after that: torch's half-imported compiler
        return exc
    return None


_USABLE_CACHE_DIRS: set[str] = set()  # values of TORCHINDUCTOR_CACHE_DIR found usable in this process


def _cache_dir_problem(value: str | None) -> str | None:
    """Why torch's compiler cannot use the cache folder ``value`` (``TORCHINDUCTOR_CACHE_DIR``;
    None: unset, torch's default, which its first use sets the variable to), or None. The
    folder is made as torch would make it (``os.makedirs``), then must be a folder this
    process can write into. A value found usable is not checked again (torch makes
    it again where it was removed); one that fails is checked again at the next call (an
    automatic compile remembers the failure: :func:`mark_compile_failed`)."""
    if value is None or value in _USABLE_CACHE_DIRS:
        return None  # None: torch's default folder in the temp directory, which the probe's compilation tries
    path = os.path.abspath(value)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:  # a file, a path inside a file, a folder in a read-only one
        return _cache_message(exc, value)
    if not os.access(path, os.W_OK | os.X_OK):  # a read-only folder (or read-only file system)
        return _cache_message(f"[Errno {errno.EACCES}] Permission denied: {path!r}", value)
    _USABLE_CACHE_DIRS.add(value)
    return None


def _compiler_problem() -> Exception | None:
    """What keeps torch's compiler from running here now, or None: it cannot be imported, or
    its cache folder (as ``TORCHINDUCTOR_CACHE_DIR`` names it now) is unusable."""
    error = _compiler_error()
    if error is not None:
        return error
    problem = _cache_dir_problem(os.environ.get(CACHE_ENV))
    return None if problem is None else OSError(problem)


def check_compiler() -> None:
    """Raise what keeps torch's compiler from running here (an unusable
    ``TORCHINDUCTOR_CACHE_DIR``: an OSError naming it, its value and the fix), where an
    explicit ``compile=True`` asks for it; nothing when it can run.

    >>> check_compiler()
    """
    error = _compiler_problem()
    if error is None:
        return
    if isinstance(error, OSError):
        raise OSError(str(error))  # a fresh exception each time (the remembered one keeps no traceback)
    raise RuntimeError(f"torch's compiler cannot be imported here ({type(error).__name__}: {error})") from error


def compile_errors() -> tuple[type[Exception], ...]:
    """What a failed compilation raises (torch before 2.7 has no InductorError: its inductor
    failures reach the caller as dynamo's BackendCompilerFailed). OSError too: torch makes
    its cache folder also outside those wrappers (``torch.compile`` itself does), and
    mixprec's compiled kernels do no I/O of their own. Only OSError where torch's compiler
    cannot be imported (nothing of it runs then)."""
    if _compiler_error() is not None:
        return (OSError,)
    return tuple(
        e
        for e in (
            torch._dynamo.exc.TorchDynamoException, getattr(torch._inductor.exc, "InductorError", None), OSError,
        )
        if e is not None
    )


def _limit_name() -> str:
    """dynamo's recompile limit per function ("cache_size_limit" before torch 2.7)"""
    return "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"

_FAILED: set[str] = set()  # device types on which a compilation failed in this process
_OFF_VALUES = ("0", "off", "false", "no")
_ON_VALUES = ("", "1", "on", "true", "yes")


def env_switch(name: str, off: str) -> bool:
    """Whether the on/off environment variable ``name`` is on (unset: on); a value it does not
    understand is an error naming it and the fix (``off`` says what 0 does)."""
    value = os.environ.get(name, "1").strip().lower()
    if value in _OFF_VALUES:
        return False
    if value in _ON_VALUES:
        return True
    raise ValueError(
        f"{name}={os.environ[name]!r} is not understood: set it to 0 ({off}) or 1 (the default), or unset it"
    )


#: the switch of mixprec's native optimizer kernel (:mod:`mixprec.optim.native`)
NATIVE_ENV = "MIXPREC_NATIVE"
#: the switch of mixprec's Triton optimizer kernel for CUDA (:mod:`mixprec.optim.triton_adam`)
TRITON_ENV = "MIXPREC_TRITON"


def _enabled_by_environment() -> bool:
    """Whether ``MIXPREC_COMPILE`` allows automatic compilation."""
    return env_switch("MIXPREC_COMPILE", "never compile mixprec's kernels automatically")


def check_environment() -> None:
    """Refuse a ``MIXPREC_COMPILE``, ``MIXPREC_NATIVE`` or ``MIXPREC_TRITON`` value that is not understood, now rather
    than at the first compilation or native step (mid-training). :class:`~mixprec.MixedPrecision`
    and the Kahan / stochastic-rounding optimizers with ``compile="auto"`` call it when they are built.

    >>> check_environment()  # each unset, 0/1, off/on, false/true or no/yes
    """
    _enabled_by_environment()
    env_switch(NATIVE_ENV, "never build or use the native optimizer kernel")
    env_switch(TRITON_ENV, "never use the Triton optimizer kernel")


def _probe(x: torch.Tensor) -> torch.Tensor:
    return (x * 2 + 1).to(torch.bfloat16)


@functools.cache
def _probe_compiles(device_type: str) -> bool:
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return False
    try:
        torch.compile(_probe, dynamic=False)(torch.ones(8, device=device_type))
    except Exception as exc:  # any failure means: no working compiler here
        mark_compile_failed(device_type, exc)
        return False
    return True


def mark_compile_failed(device: torch.device | str, exc: BaseException) -> None:
    """Remember (for this process) that compiling failed on ``device``'s type; warn once."""
    device_type = torch.device(device).type
    if device_type in _FAILED:
        return
    _FAILED.add(device_type)
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if CACHE_ENV not in first_line:  # a cache folder's message is kept whole: it ends with the fix
        first_line = first_line[:200]
    warnings.warn(
        f"torch.compile is unavailable on {device_type} ({type(exc).__name__}: {first_line}); mixprec runs "
        "its compiled kernels eagerly from now on: the fp8 emulation gives identical results, slower; "
        "Kahan / stochastic-rounding optimizer updates equal the compiled ones within fp32 rounding "
        "(stochastic rounding draws the same noise). Set MIXPREC_COMPILE=0 to skip compilation altogether.",
        RuntimeWarning,
        stacklevel=3,
    )


def compile_works(device: torch.device | str, *, probe: bool = True) -> bool:
    """Whether mixprec's compiled kernels can run on ``device``'s type in this process.

    The first call per device type compiles a two-op function (a second or two; CUDA also
    needs triton); a failure warns once and is remembered. False while torch.compile is
    tracing (the caller's code is then compiled as part of the user's graph), when
    dynamo is disabled, and with ``MIXPREC_COMPILE=0``; False, with that one warning naming
    it, where torch's cache folder (``TORCHINDUCTOR_CACHE_DIR`` as it is at the call: checked
    once per value) cannot be made or written into. ``probe=False`` answers without
    compiling anything (an untried device counts as working): for estimates.
    """
    if torch.compiler.is_compiling():
        return False
    device_type = torch.device(device).type
    if device_type not in ("cpu", "cuda") or device_type in _FAILED:
        return False
    error = _compiler_error()
    if error is not None:  # e.g. TORCHINDUCTOR_CACHE_DIR is a file or a read-only folder
        mark_compile_failed(device_type, error)
        return False
    if torch._dynamo.config.disable or not _enabled_by_environment():
        return False
    error = _compiler_problem()  # the cache folder again (per value of the variable: it may change mid-run)
    if error is not None:
        mark_compile_failed(device_type, error)
        return False
    return _probe_compiles(device_type) if probe else True


def compiles_for(x: torch.Tensor) -> bool:
    """Whether :func:`call_compiled` compiles for ``x``: a plain CPU tensor (not a fake or
    other subclass tensor; no dispatch mode active, e.g. a memory estimate tracing with
    fake tensors), outside torch.compile tracing, where :func:`compile_works`."""
    return (
        not torch.compiler.is_compiling()  # first: the checks below would break the user's graph
        and type(x) is torch.Tensor
        and x.device.type == "cpu"
        and torch._C._len_torch_dispatch_stack() == 0
        and compile_works(x.device)
    )


def eager_only(fn: Callable[..., R]) -> Callable[..., R]:
    """``fn`` kept out of a user's compiled graph (``torch.compiler.disable``), resolved at
    its first call so that importing the module that uses it does not import torch's
    compiler; where that compiler cannot be imported, plain ``fn``."""
    resolved: list[Callable[..., R]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> R:
        if not resolved:
            resolved.append(fn if _compiler_error() is not None else torch.compiler.disable(fn))
        return resolved[0](*args, **kwargs)

    return call


_CACHE: dict[Callable[..., Any], Callable[..., Any]] = {}
_SETTINGS: dict[Callable[..., Any], tuple[bool, dict[str, Any] | None]] = {}


def compiled(fn: Callable[..., R], *, dynamic: bool, options: dict[str, Any] | None = None) -> Callable[..., R]:
    """``torch.compile(fn, dynamic=dynamic, options=options)``, made once per process.

    A function has one compilation: asking for it again with other settings is an error.
    Where torch's compiler cannot run (:func:`check_compiler`: an unusable
    ``TORCHINDUCTOR_CACHE_DIR``, checked at each call) that error is raised instead.
    """
    settings = (dynamic, options or None)  # dicts compare by content, in any order
    if _SETTINGS.setdefault(fn, settings) != settings:
        raise ValueError(
            f"{fn.__qualname__} is compiled with (dynamic, options) = {_SETTINGS[fn]}, not {settings}: "
            "compile a separate function for other settings"
        )
    check_compiler()  # an unusable cache folder: its message, not an OSError deep inside torch
    out = _CACHE.get(fn)
    if out is None:
        out = _CACHE[fn] = torch.compile(fn, dynamic=dynamic, options=options)
    return out


@contextlib.contextmanager
def recompile_headroom() -> Iterator[None]:
    """Dynamo's recompile limit raised to 64 per function while inside: past its default
    of 8 it would run a function uncompiled (slower than mixprec's eager code) without a
    word. mixprec bounds what it compiles itself (:data:`MAX_SPECIALISATIONS`, the
    optimizers' layout budgets)."""
    if _compiler_error() is not None:  # nothing compiles here
        yield
        return
    limit = _limit_name()
    with torch._dynamo.config.patch(**{limit: max(getattr(torch._dynamo.config, limit), 64)}):
        yield


_KEYS: dict[Callable[..., Any], set[tuple[Any, ...]]] = {}
_DEFAULT_LIMIT: int | None = None  # dynamo's own, outside recompile_headroom (read at the first compilation)


def _specialisation(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What a dynamic-shape compilation specialises on: dtypes, ranks, size-0/1 dims,
    layout, constants, grad mode."""
    parts: list[Any] = [torch.is_grad_enabled()]
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append((a.dtype, a.dim(), tuple(d <= 1 for d in a.shape), a.is_contiguous(), a.requires_grad))
        elif a is None or isinstance(a, bool | int | float | str | torch.dtype):
            parts.append(a)
        else:
            parts.append(type(a))
    return tuple(parts)


def _default_limit() -> int:
    global _DEFAULT_LIMIT
    if _DEFAULT_LIMIT is None:
        _DEFAULT_LIMIT = int(getattr(torch._dynamo.config, _limit_name()))
    return _DEFAULT_LIMIT


def call_compiled(fn: Callable[..., R], *args: Any, eager: Callable[..., R] | None = None) -> R:
    """``fn(*args)`` through ``torch.compile(fn, dynamic=True)`` (compiled once per process
    and combination of dtypes, ranks and constants; shapes are symbolic, so every layer
    shares it) when :func:`compiles_for` the first tensor argument; else, past
    :data:`MAX_SPECIALISATIONS` combinations, and after a failed compilation (one
    warning, then never again on that device type), ``eager(*args)`` (default: ``fn``).

    >>> import torch
    >>> call_compiled(torch.add, torch.ones(2), 1)
    tensor([2., 2.])
    """
    first = next(a for a in args if isinstance(a, torch.Tensor))
    if compiles_for(first):
        keys = _KEYS.setdefault(fn, set())
        key = _specialisation(args)
        known = key in keys
        if known or len(keys) < MAX_SPECIALISATIONS:
            keys.add(key)
            # no config patch (~17 us) for a compiled key while dynamo's own limit leaves room
            # for each key to recompile once on what the key does not see (autocast, strides)
            patch = not known or 2 * len(keys) > _default_limit()
            try:
                with recompile_headroom() if patch else contextlib.nullcontext():
                    return compiled(fn, dynamic=True)(*args)
            except compile_errors() as exc:
                mark_compile_failed(first.device, exc)
    return (fn if eager is None else eager)(*args)

"""Whether ``torch.compile`` works here: one cached probe per device type, one warning on failure.

mixprec compiles a few small, hot functions of its own (the Kahan / stochastic-rounding
optimizer update, the fp8 emulation's quantiser) when that is several times faster than
eager torch. On a machine without a working compiler (no C++ compiler for inductor's CPU
code, no triton on CUDA) those fall back to eager code with the same results.

>>> compile_works("meta")
False
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch._dynamo
import torch._dynamo.exc
import torch._inductor.exc

__all__ = ["call_compiled", "compile_works", "compiles_for", "mark_compile_failed"]

R = TypeVar("R")

_FAILED: set[str] = set()  # device types on which a compilation failed in this process


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
        mark_compile_failed(device_type, "mixprec's compiled kernels", exc)
        return False
    return True


def mark_compile_failed(device: torch.device | str, what: str, exc: BaseException) -> None:
    """Remember (for this process) that compiling failed on ``device``'s type; warn once."""
    device_type = torch.device(device).type
    if device_type in _FAILED:
        return
    _FAILED.add(device_type)
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    warnings.warn(
        f"torch.compile is unavailable on {device_type} ({type(exc).__name__}: {first_line}); {what} "
        "run eagerly instead (same results, slower). Pass compile=False (optimizers) to silence this.",
        RuntimeWarning,
        stacklevel=3,
    )


def compile_works(device: torch.device | str, *, probe: bool = True) -> bool:
    """Whether mixprec's compiled kernels can run on ``device``'s type in this process.

    The first call per device type compiles a two-op function (a second or two; CUDA also
    needs triton); a failure warns once and is remembered. False while torch.compile is
    tracing (the caller's code is then compiled as part of the user's graph) and when
    dynamo is disabled. ``probe=False`` answers without compiling anything (an untried
    device counts as working): for estimates.
    """
    device_type = torch.device(device).type
    if device_type not in ("cpu", "cuda") or device_type in _FAILED:
        return False
    if torch.compiler.is_compiling() or torch._dynamo.config.disable:
        return False
    return _probe_compiles(device_type) if probe else True


def compiles_for(x: torch.Tensor) -> bool:
    """Whether :func:`call_compiled` compiles for ``x``: a plain CPU tensor (not a fake or
    other subclass tensor; no dispatch mode active, e.g. a memory estimate tracing with
    fake tensors), where :func:`compile_works`."""
    return (
        type(x) is torch.Tensor
        and x.device.type == "cpu"
        and torch._C._len_torch_dispatch_stack() == 0
        and compile_works(x.device)
    )


_CACHE: dict[Callable[..., Any], Callable[..., Any]] = {}


def call_compiled(fn: Callable[..., R], *args: Any, what: str, eager: Callable[..., R] | None = None) -> R:
    """``fn(*args)`` through ``torch.compile(fn, dynamic=True)`` (compiled once per process:
    shapes are symbolic, so every layer shares it) when :func:`compiles_for` the first
    tensor argument; else, and after a failed compilation (one warning, then never
    again on that device type), ``eager(*args)`` (default: ``fn`` itself, uncompiled).

    >>> import torch
    >>> call_compiled(torch.add, torch.ones(2), 1, what="an example")
    tensor([2., 2.])
    """
    first = next(a for a in args if isinstance(a, torch.Tensor))
    if compiles_for(first):
        compiled = _CACHE.get(fn)
        if compiled is None:
            compiled = _CACHE[fn] = torch.compile(fn, dynamic=True)
        try:
            return compiled(*args)  # type: ignore[no-any-return]
        except (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.InductorError) as exc:
            mark_compile_failed(first.device, what, exc)
    return (fn if eager is None else eager)(*args)

"""The user-facing regions: :class:`autocast` (the forward) and :class:`autocast_backward`.

:class:`autocast` is ``torch.autocast`` plus a :class:`~mixprec.amp.mode.PolicyMode`
when the policy moves ops; :class:`autocast_backward` keeps the same mode in force
while ``backward()`` recomputes a forward (activation checkpointing).
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from mixprec.amp.mode import PolicyMode, PolicyScope
from mixprec.dtypes import parse_dtype
from mixprec.policy import OpPolicy, Precision

__all__ = ["autocast", "autocast_backward"]

F = TypeVar("F", bound=Callable[..., Any])


def _is_device_type(name: str) -> bool:
    try:
        return bool(torch._C._is_autocast_available(name.strip().lower()))
    except RuntimeError:  # not a device string
        return False


def _op_list(value: Any, field: str) -> tuple[Any, ...]:
    if isinstance(value, str):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        raise TypeError(f"{field} must be a sequence of op names, got {value!r}") from None


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _nested_in_other_dtype(device_type: str, dtype: torch.dtype) -> bool:
    level = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return level > 1 and torch.get_autocast_dtype(device_type) != dtype


class autocast:
    """``torch.autocast`` with custom op lists; a context manager and a decorator.

    Args:
        dtype: the low-precision dtype (``torch.bfloat16``, ``torch.float16`` or a
            name such as ``"bf16"``); None: torch's default for the device (or the
            policy's dtype).
        device_type: "cpu", "cuda", ...; None: "cuda" when available, else "cpu".
        enabled: False disables autocast (and the custom lists) in the region.
        lower_ops: op names to run in ``dtype`` on top of the default tables.
        fp32_ops: op names to run in float32.
        policy: an :class:`~mixprec.OpPolicy` instead of ``lower_ops`` / ``fp32_ops``.
        cache_enabled: as in ``torch.autocast`` (None: torch's current setting).

    Without custom ops this is exactly ``torch.autocast``. With them, the listed
    ops run in the requested class (promote ops in their widest floating input
    type), and every other op is left to ``torch.autocast``. Casts that mixprec
    makes are never cached, so an in-place weight update between two forwards in
    one region is always seen by custom-listed ops (``torch.autocast``'s own cache
    of weight casts lives until the outermost region exits, as in PyTorch; pass
    ``cache_enabled=False`` when weights change inside one region).

    One deliberate difference from ``torch.autocast``: a region nested in an enclosing
    region of another dtype does not share that region's weight-cast cache (PyTorch
    keys the cache by tensor only, so it would return casts of the wrong dtype).

    The custom lists also cover code that backward runs (activation checkpointing
    recomputation, custom autograd functions' ``backward``) when ``backward()`` is
    called inside :class:`autocast_backward` with the same policy.

    >>> import torch
    >>> from mixprec.amp import autocast
    >>> @autocast(torch.bfloat16, device_type="cpu", fp32_ops=["mm"])
    ... def f(a, b):
    ...     return a @ b, torch.mm(a, b)
    >>> [t.dtype for t in f(torch.ones(2, 2), torch.ones(2, 2))]
    [torch.bfloat16, torch.float32]
    """

    def __new__(
        cls,
        dtype: torch.dtype | str | None = None,
        *,
        device_type: str | None = None,
        enabled: bool = True,
        lower_ops: Iterable[str] = (),
        fp32_ops: Iterable[str] = (),
        policy: OpPolicy | None = None,
        cache_enabled: bool | None = None,
    ) -> Any:
        if (
            torch.compiler.is_compiling()
            and not lower_ops
            and not fp32_ops
            and (policy is None or policy.is_default)
        ):
            # Inside a compiled function a region without custom ops is torch.autocast
            # itself, which Dynamo traces natively.
            if dtype is None and policy is not None:
                dtype = policy.dtype
            return torch.autocast(
                device_type if device_type is not None else _default_device_type(),
                dtype=parse_dtype(dtype) if dtype is not None else None,
                enabled=enabled,
                cache_enabled=cache_enabled,
            )
        return super().__new__(cls)

    def __init__(
        self,
        dtype: torch.dtype | str | None = None,
        *,
        device_type: str | None = None,
        enabled: bool = True,
        lower_ops: Iterable[str] = (),
        fp32_ops: Iterable[str] = (),
        policy: OpPolicy | None = None,
        cache_enabled: bool | None = None,
    ) -> None:
        device = _default_device_type() if device_type is None else device_type
        if not isinstance(device, str):
            raise TypeError(f"device_type must be a str such as 'cpu' or 'cuda', got {device!r}")
        if not _is_device_type(device):
            raise ValueError(
                f"device_type={device!r} is not a device type autocast supports; use 'cpu' or 'cuda' "
                "(or another torch device type such as 'xpu', 'mps')"
            )
        if not isinstance(enabled, bool):
            hint = "; a string such as 'false' would count as True" if isinstance(enabled, str) else ""
            raise TypeError(f"enabled must be True or False, got {enabled!r} ({type(enabled).__name__}){hint}")
        if cache_enabled is not None and not isinstance(cache_enabled, bool):
            raise TypeError(f"cache_enabled must be True, False or None, got {cache_enabled!r}")
        lower_ops = _op_list(lower_ops, "lower_ops")
        fp32_ops = _op_list(fp32_ops, "fp32_ops")
        if isinstance(dtype, str) and _is_device_type(dtype):
            raise ValueError(
                f"autocast() got dtype={dtype!r}, a device type; mixprec.autocast takes the dtype "
                f"first: write autocast(device_type={dtype!r}) or autocast(torch.bfloat16, "
                f"device_type={dtype!r})"
            )
        requested = parse_dtype(dtype) if dtype is not None else None
        if requested is not None and requested not in (torch.bfloat16, torch.float16) and enabled:
            # disabled, any floating dtype is accepted, as torch.autocast does (config-driven code
            # writes autocast(dtype=cfg.dtype, enabled=cfg.amp) with dtype=torch.float32)
            raise ValueError(
                f"autocast() dtype must be torch.bfloat16 or torch.float16, got {requested}; for fp32 "
                "compute run without autocast (or pass enabled=False)"
            )
        if policy is not None:
            if not isinstance(policy, OpPolicy):
                raise TypeError(f"policy must be a mixprec.OpPolicy, got {type(policy).__name__}")
            if lower_ops or fp32_ops:
                raise ValueError(
                    "autocast() got both policy= and lower_ops=/fp32_ops=; pass either a policy "
                    "or the op lists (policy.replace(lower_ops=...) combines them)"
                )
            if requested is not None and requested != policy.dtype:
                raise ValueError(
                    f"autocast() got dtype={requested} but policy.dtype={policy.dtype}; "
                    "they must agree (or leave dtype=None to use the policy's)"
                )
            requested = policy.dtype
        elif (lower_ops or fp32_ops) and (enabled or requested in (None, torch.bfloat16, torch.float16)):
            low = requested if requested is not None else torch.get_autocast_dtype(device)
            policy = OpPolicy(low, lower_ops=lower_ops, fp32_ops=fp32_ops)
            requested = policy.dtype
        # torch validates (and warns or raises) exactly as torch.autocast would
        self._torch = torch.autocast(
            device, dtype=requested, enabled=enabled, cache_enabled=cache_enabled
        )
        self.device_type = device
        self.dtype: torch.dtype = self._torch.fast_dtype
        self.enabled: bool = self._torch._enabled
        self.policy = policy
        overrides = policy.overrides(device) if policy is not None and self.enabled else {}
        self._overrides = {device: overrides} if overrides else {}
        self._local = threading.local()

    def _stack(self) -> list[tuple[Any, PolicyScope]]:
        stack: list[tuple[Any, PolicyScope]] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def __enter__(self) -> autocast:
        ctx = copy.copy(self._torch)  # a fresh torch.autocast per entry: re-entrant, thread-safe
        if (
            ctx._enabled
            and ctx._cache_enabled
            and _nested_in_other_dtype(self.device_type, self.dtype)
        ):
            # torch's weight-cast cache is keyed by tensor, not dtype: sharing it with an
            # enclosing region of another dtype would hand out casts of the wrong dtype
            ctx._cache_enabled = False
        ctx.__enter__()
        mode = (
            PolicyMode(self.dtype, self._overrides, self.device_type) if self._overrides else None
        )
        scope = PolicyScope(mode)
        try:
            scope.enter()
        except BaseException:
            ctx.__exit__(None, None, None)
            raise
        self._stack().append((ctx, scope))
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        stack = self._stack()
        if not stack:
            raise RuntimeError(
                f"{self!r}.__exit__() called without a matching __enter__() in this thread; "
                "use `with autocast(...):` (or call __enter__() first)"
            )
        ctx, scope = stack.pop()
        try:
            scope.exit()
        finally:
            ctx.__exit__(exc_type, exc_val, exc_tb)

    def __call__(self, func: F) -> F:
        if not callable(func):
            raise TypeError(
                f"autocast()(func) needs a callable, got {type(func).__name__}; to use it as a "
                "context manager write `with autocast(...):`"
            )

        @functools.wraps(func)
        def decorated(*args: Any, **kwargs: Any) -> Any:
            with self:
                return func(*args, **kwargs)

        return decorated  # type: ignore[return-value]

    def __repr__(self) -> str:
        ops = ""
        if self.policy is not None and not self.policy.is_default:
            ops = f", lower_ops={self.policy.lower_ops}, fp32_ops={self.policy.fp32_ops}"
        return (
            f"autocast(dtype={self.dtype}, device_type={self.device_type!r}, "
            f"enabled={self.enabled}{ops})"
        )


class autocast_backward:
    """Keep a policy's custom op lists in force while ``backward()`` runs.

    Autocast stays as it is (normally off during backward); the lists apply only
    where backward turns autocast back on: the forward recomputed by
    ``torch.utils.checkpoint`` (which restores the forward's autocast state) and
    custom autograd functions whose ``backward`` uses ``torch.amp.custom_bwd``.
    Without it, a checkpointed segment is recomputed with torch's default lists:
    ``use_reentrant=False`` then fails with a metadata mismatch and
    ``use_reentrant=True`` silently computes different gradients.

    Pass the policy the forward used (``None`` or a policy without custom ops does
    nothing). ``device_type=None`` follows each op's device.

    >>> import torch
    >>> import torch.nn.functional as F
    >>> from mixprec.amp import autocast, autocast_backward
    >>> from torch.utils.checkpoint import checkpoint
    >>> from mixprec.policy import OpPolicy
    >>> policy = OpPolicy(torch.bfloat16, lower_ops=["softmax"])
    >>> w = torch.randn(4, 4, requires_grad=True)
    >>> with autocast(device_type="cpu", policy=policy):
    ...     y = checkpoint(lambda w: F.softmax(w @ w, -1), w, use_reentrant=False)
    >>> with autocast_backward(policy):
    ...     y.float().sum().backward()
    >>> w.grad.dtype
    torch.float32
    """

    def __init__(self, policy: OpPolicy | None, *, device_type: str | None = None) -> None:
        if policy is not None and not isinstance(policy, OpPolicy):
            raise TypeError(
                f"policy must be a mixprec.OpPolicy or None, got {type(policy).__name__}"
            )
        self.policy = policy
        self.device_type = device_type
        overrides: dict[str, dict[str, Precision]] = {}
        if policy is not None and not policy.is_default:
            devices = (device_type,) if device_type is not None else ("cpu", "cuda")
            for device in devices:
                ops = policy.overrides(device)
                if ops:
                    overrides[device] = ops
        self._overrides = overrides
        self._local = threading.local()

    def __enter__(self) -> autocast_backward:
        mode = None
        if self.policy is not None and self._overrides:
            mode = PolicyMode(self.policy.dtype, self._overrides, self.device_type)
        scope = PolicyScope(mode)
        scope.enter()
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        stack.append(scope)
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        self._local.stack.pop().exit()

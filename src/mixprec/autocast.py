"""The autocast engine: ``torch.autocast`` plus custom op lists.

:class:`autocast` takes ``torch.autocast``'s arguments and an op policy. Without
custom ops it *is* ``torch.autocast`` (same dtypes, same values, nothing added per
op). With custom ops, a ``TorchFunctionMode`` intercepts only the ops whose class
the policy changes: it casts their floating inputs explicitly and runs them with
autocast off, so PyTorch's C++ lists cannot cast them back. The casts happen above
autograd, so backward returns each input's gradient in that input's dtype.

How the rest of autocast's machinery sees custom ops:

- The policy mode only acts while autocast is on for the op's device with the
  policy's dtype. It is harmless elsewhere, so it can stay entered around
  ``backward()``: :class:`autocast_backward` does that, so the forward that
  activation checkpointing recomputes during backward (under the autocast state
  ``torch.utils.checkpoint`` restores) follows the same policy. Both checkpoint
  flavours (``use_reentrant=True`` and ``False``) are covered.
- The innermost ``mixprec.autocast`` decides the op lists of its region: a nested
  region with other custom ops, with none, with another dtype or with
  ``enabled=False`` shadows the outer lists until it exits.
- ``torch.compile`` traces the mode: compiled and eager code run the same ops in
  the same dtypes, with no graph break added.
- Ops are matched by the name Python code calls them by (``torch.softmax``,
  ``F.softmax`` and ``Tensor.softmax`` are all "softmax"; ``a @ b`` is "matmul").
  Ops that a composite calls from C++, or that a Python-level torch function
  (such as ``F.multi_head_attention_forward``) calls internally, are not seen;
  list the composite itself or use an fp32 island (:mod:`mixprec.islands`).

>>> import torch
>>> from mixprec.autocast import autocast
>>> lin = torch.nn.Linear(4, 4)
>>> x = torch.randn(2, 4)
>>> with autocast(torch.bfloat16, device_type="cpu", fp32_ops=["linear"]):
...     y = lin(x)
...     z = torch.softmax(y, -1)
>>> y.dtype, z.dtype
(torch.float32, torch.float32)
>>> with autocast(torch.bfloat16, device_type="cpu", lower_ops=["softmax"]):
...     z = torch.softmax(lin(x), -1)
>>> z.dtype
torch.bfloat16
"""

from __future__ import annotations

import copy
import functools
import inspect
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode

from mixprec.dtypes import parse_dtype
from mixprec.policy import (
    OP_ALIASES,
    OpPolicy,
    Precision,
    record_registered_op,
    registered_ops,
)

__all__ = [
    "autocast",
    "autocast_backward",
    "custom_op_precision",
    "register_op",
    "registered_ops",
    "unregister_op",
]

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


# ---------------------------------------------------------------------- casting
def _eligible(t: torch.Tensor, device_type: str) -> bool:
    # autocast's rule: floating, on the autocast device, and never float64
    return t.is_floating_point() and t.dtype is not torch.float64 and t.device.type == device_type


def _cast(value: Any, device_type: str, dtype: torch.dtype) -> Any:
    """Cast the eligible floating tensors in ``value`` (nested lists, tuples, dicts) to ``dtype``."""
    if isinstance(value, torch.Tensor):
        if value.dtype is not dtype and _eligible(value, device_type):
            return value.to(dtype)
        return value
    if isinstance(value, list | tuple):
        items = [_cast(v, device_type, dtype) for v in value]
        if type(value) in (list, tuple):
            return type(value)(items)
        if hasattr(value, "_fields"):  # namedtuple
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, dict):
        return {k: _cast(v, device_type, dtype) for k, v in value.items()}
    return value


def _floating_dtypes(value: Any, device_type: str, out: list[torch.dtype]) -> None:
    if isinstance(value, torch.Tensor):
        if _eligible(value, device_type):
            out.append(value.dtype)
    elif isinstance(value, list | tuple):
        for v in value:
            _floating_dtypes(v, device_type, out)
    elif isinstance(value, dict):
        for v in value.values():
            _floating_dtypes(v, device_type, out)


def _widest(args: Any, kwargs: Any, device_type: str, low: torch.dtype) -> torch.dtype:
    """The promote target: fp32 if any eligible input is fp32 or the inputs mix two
    low-precision types, else the one low-precision type (the autocast dtype if none)."""
    found: list[torch.dtype] = []
    _floating_dtypes(args, device_type, found)
    _floating_dtypes(kwargs, device_type, found)
    kinds = set(found)
    if not kinds:
        return low
    if torch.float32 in kinds or len(kinds) > 1:
        return torch.float32
    return kinds.pop()


def _target_dtype(
    precision: Precision, args: Any, kwargs: Any, device_type: str, low: torch.dtype
) -> torch.dtype:
    if precision is Precision.LOW:
        return low
    if precision is Precision.FP32:
        return torch.float32
    return _widest(args, kwargs, device_type, low)


def _device_type_of(value: Any) -> str | None:
    if isinstance(value, torch.Tensor):
        return value.device.type
    if isinstance(value, list | tuple):
        for v in value:
            found = _device_type_of(v)
            if found is not None:
                return found
    elif isinstance(value, dict):
        return _device_type_of(tuple(value.values()))
    return None


def _run_in(
    func: Callable[..., Any],
    precision: Precision,
    args: Any,
    kwargs: Any,
    device_type: str,
    low: torch.dtype,
) -> Any:
    """Run ``func`` as autocast runs an op of class ``precision``: cast, then autocast off."""
    target = _target_dtype(precision, args, kwargs, device_type, low)
    args = _cast(args, device_type, target)
    kwargs = _cast(kwargs, device_type, target)
    with torch.autocast(device_type, enabled=False):
        return func(*args, **kwargs)


# ------------------------------------------------------------------ the policy mode
def _names_for(ops: Iterable[str]) -> set[str]:
    """The Python-level names under which each op can reach a TorchFunctionMode:
    its own, its aliases (``__matmul__``) and its overloads (``softmax.int``)."""
    names = set(ops)
    names.update(alias for alias, op in OP_ALIASES.items() if op in names)
    for op in list(names):
        packet = getattr(torch.ops.aten, op, None) if op.isidentifier() else None
        if isinstance(packet, torch._ops.OpOverloadPacket):
            names.update(f"{op}.{overload}" for overload in packet.overloads())
    return names


# ------------------------------------------------------ backward under the policy mode
# A TorchFunctionMode is popped while its handler runs, and Tensor.backward /
# torch.autograd.backward dispatch to modes first: so backward() called under the mode
# would start the autograd engine with the mode gone, and the engine carries the mode
# stack it starts with into backward (checkpoint recomputation, custom_bwd code). The
# mode therefore starts the engine itself, with itself pushed again.
_BACKWARD_ENTRY_NAMES = frozenset({"backward"})


def _plain_tensors(values: tuple[Any, ...]) -> bool:
    return all(type(v) in (torch.Tensor, torch.nn.Parameter) for v in values)


def _backward_with_mode(mode: TorchFunctionMode, func: Any, args: Any, kwargs: Any) -> Any:
    """Run ``Tensor.backward`` / ``torch.autograd.backward`` with ``mode`` on the stack.

    Falls back to calling ``func`` (the mode then sits out backward) for arguments
    this does not handle: tensor subclasses, the deprecated ``grad_variables``, or a
    PyTorch without the helpers used here.
    """
    make_grads = getattr(torch.autograd, "_make_grads", None)
    to_tuple = getattr(torch.autograd, "_tensor_or_tensors_to_tuple", None)
    run_engine = getattr(torch.autograd.graph, "_engine_run_backward", None)
    try:
        if func is torch.Tensor.backward:
            bound = inspect.signature(func).bind(*args, **kwargs)
            a = bound.arguments
            tensors, grads = a["self"], a.get("gradient")
        elif func is torch.autograd.backward:
            bound = inspect.signature(func).bind(*args, **kwargs)
            a = bound.arguments
            if a.get("grad_variables") is not None:
                raise TypeError("grad_variables")
            tensors, grads = a["tensors"], a.get("grad_tensors")
        else:
            raise TypeError(func)
        retain_graph, create_graph = a.get("retain_graph"), a.get("create_graph", False)
        inputs = a.get("inputs")
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        if inputs is None:
            inputs_tuple: tuple[Any, ...] = ()
        elif isinstance(inputs, torch.Tensor):
            inputs_tuple = (inputs,)
        elif isinstance(inputs, list | tuple):
            inputs_tuple = tuple(inputs)
        else:
            raise TypeError(inputs)
        if (
            make_grads is None
            or to_tuple is None
            or run_engine is None
            or (not inputs_tuple and inputs is not None)
            or not _plain_tensors(tensors + inputs_tuple)
        ):
            raise TypeError("unsupported")
    except TypeError:
        return func(*args, **kwargs)
    grad_tensors = make_grads(tensors, to_tuple(grads, len(tensors)), is_grads_batched=False)
    if retain_graph is None:
        retain_graph = create_graph
    with mode:
        run_engine(
            tensors,
            grad_tensors,
            retain_graph,
            create_graph,
            inputs_tuple,
            allow_unreachable=True,
            accumulate_grad=True,
        )
    return None


class _PolicyMode(TorchFunctionMode):
    """Intercepts the ops a policy moves to another class; passes everything else through.

    Acts only while autocast is enabled on the op's device with ``dtype`` and no
    inner mixprec region shadows it, so it can stay entered around ``backward()``.
    ``device_type=None`` serves every device with its own overrides.
    """

    def __init__(
        self,
        dtype: torch.dtype,
        overrides: Mapping[str, Mapping[str, Precision]],
        device_type: str | None,
    ) -> None:
        super().__init__()
        self.dtype = dtype
        self.device_type = device_type
        # device type -> python-level name -> precision
        self._by_device: dict[str, dict[str, Precision]] = {}
        for device, ops in overrides.items():
            table: dict[str, Precision] = {}
            for op, precision in ops.items():
                for name in _names_for((op,)):
                    table[name] = precision
            self._by_device[device] = table
        self._names = frozenset().union(_BACKWARD_ENTRY_NAMES, *self._by_device.values())
        self._shadowed = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if kwargs is None:
            kwargs = {}
        name = getattr(func, "__name__", None)
        if name not in self._names:
            return func(*args, **kwargs)
        if name in _BACKWARD_ENTRY_NAMES:
            return _backward_with_mode(self, func, args, kwargs)
        if self._shadowed:
            return func(*args, **kwargs)
        device_type = self.device_type or _device_type_of(args) or _device_type_of(kwargs)
        if (
            device_type is None
            or not torch.is_autocast_enabled(device_type)
            or torch.get_autocast_dtype(device_type) != self.dtype
        ):
            return func(*args, **kwargs)
        table = self._by_device.get(device_type)
        precision = table.get(name) if table is not None else None
        if precision is None:
            return func(*args, **kwargs)
        return _run_in(func, precision, args, kwargs, device_type, self.dtype)


def _policy_modes_on_stack() -> list[_PolicyMode]:
    if not torch._C._is_torch_function_mode_enabled():
        return []
    n = torch._C._len_torch_function_stack()
    modes = [torch._C._get_function_stack_at(i) for i in range(n)]
    return [m for m in modes if isinstance(m, _PolicyMode)]


class _PolicyScope:
    """Shadow the policy modes already entered, and enter a new one if there are overrides."""

    __slots__ = ("_mode", "_shadowed")

    def __init__(self, mode: _PolicyMode | None) -> None:
        self._mode = mode
        self._shadowed: list[_PolicyMode] = []

    def enter(self) -> None:
        self._shadowed = _policy_modes_on_stack()
        for outer in self._shadowed:
            outer._shadowed += 1
        if self._mode is not None:
            try:
                self._mode.__enter__()
            except BaseException:
                self._unshadow()
                raise

    def exit(self) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
        finally:
            self._unshadow()

    def _unshadow(self) -> None:
        for outer in self._shadowed:
            outer._shadowed -= 1
        self._shadowed = []


# ------------------------------------------------------------------------- autocast
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
    >>> from mixprec.autocast import autocast
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
        if requested is not None and requested not in (torch.bfloat16, torch.float16):
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
        elif lower_ops or fp32_ops:
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

    def _stack(self) -> list[tuple[Any, _PolicyScope]]:
        stack: list[tuple[Any, _PolicyScope]] | None = getattr(self._local, "stack", None)
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
            _PolicyMode(self.dtype, self._overrides, self.device_type) if self._overrides else None
        )
        scope = _PolicyScope(mode)
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
    >>> from mixprec.autocast import autocast, autocast_backward
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
            mode = _PolicyMode(self.policy.dtype, self._overrides, self.device_type)
        scope = _PolicyScope(mode)
        scope.enter()
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        stack.append(scope)
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        self._local.stack.pop().exit()


# ----------------------------------------------------------------- custom op hook
# Function class -> (inherited apply, the class's own apply or None, precision)
_PATCHED_FUNCTIONS: dict[type, tuple[Any, Any, Precision]] = {}
_LIBRARIES: dict[str, list[torch.library.Library]] = {}


def _run_with_precision(
    call: Callable[..., Any], precision: Precision, args: Any, kwargs: Any
) -> Any:
    device_type = _device_type_of(args) or _device_type_of(kwargs)
    if device_type is None or not torch.is_autocast_enabled(device_type):
        return call(*args, **kwargs)
    low = torch.get_autocast_dtype(device_type)
    return _run_in(call, precision, args, kwargs, device_type, low)


def _op_qualname(target: Any) -> str | None:
    from torch._library.custom_ops import CustomOpDef

    if isinstance(target, CustomOpDef):
        return target._qualname
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, str) and "::" in target:
        return target
    return None


def _register_library_op(qualname: str, precision: Precision) -> None:
    namespace, _, opname = qualname.partition("::")
    if namespace == "aten":
        raise ValueError(
            f"register_op() is for user ops; {qualname!r} is a PyTorch op: put it in "
            "OpPolicy(lower_ops=..., fp32_ops=...) instead"
        )
    if not namespace or not opname:
        raise ValueError(f"register_op() got {qualname!r}; a library op is named 'namespace::op'")
    try:
        packet = getattr(getattr(torch.ops, namespace), opname.partition(".")[0])
        overloads = (
            [getattr(packet, opname.partition(".")[2])]
            if "." in opname
            else [getattr(packet, name) for name in packet.overloads()]
        )
    except (AttributeError, RuntimeError):
        raise ValueError(
            f"register_op() got {qualname!r}, but no such op is registered with torch.library; define it "
            "first (torch.library.custom_op or a Library fragment), or check the namespace and name"
        ) from None
    _unregister_library_op(qualname)
    libs: list[torch.library.Library] = []
    for device_type in ("cpu", "cuda"):
        key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        key = getattr(torch._C.DispatchKey, key_name)
        lib = torch.library.Library(namespace, "IMPL")
        for overload in overloads:
            kernel = _autocast_kernel(overload, precision, device_type, key)
            if overload.has_kernel_for_dispatch_key(key):
                overload.py_kernels.pop(key, None)
            overload.py_impl(key)(kernel)

            def boxed(_keyset: Any, *args: Any, _k: Any = kernel, **kwargs: Any) -> Any:
                return _k(*args, **kwargs)

            base = overload._schema.name.partition("::")[2]
            suffix = overload._schema.overload_name
            lib.impl(f"{base}.{suffix}" if suffix else base, boxed, key_name, with_keyset=True)
        libs.append(lib)
    _LIBRARIES[qualname] = libs


def _autocast_kernel(
    op: Any, precision: Precision, device_type: str, key: Any
) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        low = torch.get_autocast_dtype(device_type)
        target = _target_dtype(precision, args, kwargs, device_type, low)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return op(*_cast(args, device_type, target), **_cast(kwargs, device_type, target))

    return kernel


def _unregister_library_op(qualname: str) -> bool:
    libs = _LIBRARIES.pop(qualname, None)
    if not libs:
        return False
    for lib in libs:
        lib._destroy()
    return True


def register_op(target: Any, precision: Precision | str) -> Any:
    """Declare the autocast class of a user op: ``"low"``, ``"fp32"`` or ``"promote"``.

    Under any autocast region (mixprec's or torch's) on the inputs' device, the op's
    floating inputs are cast to the autocast dtype / float32 / the widest floating
    input type, and the op runs with autocast off. Outside autocast nothing changes.
    This stops extensions that assume one dtype from failing with "expected scalar
    type Half but found Float".

    ``target`` may be:

    - a ``torch.autograd.Function`` subclass: its ``apply`` is patched in place;
    - a ``torch.library`` op (``torch.library.custom_op`` result, ``torch.ops.ns.op``,
      an overload, or "ns::op"): autocast kernels are registered for cpu and cuda;
    - any other callable: a wrapped callable is returned; call that one.

    Returns the target (or the wrapper). Registering again replaces the precision;
    :func:`unregister_op` undoes it.

    >>> import torch
    >>> from mixprec.autocast import autocast, register_op, unregister_op
    >>> class Fp32Only(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         if x.dtype != torch.float32:
    ...             raise RuntimeError(f"expected scalar type Float but found {x.dtype}")
    ...         return x * 2
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         return g * 2
    >>> _ = register_op(Fp32Only, "fp32")
    >>> with autocast(torch.bfloat16, device_type="cpu"):
    ...     y = Fp32Only.apply(torch.ones(2, dtype=torch.bfloat16))
    >>> y.dtype
    torch.float32
    >>> unregister_op(Fp32Only)
    True
    """
    p = Precision.parse(precision)
    if isinstance(target, type) and issubclass(target, torch.autograd.Function):
        _patch_function(target, p)
        record_registered_op(f"{target.__module__}.{target.__qualname__}", p)
        return target
    qualname = _op_qualname(target)
    if qualname is not None:
        _register_library_op(qualname, p)
        record_registered_op(qualname, p)
        return target
    if not callable(target):
        raise TypeError(
            "register_op() takes an autograd.Function subclass, a torch.library op or a "
            f"callable, got {type(target).__name__}"
        )

    @functools.wraps(target)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return _run_with_precision(target, p, args, kwargs)

    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
    record_registered_op(f"{getattr(target, '__module__', '?')}.{name}", p)
    return wrapped


def _patch_function(cls: type, precision: Precision) -> None:
    if cls not in _PATCHED_FUNCTIONS:
        original = inspect.getattr_static(cls, "apply")
        own = cls.__dict__.get("apply")

        def apply(klass: type, *args: Any, **kwargs: Any) -> Any:
            bound = original.__get__(None, klass)
            current = _PATCHED_FUNCTIONS[cls][2] if cls in _PATCHED_FUNCTIONS else None
            if current is None:  # unregistered while a subclass kept the patched apply
                return bound(*args, **kwargs)
            return _run_with_precision(bound, current, args, kwargs)

        apply.__doc__ = getattr(original, "__doc__", None)
        cls.apply = classmethod(apply)  # type: ignore[attr-defined]
        _PATCHED_FUNCTIONS[cls] = (original, own, precision)
    else:
        original, own, _ = _PATCHED_FUNCTIONS[cls]
        _PATCHED_FUNCTIONS[cls] = (original, own, precision)


def unregister_op(target: Any) -> bool:
    """Undo :func:`register_op` for an autograd Function or a torch.library op.

    Returns True if something was registered. (A wrapper returned for a plain
    callable is simply dropped by the caller.)
    """
    if isinstance(target, type) and target in _PATCHED_FUNCTIONS:
        _, own, _ = _PATCHED_FUNCTIONS.pop(target)
        if own is not None:
            target.apply = own  # type: ignore[attr-defined]
        else:
            delattr(target, "apply")
        record_registered_op(f"{target.__module__}.{target.__qualname__}", None)
        return True
    qualname = _op_qualname(target)
    if qualname is not None and _unregister_library_op(qualname):
        _clear_py_kernels(qualname)
        record_registered_op(qualname, None)
        return True
    return False


def _clear_py_kernels(qualname: str) -> None:
    namespace, _, opname = qualname.partition("::")
    packet = getattr(getattr(torch.ops, namespace), opname.partition(".")[0])
    for name in packet.overloads():
        overload = getattr(packet, name)
        for device_type in ("cpu", "cuda"):
            key = getattr(
                torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device_type)
            )
            overload.py_kernels.pop(key, None)


def custom_op_precision(precision: Precision | str) -> Callable[[F], F]:
    """Decorator form of :func:`register_op`.

    >>> import torch
    >>> from mixprec.autocast import autocast, custom_op_precision
    >>> @custom_op_precision("fp32")
    ... def my_kernel(x):
    ...     return x + 1
    >>> with autocast(torch.bfloat16, device_type="cpu"):
    ...     my_kernel(torch.ones(2, dtype=torch.bfloat16)).dtype
    torch.float32
    """
    Precision.parse(precision)

    def decorate(target: F) -> F:
        return register_op(target, precision)  # type: ignore[no-any-return]

    return decorate

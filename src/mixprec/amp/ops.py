"""Declaring the autocast class of user ops: :func:`register_op` and its decorator form.

Three kinds of target, three mechanisms: an ``autograd.Function`` gets its ``apply``
patched, a ``torch.library`` op gets autocast kernels at the dispatcher (cpu and
cuda), any other callable is wrapped. Each declaration is also recorded in
:func:`mixprec.policy.registered_ops`, which ``OpPolicy.explain()`` prints.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from mixprec.amp.casting import cast_call, device_type_of, run_in, target_dtype
from mixprec.policy import Precision, record_registered_op, registered_ops

__all__ = ["custom_op_precision", "register_op", "unregister_op"]

F = TypeVar("F", bound=Callable[..., Any])

# Function class -> (inherited apply, the class's own apply or None, precision)
_PATCHED_FUNCTIONS: dict[type, tuple[Any, Any, Precision]] = {}
_LIBRARIES: dict[str, list[torch.library.Library]] = {}


def _run_with_precision(
    call: Callable[..., Any], precision: Precision, args: Any, kwargs: Any
) -> Any:
    device_type = device_type_of(args, kwargs)
    if device_type is None or not torch.is_autocast_enabled(device_type):
        return call(*args, **kwargs)
    low = torch.get_autocast_dtype(device_type)
    return run_in(call, precision, args, kwargs, device_type, low)


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
        target = target_dtype(precision, args, kwargs, device_type, low)
        cast_args, cast_kwargs = cast_call(args, kwargs, device_type, target)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return op(*cast_args, **cast_kwargs)

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
    >>> from mixprec.amp import autocast, register_op, unregister_op
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

    record_registered_op(_callable_name(target), p)  # the wrapper runs the precision; the record informs explain()
    return wrapped


def _callable_name(target: Any) -> str:
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
    return f"{getattr(target, '__module__', '?')}.{name}"


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
    """Undo :func:`register_op` for an autograd Function, a torch.library op, or a plain
    callable (given itself or the wrapper register_op returned: the record is forgotten;
    the wrapper keeps its precision, so stop calling it).

    Returns True if something was registered.
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
    if callable(target):
        name = _callable_name(getattr(target, "__wrapped__", target))
        if name in registered_ops():
            record_registered_op(name, None)
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
    >>> from mixprec.amp import autocast, custom_op_precision
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

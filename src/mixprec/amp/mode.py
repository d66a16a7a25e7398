"""The policy mode: a ``TorchFunctionMode`` that runs the ops a policy moves in their new class.

:class:`PolicyMode` intercepts only the Python-level names of the ops whose class a
policy changes (everything else passes through untouched) and runs them with
:func:`~mixprec.amp.casting.run_in`. :class:`PolicyScope` enters one and shadows the
policy modes already on the stack, so the innermost mixprec region decides.

>>> import torch
>>> from mixprec.policy import Precision
>>> from mixprec.amp.mode import PolicyMode
>>> forced = PolicyMode(torch.bfloat16, {"cpu": {"softmax": Precision.LOW}}, "cpu")
>>> with torch.autocast("cpu", dtype=torch.bfloat16), forced:
...     torch.softmax(torch.ones(2), -1).dtype
torch.bfloat16
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from mixprec.amp.backward import BACKWARD_ENTRY_NAMES, backward_with_mode
from mixprec.amp.casting import device_type_of, run_in
from mixprec.policy import OP_ALIASES, Precision

__all__ = ["PolicyMode", "PolicyScope", "policy_modes_on_stack"]


def _names_for(ops: Iterable[str]) -> set[str]:
    """The Python-level names under which each op can reach a TorchFunctionMode:
    its own, its aliases (``__matmul__``) and its overloads (``softmax.int``)."""
    return set().union(*(_op_names(op) for op in ops))


@functools.cache
def _op_names(op: str) -> frozenset[str]:
    # cached: every autocast region with a custom policy builds a mode from these
    names = {op, *(alias for alias, target in OP_ALIASES.items() if target == op)}
    for name in list(names):
        packet = getattr(torch.ops.aten, name, None) if name.isidentifier() else None
        if isinstance(packet, torch._ops.OpOverloadPacket):
            names.update(f"{name}.{overload}" for overload in packet.overloads())
    return frozenset(names)


class PolicyMode(TorchFunctionMode):
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
        self._names = frozenset().union(BACKWARD_ENTRY_NAMES, *self._by_device.values())
        self._shadowed = 0

    def shadow(self) -> None:
        """An inner mixprec region starts: pass every op through until :meth:`unshadow`."""
        self._shadowed += 1

    def unshadow(self) -> None:
        """The inner region that called :meth:`shadow` has exited."""
        self._shadowed -= 1

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if kwargs is None:
            kwargs = {}
        name = getattr(func, "__name__", None)
        if name not in self._names:
            return func(*args, **kwargs)
        if name in BACKWARD_ENTRY_NAMES:
            return backward_with_mode(self, func, args, kwargs)
        if self._shadowed:
            return func(*args, **kwargs)
        device_type = self.device_type or device_type_of(args, kwargs)
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
        return run_in(func, precision, args, kwargs, device_type, self.dtype)


def policy_modes_on_stack() -> list[PolicyMode]:
    """The policy modes on this thread's torch-function mode stack, outermost first."""
    if not torch._C._is_torch_function_mode_enabled():
        return []
    n = torch._C._len_torch_function_stack()
    modes = [torch._C._get_function_stack_at(i) for i in range(n)]
    return [m for m in modes if isinstance(m, PolicyMode)]


class PolicyScope:
    """Shadow the policy modes already entered, and enter a new one if there are overrides."""

    __slots__ = ("_mode", "_shadowed")

    def __init__(self, mode: PolicyMode | None) -> None:
        self._mode = mode
        self._shadowed: list[PolicyMode] = []

    def enter(self) -> None:
        """Shadow the outer policy modes, then push this scope's mode (if any)."""
        self._shadowed = policy_modes_on_stack()
        for outer in self._shadowed:
            outer.shadow()
        if self._mode is not None:
            try:
                self._mode.__enter__()
            except BaseException:
                self._unshadow()
                raise

    def exit(self) -> None:
        """Pop this scope's mode and unshadow the outer ones (also when popping fails)."""
        try:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
        finally:
            self._unshadow()

    def _unshadow(self) -> None:
        for outer in self._shadowed:
            outer.unshadow()
        self._shadowed = []

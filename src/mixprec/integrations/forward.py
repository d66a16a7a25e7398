"""A module's forward under a plan's autocast, kept as the module's own ``forward``.

A loop that never opens ``mp.autocast()`` (Accelerate's: the user calls ``model(x)``)
needs the prepared model itself to compute in the plan's precision, as Accelerate's
own mixed precision does it: ``model.forward`` becomes an instance attribute that runs
the class's forward inside the autocast. :class:`AutocastForward` is that attribute.
It holds the module and the frozen plan, never a closure over them and never the
:class:`~mixprec.MixedPrecision` (whose optimizers and counters belong to one run), so
the prepared model stays an ordinary module:

- ``copy.deepcopy(model)`` (an EMA or evaluation copy) runs the copy's weights in the
  plan's precision; changing or loading the copy leaves the original alone;
- ``torch.save(model)`` / ``torch.load(..., weights_only=False)`` give back a model that
  still computes in the plan's precision (loading needs mixprec, not the framework);
- ``state_dict()`` / ``load_state_dict()`` are the module's own (the forward is no
  parameter or buffer).

>>> import copy, torch
>>> from mixprec import get_plan
>>> from mixprec.integrations.forward import AutocastForward
>>> model = torch.nn.Linear(4, 2)
>>> AutocastForward.install(model, get_plan("bf16-mixed"))
>>> model(torch.randn(3, 4)).dtype
torch.bfloat16
>>> twin = copy.deepcopy(model)
>>> twin.forward.module is twin
True
"""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType
from typing import Any

import torch

from mixprec.composable import FirstParameter
from mixprec.plans import Plan

__all__ = ["AutocastForward"]


class AutocastForward:
    """``module.forward`` replaced by the module's previous forward under ``plan.autocast``.

    The autocast's device type is where the module's parameters are at each call (a
    framework may move the model after it was prepared). Install it with :meth:`install`.

    Attributes:
        module: the module whose forward this is (a copy's own, after ``copy.deepcopy``).
        plan: the plan whose autocast the forward runs in.
    """

    def __init__(self, module: torch.nn.Module, plan: Plan, inner: Callable[..., Any] | None, bound: bool) -> None:
        self.module = module
        self.plan = plan
        # the forward it replaces: None for the class's own; a function to call with the
        # module first (``bound``: an instance-level method of the module); any other callable
        self._inner = inner
        self._bound = bound
        self._first = FirstParameter()
        self._first.of(module)  # found now: a compiled first call would otherwise compile twice

    @classmethod
    def install(cls, module: torch.nn.Module, plan: Plan) -> None:
        """Make ``module.forward`` run under ``plan``'s autocast (installed again: the new plan, one wrapper)."""
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"AutocastForward.install() expects an nn.Module, got {type(module).__name__}")
        if not isinstance(plan, Plan):
            raise TypeError(f"AutocastForward.install() expects a mixprec Plan, got {type(plan).__name__}")
        own = module.__dict__.get("forward")
        if isinstance(own, AutocastForward):  # prepared before (this plan now; never wrapped twice)
            inner, bound = own._inner, own._bound
        elif own is None:
            inner, bound = None, False
        elif isinstance(own, MethodType) and own.__self__ is module:
            # kept unbound: a copy or an unpickled model calls it with itself
            inner, bound = own.__func__, True
        else:
            inner, bound = own, False
        module.forward = cls(module, plan, inner, bound)  # type: ignore[method-assign]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        first = self._first.of(self.module)
        with self.plan.autocast("cpu" if first is None else first.device.type):
            if self._inner is None:
                return type(self.module).forward(self.module, *args, **kwargs)
            if self._bound:
                return self._inner(self.module, *args, **kwargs)
            return self._inner(*args, **kwargs)

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        """The forward without the autocast (``inspect.signature(model.forward)`` reads it)."""
        if self._inner is None:
            return MethodType(type(self.module).forward, self.module)
        if self._bound:
            return MethodType(self._inner, self.module)
        return self._inner

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_first"]  # a cache of links into this module's dicts; found again after a copy
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._first = FirstParameter()

    def __repr__(self) -> str:
        return f"<forward of {type(self.module).__name__} under plan {self.plan.name!r}>"

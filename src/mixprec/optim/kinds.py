"""State kinds: per-parameter state a wrapper keeps beside the inner optimizer's, described once as data.

A :class:`StateKind` says what one kind of tensor is (its name in checkpoints and in
``explain()``, the memory class it counts in, its dtype, its shape, how it starts and how
it follows a step). A wrapper holds its kinds in a :class:`KindStore`, and everything
else reads the kinds from there: the wrapper's ``state_dict`` / ``load_state_dict``, the
validator (:func:`mixprec.optim.checks.check_kind_state`), the snapshot that undoes a
refused step (:mod:`mixprec.optim.snapshot`) and the memory estimate
(``state_bytes()``). Adding a kind is one entry: a :class:`StateKind`, given to
:meth:`~mixprec.optim.WrappedOptimizer.add_state_kind` (or listed in a wrapper class's
``state_kinds``).

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
>>> ema = StateKind("ema", "optimizer_state", "fp32 moving average of each weight", dtype=torch.float32,
...                 after_step=lambda p, v: v.lerp_(p.float(), 0.5), init=lambda p: p.float())
>>> store = KindStore([ema])
>>> store.bytes_by_category([w])  # predicted before the first step: 4 fp32 elements
{'optimizer_state': 16}
>>> store.before_step([w])  # created from the weight before its update
>>> with torch.no_grad():
...     _ = w.add_(1.0)
>>> store.after_step([w])
>>> store.get("ema", w).tolist()
[1.5, 1.5, 1.5, 1.5]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.dtypes import LOW_PRECISION_DTYPES
from mixprec.nested import local_share, shard_local

__all__ = ["CATEGORIES", "COMPENSATION", "MASTER", "KindStore", "StateKind"]

#: names a kind cannot take: the wrappers' own checkpoint entries beside the kinds'
RESERVED_NAMES = frozenset({"state_kinds", "compiled_layouts", "generators", "seed", "counter", "step"})

#: the memory classes a kind may count in (those of ``WrappedOptimizer.state_bytes``)
CATEGORIES: tuple[str, ...] = ("master_weights", "optimizer_state", "compensation", "grad_accumulation")


def _low_precision(param: torch.Tensor) -> bool:
    return param.dtype in LOW_PRECISION_DTYPES


@dataclass(frozen=True)
class StateKind:
    """One kind of per-parameter state.

    Args:
        name: its key in a state_dict and its row in ``explain()``; unique within a wrapper.
        category: the memory class it counts in (one of :data:`CATEGORIES`).
        describe: one line for ``explain()`` and error messages.
        dtype: its dtype; None: the parameter's.
        shape: its shape from the parameter's; None: the parameter's shape.
        applies: which parameters have one (default: the bf16/fp16 ones).
        init: its first value for a parameter (default: zeros); it may read the parameter.
        after_step: ``(param, value)`` after each update of ``param`` that stands (the
            value's own update rule, in place); None for state the update itself writes
            (Kahan's compensation).
        sparse: a 1-D int64 list of element indices of the parameter, of any length
            (``dtype`` and ``shape`` do not apply): counted as held, predicted empty.
    """

    name: str
    category: str
    describe: str
    dtype: torch.dtype | None = None
    shape: Callable[[torch.Tensor], torch.Size] | None = None
    applies: Callable[[torch.Tensor], bool] = _low_precision
    init: Callable[[torch.Tensor], torch.Tensor] | None = None
    after_step: Callable[[torch.Tensor, torch.Tensor], None] | None = None
    sparse: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"StateKind name must be an identifier (its state_dict key), got {self.name!r}")
        if self.name in RESERVED_NAMES:
            raise ValueError(
                f"StateKind name {self.name!r} is taken by the wrappers' own checkpoint entries "
                f"({', '.join(sorted(RESERVED_NAMES))}); choose another name"
            )
        if self.category not in CATEGORIES:
            raise ValueError(
                f"StateKind {self.name!r} has category {self.category!r}; expected one of {', '.join(CATEGORIES)}"
            )

    def dtype_for(self, param: torch.Tensor) -> torch.dtype:
        if self.sparse:
            return torch.int64
        return param.dtype if self.dtype is None else self.dtype

    def shape_for(self, param: torch.Tensor) -> torch.Size:
        """The shape of a new tensor of this kind (a sparse kind's: empty)."""
        if self.sparse:
            return torch.Size([0])
        return param.shape if self.shape is None else torch.Size(self.shape(param))

    def nbytes_for(self, param: torch.Tensor) -> int:
        """Bytes of this kind's tensor for ``param`` (0 where it does not apply)."""
        if not self.applies(param):
            return 0
        share = local_share(param)  # an FSDP2 shard: this rank's part
        return round(self.shape_for(param).numel() * share) * self.dtype_for(param).itemsize

    @torch.no_grad()
    def new(self, param: torch.Tensor) -> torch.Tensor:
        """A first value for ``param``, of this kind's dtype and shape, on its device."""
        if self.init is None:
            return torch.zeros(self.shape_for(param), dtype=self.dtype_for(param), device=param.device)
        value = self.init(param).detach().to(device=param.device, dtype=self.dtype_for(param), copy=True)
        if value.shape != self.shape_for(param):
            raise ValueError(
                f"StateKind {self.name!r}: init returned shape {tuple(value.shape)}, expected "
                f"{tuple(self.shape_for(param))}"
            )
        return value


#: Kahan compensation: what rounding dropped from each low-precision weight, in its dtype
COMPENSATION = StateKind("compensation", "compensation", "what rounding dropped from each low-precision weight")
#: fp32 master weights (the master wrapper keeps them as the inner optimizer's parameters)
MASTER = StateKind("master", "master_weights", "fp32 copy of each low-precision weight", dtype=torch.float32)


class KindStore:
    """The tensors of a wrapper's state kinds, by kind name and parameter."""

    def __init__(self, kinds: Iterable[StateKind] = ()) -> None:
        self.kinds: dict[str, StateKind] = {}
        self.values: dict[str, dict[torch.Tensor, torch.Tensor]] = {}
        for kind in kinds:
            self.add(kind)

    def add(self, kind: StateKind) -> None:
        if not isinstance(kind, StateKind):
            raise TypeError(f"expected a mixprec.optim.kinds.StateKind, got {type(kind).__name__}")
        if kind.name in self.kinds:
            raise ValueError(f"a state kind named {kind.name!r} is already registered on this optimizer")
        self.kinds[kind.name] = kind
        self.values[kind.name] = {}

    def __iter__(self) -> Iterator[StateKind]:
        return iter(self.kinds.values())

    def __bool__(self) -> bool:
        return bool(self.kinds)

    # ------------------------------------------------------------------ access
    def get(self, name: str, param: torch.Tensor) -> torch.Tensor | None:
        return self.values[name].get(param)

    def ensure(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """The ``name`` tensor of ``param``, created by the kind's ``init`` if it has none yet."""
        value = self.values[name].get(param)
        if value is None:
            value = self.values[name][param] = self.kinds[name].new(param)
        return value

    def set(self, name: str, param: torch.Tensor, value: torch.Tensor) -> None:
        kind = self.kinds[name]
        if not kind.sparse and value.shape != kind.shape_for(param):
            raise ValueError(
                f"a {name} tensor of shape {tuple(value.shape)} for a parameter of shape {tuple(param.shape)}; "
                f"pass a tensor of shape {tuple(kind.shape_for(param))}"
            )
        self.values[name][param] = value

    def drop(self, name: str, param: torch.Tensor) -> None:
        self.values[name].pop(param, None)

    def of(self, param: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """Every kind's tensor of ``param`` (None where it has none), by name."""
        return {name: values.get(param) for name, values in self.values.items()}

    def tensors(self) -> Iterator[torch.Tensor]:
        for values in self.values.values():
            yield from values.values()

    # ------------------------------------------------------------- the step
    def before_step(self, params: Iterable[torch.Tensor]) -> None:
        """Create the missing tensors of kinds with an ``after_step`` rule for ``params`` about
        to be updated (their ``init`` reads the weights before the update)."""
        for kind in self.kinds.values():
            if kind.after_step is not None:
                for p in params:
                    if kind.applies(p):
                        self.ensure(kind.name, p)

    @torch.no_grad()
    def after_step(self, params: Iterable[torch.Tensor]) -> None:
        """Run each kind's ``after_step`` rule on ``params`` it applies to (after their update)."""
        for kind in self.kinds.values():
            if kind.after_step is None:
                continue
            for p in params:
                if kind.applies(p):
                    kind.after_step(p, self.ensure(kind.name, p))

    # -------------------------------------------------------------- memory
    def bytes_by_category(self, params: Iterable[torch.Tensor], *, skip: Sequence[str] = ()) -> dict[str, int]:
        """Bytes of every kind (but those named in ``skip``) over ``params``: a tensor as it is
        where one exists, else predicted from the kind's dtype and shape."""
        out: dict[str, int] = {}
        unique = list({id(p): p for p in params}.values())
        for kind in self.kinds.values():
            if kind.name in skip:
                continue
            values = self.values[kind.name]
            total = 0
            for p in unique:
                value = values.get(p)
                if value is not None:
                    total += shard_local(value).numel() * value.element_size()  # an FSDP2 shard: its part
                elif p.requires_grad:  # a frozen parameter is never stepped: it never gets one
                    total += kind.nbytes_for(p)
            out[kind.category] = out.get(kind.category, 0) + total
        return out

    # ---------------------------------------------------------- checkpoints
    def state(self, params: Sequence[torch.Tensor]) -> dict[str, dict[int, torch.Tensor]]:
        """``{kind name: {parameter index: copy}}`` over ``params`` (what a state_dict stores)."""
        return {
            name: {i: values[p].detach().clone() for i, p in enumerate(params) if p in values}
            for name, values in self.values.items()
        }

    def load(self, saved: dict[str, Any], params: Sequence[torch.Tensor]) -> None:
        """Replace every kind's tensors by ``saved`` (checked by
        :func:`mixprec.optim.checks.check_kind_state` first; a kind absent from it starts afresh)."""
        for name, kind in self.kinds.items():
            entries = saved.get(name) or {}
            values = {
                params[int(i)]: v.detach().to(device=params[int(i)].device, dtype=kind.dtype_for(params[int(i)]),
                                              copy=True)
                for i, v in entries.items()
            }
            self.values[name] = {p: v.sort().values for p, v in values.items()} if kind.sparse else values

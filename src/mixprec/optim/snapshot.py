"""The one way optimizer-owned state is put back: undoing a refused step, and a refused load.

A :class:`Snapshot` copies, for each parameter given to :meth:`Snapshot.add`, its value, its
state in the optimizer (moments in any dtype, step counts) and its tensors of every state
kind (:mod:`mixprec.optim.kinds`: Kahan compensation, remainders, ...), optionally the param
group settings and a wrapper's small extra state (the rounding noise). :meth:`Snapshot.restore`
puts them back bit for bit, once. The master-weight guard snapshots every master at once,
the fp16 guard of the low-precision wrappers every parameter, and the optimizer in backward
one parameter per hook. :meth:`Snapshot.nbytes` is what it holds: the copied tensors, never
more (:func:`~mixprec.optim.footprint.low_precision_step_transient` predicts it).

:func:`all_or_nothing` is the same promise for a load: a load that fails half-way puts the
optimizer's state, groups and the wrapper's attributes back as they were.

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(2))
>>> sgd = torch.optim.SGD([w], lr=1.0, momentum=0.9)
>>> w.grad = torch.ones(2)
>>> snap = Snapshot(sgd, groups=True).add([w])
>>> sgd.step()
>>> snap.restore()
True
>>> w.detach(), len(sgd.state)
(tensor([1., 1.]), 0)
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec.optim.kinds import KindStore
from mixprec.optim.scratch import FlatViews, int_views
from mixprec.optim.shards import local_of

__all__ = ["DeviceSnapshot", "Saved", "Snapshot", "all_or_nothing", "clone_all", "masters_nonfinite"]


@dataclass
class Saved:
    """What one parameter held before: its value, optimizer state and state-kind tensors."""

    param: torch.Tensor
    value: torch.Tensor
    state: dict[Any, Any] | None
    kinds: dict[str, torch.Tensor | None] = field(default_factory=dict)
    kind_key: torch.Tensor | None = None  # the parameter the kinds are kept for (default: ``param``)
    version: int | None = None  # marks a caller may set after the update (the optimizer in backward)
    state_after: Any = None


def clone_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (one foreach copy per device and dtype; DTensors stay DTensors)."""
    out = [torch.empty_like(t) for t in tensors]
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for t, c in zip(tensors, out, strict=True):
        dst, src = groups.setdefault((t.device, t.dtype), ([], []))
        dst.append(c)
        src.append(t)
    for dst, src in groups.values():  # FSDP2 shards: copied as this rank's local tensors
        torch._foreach_copy_([local_of(t) for t in dst], [local_of(t) for t in src])
    return out


class Snapshot:
    """Copies of parameters, their optimizer state and state-kind tensors, restored together.

    Args:
        optimizer: the optimizer whose ``state`` holds the parameters' state.
        kinds: the wrapper's state kinds (None: none).
        groups: also copy the param groups' settings (everything but ``params``).
        extra: a wrapper's own small state (deep-copied; the caller restores it from
            :attr:`extra` after :meth:`restore`).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, kinds: KindStore | None = None, *, groups: bool = False,
        extra: Any = None,
    ) -> None:
        self.optimizer = optimizer
        self.kinds = kinds
        self.entries: list[Saved] = []
        self.groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] if groups else None
        self.extra = copy.deepcopy(extra)
        self.restored = False

    @torch.no_grad()
    def add(self, params: Iterable[torch.Tensor], kind_keys: Sequence[torch.Tensor] | None = None) -> Snapshot:
        """Copy ``params`` as they are now (one foreach copy per device and dtype); returns self.
        ``kind_keys``: the parameters their state kinds are kept for, where those differ (the
        model parameters of fp32 masters)."""
        params = list(params)
        keys = list(kind_keys) if kind_keys is not None else params
        sources: list[torch.Tensor] = list(params)
        entries = []
        for p, key in zip(params, keys, strict=True):
            live = self.optimizer.state.get(p)
            state = None if live is None else dict(live)
            kinds = self.kinds.of(key) if self.kinds is not None else {}
            entries.append(Saved(p, p, state, kinds, key))
            sources.extend(v for v in (state or {}).values() if isinstance(v, torch.Tensor))
            sources.extend(v for v in kinds.values() if v is not None)
        by_id = {id(t): c for t, c in zip(sources, clone_all(sources), strict=True)}
        for entry in entries:
            entry.value = by_id[id(entry.param)]
            if entry.state is not None:
                entry.state = {
                    k: by_id[id(v)] if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in entry.state.items()
                }
            entry.kinds = {k: None if v is None else by_id[id(v)] for k, v in entry.kinds.items()}
        self.entries.extend(entries)
        return self

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[Saved]:
        return iter(self.entries)

    @torch.no_grad()
    def became_nonfinite(self) -> torch.Tensor:
        """A bool tensor: an fp16 parameter that was finite when copied holds a non-finite value now
        (in this rank's shard of an FSDP2 parameter: the caller all-reduces the decision)."""
        flags = [
            (torch.isfinite(local_of(e.value)) & ~torch.isfinite(local_of(e.param))).any() for e in self.entries
            if e.param.dtype == torch.float16
        ]
        if not flags:
            return torch.zeros((), dtype=torch.bool)
        return torch.stack(flags).any()

    @torch.no_grad()
    def restore(self) -> bool:
        """Put every copied parameter, its state and state-kind tensors (and the group settings)
        back, the last copied first; in place where the layout allows. Once: False when it was
        already restored."""
        if self.restored:
            return False
        state = self.optimizer.state
        by_layout: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

        def put(dst: torch.Tensor, src: torch.Tensor) -> None:
            targets, values = by_layout.setdefault((dst.device, dst.dtype), ([], []))
            targets.append(dst)
            values.append(src)

        for e in reversed(self.entries):
            put(e.param, e.value)
            if e.state is None:
                state.pop(e.param, None)
            else:
                current = state.get(e.param)
                if current is None:
                    state[e.param] = e.state
                else:
                    for k in [k for k in current if k not in e.state]:
                        del current[k]
                    for k, v in e.state.items():
                        cur = current.get(k)
                        if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor) and _same_layout(cur, v):
                            put(cur, v)
                        else:
                            current[k] = v
            key = e.param if e.kind_key is None else e.kind_key
            if self.kinds is not None:
                for name, saved in e.kinds.items():
                    cur = self.kinds.get(name, key)
                    if saved is None:
                        self.kinds.drop(name, key)
                    elif cur is not None and _same_layout(cur, saved):
                        put(cur, saved)
                    else:
                        self.kinds.values[name][key] = saved
        for targets, values in by_layout.values():
            torch._foreach_copy_([local_of(t) for t in targets], [local_of(t) for t in values])
        if self.groups is not None:
            for group, saved_group in zip(self.optimizer.param_groups, self.groups, strict=False):
                group.update(saved_group)
        self.restored = True
        return True

    def nbytes(self) -> int:
        """Bytes of the copies held (what taking this snapshot allocated)."""
        total = 0
        for e in self.entries:
            tensors = [e.value, *(v for v in (e.state or {}).values() if isinstance(v, torch.Tensor))]
            tensors += [v for v in e.kinds.values() if v is not None]
            total += sum(local_of(t).numel() * t.element_size() for t in tensors)
        return total


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


@contextlib.contextmanager
def all_or_nothing(optimizer: torch.optim.Optimizer, owner: object | None = None, what: str = "") -> Iterator[None]:
    """A load inside this context that raises leaves ``optimizer``'s state and param groups
    (and ``owner``'s attributes) as they were. A ValueError/TypeError passes on as it is;
    another exception becomes a ValueError that starts with ``what`` (default: "cannot load
    this optimizer state_dict into <its class>")."""
    old_state, old_groups = optimizer.state, optimizer.param_groups
    old_attrs = dict(owner.__dict__) if owner is not None else None
    kinds = getattr(owner, "kinds", None)
    old_kinds = dict(kinds.values) if isinstance(kinds, KindStore) else None  # KindStore.load replaces them
    try:
        yield
    except Exception as exc:
        optimizer.state, optimizer.param_groups = old_state, old_groups
        if owner is not None and old_attrs is not None:
            owner.__dict__.clear()
            owner.__dict__.update(old_attrs)
        if isinstance(kinds, KindStore) and old_kinds is not None:
            kinds.values = old_kinds
        if isinstance(exc, ValueError | TypeError):
            raise
        what = what or f"cannot load this optimizer state_dict into {type(optimizer).__name__}"
        raise ValueError(
            f"{what} ({type(exc).__name__}: {exc}); nothing was changed. Was it saved from another kind of optimizer?"
        ) from exc


class DeviceSnapshot:
    """Copies of tensors, put back where a device flag says so, without reading it on the host.

    :meth:`take` copies the tensors into scratch views made once (:class:`~mixprec.optim.scratch.FlatViews`:
    one foreach copy, no per-tensor host work while the tensors stay the same);
    :meth:`restore_where` puts the saved bits back exactly where ``flag`` is 1 and changes
    nothing where it is 0, in integer arithmetic on the tensors' bits (``t += flag * (saved - t)``,
    wrapping: exact for every value, NaN patterns and signed zeros included), three foreach
    kernels per element size; :meth:`release` frees the copies' memory.

    >>> import torch
    >>> w = torch.tensor([1.5, float("nan")])
    >>> snap = DeviceSnapshot()
    >>> snap.take([w])
    >>> _ = w.add_(1.0)
    >>> snap.restore_where(torch.tensor(0.0)); w
    tensor([2.5000,    nan])
    >>> snap.take([w]); _ = w.add_(1.0)
    >>> snap.restore_where(torch.tensor(1.0)); w
    tensor([2.5000,    nan])
    """

    def __init__(self) -> None:
        self._scratch = FlatViews()
        self._key: tuple[tuple[int, int], ...] | None = None
        self._groups: dict[tuple[int, torch.device], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.taken = False

    @torch.no_grad()
    def take(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors`` as they are now (empty ones are left out)."""
        tensors = [local_of(t) for t in tensors if t.numel()]
        saved = self._scratch.take(tensors)
        key = tuple((id(t), t.data_ptr()) for t in tensors)
        if key != self._key:  # new tensors (a first step, a load): their bit views once
            groups: dict[tuple[int, torch.device], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            for t, bits, copy_bits in zip(tensors, int_views(tensors), int_views(saved), strict=True):
                cur, old = groups.setdefault((t.element_size(), t.device), ([], []))
                cur.append(bits)
                old.append(copy_bits)
            self._key, self._groups = key, groups
        if tensors:
            torch._foreach_copy_(saved, tensors)
        self.taken = True

    @torch.no_grad()
    def restore_where(self, flag: torch.Tensor) -> None:
        """Put the saved values back where ``flag`` (a 0-dim 0/1 tensor) is 1; once per :meth:`take`
        (the copies are used up)."""
        for (_, device), (cur, old) in self._groups.items():  # the copies become the differences: no scratch
            torch._foreach_sub_(old, cur)
            torch._foreach_mul_(old, flag.to(device=device, dtype=cur[0].dtype))
            torch._foreach_add_(cur, old)
        self.taken = False  # (the copies are spent)

    @property
    def device(self) -> torch.device:
        """Where the copied tensors are (the CPU when nothing was copied)."""
        for cur, _ in self._groups.values():
            return cur[0].device
        return torch.device("cpu")

    def release(self) -> None:
        """Free the copies (the next :meth:`take` allocates them again)."""
        self._scratch.release()
        self.taken = False

    def nbytes(self) -> int:
        return self._scratch.held_bytes()


# ------------------------------------------------- the master-weight step guard
def _inf_threshold(dtype: torch.dtype) -> float:
    """The smallest magnitude that rounds to inf when cast to ``dtype`` (round to nearest even)."""
    fmax = torch.finfo(dtype).max
    _, exp = math.frexp(fmax)
    return fmax + torch.finfo(dtype).eps * 2.0 ** (exp - 1) / 2


@torch.no_grad()
def masters_nonfinite(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], optimizer: torch.optim.Optimizer
) -> torch.Tensor:
    """After a master-weight step: True if a master (of ``(model parameter, master)`` ``pairs``)
    or an fp32 parameter ``optimizer`` updates is inf/NaN, or a master
    rounds to inf in its model parameter's dtype (one inf-norm read of each).

    The optimizer state is not read: from finite gradients, the usual optimizers' state
    stays finite (Adam's squared gradients overflow fp32 only beyond 1.8e19; fp16
    gradients end at 65504), and a non-finite state shows in the masters it updates.
    """
    by_threshold: dict[tuple[torch.device, float], list[torch.Tensor]] = {}
    for p, m in pairs:
        if m.numel():  # an empty tensor holds nothing non-finite (and has no inf-norm)
            by_threshold.setdefault((m.device, _inf_threshold(p.dtype)), []).append(m)
    direct = {id(m) for _, m in pairs}
    fp32_max = _inf_threshold(torch.float32)
    for group in optimizer.param_groups:
        for q in group["params"]:
            if id(q) not in direct and q.is_floating_point() and q.numel():
                by_threshold.setdefault((q.device, fp32_max), []).append(q)
    flags = []
    device = None
    for (dev, threshold), tensors in by_threshold.items():
        device = device or dev
        norms = torch._foreach_norm(tensors, float("inf"))
        flags.append((~(torch.stack(norms).float() < threshold)).any().to(device))
    if not flags:
        return torch.zeros((), dtype=torch.bool)
    return torch.stack(flags).any()

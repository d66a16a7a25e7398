"""Optimizer state that follows the model's weights when something else writes them.

A master-weight or Kahan optimizer keeps more than the model's low-precision weight: an
fp32 master, or a compensation buffer holding what rounding dropped. Whoever writes the
weights after :meth:`~mixprec.MixedPrecision.prepare` (``model.load_state_dict``, a
framework's checkpoint or best-model reload, user code under ``torch.no_grad()``) leaves
that state describing the *old* weight, and the next step would write it back. So:

- A ``load_state_dict`` is seen as it happens: :func:`install_load_hooks` puts load hooks
  on the modules owning low-precision parameters, and each load reaches the parameter's
  *follower* (:func:`register`: the optimizer wrapper, or the seeds kept for optimizers
  not prepared yet) with the loaded values. Where they were wider than the parameter (an
  fp32 checkpoint into a bf16 model) the master takes them exactly, not their rounding,
  and a Kahan compensation takes their residual; elements the load left unchanged keep
  their master or compensation (a reload of the same weights loses nothing).
- Any other write (user code under ``torch.no_grad()``, ``param.data = ...``) is found at
  the next step: :class:`WriteWatch` stamps each parameter (autograd's version counter and
  the data pointer) when the optimizer wrote it last. Masters of written parameters are
  re-seeded element by element (:func:`seed_master`: a master whose rounding is still the
  weight stays, any other element starts from the weight); a written parameter's Kahan
  compensation starts again from zero.

Checking the stamps costs well under a microsecond per parameter and step; the
element-wise work runs only for parameters that were written.

>>> import torch
>>> from mixprec.optim.follow import WriteWatch
>>> w = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
>>> watch = WriteWatch()
>>> watch.record([w])
>>> with torch.no_grad():
...     _ = w.mul_(2)
>>> watch.changed([w]) == [w]
True
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

from mixprec.dtypes import LOW_PRECISION_DTYPES
from mixprec.nested import shard_local

__all__ = [
    "Follower", "Seeds", "WriteWatch", "follow_masters", "install_load_hooks", "load_compensation", "master_value", "register", "seed_master",
]


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _stamp(param: torch.Tensor) -> tuple[int, int]:
    local = shard_local(param)  # a DTensor's shard
    if type(local) not in _PLAIN and (local.device.type == "meta" or type(local).__name__ == "FakeTensor"):
        return local._version, id(local)  # no data (the memory estimator's fake models): the object stands in
    return local._version, local.data_ptr()


class WriteWatch:
    """The stamps of parameters as the optimizer last wrote (or checked) them."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[int, int]] = {}

    def record(self, params: Iterable[torch.Tensor]) -> None:
        """Note ``params`` as they are now: the optimizer wrote them, or took them in."""
        seen = self._seen
        for p in params:
            seen[id(p)] = _stamp(p)

    def changed(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters written since :meth:`record` (never recorded ones count as written)."""
        seen = self._seen
        return [p for p in params if seen.get(id(p)) != _stamp(p)]

    def forget(self) -> None:
        """Treat every parameter as written (after a copy, whose parameters are new objects)."""
        self._seen = {}


# ------------------------------------------------------------------------ loads
class Follower(Protocol):
    """Who keeps state beside a low-precision parameter and must hear of a load into it."""

    def loaded(self, param: torch.Tensor, value: torch.Tensor | None, kept: torch.Tensor) -> None:
        """``param`` was just loaded: ``value`` is what the state dict held when it was wider
        than the parameter (else None); ``kept`` is True where the load wrote the value the
        parameter had already."""


# parameter -> weak reference to its follower (the optimizer wrapper holding its master or
# compensation, or the seeds kept for optimizers not prepared yet)
_FOLLOWERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_PENDING: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> (value, kept) during one load


def register(follower: Any, params: Iterable[torch.Tensor]) -> None:
    """Tell ``follower`` of every later ``load_state_dict`` into ``params`` (the latest
    registration wins; the follower is held weakly)."""
    ref = weakref.ref(follower)
    for p in params:
        _FOLLOWERS[p] = ref


def _own_low_params(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in module._parameters.items() if p is not None and p.dtype in LOW_PRECISION_DTYPES]


def _before_load(module: torch.nn.Module, state_dict: Any, prefix: str, *args: Any) -> None:
    for name, p in _own_low_params(module):
        _PENDING.pop(p, None)
        if p not in _FOLLOWERS:
            continue
        value = state_dict.get(prefix + name) if hasattr(state_dict, "get") else None
        if (
            not isinstance(value, torch.Tensor)
            or type(value) is not type(p.detach())
            or value.shape != p.shape
            or not value.is_floating_point()
        ):
            continue  # torch refuses it, or it is nothing this module can compare
        with torch.no_grad():
            incoming = value.detach().to(p.device)
            kept = incoming.to(p.dtype) == p
        wider = incoming.dtype.itemsize > p.dtype.itemsize
        _PENDING[p] = (incoming if wider else None, kept)
        before = getattr(_FOLLOWERS[p](), "before_load", None)
        if callable(before):
            before(p)  # a follower that must first see writes made before this load (remainders)


def _after_load(module: torch.nn.Module, incompatible: Any) -> None:
    for _, p in _own_low_params(module):
        pending = _PENDING.pop(p, None)
        ref = _FOLLOWERS.get(p)
        follower = None if ref is None else ref()
        if pending is not None and follower is not None:
            follower.loaded(p, *pending)


def install_load_hooks(model: torch.nn.Module) -> list[Any]:
    """Hook ``load_state_dict`` of every module owning low-precision parameters, so each
    load reaches the parameters' followers (:func:`register`); returns the handles. The
    hooks are module-level functions: copies and pickles of the model keep them."""
    handles: list[Any] = []
    for module in model.modules():
        if _own_low_params(module):
            handles.append(module._register_load_state_dict_pre_hook(_before_load, with_module=True))
            handles.append(module.register_load_state_dict_post_hook(_after_load))
    return handles


# --------------------------------------------------------------------- following
@torch.no_grad()
def seed_master(param: torch.Tensor, master: torch.Tensor, loaded: torch.Tensor | None = None) -> None:
    """Bring ``master`` (fp32) in line with ``param``'s low-precision value, in place: elements
    whose rounding is the weight stay, elements of ``loaded`` (wider values just loaded)
    that round to it are taken, the rest start from the weight."""
    master.copy_(master_value(param, master, loaded))


def master_value(weight: torch.Tensor, master: torch.Tensor, loaded: torch.Tensor | None = None) -> torch.Tensor:
    """The master ``weight`` stands for now (the rule of :func:`seed_master`), as a new tensor."""
    w = weight.detach()
    new = torch.where(master.to(w.dtype) == w, master, w.to(master.dtype))
    if loaded is not None:
        new = torch.where(loaded.to(w.dtype) == w, loaded.to(master.dtype), new)
    return new


def follow_masters(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], watch: WriteWatch) -> int:
    """Re-seed the masters of parameters written since ``watch`` recorded them; returns how many.
    The caller records the parameters again once it has written them."""
    written = watch.changed(p for p, _ in pairs)
    if not written:
        return 0
    ids = {id(p) for p in written}
    for p, m in pairs:
        if id(p) in ids:
            seed_master(p, m)
    return len(written)


@torch.no_grad()
def load_compensation(comp: torch.Tensor, param: torch.Tensor, value: torch.Tensor | None, kept: torch.Tensor) -> None:
    """Kahan compensation after a load into ``param``: the residual of a wider loaded value
    (weight + compensation then stands for it), else kept where the load wrote the same value."""
    if value is not None:
        comp.copy_(value.to(torch.float32) - param.to(torch.float32))
    else:
        comp.mul_(kept)


class Seeds(dict):  # type: ignore[type-arg]
    """fp32 values that seed the masters of optimizers not prepared yet, by parameter; a load
    into a parameter replaces its seed (the loaded value where it was wider, else the weight)."""

    def loaded(self, param: torch.Tensor, value: torch.Tensor | None, kept: torch.Tensor) -> None:
        seed = self.get(param)
        if seed is not None:
            with torch.no_grad():
                fresh = param.detach().to(seed.dtype) if value is None else value.to(seed.dtype)
                self[param] = torch.where(kept, seed, fresh) if value is None else fresh

"""Exact fp32 master weights in two extra bytes: the bf16 weight plus a 16-bit remainder.

A bf16 weight is the top half of its fp32 master, rounded to nearest. :class:`RemainderOptimizer`
keeps the bottom half (an int16 remainder per weight) instead of a whole fp32 copy: inside
``step()`` the master is rebuilt exactly (:func:`mixprec.optim.quant.join_master`), updated in
fp32, and split again (:func:`~mixprec.optim.quant.split_master`: the weight is the
round-to-nearest-even cast of the new master, bit for bit, so the model sees exactly what
``bf16-master`` would give it). One case needs a 17th bit: a master exactly halfway between two
bf16 values that rounded down; such elements (about one in 2**17) are listed per weight as flat
indices. The optimizer state stays fp32 (``state_dtype``), so the update, and every weight and
loss, equal the fp32-master plan's bit for bit.

Training-state bytes for AdamW: 2 (weight) + 2 (gradient) + 2 (remainder) + 8 (fp32 moments)
= 14 per parameter, against 16 for fp32 masters; 12 with the optimizer in backward.

>>> import torch
>>> from mixprec.optim import RemainderOptimizer
>>> w = torch.nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
>>> opt = RemainderOptimizer(torch.optim.SGD([w], lr=1.0))
>>> for _ in range(100):
...     w.grad = torch.full_like(w, -1e-4)
...     opt.step()
>>> round(float(opt.master(w).mean()), 4), float(w[0])  # the master holds 1.01; the weight its rounding
(1.01, 1.0078125)
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch

from mixprec.nested import by_device_dtype
from mixprec.optim import codecs, shards
from mixprec.optim.compiled import CompileSetting, RemainderIO
from mixprec.optim.fast import Piece, prefer_fast_update
from mixprec.optim.follow import Seeds, WriteWatch, master_value, register
from mixprec.optim.kinds import StateKind
from mixprec.optim.lowbit import LowPrecisionOptimizer

__all__ = ["REMAINDER", "REMAINDER_TIES", "RemainderOptimizer"]

def _bf16(param: torch.Tensor) -> bool:
    return param.dtype == torch.bfloat16


#: the low 16 bits of each fp32 master
REMAINDER = StateKind(
    "remainder", "master_weights", "the low half of each fp32 master, whose rounded high half is the weight",
    dtype=torch.int16, applies=_bf16,
)
#: the elements whose master lies exactly halfway and rounded down (flat indices)
REMAINDER_TIES = StateKind(
    "remainder_ties", "master_weights", "elements whose master is an exact tie rounded down", applies=_bf16, sparse=True,
)


class RemainderOptimizer(LowPrecisionOptimizer):
    """bf16 weights with exact fp32 masters kept as an int16 remainder per weight.

    Args:
        optimizer: any torch optimizer over bf16 parameters (fp32 ones, such as norm
            layers, are stepped as they are).
        master_values: fp32 values to start the masters from, by parameter (the weights
            before the model was cast down); others start from their weights.
        state_dtype: dtype the optimizer state is kept in between steps (None, the
            default: fp32, as ``bf16-master``; bf16 saves 4 more bytes per parameter).
        fast, chunk_numel, fused: see :class:`LowPrecisionOptimizer`.
        compile: ``"auto"`` (the default) steps Adam/AdamW natively on the CPU when the state is
            kept in bf16, fp16 or 8 bits (:mod:`mixprec.optim.native`: one C loop per weight, the
            eager path's bits); elsewhere it runs groups of 2**20+ elements through
            ``torch.compile`` when the state is kept in bf16 (8-bit: measured no faster): the
            master is rebuilt, updated, split and the state expanded and stored in one loop
            per parameter (the eager path's arithmetic up to fp32 rounding, which the state's own
            rounding can carry to a unit of the state's dtype). With fp32 state it keeps
            the eager fast path (torch's fused kernel on the rebuilt masters), bit for bit
            ``bf16-master``; ``True`` compiles then too, ``False`` never (see
            :func:`~mixprec.optim.compiled.use_compiled_route`). Either way only groups the
            fast path takes (not with ``fused=False``, nor a group that sets ``foreach`` or
            ``fused`` itself) and contiguous weights on the CPU; the compiled route under
            "auto" only whole steps (the native one ``optimizer_in_backward`` too).
    """

    rounding = "remainder"
    #: a chunk's pieces, ties and remainders cost host time per chunk: 2**20 elements (10 MiB
    #: of scratch) step the GPT benchmark's 19.6M parameters 1.6x faster than 2**17 on one CPU core
    cpu_chunk_numel: ClassVar[int] = 1 << 20
    state_kinds: ClassVar[tuple[StateKind, ...]] = (REMAINDER, REMAINDER_TIES)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        master_values: Mapping[torch.Tensor, torch.Tensor] | None = None,
        state_dtype: torch.dtype | str | None = None,
        fast: bool = True,
        chunk_numel: int | None = None,
        fused: bool = True,
        compile: CompileSetting = "auto",
    ) -> None:
        if any(shards.is_dtensor(p) for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(
                "RemainderOptimizer does not run on FSDP2 shards: there the fp32 shards are the masters already "
                "(get_plan('bf16-master') under FSDP2 keeps them sharded, 4 B per parameter / world size)"
            )
        super().__init__(
            optimizer, state_dtype=state_dtype, fast=fast, chunk_numel=chunk_numel, fused=fused, compile=compile
        )
        for p in self._low_params():
            if p.dtype != torch.bfloat16:
                raise ValueError(
                    f"RemainderOptimizer needs bf16 parameters, got {p.dtype}: an fp16 weight is not the high half "
                    "of its fp32 master. Use MasterWeightOptimizer (get_plan('fp16-master'))"
                )
        self._watch = WriteWatch()  # the weights as this wrapper last wrote them
        # prepare()'s seeds of the parameters no optimizer holds yet, for groups added later
        self._seeds = weakref.ref(master_values) if isinstance(master_values, Seeds) else None
        held = {id(q) for q in self._low_params()}
        with torch.no_grad():
            for param, value in (master_values or {}).items():
                if _bf16(param) and id(param) in held:
                    self._seed(param, value)
        self._held = held
        self._follow_loads()

    def _seed(self, param: torch.Tensor, value: torch.Tensor) -> None:
        seed = value.detach().to(device=param.device, dtype=torch.float32)
        self._set_master(param, master_value(param, seed))

    def _adopt_added(self) -> None:
        """Masters for the bf16 parameters put into the groups since the last look (``add_param_group``
        on this wrapper or on the inner optimizer): from prepare()'s exact fp32 seed where it kept one
        (each used once), as the fp32-master wrapper seeds its masters, else from the weight. While
        the groups hold the same parameters, this is a set of ``id`` reads."""
        low = self._low_params()
        if len(low) == len(self._held) and all(id(p) in self._held for p in low):
            return
        seeds = self._seeds() if self._seeds is not None else None
        for p in low:
            if id(p) in self._held:
                continue
            self._held.add(id(p))
            seed = seeds.pop(p, None) if seeds is not None else None
            if seed is not None and _bf16(p) and self.kinds.get(REMAINDER.name, p) is None:
                self._seed(p, seed)
        self._follow_loads()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._adopt_added()

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        self._adopt_added()  # a group added to the inner optimizer since: seeded before it steps
        return super().step(closure)

    def step_selected(self, selected: set[torch.Tensor] | None) -> Any:
        self._adopt_added()
        return super().step_selected(selected)

    def _follow_loads(self) -> None:
        low = self._low_params()
        register(self, low)
        self._watch.record(low)

    # ------------------------------------------------------------------ masters
    def master(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 master of a bf16 ``param``, rebuilt exactly (a new tensor)."""
        rem = self.kinds.get(REMAINDER.name, param)
        if rem is None:
            return param.detach().float()
        return codecs.remainder_master(param.detach(), rem, self._ties(param))

    def master_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """The fp32 master of a bf16 model parameter this wrapper steps, rebuilt exactly (a new
        tensor; a weight written since the last step first becomes its own master, as the next step
        would take it); None for parameters it holds no master for (fp32 ones, others')."""
        self._adopt_added()
        if not _bf16(param) or id(param) not in {id(q) for q in self._low_params()}:
            return None
        self.follow_writes([param])
        return self.master(param)

    @torch.no_grad()
    def _set_master(self, param: torch.Tensor, master: torch.Tensor) -> None:
        """Store ``master`` (which rounds to ``param``'s weight) as its remainder and ties."""
        weight, rem, ties = codecs.remainder_split(master.contiguous())
        if not codecs.same_weight(weight, param.detach()):  # NaN bits may differ
            raise ValueError("a master value that does not round to its weight")  # pragma: no cover - callers ensure
        self.kinds.set(REMAINDER.name, param, rem)
        self.kinds.set(REMAINDER_TIES.name, param, ties)

    def _ties(self, param: torch.Tensor) -> torch.Tensor:
        ties = self.kinds.get(REMAINDER_TIES.name, param)
        return ties if ties is not None else torch.empty(0, dtype=torch.int64, device=param.device)

    def _remainder_for(self, param: torch.Tensor) -> torch.Tensor:
        return self.kinds.ensure(REMAINDER.name, param)

    def _compiled_rounding_inputs(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return self._remainder_for

    def _compiled_remainder(self) -> RemainderIO | None:
        return RemainderIO(self._ties, lambda p, ties: self.kinds.set(REMAINDER_TIES.name, p, ties))

    # ------------------------------------------- weights written from outside (follow.py)
    def follow_writes(self, params: Sequence[torch.Tensor]) -> None:
        """A weight written since this wrapper last wrote it (under ``torch.no_grad()``) has its
        weight as master again, every element of it: the remainder cannot tell which elements the
        write changed (fp32 masters can: there, untouched elements keep theirs); loads are
        handled as they happen, element by element."""
        for p in self._watch.changed(params):
            self.kinds.drop(REMAINDER.name, p)
            self.kinds.drop(REMAINDER_TIES.name, p)

    def note_written(self, params: Sequence[torch.Tensor]) -> None:
        self._watch.record(params)

    def before_load(self, param: torch.Tensor) -> None:
        """Just before a ``load_state_dict`` writes ``param``: a write since its last step first
        drops its remainder (else the load would keep one that belongs to another weight)."""
        self.follow_writes([param])

    def loaded(self, param: torch.Tensor, value: torch.Tensor | None, kept: torch.Tensor) -> None:
        """``param`` was loaded: its master becomes the loaded fp32 value where it was wider, and
        stays where the load wrote the value the weight had."""
        with torch.no_grad():
            if value is not None:
                self._set_master(param, master_value(param, self.master(param), value.to(torch.float32)))
            elif self.kinds.get(REMAINDER.name, param) is not None:
                old = self.master(param)
                self._set_master(param, torch.where(kept, old, param.detach().float()))
        self._watch.record([param])

    # ------------------------------------------------------------- clipping in fp32
    def scale_grads_later(self, factor: torch.Tensor) -> list[torch.Tensor]:
        """Multiply the bf16 weights' gradients by ``factor`` (a one-element fp32 tensor: a
        clip's) in fp32 inside the next ``step()``, where they are expanded, instead of in place
        now; returns the gradients taken (the caller scales the rest, fp32 ones, itself).

        A bf16 gradient times a clip factor rounds to bf16; the fp32-master plan multiplies the
        gradient's exact fp32 copy. Deferred, the product is that same fp32 value, so clipped
        runs stay bit-identical to ``bf16-master``. Until the step, ``.grad`` still reads
        unclipped. Cleared by the step, ``prepare_grads()`` (a new step) and ``zero_grad()``.
        """
        taken = [p.grad for p in self._low_params() if p.grad is not None]
        if taken:
            self._grad_scales = [*self._pending_grad_scales(), factor.detach().to(torch.float32).clone()]
        return taken

    def apply_pending_grad_scales(self) -> None:
        """Multiply the deferred factors into the bf16 ``.grad`` now (rounded to bf16): for an
        in-place change of the gradients after the clip (a value clip, a second measurement),
        which must see them clipped."""
        scales, self._grad_scales = self._pending_grad_scales(), []
        if not scales:
            return
        grads = [p.grad for p in self._low_params() if p.grad is not None]
        for (device, _), gs in by_device_dtype(grads).items():
            for factor in scales:
                torch._foreach_mul_(gs, factor.to(device))

    def prepare_grads(self) -> None:
        self._grad_scales = []  # a new step: a skipped one's clip is not carried over
        self._adopt_added()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grad_scales = []
        super().zero_grad(set_to_none=set_to_none)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_seeds": None}  # a weak reference to prepare()'s seeds

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._seeds = state.get("_seeds")
        self._held = {id(q) for q in self._low_params()}  # a copy holds new parameters
        self._follow_loads()

    def _fast_kind(self, group: dict[str, Any]) -> str | None:
        """The fast path only where the fp32-master wrapper would pick torch's fused kernel or
        foreach for the group (both left at torch's default) and ``fused`` is on; a group that
        chooses its implementation itself steps on the generic path, with that implementation."""
        explicit = group.get("foreach") is not None or bool(group.get("fused"))
        return None if explicit or not self.fused else super()._fast_kind(group)

    def _step_full_precision(self) -> Any:
        with _as_master_update(self.optimizer, self.optimizer.param_groups):
            return self.optimizer.step()

    def _step_one(self, p: torch.nn.Parameter, group: dict[str, Any], scratch: dict[Any, torch.Tensor]) -> None:
        with _as_master_update(self.optimizer, [group]):
            super()._step_one(p, group, scratch)

    # ------------------------------------------------------- expand / store (mixprec.optim.codecs)
    def _expand_into(self, param: torch.Tensor, out: torch.Tensor) -> None:
        if not out.is_contiguous():  # pragma: no cover - the scratch buffers are contiguous
            raise ValueError("the fp32 scratch of a remainder step must be contiguous")
        codecs.remainder_master(param.detach().contiguous(), self._remainder_for(param), self._ties(param), out=out)

    def _store(self, param: torch.Tensor, value32: torch.Tensor) -> None:
        weight, rem, ties = codecs.remainder_split(value32)
        param.copy_(weight)
        self._remainder_for(param).copy_(rem)
        self.kinds.set(REMAINDER_TIES.name, param, ties)

    def _expand_many(self, pieces: list[Piece], values: list[torch.Tensor]) -> None:
        codecs.remainder_load(pieces, values, [pc.of(self._remainder_for(pc.param)) for pc in pieces],
                              [self._ties(pc.param) for pc in pieces])

    def _store_many(self, pieces: list[Piece], values: list[torch.Tensor], flat: torch.Tensor) -> None:
        rems = [pc.of(self._remainder_for(pc.param)).view(-1) for pc in pieces]
        for pc, new in zip(pieces, codecs.remainder_store(pieces, values, flat, rems), strict=True):
            old = self._ties(pc.param)
            if not (old.numel() or new.numel()):
                continue
            if pc.whole:
                self.kinds.set(REMAINDER_TIES.name, pc.param, new)
            else:  # the ties of the rest of the weight stay; both runs are sorted
                lo, hi = torch.searchsorted(old, torch.tensor([pc.start, pc.end], device=old.device)).tolist()
                self.kinds.set(REMAINDER_TIES.name, pc.param, torch.cat([old[:lo], new, old[hi:]]))


@contextlib.contextmanager
def _as_master_update(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> Iterator[None]:
    """The inner optimizer's own steps (fp32 parameters, the generic path's fp32 proxies) run the
    implementation the fp32-master wrapper picks (torch's fused kernel for Adam/AdamW where the
    group leaves the choice to torch, else foreach), so every update matches it bit for bit."""
    saved = [(g.get("foreach"), g.get("fused")) for g in groups]
    try:
        for group in groups:
            prefer_fast_update(optimizer, group)
        yield
    finally:
        for group, (foreach, fused) in zip(groups, saved, strict=True):
            group["foreach"], group["fused"] = foreach, fused

"""Kahan-compensated updates: bf16/fp16 weights that lose no update, without an fp32 master copy.

:class:`KahanOptimizer` keeps a compensation buffer per low-precision weight holding what
rounding dropped; weight + compensation represents the weight with about twice the
significant bits, and the next update starts from it (Kahan summation).

>>> import torch
>>> from mixprec.optim import KahanOptimizer
>>> w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
>>> opt = KahanOptimizer(torch.optim.SGD([w], lr=1.0))
>>> w.grad = torch.full_like(w, -1e-3)
>>> opt.step()
>>> float(w.detach()[0]), float(opt.compensation(w)[0]) != 0.0  # 1.001 is not a bf16 value: the rest is kept
(1.0, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from mixprec.optim import codecs, shards
from mixprec.optim.compiled import CompileSetting
from mixprec.optim.fast import Piece
from mixprec.optim.follow import WriteWatch, load_compensation, register
from mixprec.optim.kinds import COMPENSATION, StateKind
from mixprec.optim.lowbit import LowPrecisionOptimizer

__all__ = ["KahanOptimizer"]


class KahanOptimizer(LowPrecisionOptimizer):
    """bf16/fp16 weights with Kahan-compensated updates: no update is lost, no fp32 master copy.

    Args:
        optimizer: any torch optimizer over low-precision parameters.
        state_dtype: dtype the optimizer state is kept in between steps (None: fp32).
        fast, chunk_numel, fused, compile: see :class:`LowPrecisionOptimizer`.

    Training-state memory for AdamW: 2 (weight) + 2 (grad) + 2 (compensation) +
    4 (two bf16 moments) = 10 bytes per parameter, against 16 for fp32 training.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        state_dtype: torch.dtype | str | None = torch.bfloat16,
        fast: bool = True,
        chunk_numel: int | None = None,
        fused: bool = True,
        compile: CompileSetting = "auto",
    ) -> None:
        super().__init__(
            optimizer, state_dtype=state_dtype, fast=fast, chunk_numel=chunk_numel, fused=fused, compile=compile
        )
        self._watch = WriteWatch()  # the weights as this wrapper last wrote them
        self._follow_loads()

    def _follow_loads(self) -> None:
        low = self._low_params()
        register(self, low)
        self._watch.record(low)

    rounding = "kahan"
    state_kinds: ClassVar[tuple[StateKind, ...]] = (COMPENSATION,)

    @property
    def _comp(self) -> dict[torch.Tensor, torch.Tensor]:
        """The compensation buffers by parameter (the :data:`~mixprec.optim.kinds.COMPENSATION` kind's tensors)."""
        return self.kinds.values[COMPENSATION.name]

    # --------------------------------------------------------------- compensation
    def compensation(self, param: torch.Tensor) -> torch.Tensor | None:
        """The compensation buffer of ``param`` (what rounding dropped from its weight), or
        None before its first step."""
        return self._comp.get(param)

    def set_compensation(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Replace the compensation buffer of a low-precision ``param`` (``value`` is kept, not copied)."""
        if not COMPENSATION.applies(param):
            raise ValueError(
                f"set_compensation() on a {param.dtype} parameter: only bf16/fp16 weights have compensation "
                "(an fp32 one loses no update to rounding)"
            )
        if shards.is_dtensor(param) and not shards.is_dtensor(value):
            raise ValueError(
                "set_compensation(value=...) got a plain tensor for an FSDP2-sharded parameter; pass a DTensor sharded "
                "like it (e.g. torch.zeros_like(param))"
            )
        if value.shape != param.shape:
            raise ValueError(
                f"set_compensation(value=...) has shape {tuple(value.shape)}, but the parameter {tuple(param.shape)}; "
                "pass a tensor shaped like the parameter"
            )
        self.kinds.set(COMPENSATION.name, param, value)

    def drop_compensation(self, param: torch.Tensor) -> None:
        """Forget the compensation buffer of ``param``: its next step starts from zero."""
        self._comp.pop(param, None)

    # ------------------------------------------- weights written from outside (follow.py)
    def follow_writes(self, params: Sequence[torch.Tensor]) -> None:
        """A weight written since this wrapper last wrote it starts again without compensation
        (its old residual belonged to the old weight); loads are handled as they happen (:meth:`loaded`)."""
        for p in self._watch.changed(params):
            self._comp.pop(p, None)

    def note_written(self, params: Sequence[torch.Tensor]) -> None:
        self._watch.record(params)

    def loaded(self, param: torch.Tensor, value: torch.Tensor | None, kept: torch.Tensor) -> None:
        """``param`` was loaded: its compensation becomes the residual of a wider loaded value
        (weight + compensation then stands for it), and is kept where the load wrote the same value."""
        comp = self._comp.get(param)
        if comp is not None:
            load_compensation(comp, param, value, kept)
        elif value is not None:
            self._comp[param] = torch.zeros_like(param, memory_format=torch.preserve_format)
            load_compensation(self._comp[param], param, value, kept)
        self._watch.record([param])

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._follow_loads()  # a copy holds new parameters

    def _compensation_for(self, param: torch.Tensor) -> torch.Tensor:
        """The compensation of ``param``, made at zero where it has none; for the local stand-in
        of an FSDP2 shard, the local part of its parameter's (sharded) compensation."""
        owner = shards.owner_of(param)
        comp = self._comp.get(owner)
        if comp is None:
            comp = self._comp[owner] = torch.zeros_like(owner, memory_format=torch.preserve_format)
        return shards.local_of(comp) if owner is not param else comp

    def _init_kinds(self, params: list[torch.nn.Parameter]) -> None:
        for p in params:
            self._compensation_for(p)

    def _expand_many(self, pieces: list[Piece], values: list[torch.Tensor]) -> None:
        codecs.kahan_load(pieces, values, [pc.of(self._compensation_for(pc.param)) for pc in pieces])

    def _store_many(self, pieces: list[Piece], values: list[torch.Tensor], flat: torch.Tensor) -> None:
        codecs.kahan_store(pieces, values, [pc.of(self._compensation_for(pc.param)) for pc in pieces])

    def _compiled_rounding_inputs(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return self._compensation_for

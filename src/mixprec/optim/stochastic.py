"""Stochastic-rounding updates: bf16 weights rounded up or down at random, unbiased, no extra buffer.

:class:`StochasticRoundingOptimizer` rounds each updated weight up or down with
probabilities proportional to the distance, so updates smaller than a bf16 unit survive
in expectation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from mixprec.optim import codecs, shards
from mixprec.optim.compiled import CompileSetting
from mixprec.optim.fast import Piece
from mixprec.optim.lowbit import LowPrecisionOptimizer

__all__ = ["StochasticRoundingOptimizer", "stochastic_round"]


def stochastic_round(x: torch.Tensor, dtype: torch.dtype = torch.bfloat16, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round fp32 ``x`` to bf16, up or down at random: E[result] == x (for finite, in-range values).

    >>> import torch
    >>> x = torch.full((100000,), 1.0 + 2**-10)  # a quarter of the way between two bf16 values
    >>> y = stochastic_round(x, generator=torch.Generator().manual_seed(0)).float()
    >>> abs(float(y.mean()) - (1 + 2**-10)) < 1e-4
    True
    """
    if dtype != torch.bfloat16:
        raise ValueError(f"stochastic_round supports dtype=torch.bfloat16 only, got {dtype}")
    return codecs.stochastic_round(x, generator)


class StochasticRoundingOptimizer(LowPrecisionOptimizer):
    """bf16 weights updated with stochastic rounding: unbiased, no extra buffer per weight.

    Args:
        optimizer: any torch optimizer over bf16 parameters.
        state_dtype: dtype the optimizer state is kept in between steps (None: fp32).
        seed: seed of the rounding noise.
        fast, chunk_numel, fused, compile: see :class:`LowPrecisionOptimizer`.

    The noise is one stream on every route (the generic path, the eager chunks, the compiled
    and the native loops: :class:`~mixprec.optim.codecs.Noise`): 16 bits hashed from each
    element's position in its param group and a seed mixed from a checkpointed count of the
    wrapper's calls (one per param group and step), so which route steps a weight, and how its
    chunks are cut, changes its noise not at all and its value only within the fp32 rounding
    of the update. No random tensor is drawn or stored. FSDP2 shards mix their shard index into
    the seed (replicas of a shard round alike). Checkpoints of earlier versions, which held
    ``torch.Generator`` states, still load: their noise continues as this stream.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        state_dtype: torch.dtype | str | None = torch.bfloat16,
        seed: int = 0,
        fast: bool = True,
        chunk_numel: int | None = None,
        fused: bool = True,
        compile: CompileSetting = "auto",
    ) -> None:
        super().__init__(
            optimizer, state_dtype=state_dtype, fast=fast, chunk_numel=chunk_numel, fused=fused, compile=compile
        )
        for p in self._low_params():
            if p.dtype != torch.bfloat16:
                raise ValueError(
                    f"StochasticRoundingOptimizer needs bf16 parameters, got {p.dtype}; use KahanOptimizer for fp16"
                )
        self._seed = seed
        self._counter = [_first_count(seed)]  # the call count (checkpointed)

    rounding = "stochastic"
    _shard = 0  # the FSDP2 shard index of the call being stepped (0: a plain weight)

    @contextmanager
    def _noise_for(self, params: list[torch.nn.Parameter]) -> Iterator[codecs.Noise]:
        """One call's noise (``self._noise`` meanwhile), counted once the call has stepped."""
        self._noise = codecs.call_noise(self._counter[0], self._shard, params)
        try:
            yield self._noise
        finally:
            self._noise = None
        self._counter[0] += 1  # (not for an interrupted call: a retry draws the same noise)

    def _step_shards(self, group: dict[str, Any], active: list[torch.nn.Parameter], kind: str | None,
                     scratch: dict[Any, torch.Tensor]) -> None:
        self._shard = shards.shard_index(active[0])  # (the shards of a rank share one index)
        try:
            super()._step_shards(group, active, kind, scratch)
        finally:
            self._shard = 0

    def _store_many(self, pieces: list[Piece], values: list[torch.Tensor], flat: torch.Tensor) -> None:
        if self._noise is None:
            raise RuntimeError("a stochastic-rounding store outside a call of the wrapper (no noise drawn)")
        codecs.stochastic_store(pieces, values, flat, self._noise)

    def rounding_state(self) -> dict[str, Any]:
        return {"seed": self._seed, "counter": self._counter[0]}

    def load_rounding_state(self, extra: dict[str, Any]) -> None:
        # (an earlier version's "generators", torch.Generator states, are not needed: the count is)
        self._seed = int(extra.get("seed", self._seed))
        self._counter = [int(extra.get("counter", _first_count(self._seed)))]


def _first_count(seed: int) -> int:
    return (seed * 0x9E3779B9) % (1 << 32)

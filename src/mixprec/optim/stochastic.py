"""Stochastic-rounding updates: bf16 weights rounded up or down at random, unbiased, no extra buffer.

:class:`StochasticRoundingOptimizer` rounds each updated weight up or down with
probabilities proportional to the distance, so updates smaller than a bf16 unit survive
in expectation.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
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
        seed: seed of the rounding noise (its generator state is checkpointed).
        fast, chunk_numel, fused, compile: see :class:`LowPrecisionOptimizer`.

    The noise is one ``randint`` per parameter on the generic path and one per chunk on
    the fast path, drawn from the same generator in the same parameter order (on CPU
    both paths draw identical bits). The compiled route (``compile=True``, or "auto" on
    large groups) instead hashes each element's position with a seed mixed from a
    checkpointed step counter inside the kernel (no random tensor at all): the same
    distribution, other bits. Which route each step took is checkpointed too, so a
    resumed run rounds exactly as an uninterrupted one.
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
        self._generators: dict[torch.device, torch.Generator] = {}
        self._counter = [(seed * 0x9E3779B9) % (1 << 32)]  # noise counter of the compiled route

    rounding = "stochastic"

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            # FSDP2: each shard draws its own noise (the same seed would round element i of
            # every shard alike); replicas of a shard (DDP, HSDP) draw the same
            offset = self.__dict__.get("_shard_offset", 0)
            gen = torch.Generator(device=device).manual_seed((self._seed + offset * 0x9E3779B97F4A7C15) % (1 << 63))
            self._generators[device] = gen
        return gen

    def _init_kinds(self, params: list[torch.nn.Parameter]) -> None:
        sharded = [p for p in params if shards.is_dtensor(p)]
        if sharded:
            self._shard_offset = shards.shard_index(sharded[0])
        for device in {shards.local_of(p).device for p in params}:
            self._generator(device)

    def _step_shards(self, group: dict[str, Any], active: list[torch.nn.Parameter], kind: str | None,
                     scratch: dict[Any, torch.Tensor]) -> None:
        self._shard_offset = shards.shard_index(active[0])
        super()._step_shards(group, active, kind, scratch)

    def _store_many(self, pieces: list[Piece], values: list[torch.Tensor], flat: torch.Tensor) -> None:
        codecs.stochastic_store(pieces, values, flat, self._generator(flat.device))

    def _compiled_rounding_inputs(self) -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, list[int] | None]:
        return None, self._counter

    def rounding_state(self) -> dict[str, Any]:
        # FSDP2: each shard's generator under its own key ("cpu/shard1"), so a checkpoint that keeps
        # one copy of what the ranks share (torch.distributed.checkpoint) keeps every rank's noise
        offset = self.__dict__.get("_shard_offset")
        suffix = "" if offset is None else f"/shard{offset}"
        return {
            "generators": {f"{dev}{suffix}": g.get_state() for dev, g in self._generators.items()},
            "seed": self._seed,
            "counter": self._counter[0],
        }

    def load_rounding_state(self, extra: dict[str, Any]) -> None:
        self._seed = int(extra.get("seed", self._seed))
        self._counter = [int(extra.get("counter", (self._seed * 0x9E3779B9) % (1 << 32)))]
        self._generators = {}
        sharded = [p for p in self._low_params() if shards.is_dtensor(p)]
        own = shards.shard_index(sharded[0]) if sharded else None
        here = shards.local_of(sharded[0]).device if sharded else None
        missing = False
        for key, state in extra.get("generators", {}).items():
            dev, _, shard = str(key).partition("/shard")
            if own is not None and (not shard or int(shard) != own or torch.device(dev).type != here.type):  # type: ignore[union-attr]
                # another shard's noise (a whole-model state dict holds every rank's, or rank 0's), or
                # noise saved unsharded, which every shard would then repeat
                missing = True
                continue
            if shard:
                self._shard_offset = int(shard)
            # a shard's noise goes to the device this rank holds that shard on (saved by a rank
            # that may have held it on another GPU: a CUDA generator's state is its seed and offset)
            device = here if here is not None else torch.device(dev)
            if device not in self._generators:  # (replicas of a shard saved the same noise: the first)
                self._generator(device).set_state(state)
        if missing and not self._generators:
            self._shard_offset = own or 0
            warnings.warn(
                f"StochasticRoundingOptimizer: the loaded state holds no rounding noise for this rank's shard ({own}); "
                "its noise starts again from the seed (the resumed run rounds with other noise than an uninterrupted one)",
                UserWarning, stacklevel=3,
            )

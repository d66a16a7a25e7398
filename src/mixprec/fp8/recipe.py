"""fp8 scaling recipes: delayed scaling (amax history of past iterations) and current scaling.

A recipe is a frozen dataclass: plain configuration, hashable, safe to share between
layers and to trace. It decides one thing, the scale a tensor is quantised with:

- :class:`DelayedScaling` (the TransformerEngine convention): the scale used at iteration
  ``t`` is computed from the amax history recorded up to iteration ``t - 1``; the amax of
  iteration ``t`` is recorded after use. Only the very first iteration, with nothing
  recorded yet, scales from the tensor's own amax (``amax_init``).
- :class:`CurrentScaling`: the scale comes from the tensor being quantised (never
  saturates, costs one reduction before the cast).

>>> from mixprec.fp8 import CurrentScaling, DelayedScaling, Fp8Format
>>> r = DelayedScaling(fmt="e4m3", margin=1, amax_history_len=16)
>>> r.fp8_format is Fp8Format.E4M3, r.history_len
(True, 16)
>>> CurrentScaling().fp8_format.backward.max
57344.0
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.fp8.formats import Fp8Format
from mixprec.fp8.scaling import (
    AMAX_COMPUTE_ALGOS,
    AmaxComputeAlgo,
    check_margin,
    compute_scale,
    history_amax,
)

__all__ = ["MAX_AMAX_HISTORY_LEN", "CurrentScaling", "DelayedScaling", "Fp8Recipe"]

#: The longest amax history a :class:`DelayedScaling` recipe keeps: 65,536 past iterations
#: (256 KiB per tensor kind and layer). TransformerEngine's default is 1024; a longer
#: window only delays the scale's response to a shrinking range.
MAX_AMAX_HISTORY_LEN = 2**16

_FMT_CHOICES = "'hybrid' (E4M3 forward, E5M2 gradients), 'e4m3' (E4M3 everywhere) or 'e5m2' (E5M2 everywhere)"


class Fp8Recipe(abc.ABC):
    """What every recipe provides to an fp8 layer (subclasses are frozen dataclasses)."""

    fmt: Fp8Format | str
    margin: int

    @property
    def fp8_format(self) -> Fp8Format:
        """The format pair, as an :class:`Fp8Format` (``fmt`` may have been given as a string)."""
        return Fp8Format(self.fmt)

    @property
    @abc.abstractmethod
    def history_len(self) -> int:
        """Number of amax entries each layer keeps per tensor kind."""

    @abc.abstractmethod
    def select_scale(
        self,
        history: torch.Tensor,
        amax: torch.Tensor,
        fmt_max: float,
        prev_scale: torch.Tensor,
    ) -> torch.Tensor:
        """Scale to quantise with now, from the history of past amaxes or the current ``amax``."""

    @abc.abstractmethod
    def next_scale(self, history: torch.Tensor, fmt_max: float, prev_scale: torch.Tensor) -> torch.Tensor | None:
        """Scale the next iteration will use, where it is already known (None otherwise)."""


def _check_common(owner: str, fmt: Any, margin: Any) -> Fp8Format:
    if isinstance(fmt, Fp8Format):
        parsed = fmt
    elif isinstance(fmt, str):
        try:
            parsed = Fp8Format(fmt)
        except ValueError:
            raise ValueError(f"{owner}(fmt={fmt!r}): unknown fp8 format; expected {_FMT_CHOICES}") from None
    else:
        raise TypeError(f"{owner}(fmt={fmt!r}): expected a str or an Fp8Format: {_FMT_CHOICES}")
    check_margin(margin, owner)
    return parsed


@dataclass(frozen=True)
class DelayedScaling(Fp8Recipe):
    """Scale each tensor from the amax history of previous iterations (TransformerEngine's recipe).

    Args:
        fmt: ``"hybrid"`` (E4M3 for inputs and weights, E5M2 for output gradients),
            ``"e4m3"`` (E4M3 for all three) or ``"e5m2"`` (E5M2 for all three), or an
            :class:`Fp8Format`.
        margin: headroom in powers of two: ``scale = (fmt_max / amax) / 2**margin``; an int
            from 0 to :data:`~mixprec.fp8.MAX_MARGIN` (64).
        amax_history_len: how many past iterations' amaxes each layer keeps, an int from 1
            to :data:`MAX_AMAX_HISTORY_LEN` (65,536).
        amax_compute_algo: ``"max"`` (largest finite amax in the history) or
            ``"most_recent"`` (the previous iteration's amax).
        amax_init: while a layer's history is still empty (its first iteration, or after
            loading a checkpoint without fp8 state), scale from the tensor's own amax, as
            torchao's delayed scaling did. False keeps the initial scale 1 until an amax is
            recorded (TransformerEngine's behaviour), which flushes small gradients such as
            a language model's to zero in E5M2 at the first step.

    >>> DelayedScaling(amax_compute_algo="mean")
    Traceback (most recent call last):
    ...
    ValueError: DelayedScaling(amax_compute_algo='mean'): expected 'max' (largest amax in the history) or 'most_recent' (the previous iteration's amax)
    """

    fmt: Fp8Format | str = "hybrid"
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: AmaxComputeAlgo = "max"
    amax_init: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "fmt", _check_common("DelayedScaling", self.fmt, self.margin))
        n = self.amax_history_len
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(
                f"DelayedScaling(amax_history_len={n!r}): expected an int >= 1 (the number of past "
                "iterations whose amax is kept); use 1 to scale from the previous iteration only"
            )
        if n < 1:
            raise ValueError(
                f"DelayedScaling(amax_history_len={n!r}): expected an int >= 1 (the number of past "
                "iterations whose amax is kept); use 1 to scale from the previous iteration only"
            )
        if n > MAX_AMAX_HISTORY_LEN:
            raise ValueError(
                f"DelayedScaling(amax_history_len={n!r}): at most {MAX_AMAX_HISTORY_LEN} (2**16) past "
                "iterations are kept (each layer holds that many fp32 amaxes per tensor kind); pass e.g. "
                "amax_history_len=1024 (TransformerEngine's default) or 16"
            )
        algo = self.amax_compute_algo
        if not isinstance(algo, str) or algo not in AMAX_COMPUTE_ALGOS:
            raise (TypeError if not isinstance(algo, str) else ValueError)(
                f"DelayedScaling(amax_compute_algo={self.amax_compute_algo!r}): expected 'max' "
                "(largest amax in the history) or 'most_recent' (the previous iteration's amax)"
            )
        if not isinstance(self.amax_init, bool):
            raise TypeError(f"DelayedScaling(amax_init={self.amax_init!r}): expected True or False")

    @property
    def history_len(self) -> int:
        return self.amax_history_len

    def select_scale(
        self,
        history: torch.Tensor,
        amax: torch.Tensor,
        fmt_max: float,
        prev_scale: torch.Tensor,
    ) -> torch.Tensor:
        # The current amax is recorded after this use; it only stands in for an empty history.
        reduced = history_amax(history, self.amax_compute_algo)
        if self.amax_init:
            reduced = torch.where((history == 0).all(), amax, reduced)
        return compute_scale(reduced, fmt_max, self.margin, prev_scale)

    def next_scale(self, history: torch.Tensor, fmt_max: float, prev_scale: torch.Tensor) -> torch.Tensor:
        # With an empty history and amax_init, the next scale will come from the next tensor;
        # this reports the scale that would be kept without it.
        return compute_scale(history_amax(history, self.amax_compute_algo), fmt_max, self.margin, prev_scale)


@dataclass(frozen=True)
class CurrentScaling(Fp8Recipe):
    """Scale each tensor from its own amax, computed just before the cast (never saturates).

    Args:
        fmt: ``"hybrid"``, ``"e4m3"`` or ``"e5m2"``, as for :class:`DelayedScaling`.
        margin: headroom in powers of two, an int from 0 to 64.

    >>> CurrentScaling(fmt="e3m4")
    Traceback (most recent call last):
    ...
    ValueError: CurrentScaling(fmt='e3m4'): unknown fp8 format; expected 'hybrid' (E4M3 forward, E5M2 gradients), 'e4m3' (E4M3 everywhere) or 'e5m2' (E5M2 everywhere)
    """

    fmt: Fp8Format | str = "hybrid"
    margin: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "fmt", _check_common("CurrentScaling", self.fmt, self.margin))

    @property
    def history_len(self) -> int:
        return 1

    def select_scale(
        self,
        history: torch.Tensor,
        amax: torch.Tensor,
        fmt_max: float,
        prev_scale: torch.Tensor,
    ) -> torch.Tensor:
        return compute_scale(amax, fmt_max, self.margin, prev_scale)

    def next_scale(self, history: torch.Tensor, fmt_max: float, prev_scale: torch.Tensor) -> None:
        return None

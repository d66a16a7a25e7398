"""Scale math for fp8: ``scale = (fmt_max / amax) / 2**margin``, and the rolling amax history.

Everything here is tensor ops on the tensors' own device: no ``.item()``, no host sync, so
a training step never waits on the GPU for its scales.

>>> import torch
>>> from mixprec.fp8 import compute_scale
>>> compute_scale(torch.tensor(1.25), 448.0)
tensor(358.4000)
>>> compute_scale(torch.tensor(0.0), 448.0, prev_scale=7.0)  # amax 0 keeps the previous scale
tensor(7.)
"""

from __future__ import annotations

from typing import Literal

import torch

from mixprec.dtypes import Format

__all__ = [
    "AMAX_COMPUTE_ALGOS",
    "FP32_MAX",
    "MAX_MARGIN",
    "MIN_SCALE",
    "check_margin",
    "compute_scale",
    "history_amax",
    "record_amax",
]

AmaxComputeAlgo = Literal["max", "most_recent"]
AMAX_COMPUTE_ALGOS: tuple[str, ...] = ("max", "most_recent")

#: The largest finite fp32 value: the scale a tiny (but non-zero) amax gets, instead of inf.
FP32_MAX = float(torch.finfo(torch.float32).max)

#: The smallest scale: the smallest normal fp32 value (2**-126), whose reciprocal (the
#: dequantisation factor) is still finite. A huge amax gets it instead of 0.
MIN_SCALE = float(torch.finfo(torch.float32).tiny)

#: The largest ``margin``: ``fmt_max / 2**margin`` stays a normal fp32 number (exact, so
#: the scale is still one rounding), and 64 powers of two of headroom is far beyond need.
MAX_MARGIN = 64


def check_margin(margin: object, owner: str) -> int:
    """``margin`` if it is an int in ``[0, MAX_MARGIN]``, else TypeError / ValueError naming it.

    >>> check_margin(2, "compute_scale")
    2
    >>> check_margin(65, "compute_scale")
    Traceback (most recent call last):
    ...
    ValueError: compute_scale(margin=65): margin must be between 0 and 64 (the scale is divided by 2**margin to leave headroom; beyond 64 it is no longer a finite, exact fp32 scale); pass e.g. margin=0 or margin=1
    """
    if isinstance(margin, bool) or not isinstance(margin, int):
        raise TypeError(
            f"{owner}(margin={margin!r}): margin must be an int (the scale is divided by 2**margin "
            "to leave headroom); pass e.g. margin=0 or margin=1"
        )
    if not 0 <= margin <= MAX_MARGIN:
        raise ValueError(
            f"{owner}(margin={margin!r}): margin must be between 0 and {MAX_MARGIN} (the scale is divided "
            f"by 2**margin to leave headroom; beyond {MAX_MARGIN} it is no longer a finite, exact fp32 "
            "scale); pass e.g. margin=0 or margin=1"
        )
    return margin


def compute_scale(
    amax: torch.Tensor | float,
    fmt_max: float | Format,
    margin: int = 0,
    prev_scale: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """Scale that maps ``amax`` to ``fmt_max / 2**margin``, as an fp32 tensor.

    ``scale = (fmt_max / amax) / 2**margin``, rounded once to fp32. An amax of 0, inf or
    NaN (nothing to learn from) keeps ``prev_scale``; a tiny amax whose scale would
    overflow gives the largest fp32 value, never inf; a huge amax whose scale would
    underflow gives :data:`MIN_SCALE` (2**-126), never 0, so ``1 / scale`` stays finite.
    Works elementwise on any shape.

    Args:
        amax: largest absolute value seen (a tensor, or a number).
        fmt_max: largest finite value of the target format (448 for E4M3, 57344 for
            E5M2), or the :class:`~mixprec.dtypes.Format` itself.
        margin: headroom in powers of two; each unit halves the scale. An int from 0 to
            :data:`MAX_MARGIN`.
        prev_scale: the scale kept when ``amax`` carries no information.

    >>> import torch
    >>> compute_scale(torch.tensor([2.0, float("inf"), 1e-45]), 448.0, margin=1, prev_scale=3.0)
    tensor([1.1200e+02, 3.0000e+00, 3.4028e+38])
    """
    check_margin(margin, "compute_scale")
    top = fmt_max.max if isinstance(fmt_max, Format) else float(fmt_max)
    amax_t = torch.as_tensor(amax, dtype=torch.float32)
    prev = torch.as_tensor(prev_scale, dtype=torch.float32, device=amax_t.device)
    # (top / 2**margin) is exact in fp32 (a power-of-two shift of 448 or 57344), so the one
    # division below is the only rounding. Do not write ``top / amax``: a Python number
    # divided by a tensor is computed as ``amax.reciprocal() * top``, which rounds twice.
    numerator = torch.full_like(amax_t, top / 2.0**margin)
    scale = torch.clamp(numerator / amax_t, min=MIN_SCALE, max=FP32_MAX)
    informative = torch.isfinite(amax_t) & (amax_t > 0)
    return torch.where(informative, scale, prev)


def history_amax(history: torch.Tensor, algo: str = "max") -> torch.Tensor:
    """Reduce an amax history (most recent entry first, along the last dim) to one amax.

    ``"max"`` takes the largest finite entry, so one overflowing iteration (amax inf or
    NaN) does not freeze the scale for the length of the history; ``"most_recent"`` takes
    entry 0 as it is (an inf there keeps the previous scale, see :func:`compute_scale`).

    >>> import torch
    >>> h = torch.tensor([1.0, float("inf"), 3.0, 0.0])
    >>> history_amax(h, "max"), history_amax(h, "most_recent")
    (tensor(3.), tensor(1.))
    """
    if algo == "most_recent":
        return history[..., 0]
    if algo == "max":
        finite = torch.where(torch.isfinite(history), history, torch.zeros_like(history))
        return finite.amax(dim=-1)
    raise ValueError(f"amax_compute_algo={algo!r} is unknown; expected one of {AMAX_COMPUTE_ALGOS}")


def record_amax(history: torch.Tensor, amax: torch.Tensor) -> None:
    """Roll ``history`` one step along its last dim (in place) and store ``amax`` as entry 0.

    A non-finite ``amax`` (inf or NaN: the tensor overflowed) is stored as 0, the entry that
    carries no information: no later scale is computed from it.

    >>> import torch
    >>> h = torch.zeros(3)
    >>> for a in (1.0, 2.0):
    ...     record_amax(h, torch.tensor(a))
    >>> h
    tensor([2., 1., 0.])
    >>> record_amax(h, torch.tensor(float("inf")))
    >>> h
    tensor([0., 2., 1.])
    """
    with torch.no_grad():
        amax = torch.as_tensor(amax, dtype=history.dtype, device=history.device)
        history.copy_(torch.roll(history, 1, dims=-1))
        history[..., 0] = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))

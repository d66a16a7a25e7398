"""What an :class:`~mixprec.tracing.OverflowTracer` records: one entry per measured tensor.

A record is (module index, event code, call, dtype, amax): the largest magnitude of one
tensor, kept on its device as a 0-dim tensor until the tracer reads every record back at
once (:func:`read_records`, one host transfer per device).
"""

from __future__ import annotations

import torch

from mixprec.nested import shard_local

__all__ = ["BWD_IN", "BWD_OUT", "BWD_PARAM", "FWD_IN", "FWD_OUT", "MODEL_INPUT", "WHAT", "Record",
           "read_records", "tensor_amax"]

# Event codes: what a record measured.
FWD_OUT, BWD_OUT, BWD_IN, BWD_PARAM, FWD_IN = 0, 1, 2, 3, 4
#: what a finding names when the model's input itself held inf/NaN (the data, not the precision)
MODEL_INPUT = "the model's input"
WHAT = {
    FWD_OUT: "output",
    FWD_IN: MODEL_INPUT,
    BWD_OUT: "gradient of its output",
    BWD_IN: "gradient of its input",
    BWD_PARAM: "gradient of its parameters",
}


def tensor_amax(t: torch.Tensor) -> torch.Tensor | None:
    """Largest |value| of ``t`` as a 0-dim tensor (inf/NaN propagate), without a sync. A DTensor
    (tensor parallelism) is measured on this rank's shard: no collective inside a hook, and a
    plain tensor to read back."""
    t = shard_local(t)
    if t.numel() == 0 or t.is_complex():
        return None
    try:
        mn, mx = torch.aminmax(t.detach())
    except (RuntimeError, NotImplementedError):  # a dtype without a reduction kernel (fp8)
        return None
    return torch.maximum(mx, mn.neg())


Record = tuple[int, int, int, torch.dtype, torch.Tensor]  # module, event code, call, dtype, amax


def read_records(records: list[Record]) -> list[float]:
    """The amax of every record as Python floats: one host transfer per device."""
    by_device: dict[torch.device, list[int]] = {}
    for pos, r in enumerate(records):
        by_device.setdefault(r[4].device, []).append(pos)
    values = [0.0] * len(records)
    for positions in by_device.values():
        stacked = torch.stack([records[p][4].to(torch.float32) for p in positions])
        for p, v in zip(positions, stacked.tolist(), strict=True):
            values[p] = v
    return values

"""Where fp8 linear layers pay: measured fp8-over-bf16 speedups by GEMM shape, per GPU kind.

``benchmarks/bench_fp8_shapes.py --table FILE`` times one ``nn.Linear`` forward + backward
under bf16 autocast against mixprec's fp8 layer (with the fp8-mixed plan's defaults) for
each (M, K, N): M tokens, K input and N output features. The table it writes, one per GPU
kind (``"sm90"`` for compute capability 9.0), goes into the package as
``mixprec/fp8/payoff_<kind>.json``; :func:`table_for` finds it for a device. Only measured
tables are shipped: where none exists for a device (a CPU, a GPU kind not measured yet),
:func:`table_for` returns None and nothing is predicted.

A layer's speedup is predicted from the nearest measured shape (in log2 of M, K and N),
never extrapolated into a number of its own: :class:`Prediction` names the shape it comes
from. The fp8-mixed plan keeps in bf16 the layers predicted below ``min_payoff`` and says
so in ``explain()``; ``precision="auto"`` picks fp8-mixed where enough of the model's GEMM
time is predicted to pay (:func:`model_payoff`).

>>> table = PayoffTable(kind="sm90", device="test GPU", source="a test", rows=(
...     PayoffRow(8192, 1024, 1024, 0.8), PayoffRow(8192, 4096, 4096, 1.3)))
>>> table.predict(8192, 4096, 2048)
Prediction(speedup=1.3, shape=(8192, 4096, 4096))
>>> table.predict(8192, 768, 768).speedup
0.8
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "TABLES",
    "ModelPayoff",
    "PayoffRow",
    "PayoffTable",
    "Prediction",
    "gpu_kind",
    "load_table",
    "model_payoff",
    "table_for",
    "table_of_kind",
]

#: Tables registered in this process by GPU kind (tests, or a table measured on this machine):
#: they take precedence over the package's files. A value of None hides a package file.
TABLES: dict[str, PayoffTable | None] = {}


@dataclass(frozen=True)
class PayoffRow:
    """One measured shape: ``m`` tokens, ``k`` in and ``n`` out features; ``speedup`` is the
    bf16 time over the fp8 time (> 1: fp8 faster); ``kernels``: GPU kernels per forward +
    backward of the fp8 layer (from the profiler), where counted."""

    m: int
    k: int
    n: int
    speedup: float
    kernels: int | None = None


@dataclass(frozen=True)
class Prediction:
    """A layer's predicted ``speedup`` and the measured ``shape`` (M, K, N) it comes from."""

    speedup: float
    shape: tuple[int, int, int]


@dataclass(frozen=True)
class PayoffTable:
    """The measured speedups of one GPU kind (``kind``, e.g. ``"sm90"``), with where they come from."""

    kind: str
    device: str
    source: str
    rows: tuple[PayoffRow, ...]

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError(f"PayoffTable(kind={self.kind!r}) has no rows: a table holds at least one measured shape")
        for row in self.rows:
            if min(row.m, row.k, row.n) <= 0 or not (math.isfinite(row.speedup) and row.speedup > 0):
                raise ValueError(
                    f"PayoffTable(kind={self.kind!r}): row {row} needs positive M, K, N and a positive, finite speedup"
                )

    def predict(self, m: int, k: int, n: int) -> Prediction:
        """The speedup of the nearest measured shape (least squared distance in log2 of M, K, N)."""
        point = [math.log2(max(v, 1)) for v in (m, k, n)]

        def distance(row: PayoffRow) -> float:
            return sum((a - math.log2(b)) ** 2 for a, b in zip(point, (row.m, row.k, row.n), strict=True))

        best = min(self.rows, key=distance)
        return Prediction(best.speedup, (best.m, best.k, best.n))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PayoffTable:
        """A table from the JSON object ``bench_fp8_shapes.py --table`` writes."""
        try:
            rows = tuple(
                PayoffRow(int(r["m"]), int(r["k"]), int(r["n"]), float(r["speedup"]),
                          None if r.get("kernels") is None else int(r["kernels"]))
                for r in data["rows"]
            )
            return cls(kind=str(data["kind"]), device=str(data["device"]), source=str(data["source"]), rows=rows)
        except (KeyError, TypeError) as exc:
            raise ValueError(
                f"not an fp8 pay-off table ({exc!r}): expected {{'kind', 'device', 'source', 'rows': "
                "[{'m', 'k', 'n', 'speedup', 'kernels'}]}, as benchmarks/bench_fp8_shapes.py --table writes"
            ) from None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "device": self.device,
            "source": self.source,
            "rows": [{"m": r.m, "k": r.k, "n": r.n, "speedup": r.speedup, "kernels": r.kernels} for r in self.rows],
        }


def gpu_kind(device: torch.device | str | None) -> str | None:
    """The GPU kind a table is measured for: ``"sm<major><minor>"`` of a CUDA device (e.g.
    ``"sm90"`` for an H100 or H200); None for anything else.

    >>> gpu_kind("cpu") is None
    True
    """
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(dev)
    return f"sm{major}{minor}"


@functools.cache
def load_table(kind: str) -> PayoffTable | None:
    """The package's table for GPU kind ``kind`` (``mixprec/fp8/payoff_<kind>.json``), or None."""
    resource = importlib.resources.files("mixprec.fp8").joinpath(f"payoff_{kind}.json")
    if not resource.is_file():
        return None
    return PayoffTable.from_json(json.loads(resource.read_text()))


def table_for(device: torch.device | str | None) -> PayoffTable | None:
    """The measured table for ``device``'s GPU kind (:data:`TABLES` first, then the
    package's files); None on CPUs and on GPU kinds without a measured table.

    >>> table_for("cpu") is None
    True
    """
    kind = gpu_kind(device)
    if kind is None:
        return TABLES.get("cpu")  # (only a registered one: no CPU table is shipped)
    return table_of_kind(kind)


def table_of_kind(kind: str) -> PayoffTable | None:
    """The table of GPU kind ``kind`` (e.g. ``"sm90"``): :data:`TABLES`, then the package's file."""
    if kind in TABLES:
        return TABLES[kind]
    return load_table(kind)


@dataclass(frozen=True)
class ModelPayoff:
    """What a table predicts for a model's ``nn.Linear`` GEMMs under fp8-mixed's filter.

    ``share``: the fraction of the GEMM work (``tokens * in * out`` per layer, standing for
    GEMM time: every layer sees the same tokens) in layers predicted to pay (at least
    ``min_payoff`` times faster in fp8); ``speedup``: the predicted bf16 time of all those
    GEMMs over their time with the paying layers in fp8 and the rest in bf16 (>= 1);
    ``predictions``: per eligible layer (:func:`~mixprec.fp8.default_module_filter`).
    """

    share: float
    speedup: float
    predictions: dict[str, Prediction]


def model_payoff(model: nn.Module, table: PayoffTable, tokens: int, min_payoff: float = 1.0) -> ModelPayoff:
    """:class:`ModelPayoff` of ``model`` with ``table`` at ``tokens`` rows per step (share 0
    and speedup 1 without Linear layers).

    >>> table = PayoffTable("sm90", "test GPU", "a test", (PayoffRow(8192, 64, 64, 2.0), PayoffRow(8192, 16, 16, 0.5)))
    >>> model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 16), nn.Linear(16, 10))
    >>> result = model_payoff(model, table, 8192)
    >>> round(result.share, 3), round(result.speedup, 3), sorted(result.predictions)
    (0.97, 1.941, ['0', '1'])
    """
    from mixprec.fp8.convert import default_module_filter

    total = paying = fp8_time = 0.0
    predictions: dict[str, Prediction] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            work = float(tokens) * module.in_features * module.out_features
            total += work
            if not default_module_filter(name, module):  # never fp8: stays bf16
                continue
            prediction = table.predict(tokens, module.in_features, module.out_features)
            predictions[name] = prediction
            if prediction.speedup >= min_payoff:
                paying += work
                fp8_time += work / prediction.speedup
    if not total:
        return ModelPayoff(0.0, 1.0, predictions)
    return ModelPayoff(paying / total, total / (fp8_time + total - paying), predictions)

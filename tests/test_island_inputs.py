"""Inputs cast outside the model (a framework's batch conversion) and fp32 islands.

Lightning's ``bf16-true`` converts a whole batch before the step; the Lightning plugin does
the same for the pure plans with :func:`mixprec.inputs.cast_inputs`, and holds the
originals with :func:`mixprec.inputs.input_originals` while the step runs.
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec.inputs import cast_inputs, input_originals
from mixprec.islands import apply_fp32_islands, install_input_cast
from mixprec.policy import OpPolicy


def test_cast_inputs_casts_floats_keeps_integers_and_records_originals() -> None:
    ids, x, x64 = torch.arange(3), torch.randn(3), torch.randn(3, dtype=torch.float64)
    originals: dict = {}
    out = cast_inputs({"ids": ids, "x": [x, x64], "n": 3}, torch.bfloat16, originals)
    assert out["ids"] is ids and out["n"] == 3
    assert [t.dtype for t in out["x"]] == [torch.bfloat16, torch.bfloat16]
    assert {id(low): orig for low, orig in originals.values()} == {id(out["x"][0]): x, id(out["x"][1]): x64}
    assert cast_inputs(out, torch.bfloat16, originals)["x"][0] is out["x"][0]  # already cast: as is


class _Probe(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = (x.dtype, x.abs().max().item(), torch.ones(1).dtype)
        return super().forward(x)


def _island_first() -> nn.Sequential:
    net = nn.Sequential(_Probe(4), nn.Linear(4, 2))
    net[1].half()
    apply_fp32_islands(net, OpPolicy(fp32_modules=["0"]), output_dtype=torch.float16)
    return net


def test_island_gets_the_value_a_batch_conversion_cast_from() -> None:
    """A batch converted before the model's forward (whose own input cast then has nothing to
    do): inside input_originals the island still sees 1e5, not fp16's inf."""
    net = _island_first()
    handles = install_input_cast(net, torch.float16)
    x = torch.tensor([[1e5, 1.0, 2.0, 3.0]])
    originals: dict = {}
    low = cast_inputs(x, torch.float16, originals)
    with input_originals(originals):
        out = net(low)
    assert net[0].seen[:2] == (torch.float32, 1e5)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    net(low)  # outside: the rounded value, as any fp16 tensor
    assert net[0].seen[1] == float("inf")
    for h in handles:
        h.remove()


def test_island_creates_fp32_tensors_under_a_low_default_dtype() -> None:
    net = _island_first()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        net(torch.ones(1, 4, dtype=torch.float16))
        assert torch.get_default_dtype() == torch.float16  # restored on the way out
    finally:
        torch.set_default_dtype(previous)
    assert net[0].seen == (torch.float32, 1.0, torch.float32)

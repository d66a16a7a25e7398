"""The found-inf flag is all-reduced: every rank takes the same skip decision."""

from __future__ import annotations

import os

import pytest
import torch

from tests._dist import run_ranks

pytestmark = pytest.mark.distributed


def _inf_on_rank0_only(rank: int, world_size: int, out_dir: str) -> None:
    from mixprec import DynamicLossScaler

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=256.0, growth_interval=2)
    results = []
    for step in range(4):
        loss = model(torch.ones(2, 3)).sum()
        if step == 1 and rank == 0:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        stepped = scaler.found_inf(opt).item() == 0.0
        scaler.update()
        opt.zero_grad()
        results.append((stepped, scaler.get_scale(), [p.detach().clone() for p in model.parameters()]))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def test_inf_on_one_rank_makes_every_rank_skip(tmp_path):
    run_ranks(_inf_on_rank0_only, 2, str(tmp_path))
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert [r[0] for r in r0] == [True, False, True, True]
    assert [r[0] for r in r1] == [True, False, True, True]
    assert [r[1] for r in r0] == [r[1] for r in r1] == [256.0, 128.0, 128.0, 256.0]
    for a, b in zip(r0, r1, strict=True):
        for pa, pb in zip(a[2], b[2], strict=True):
            assert torch.equal(pa, pb)

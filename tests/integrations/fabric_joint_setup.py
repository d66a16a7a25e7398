"""Run by torchrun from test_lightning_model_parallel.py: Fabric's joint setup (mixprec's
``setup(fabric, model, optimizer)``) under a ModelParallelStrategy whose parallelize_fn shards
the model, so the optimizer built before is left holding the pre-shard parameters. Writes
what setup() did ("set up", or its error) to ``<out>/rank<r>.pt``.

Usage: torchrun --nproc_per_node 2 fabric_joint_setup.py OUT
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402
from lightning.fabric.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from mixprec.integrations.lightning import MixprecPrecision, setup  # noqa: E402


def parallelize(model: torch.nn.Module, device_mesh) -> torch.nn.Module:
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=device_mesh["data_parallel"])
    return model


def main() -> None:
    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[MixprecPrecision("bf16-mixed")])
    fabric.launch()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    try:
        setup(fabric, model, torch.optim.SGD(model.parameters(), lr=0.1))
        result = "set up"
    except RuntimeError as exc:
        result = str(exc)
    torch.save(result, os.path.join(sys.argv[1], f"rank{fabric.global_rank}.pt"))


if __name__ == "__main__":
    main()

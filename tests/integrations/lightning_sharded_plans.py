"""Run by torchrun from test_lightning_sharded_plans.py: the plans without masters (and
``fp16-master`` in Fabric, and ``fp8-mixed``) under Lightning's ModelParallelStrategy, every cell in one launch
on 2 gloo ranks:

- ``fit PLAN``: the Trainer with the documented ``configure_model`` sharding through
  ``fully_shard_model`` (lightning_model_parallel.py), 10 steps; ``fit PLAN inf``: the same
  with an inf in rank 1's own gradient shard at INF_STEP;
- ``resume PLAN``: the Trainer's own sharded checkpoint, saved at the first epoch's end and
  resumed by a new Trainer (lightning_trainer_checkpoint.py);
- ``fabric PLAN``: Fabric's documented order, ``fabric.save`` after 5 of 10 steps, ``fabric.load``
  and the last 5 again (fabric_sharded_checkpoint.py); under the fp16 plans rank 1's gradient
  shard overflows at FABRIC_INF_STEP, after the save, in both runs.

Writes ``{cell: result}`` to ``<out>/rank<r>.pt``.

Usage: torchrun --nproc_per_node 2 lightning_sharded_plans.py OUT
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable

import torch

warnings.filterwarnings("ignore")

sys.path.insert(0, os.path.dirname(__file__))
from fabric_sharded_checkpoint import run  # noqa: E402
from lightning_model_parallel import fit  # noqa: E402
from lightning_trainer_checkpoint import resume  # noqa: E402

INF_STEP = 3
FABRIC_INF_STEP = 7  # after the save: the resumed run skips it only with the loss scale restored


def cells(out: str) -> dict[str, Callable[[], dict]]:
    return {
        "fit bf16-sr": lambda: fit("bf16-sr", "mixprec"),
        "fit bf16-pure": lambda: fit("bf16-pure", "mixprec"),
        "fit fp16-pure": lambda: fit("fp16-pure", "mixprec"),
        "fit fp16-pure inf": lambda: fit("fp16-pure", "mixprec", INF_STEP),
        "resume bf16-pure": lambda: resume("bf16-pure", "mixprec", os.path.join(out, "trainer-bf16-pure")),
        "resume fp16-pure": lambda: resume("fp16-pure", "mixprec", os.path.join(out, "trainer-fp16-pure")),
        "fabric bf16-pure": lambda: run("bf16-pure", os.path.join(out, "fabric-bf16-pure")),
        "fabric fp16-pure": lambda: run("fp16-pure", os.path.join(out, "fabric-fp16-pure"), inf_step=FABRIC_INF_STEP),
        "fabric fp16-master": lambda: run("fp16-master", os.path.join(out, "fabric-fp16-master"),
                                          inf_step=FABRIC_INF_STEP),
        "fit fp8-mixed": lambda: fit("fp8-mixed", "mixprec"),
        # compiled in the parallelize_fn, against the same run eager
        "fabric bf16-kahan": lambda: run("bf16-kahan", os.path.join(out, "fabric-bf16-kahan")),
        "fabric bf16-kahan compiled": lambda: run("bf16-kahan", os.path.join(out, "fabric-bf16-kahan-c"), compile=True),
        # the LightningModule itself as the FSDP root
        "root bf16-master": lambda: fit("bf16-master", "policy", root=True),
        "root fp16-master inf": lambda: fit("fp16-master", "policy", INF_STEP, root=True),
        "root bf16-kahan": lambda: fit("bf16-kahan", "mixprec", root=True),
        "root fp16-pure inf": lambda: fit("fp16-pure", "mixprec", INF_STEP, root=True),
        "fabric fp8-mixed": lambda: run("fp8-mixed", os.path.join(out, "fabric-fp8-mixed")),
    }


def main() -> None:
    out = sys.argv[1]
    results = {name: cell() for name, cell in cells(out).items()}
    torch.save(results, os.path.join(out, f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    main()

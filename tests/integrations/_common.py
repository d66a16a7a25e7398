"""Shared pieces of the integration tests: tiny models, generated data, the reference loop.

The reference for every integration is mixprec's own ``MixedPrecision`` loop on the same
model (a deep copy), the same optimizer and scheduler construction and the same batches.
"""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import mixprec
from mixprec import MixedPrecision

# GPT-2 runs its projections through addmm (low by default): keeping them fp32 changes what
# checkpoint recomputation must reproduce.
CUSTOM_POLICY = mixprec.OpPolicy(dtype=torch.bfloat16, lower_ops=("softmax",), fp32_ops=("gelu", "addmm"))

# Plans of the cross-check matrix; "custom" is bf16-mixed with a custom op list.
PLAN_NAMES = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-kahan", "bf16-sr", "custom")


def make_plan(name: str) -> Any:
    if name == "custom":
        return mixprec.get_plan("bf16-mixed", policy=CUSTOM_POLICY)
    return mixprec.get_plan(name)


class TinyMLP(torch.nn.Module):
    """Linear -> LayerNorm -> GELU -> softmax-gated Linear: every op class of the plans."""

    def __init__(self, d_in: int = 8, d_hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, d_hidden)
        self.norm = torch.nn.LayerNorm(d_hidden)
        self.fc2 = torch.nn.Linear(d_hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.norm(self.fc1(x)))
        h = h * torch.softmax(h, dim=-1)
        return self.fc2(h)


def mlp_data(n_batches: int = 20, batch: int = 4, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 8, generator=g), torch.randn(batch, 1, generator=g)) for _ in range(n_batches)]


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.float(), y)


def make_optimizer(model: torch.nn.Module, lr: float = 1e-2, **flags: Any) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, **flags)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    return opt, sched


def reference_run(
    model: torch.nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    precision: Any,
    *,
    grad_accum_steps: int = 1,
    clip: float | None = None,
    lr: float = 1e-2,
    opt_factory: Callable[[torch.nn.Module], tuple[torch.optim.Optimizer, Any]] | None = None,
) -> dict[str, Any]:
    """mixprec's own loop: losses per micro-batch, StepResults, final parameters and LR."""
    model = copy.deepcopy(model)
    mp = precision if isinstance(precision, MixedPrecision) else MixedPrecision(
        precision, grad_accum_steps=grad_accum_steps, clip_grad_norm=clip
    )
    opt, sched = (opt_factory or (lambda m: make_optimizer(m, lr)))(model)
    if sched is None:
        model, opt = mp.prepare(model, opt)
    else:
        model, opt, sched = mp.prepare(model, opt, scheduler=sched)
    losses, results = [], []
    for batch in batches:
        with mp.autocast():
            loss = loss_fn(model, batch)
        losses.append(loss.item())
        mp.backward(loss)
        r = mp.step()
        if not r.accumulating:
            results.append(r)
    return {
        "losses": losses,
        "results": results,
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "lr": None if sched is None else sched.get_last_lr()[0],
        "mp": mp,
    }


def assert_close_losses(got: list[float], want: list[float], *, exact: bool) -> None:
    assert len(got) == len(want), (len(got), len(want))
    g, w = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    if exact:
        diff = (g != w).nonzero()
        assert diff.numel() == 0, f"first differing step {diff[0].item()}: {got[diff[0]]} vs {want[diff[0]]}"
    else:
        rel = ((g - w).abs() / w.abs().clamp_min(1e-12))
        worst = int(rel.argmax())
        assert rel.max() <= 1e-3, f"step {worst}: {got[worst]} vs {want[worst]} (relative {rel[worst]:.2e})"


def assert_same_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k}: max diff {(got[k].float() - want[k].float()).abs().max()}"


def torchrun(script: Path, args: list[str], out: Path, after: list[str] | None = None, ranks: int = 2) -> list:
    """``script`` under torchrun on ``ranks`` ranks as ``script *args out *after``; each rank's result."""
    out.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2]) + os.pathsep +
           os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1",
           "--master_port", str(port), str(script), *args, str(out), *(after or [])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    files = [out / f"rank{r}.pt" for r in range(ranks)]
    if not all(f.exists() for f in files):
        pytest.fail(f"torchrun exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [torch.load(f, weights_only=True) for f in files]


def run_fsdp(acc: Any, plugin: Any) -> None:
    """Set Accelerator ``acc``'s state to FSDP with ``plugin``, as Accelerate sets it on GPUs (on a
    CPU it sets the plugin aside and runs DDP): its FSDP2 code paths then run here."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    # (each AcceleratorState() copies the process state's distributed type: set both)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin

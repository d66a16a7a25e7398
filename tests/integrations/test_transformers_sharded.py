"""transformers' load-time sharding (FSDP2 through ``from_pretrained(..., distributed_config=...)``)
with MixprecTrainer on two gloo ranks, against one process on the global batch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

SCRIPT = Path(__file__).with_name("transformers_load_sharded.py")


def _checkpoint(path: Path) -> None:
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )).save_pretrained(path)


def test_load_time_sharding_trains_mixed_master_and_kahan_like_one_process(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    from transformers_load_sharded import LOADS, PER_RANK, rows, train

    _checkpoint(tmp_path / "ckpt")
    out = tmp_path / "run"
    out.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).parents[2] / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), str(SCRIPT), str(tmp_path / "ckpt"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    files = [out / f"rank{r}.pt" for r in range(2)]
    if not all(f.exists() for f in files):
        pytest.fail(f"torchrun exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    a, b = (torch.load(f, weights_only=True) for f in files)
    # the Trainer itself refuses to checkpoint a model sharded at load time (it would save one shard)
    assert "save_strategy='no'" in a["trainer save"], a["trainer save"]
    for plan, load in LOADS.items():  # (the "trainer save" entry is not a plan)
        assert len(a[plan]["losses"]) == 4 and a[plan]["losses"] == b[plan]["losses"], plan  # the global loss
        for name in a[plan]["params"]:  # one model on both ranks
            assert torch.equal(a[plan]["params"][name], b[plan]["params"][name]), (plan, name)
        dtype = load.get("dtype")
        model = GPT2LMHeadModel.from_pretrained(tmp_path / "ckpt", **({"dtype": dtype} if dtype else {}))
        # one process on the global batch: the sampler gives each rank alternate rows, the
        # global batch is the same rows
        train(model, plan, str(tmp_path / "one"), 2 * PER_RANK, rows())
        for name, p in model.named_parameters():
            torch.testing.assert_close(a[plan]["params"][name], p.detach().float(), rtol=3e-2, atol=3e-3,
                                       msg=lambda m, plan=plan, name=name: f"{plan} {name}: {m}")

"""The integration examples run end to end (each in seconds on a CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize(
    ("script", "framework", "expect"),
    [
        ("accelerate_loop.py", "accelerate", "loaded the step-8 state back"),
        ("lightning_trainer.py", "lightning", "Fabric, plan bf16-master"),
        ("hf_trainer.py", "transformers", "identical to the uninterrupted run: True"),
    ],
)
def test_example_runs(script, framework, expect):
    pytest.importorskip(framework)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    plan = "bf16-master" if framework == "lightning" else "fp16-mixed"
    out = subprocess.run([sys.executable, str(ROOT / "examples" / script), plan], env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert expect in out.stdout, out.stdout[-3000:]

"""A steady ``backward()`` + ``step()`` on CUDA reads nothing back to the host: CUDA's own check.

With ``torch.cuda.set_sync_debug_mode("error")`` any synchronising call (``.item()``,
``.tolist()``, a blocking copy to the host, ``nonzero``) raises. For each plan the built-in
GPT trains a few steps (the first ones create the optimizer state and are decided on the
host), then one more backward and step run under the check. Prints one line per plan:
``ok`` or the error. Part of ``benchmarks/gpu_check.sh``; on the CPU, ``tests/test_device_first.py``
counts the same reads exactly.

Usage::

    python benchmarks/gpu_syncs.py [plan ...]
"""

from __future__ import annotations

import sys

import torch

from mixprec import MixedPrecision
from mixprec.cli.models.gpt import GPT, GPTConfig, TokenCrossEntropy

PLANS = ("bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "fp32", "bf16-pure", "bf16-kahan", "bf16-sr")


def check(plan: str) -> str:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, seq_len=64, num_layers=2, dim=128, num_heads=4)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    mp = MixedPrecision(plan, clip_grad_norm=1.0)
    model, opt, crit = mp.prepare(model, opt, criterion=TokenCrossEntropy())
    x = torch.randint(0, 512, (4, 64), device="cuda")
    y = torch.roll(x, -1, 1)
    for i in range(4):
        with mp.autocast():
            loss = crit(model(x), y)
        if i == 3:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                mp.backward(loss)
                mp.step()
            except RuntimeError as exc:
                return f"SYNC: {str(exc).splitlines()[0]}"
            finally:
                torch.cuda.set_sync_debug_mode(0)
        else:
            mp.backward(loss)
            mp.step()
    return f"ok (stepped={mp.last_result.stepped}, optimizer_steps={mp.optimizer_steps})"  # type: ignore[union-attr]


def main(argv: list[str]) -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    for plan in argv or PLANS:
        try:
            print(f"{plan}: {check(plan)}", flush=True)
        except Exception as exc:  # one plan's failure is reported, the others still run
            print(f"{plan}: ERROR {type(exc).__name__}: {exc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

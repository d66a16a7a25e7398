"""Low-precision optimizer plans under DDP on two gloo ranks (CPU).

The wrappers must never swap a parameter's ``data`` for a tensor of another dtype:
``Variable.set_data`` drops the parameter's gradient accumulator, and with it the hook
DDP's reducer registered there, so the next backward reduces nothing (bf16-pure replicas
drift apart) or only the fp32 norm layers (bf16-kahan, bf16-sr: "Expected to have
finished reduction in the prior iteration"). Checked here, after every step: the ranks
hold bit-identical weights, and they match one process trained on the concatenated
batch within the plan's tolerance; for the fast path (AdamW, SGD) and the generic
path (ASGD).
"""

from __future__ import annotations

import os

import pytest
import torch

from mixprec import MixedPrecision, get_plan
from mixprec.cli.models import build_task
from tests._dist import run_ranks

WORLD, STEPS, MICRO = 2, 4, 8
PLANS = ["bf16-pure", "fp16-pure", "bf16-kahan", "bf16-sr"]
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "asgd": lambda params: torch.optim.ASGD(params, lr=0.05),  # no fast path: the generic one
}

# Against one process on the global batch: the runs differ in rounding only (bf16/fp16
# gradients of half batches, their low-precision all-reduce, and a low-precision weight
# store after every step that can land one unit in the last place either side of a
# rounding boundary). Relative tolerance: 4 units in the last place of the weight dtype
# after STEPS steps (fp32 norm layers: as bf16, their gradients come from bf16 compute).
# Absolute 2.5e-3: AdamW's first step moves every weight by lr * sign(grad) = 1e-3, so a
# gradient element near zero whose sign the two runs round differently moves 2e-3 apart.
ULPS, ATOL = 4, 2.5e-3
RTOL = {torch.bfloat16: ULPS * 2.0**-7, torch.float16: ULPS * 2.0**-10, torch.float32: ULPS * 2.0**-7}


def _train(plan_name: str, opt_name: str, rank: int, world: int, *, ddp: bool) -> list[dict[str, torch.Tensor]]:
    from mixprec.checkpoint import unwrap_model

    task = build_task("mlp", size="tiny", seed=0)
    mp = MixedPrecision(get_plan(plan_name))
    opt = OPTIMIZERS[opt_name](task.model.parameters())
    model, opt, criterion = mp.prepare(task.model, opt, criterion=task.criterion, ddp=ddp)
    history = []
    for step in range(STEPS):
        x, y = task.batch(world * MICRO, torch.Generator().manual_seed(100 + step))
        if ddp:
            x, y = x[rank * MICRO : (rank + 1) * MICRO], y[rank * MICRO : (rank + 1) * MICRO]
        with mp.autocast():
            loss = criterion(model(x), y)
        mp.backward(loss)
        result = mp.step()
        assert result.stepped, (plan_name, opt_name, step, result)
        history.append({n: p.detach().clone() for n, p in unwrap_model(model).named_parameters()})
    return history


def _worker(rank: int, world: int, out: str) -> None:
    results = {f"{plan}/{opt}": _train(plan, opt, rank, world, ddp=True) for plan in PLANS for opt in OPTIMIZERS}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.distributed
def test_lowbit_plans_under_ddp_match_one_process_and_stay_identical(tmp_path):
    run_ranks(_worker, WORLD, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD))
    worst: dict[str, float] = {}
    for key in r0:
        plan_name, opt_name = key.split("/")
        reference = _train(plan_name, opt_name, 0, WORLD, ddp=False)
        for step, (a, b, ref) in enumerate(zip(r0[key], r1[key], reference, strict=True)):
            for name in a:
                assert torch.equal(a[name], b[name]), f"{key}: ranks differ at step {step} in {name}"
                atol, rtol = ATOL, RTOL[a[name].dtype]
                diff = (a[name].float() - ref[name].float()).abs()
                ratio = (diff / (atol + rtol * ref[name].float().abs())).max().item()
                worst[key] = max(worst.get(key, 0.0), ratio)
                assert ratio <= 1.0, (
                    f"{key}: step {step}, {name}: {ratio:.2f}x the tolerance (max |diff| {diff.max().item():.3g})"
                )
        # and it trained: the weights moved
        assert any(not torch.equal(r0[key][-1][n], r0[key][0][n]) for n in r0[key][0]), key
        assert worst[key] > 0  # the comparison sees the rounding differences it allows for
    print("worst diff / tolerance:", {k: round(v, 3) for k, v in worst.items()})

"""Fault injection through the front door: every plan x gradient accumulation x clipping.

Non-finite inputs (a non-finite loss) and non-finite gradients are injected at chosen
steps. Invariants checked after every step:
- no parameter, optimizer-state tensor or buffer is ever non-finite;
- a skipped step is bitwise free of side effects (parameters, optimizer state, buffers);
- a clean step after a fault trains again.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mixprec import MixedPrecision

PLANS = (
    "fp32", "tf32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-pure", "fp16-pure",
    "bf16-kahan", "bf16-sr", "fp8-mixed",
)
STEPS = 8
FAULTS = {2: "nan_input", 4: "inf_grad", 5: "nan_grad", 6: "inf_input"}  # step -> fault (others clean)
CONFIGS = list(itertools.product(PLANS, (1, 2), (None, 0.5)))  # 44 configurations


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)  # sizes fp8 layers accept
        self.bn = torch.nn.BatchNorm1d(32)
        self.fc2 = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _tensors(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}[{i}]")


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    snap = {f"model{k}": v.detach().clone() for k, v in _tensors(model.state_dict())}
    snap.update({f"opt{k}": v.detach().clone() for k, v in _tensors(opt.state_dict()) if v.is_floating_point()})
    return snap


@pytest.mark.parametrize(("plan", "accum", "clip"), CONFIGS, ids=[f"{p}-acc{a}-clip{c}" for p, a, c in CONFIGS])
def test_faults_never_leave_non_finite_state_and_skips_have_no_side_effects(plan, accum, clip):
    torch.manual_seed(0)
    model = Net()
    mp = MixedPrecision(plan, grad_accum_steps=accum, clip_grad_norm=clip)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    if plan == "fp8-mixed":
        from mixprec.fp8 import fp8_layers

        assert len(fp8_layers(model)) == 2
    gen = torch.Generator().manual_seed(1)
    skipped = stepped = 0
    for step in range(STEPS):
        before = _snapshot(model, opt)
        fault = FAULTS.get(step)
        handle = None
        for micro in range(accum):
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
            last = micro == accum - 1
            if fault in ("nan_input", "inf_input") and last:
                x[1, 3] = float("nan") if fault == "nan_input" else float("inf")
            if fault in ("inf_grad", "nan_grad") and last:
                value = float("inf") if fault == "inf_grad" else float("nan")
                handle = model.fc1.weight.register_hook(lambda g, v=value: torch.full_like(g, v))
            with mp.autocast():
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            mp.backward(loss)
            if handle is not None:
                handle.remove()
                handle = None
            result = mp.step()
        after = _snapshot(model, opt)
        for name, value in after.items():
            assert torch.isfinite(value).all(), f"step {step} ({fault}): non-finite {name}"
        if fault is None:
            assert result.stepped, f"clean step {step} was skipped: {result.skip_reason}"
            stepped += 1
        else:
            assert result.skipped, f"step {step} with {fault} was not skipped"
            skipped += 1
            assert result.skip_reason == ("overflow" if fault.endswith("_grad") else "nonfinite_loss")
            assert after.keys() == before.keys()
            for name in before:
                assert torch.equal(after[name], before[name]), f"skipped step {step} ({fault}) changed {name}"
    assert (stepped, skipped) == (STEPS - len(FAULTS), len(FAULTS))

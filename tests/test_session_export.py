"""MixedPrecision.export_fp32_state_dict(): the model's state dict with the fp32 masters in place of
low-precision weights, fp32 everywhere else."""

from __future__ import annotations

import re

import pytest
import torch

from mixprec import MixedPrecision

LOW = (torch.float16, torch.bfloat16)


class Net(torch.nn.Module):
    """Linear, BatchNorm (float and integer buffers), LayerNorm and a weight tied under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 16, bias=False)
        self.head = torch.nn.Linear(16, 16, bias=False)
        self.head.weight = self.fc2.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(self.norm(self.bn(self.fc1(x))))))


def trained(plan: str, steps: int = 3):
    torch.manual_seed(0)
    model = Net()
    mp = MixedPrecision(plan)
    # a small learning rate: the masters move by less than a bf16/fp16 unit and differ from the weights
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 8, generator=gen)
        with mp.autocast():
            loss = model(x).float().pow(2).mean()
        mp.backward(loss)
        assert mp.step().stepped
    return mp, model, opt


@pytest.mark.parametrize("plan", ["bf16-master", "fp16-master"])
def test_low_precision_weights_are_replaced_by_their_masters_exactly(plan):
    mp, model, opt = trained(plan)
    export = mp.export_fp32_state_dict()
    state = model.state_dict()
    assert list(export) == list(state)
    params = dict(model.named_parameters(remove_duplicate=False))
    differs = False
    for key, value in export.items():
        live = state[key]
        if key in params and live.dtype in LOW:
            master = opt.master_of(params[key])
            assert master is not None and master.dtype == torch.float32
            assert value.dtype == torch.float32 and torch.equal(value, master), key
            differs |= not torch.equal(master, live.float())
        elif live.is_floating_point():
            assert value.dtype == torch.float32 and torch.equal(value, live.float()), key
        else:  # BatchNorm's num_batches_tracked
            assert value.dtype == live.dtype and torch.equal(value, live), key
        assert not value.requires_grad
    assert differs, "the masters equal the weights: the test would not see a difference"
    assert export["fc2.weight"] is export["head.weight"]  # tied weights stay one tensor
    # an fp32 copy of the model loads it and computes with the masters
    fp32 = Net()
    fp32.load_state_dict(export)
    assert torch.equal(fp32.fc1.weight, opt.master_of(model.fc1.weight))


@pytest.mark.parametrize("plan", ["bf16-pure", "bf16-kahan", "bf16-sr"])
def test_plans_without_masters_export_their_weights_upcast(plan):
    mp, model, _ = trained(plan)
    export = mp.export_fp32_state_dict()
    state = model.state_dict()
    assert list(export) == list(state)
    assert state["fc1.weight"].dtype == torch.bfloat16
    for key, live in state.items():
        want = live.float() if live.is_floating_point() else live
        assert export[key].dtype == want.dtype and torch.equal(export[key], want), key


@pytest.mark.parametrize("plan", ["fp32", "bf16-mixed"])
def test_fp32_weights_are_the_state_dict_itself(plan):
    mp, model, _ = trained(plan)
    export, state = mp.export_fp32_state_dict(), model.state_dict()
    assert list(export) == list(state)
    for key, live in state.items():
        assert export[key].data_ptr() == live.data_ptr() and torch.equal(export[key], live), key


def test_weights_written_after_the_last_step_are_exported_as_written():
    mp, model, opt = trained("bf16-master")
    master = opt.master_of(model.fc1.weight)
    assert not torch.equal(master, model.fc1.weight.float())
    with torch.no_grad():
        model.fc1.weight[0] = 2.0  # user code writes one row; the masters follow at the next step
    export = mp.export_fp32_state_dict()
    assert torch.equal(export["fc1.weight"][0], torch.full((8,), 2.0))
    assert torch.equal(export["fc1.weight"][1:], master[1:])


def test_export_loaded_back_gives_the_same_masters():
    mp, model, opt = trained("bf16-master")
    export = {k: v.clone() for k, v in mp.export_fp32_state_dict().items()}
    before = [m.clone() for m in opt.masters]
    model.load_state_dict(export)
    assert all(torch.equal(a, b) for a, b in zip(before, opt.masters, strict=True))
    assert torch.equal(model.fc1.weight, export["fc1.weight"].to(torch.bfloat16))


def test_export_before_prepare_is_an_error():
    with pytest.raises(RuntimeError, match=re.escape(
        "export_fp32_state_dict() called before prepare(); prepare the model (and its optimizers) first"
    )):
        MixedPrecision("bf16-master").export_fp32_state_dict()

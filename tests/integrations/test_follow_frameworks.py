"""Master weights follow the model inside the frameworks: loads after prepare, several
optimizers, manual accumulation (Lightning, Fabric, Accelerate, the HF Trainer).

References: the loaded weights themselves (a step at learning rate 0 must leave them as
loaded), the fp32 values the model had before conversion, and mixprec's own loop with
``grad_accum_steps=2`` (bit for bit).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mixprec import MixedPrecision
from tests.integrations._common import TinyMLP, assert_same_params, mlp_data, mse

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

MASTER_PLANS = ["bf16-master", "fp16-master"]


def _fp32_weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in TinyMLP().state_dict().items()}


def _assert_loaded(net: torch.nn.Module, loaded: dict[str, torch.Tensor], masters: dict[torch.Tensor, torch.Tensor]) -> None:
    """Weights as loaded (rounded to their dtype) and masters exactly the loaded fp32 values."""
    for name, p in net.named_parameters():
        assert torch.equal(p, loaded[name].to(p.dtype)), name
        if p in masters:
            assert torch.equal(masters[p], loaded[name]), name


def _masters(mp: MixedPrecision) -> dict[torch.Tensor, torch.Tensor]:
    out = {}
    for opt in mp.optimizers:
        for p, m in getattr(opt, "_pairs", []):
            out[p] = m
    return out


# ---------------------------------------------------------------------------- Lightning
lightning = pytest.importorskip("lightning")
L = lightning

from mixprec.integrations.lightning import MixprecPrecision, setup  # noqa: E402


class LoadOnFitStart(L.LightningModule):
    def __init__(self, net: torch.nn.Module, load: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.net, self.load = net, load

    def on_fit_start(self) -> None:  # after the plugin converted the model
        self.net.load_state_dict(self.load)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return mse(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.0)


def _trainer(plugin, steps: int) -> L.Trainer:
    return L.Trainer(
        plugins=[plugin], accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )


def _loader(batches):
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(batches[0][0]))


@pytest.mark.parametrize("plan", MASTER_PLANS)
def test_lightning_weights_loaded_in_on_fit_start_stand(plan: str) -> None:
    """Before: the first step wrote the pre-load masters back (0.49 off)."""
    loaded = _fp32_weights(seed=3)
    lit = LoadOnFitStart(TinyMLP(), loaded)
    plugin = MixprecPrecision(plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(plugin, 3).fit(lit, _loader(mlp_data(3)))
    _assert_loaded(lit.net, loaded, _masters(plugin.mp))


class TwoOptimizersManual(L.LightningModule):
    """Two optimizers (manual optimisation, as Lightning requires), each micro-batch pair accumulated."""

    def __init__(self, net: torch.nn.Module, lr: float, accumulate: int = 1) -> None:
        super().__init__()
        self.net, self.lr, self.accumulate = net, lr, accumulate
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        opts = self.optimizers()
        loss = mse(self.net(x), y) / self.accumulate
        self.manual_backward(loss)
        if (batch_idx + 1) % self.accumulate == 0:
            for opt in opts if isinstance(opts, list) else [opts]:
                opt.step()
                opt.zero_grad()
        return loss

    def configure_optimizers(self):
        return [
            torch.optim.SGD(self.net.fc1.parameters(), lr=self.lr),
            torch.optim.SGD([*self.net.norm.parameters(), *self.net.fc2.parameters()], lr=self.lr),
        ]


@pytest.mark.parametrize("plan", MASTER_PLANS)
def test_lightning_second_optimizer_masters_are_the_fp32_weights(plan: str) -> None:
    """Before: the second optimizer's masters came from the already-rounded weights."""
    net = TinyMLP()
    original = {k: v.detach().clone() for k, v in net.state_dict().items()}
    lit = TwoOptimizersManual(net, lr=0.0)
    plugin = MixprecPrecision(plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(plugin, 2).fit(lit, _loader(mlp_data(2)))
    assert len(plugin.mp.optimizers) == 2
    _assert_loaded(lit.net, original, _masters(plugin.mp))


def _reference_accumulated(plan: str, batches, lr: float = 0.05) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = TinyMLP()
    mp = MixedPrecision(plan, grad_accum_steps=2)
    net, opt = mp.prepare(net, torch.optim.SGD(net.parameters(), lr=lr))
    for x, y in batches:
        with mp.autocast():
            loss = mse(net(x), y)
        mp.backward(loss)
        mp.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


class OneOptimizerManual(TwoOptimizersManual):
    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=self.lr)


@pytest.mark.parametrize("plan", MASTER_PLANS)
def test_lightning_manual_accumulation_adds_up_in_fp32(plan: str) -> None:
    """Before: the micro-batches added up in bf16/fp16 (9.8e-4 off for bf16-master)."""
    batches = mlp_data(8)
    want = _reference_accumulated(plan, batches)
    torch.manual_seed(0)
    lit = OneOptimizerManual(TinyMLP(), lr=0.05, accumulate=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(MixprecPrecision(plan), 4).fit(lit, _loader(batches))  # max_steps counts optimizer steps
    assert_same_params({k: v.detach() for k, v in lit.net.state_dict().items()}, want)


@pytest.mark.parametrize("plan", MASTER_PLANS)
def test_fabric_accumulation_adds_up_in_fp32(plan: str) -> None:
    batches = mlp_data(8)
    want = _reference_accumulated(plan, batches)
    torch.manual_seed(0)
    net = TinyMLP()
    fabric = L.Fabric(plugins=[MixprecPrecision(plan)], accelerator="cpu", devices=1)
    net, opt = setup(fabric, net, torch.optim.SGD(net.parameters(), lr=0.05))
    for i, (x, y) in enumerate(batches):
        boundary = i % 2 == 1
        with fabric.no_backward_sync(net, enabled=not boundary):
            fabric.backward(mse(net(x), y) / 2)
        if boundary:
            opt.step()
            opt.zero_grad()
    assert_same_params({k: v.detach() for k, v in net.state_dict().items()}, want)


@pytest.mark.parametrize("plan", MASTER_PLANS)
def test_fabric_two_optimizers_and_load_raw(plan: str, tmp_path) -> None:
    net = TinyMLP()
    original = {k: v.detach().clone() for k, v in net.state_dict().items()}
    fabric = L.Fabric(plugins=[MixprecPrecision(plan)], accelerator="cpu", devices=1)
    opt_a = torch.optim.SGD(net.fc1.parameters(), lr=0.0)
    opt_b = torch.optim.SGD([*net.norm.parameters(), *net.fc2.parameters()], lr=0.0)
    net, opt_a, opt_b = setup(fabric, net, opt_a, opt_b)
    mp = fabric._precision.mp
    _assert_loaded(net.module, original, _masters(mp))  # both optimizers seeded from the fp32 weights
    loaded = _fp32_weights(seed=4)
    torch.save(loaded, tmp_path / "raw.pt")
    fabric.load_raw(tmp_path / "raw.pt", net)
    for x, y in mlp_data(2):
        fabric.backward(mse(net(x), y))
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
    _assert_loaded(net.module, loaded, _masters(mp))


# --------------------------------------------------------------------------- Accelerate
@pytest.mark.parametrize("plan", MASTER_PLANS)
def test_accelerate_unwrapped_model_loads_stand(plan: str) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from mixprec.integrations.accelerate import prepare

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        acc = Accelerator(cpu=True)
        mp = MixedPrecision(plan)
        net = TinyMLP()
        model, opt = prepare(acc, mp, net, torch.optim.SGD(net.parameters(), lr=0.0))
        for x, y in mlp_data(2):
            acc.backward(mse(model(x), y))
            opt.step()
            opt.zero_grad()
        loaded = _fp32_weights(seed=5)
        acc.unwrap_model(model).load_state_dict(loaded)
        for x, y in mlp_data(2, seed=1):
            acc.backward(mse(model(x), y))
            opt.step()
            opt.zero_grad()
        _assert_loaded(acc.unwrap_model(model), loaded, _masters(mp))
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


# ------------------------------------------------------------------------------ Trainer
@pytest.mark.parametrize("plan", MASTER_PLANS)
def test_hf_trainer_model_loaded_after_construction_stands(plan: str, tmp_path) -> None:
    """Before: weights loaded into the model after MixprecTrainer(...) were reverted (0.12 off)."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from mixprec.integrations.transformers import MixprecTrainer

    def gpt2(seed: int) -> GPT2LMHeadModel:
        torch.manual_seed(seed)
        return GPT2LMHeadModel(GPT2Config(
            n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        ))

    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": r, "labels": r} for r in torch.randint(0, 32, (4, 8), generator=g)]
    model = gpt2(0)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, max_grad_norm=0.0)
    trainer = MixprecTrainer(model=model, args=args, train_dataset=rows, precision=plan,
                             optimizers=(torch.optim.SGD(model.parameters(), lr=0.0), None))
    loaded = {k: v.detach().clone() for k, v in gpt2(1).state_dict().items()}
    trainer.model.load_state_dict(loaded)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    masters = _masters(trainer.mp)
    assert masters  # the plan keeps masters
    _assert_loaded(trainer.model, loaded, masters)

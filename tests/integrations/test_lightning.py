"""The mixprec precision plugin in the Lightning Trainer and in Fabric, against mixprec's own loop."""

from __future__ import annotations

import copy
import importlib
import re
import sys
import warnings

import pytest
import torch

pytest.importorskip("lightning")

import lightning as L

from mixprec import DynamicLossScaler, MixedPrecision
from mixprec.integrations.lightning import MixprecPrecision, setup
from tests.integrations._common import (
    PLAN_NAMES,
    TinyMLP,
    assert_close_losses,
    assert_same_params,
    make_optimizer,
    make_plan,
    mlp_data,
    mse,
    reference_run,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


class LitMLP(L.LightningModule):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net
        self.losses: list[float] = []
        self.hook_norms: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = mse(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.hook_norms.append(float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads]))))

    def configure_optimizers(self):
        opt, sched = make_optimizer(self.net)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(batches):
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(batches[0][0]))


def trainer(plugin, max_steps, **kwargs):
    return L.Trainer(
        plugins=[plugin], accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
        enable_checkpointing=kwargs.pop("enable_checkpointing", False), enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, **kwargs,
    )


def lightning_run(net, batches, precision, *, gas=1, clip=None, max_steps=None, ckpt_path=None, save_dir=None,
                  clip_algorithm=None):
    lit = LitMLP(net)
    plugin = MixprecPrecision(precision)
    steps = max_steps if max_steps is not None else len(batches) // gas
    extra = {}
    if save_dir is not None:  # a checkpoint at the end of every epoch, as users save them
        extra = {"enable_checkpointing": True, "callbacks": [L.pytorch.callbacks.ModelCheckpoint(
            dirpath=save_dir, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True)]}
    if clip_algorithm is not None:
        extra["gradient_clip_algorithm"] = clip_algorithm
    t = trainer(plugin, steps, accumulate_grad_batches=gas, gradient_clip_val=clip, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.fit(lit, loader(batches), ckpt_path=ckpt_path)
    return {
        "losses": lit.losses, "hook_norms": lit.hook_norms, "mp": plugin.mp, "plugin": plugin,
        "params": {k: v.detach().clone() for k, v in lit.net.state_dict().items()},
        "lr": t.lr_scheduler_configs[0].scheduler.get_last_lr()[0],
    }


@pytest.mark.parametrize("plan", PLAN_NAMES)
def test_same_losses_as_mixprec_loop_with_accumulation_and_clipping(plan):
    model, data = TinyMLP(), mlp_data(24)
    want = reference_run(model, data, lambda m, b: mse(m(b[0]), b[1]), make_plan(plan), grad_accum_steps=2, clip=0.5)
    got = lightning_run(copy.deepcopy(model), data, make_plan(plan), gas=2, clip=0.5)
    assert_close_losses(got["losses"], want["losses"], exact=True)
    assert got["mp"].optimizer_steps == want["mp"].optimizer_steps
    assert got["mp"].optimizer_steps + got["mp"].scaler.skipped_steps == 12
    assert got["lr"] == want["lr"]
    assert_same_params(got["params"], want["params"])
    # on_before_optimizer_step saw the true (unscaled, gathered) gradients, before clipping
    finite = [(h, r.grad_norm) for h, r in zip(got["hook_norms"], want["results"], strict=True) if r.stepped]
    assert [h for h, _ in finite] == pytest.approx([n for _, n in finite], rel=1e-5)


def test_clipping_by_value_clamps_the_true_gradients_as_lightning_does_in_fp32():
    """fp32 plan, gradient_clip_algorithm="value": the same parameters as Lightning's own fp32 run."""
    model, data = TinyMLP(), mlp_data(8)
    got = lightning_run(copy.deepcopy(model), data, "fp32", clip=1e-3, clip_algorithm="value")
    lit = LitMLP(copy.deepcopy(model))
    t = L.Trainer(accelerator="cpu", devices=1, max_steps=len(data), logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                  gradient_clip_val=1e-3, gradient_clip_algorithm="value")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.fit(lit, loader(data))
    assert got["losses"] == lit.losses
    assert_same_params(got["params"], {k: v.detach() for k, v in lit.net.state_dict().items()})


def test_fp16_overflow_skips_steps_and_holds_the_scheduler():
    model, data = TinyMLP(), mlp_data(20)

    def session():
        return MixedPrecision("fp16-mixed", scaler=DynamicLossScaler(init_scale=2.0**24))

    want = reference_run(model, data, lambda m, b: mse(m(b[0]), b[1]), session())
    got = lightning_run(copy.deepcopy(model), data, session())
    skipped = got["mp"].scaler.skipped_steps
    assert skipped >= 3, "the forced overflow did not happen"
    assert skipped == want["mp"].scaler.skipped_steps
    steps = got["mp"].optimizer_steps
    assert steps == 20 - skipped
    assert got["lr"] == pytest.approx(1e-2 / (1.0 + 0.1 * steps), rel=1e-12)
    assert_close_losses(got["losses"], want["losses"], exact=True)
    assert_same_params(got["params"], want["params"])


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["fp16-mixed", "bf16-master", "bf16-sr"])
def test_checkpoint_resume_is_bit_identical(tmp_path, plan):
    # One batch per epoch: resuming from an epoch-end checkpoint, Lightning itself runs the
    # first batch of the resumed epoch twice (also without mixprec); with one batch per epoch
    # that replay is the batch the uninterrupted run sees, so the runs are comparable.
    model, data = TinyMLP(), mlp_data(1, batch=8)
    full = lightning_run(copy.deepcopy(model), data, make_plan(plan), clip=1.0, max_steps=12, save_dir=tmp_path)
    ckpt = tmp_path / "epoch=5-step=6.ckpt"
    assert ckpt.is_file(), sorted(p.name for p in tmp_path.iterdir())
    resumed = lightning_run(TinyMLP(), data, make_plan(plan), clip=1.0, max_steps=12, ckpt_path=ckpt)
    assert resumed["mp"].optimizer_steps == full["mp"].optimizer_steps
    assert resumed["mp"].scaler.get_scale() == full["mp"].scaler.get_scale()
    assert_close_losses(resumed["losses"], full["losses"][6:], exact=True)
    assert_same_params(resumed["params"], full["params"])


class TwoNets(L.LightningModule):
    """Manual optimisation with two optimizers; net b's loss is large enough to overflow fp16 more often."""

    def __init__(self, a: torch.nn.Module, b: torch.nn.Module) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b = a, b
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        loss_a = mse(self.a(x), y)
        self.manual_backward(loss_a)
        opt_a.step()
        opt_a.zero_grad()
        loss_b = mse(self.b(x), y) * 3000.0
        self.manual_backward(loss_b)
        opt_b.step()
        opt_b.zero_grad()
        self.losses += [loss_a.item(), loss_b.item()]

    def configure_optimizers(self):
        return [torch.optim.AdamW(self.a.parameters(), lr=1e-2), torch.optim.AdamW(self.b.parameters(), lr=1e-2)]


def test_manual_optimisation_steps_each_optimizer_on_its_own():
    a, b, data = TinyMLP(), TinyMLP(), mlp_data(12)
    # reference: one mixprec session per optimizer, sharing one scaler (the plugin's one scale)
    scaler = DynamicLossScaler(init_scale=2.0**16)
    ref = []
    for net in (copy.deepcopy(a), copy.deepcopy(b)):
        mp = MixedPrecision("fp16-mixed", scaler=scaler)
        net, opt = mp.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        ref.append((mp, net))
    want_losses = []
    for x, y in data:
        for (mp, net), factor in zip(ref, (1.0, 3000.0), strict=True):
            with mp.autocast():
                loss = mse(net(x), y) * factor
            want_losses.append(loss.item())
            mp.backward(loss)
            mp.step()

    lit = TwoNets(copy.deepcopy(a), copy.deepcopy(b))
    plugin = MixprecPrecision("fp16-mixed")
    t = trainer(plugin, max_steps=2 * len(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.fit(lit, loader(data))
    assert_close_losses(lit.losses, want_losses, exact=True)
    assert_same_params(dict(lit.a.named_parameters()), dict(ref[0][1].named_parameters()))
    assert_same_params(dict(lit.b.named_parameters()), dict(ref[1][1].named_parameters()))
    assert plugin.mp.scaler.get_scale() == scaler.get_scale()
    # b overflowed where a did not: a skip of one optimizer did not skip the other
    assert ref[0][0].optimizer_steps > ref[1][0].optimizer_steps


def fabric_run(net, batches, plan, clip):
    fabric = L.Fabric(plugins=[MixprecPrecision(plan)], accelerator="cpu", devices=1)
    opt, _ = make_optimizer(net)
    net, opt = setup(fabric, net, opt)
    losses, norms = [], []
    for x, y in batches:
        loss = mse(net(x), y)
        losses.append(loss.item())
        fabric.backward(loss)
        if plan == "fp16-master":  # Fabric's own clipping (norm in the grads' dtype: fp32 masters here)
            norm = fabric.clip_gradients(net, opt, max_norm=clip, error_if_nonfinite=False)
        else:  # bf16 weights: the plugin's fp32 norm
            norm = fabric._precision.clip_grad_norm_(opt, clip)
        norms.append(float(norm))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "mp": fabric._precision.mp,
            "params": {k: v.detach().clone() for k, v in net.state_dict().items()}}


@pytest.mark.parametrize("plan", ["fp16-master", "bf16-kahan"])
def test_fabric_matches_mixprec_loop(plan):
    model, data = TinyMLP(), mlp_data(20)
    opt_factory = lambda m: (make_optimizer(m)[0], None)  # noqa: E731
    want = reference_run(model, data, lambda m, b: mse(m(b[0]), b[1]), plan, clip=0.5, opt_factory=opt_factory)
    got = fabric_run(copy.deepcopy(model), data, plan, clip=0.5)
    assert got["mp"].optimizer_steps == want["mp"].optimizer_steps
    assert_close_losses(got["losses"], want["losses"], exact=True)
    assert_same_params(got["params"], want["params"])
    assert got["norms"] == [r.grad_norm for r in want["results"]]


def test_fabric_optimizer_not_set_up_by_mixprec_is_refused():
    fabric = L.Fabric(plugins=[MixprecPrecision("bf16-master")], accelerator="cpu", devices=1)
    net = TinyMLP()
    net, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    fabric.backward(mse(net(torch.randn(2, 8)), torch.randn(2, 1)))
    with pytest.raises(RuntimeError, match=re.escape("mixprec.integrations.lightning.setup(fabric, model, *optimizers)")):
        opt.step()


def test_missing_framework_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.delitem(sys.modules, "mixprec.integrations.lightning", raising=False)
    with pytest.raises(ImportError, match=re.escape("pip install mixprec[lightning]")):
        importlib.import_module("mixprec.integrations.lightning")

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

import mixprec
from mixprec import DynamicLossScaler, MixedPrecision, NoOpScaler
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


class Quiet(LitMLP):
    """No host read of its own in the step (the loss is kept on the device); an inf planted in
    the first weight's gradient after backward at the optimizer steps ``infs``."""

    def __init__(self, net: torch.nn.Module, infs: tuple[int, ...] = ()) -> None:
        super().__init__(net)
        self.infs = infs

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = mse(self.net(x), y)
        self.losses.append(loss.detach())
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        pass  # (LitMLP's reads the gradient norm)

    def configure_optimizers(self):  # a fused AdamW: it masks a skipped update on the device
        opt = torch.optim.AdamW(self.net.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_after_backward(self) -> None:
        if self.global_step in self.infs:
            next(self.net.parameters()).grad.view(-1)[0] = float("inf")


@pytest.mark.parametrize("plan", ["bf16-mixed", "fp16-mixed"])
def test_steady_steps_with_a_step_scheduler_read_nothing_back(plan, monkeypatch):
    """The Trainer's optimizer step and its step-interval scheduler's step wait for nothing on the
    device: no device value is read, and the skip decision's host copy is read one step late (at
    the next optimizer step, when it is free), never in the step that made it, as in mixprec's own
    loop (``tests._syncs.LateReads``)."""
    from tests._syncs import LateReads

    lit, plugin, late = Quiet(TinyMLP()), MixprecPrecision(plan), LateReads(monkeypatch)

    class Guard(L.Callback):
        def on_train_start(self, trainer, pl_module):  # the scheduler's class holds it by now
            held = type(trainer.lr_scheduler_configs[0].scheduler)
            monkeypatch.setattr(held, "step", late.wrap(held.step))

    plugin._run_step = late.wrap(plugin._run_step, new_step=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(plugin, 8, callbacks=[Guard()]).fit(lit, loader(mlp_data(8)))
    assert late.calls == 16 and late.step == 8  # eight optimizer steps and eight scheduler steps
    assert plugin.mp.optimizer_steps + plugin.mp.scaler.skipped_steps == 8


class TwoSchedules(Quiet):
    """A step-interval ExponentialLR and an epoch-interval StepLR on one fused SGD."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.net.parameters(), lr=0.1, fused=True)
        every_step = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
        every_epoch = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return [opt], [{"scheduler": every_step, "interval": "step"}, {"scheduler": every_epoch, "interval": "epoch"}]

    def on_after_backward(self) -> None:  # by batch (a skipped step does not advance global_step)
        self.batches = getattr(self, "batches", -1) + 1
        if self.batches in self.infs:
            next(self.net.parameters()).grad.view(-1)[0] = float("inf")


def test_an_epoch_scheduler_beside_a_held_step_scheduler_steps_after_the_skip_is_put_back():
    """fp16: the last step of the first epoch overflows. Lightning steps the epoch scheduler right
    after the held step scheduler; it settles the held step first, so its halving applies to the lr
    the skip left (0.1 * 0.9**3). Before: the put-back, one step later, restored the lr from before
    the halving, and the run trained at twice the learning rate from then on."""
    session = MixedPrecision("fp16-mixed", scaler=DynamicLossScaler(init_scale=2.0**8))  # (no overflow of its own)
    lit, plugin = TwoSchedules(TinyMLP(), infs=(3,)), MixprecPrecision(session)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(plugin, 12, max_epochs=3).fit(lit, loader(mlp_data(4)))
    assert plugin.mp.scaler.skipped_steps == 1 and plugin.mp.optimizer_steps == 11
    every_step, every_epoch = (c.scheduler for c in lit.trainer.lr_scheduler_configs)
    assert every_step.last_epoch == 11 and every_epoch.last_epoch == 3
    assert lit.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.9**11 * 0.5**3, rel=1e-12)


@pytest.mark.slow
def test_a_checkpoint_right_after_a_skipped_step_resumes_with_the_held_scheduler(tmp_path):
    """fp16: the step before an epoch-end checkpoint overflows. The scheduler, stepped at once and
    put back one step late, is put back before the checkpoint saves anything, so the saved
    optimizer and scheduler agree and the resumed run is the uninterrupted one, bit for bit."""
    model, data = TinyMLP(), mlp_data(1, batch=8)

    def run(net, **kwargs):
        lit, plugin = Quiet(net, infs=(5,)), MixprecPrecision("fp16-mixed")
        extra = {"enable_checkpointing": True, "callbacks": [L.pytorch.callbacks.ModelCheckpoint(
            dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True)]}
        t = trainer(plugin, 9, **extra)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t.fit(lit, loader(data), **kwargs)
        sched = t.lr_scheduler_configs[0].scheduler
        return lit, plugin, sched.get_last_lr()[0], {k: v.detach().clone() for k, v in lit.net.state_dict().items()}

    lit, plugin, lr, params = run(copy.deepcopy(model))
    assert plugin.mp.scaler.skipped_steps == 1 and plugin.mp.optimizer_steps == 8
    assert lr == pytest.approx(1e-2 / (1.0 + 0.1 * 8), rel=1e-12)  # held once
    saved = torch.load(tmp_path / "epoch=5-step=6.ckpt", weights_only=False)
    assert saved["lr_schedulers"][0]["last_epoch"] == 5  # the skipped sixth step held it
    assert saved["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(1e-2 / 1.5, rel=1e-12)
    again, plugin_again, lr_again, params_again = run(TinyMLP(), ckpt_path=tmp_path / "epoch=5-step=6.ckpt")
    assert lr_again == lr and plugin_again.mp.optimizer_steps == plugin.mp.optimizer_steps
    assert [float(x) for x in again.losses] == [float(x) for x in lit.losses[6:]]
    assert_same_params(params_again, params)


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


# ------------------------------------------------------- plans with low-precision inputs
# bf16-pure / fp16-pure (plan.input_dtype set) run as Lightning's own bf16-true / 16-true:
# the batch is converted by the plugin's convert_input, so a step may call a submodule
# (self.net(x)) rather than self(x), and the plan's dtype is the default dtype in the step.
TRUE_PRECISION = {"bf16-pure": ("bf16-true", torch.bfloat16), "fp16-pure": ("16-true", torch.float16)}


class LitSteps(L.LightningModule):
    """Every step calls the submodule ``self.net`` (never ``self``) and records, per stage, the
    batch's dtypes and the default dtype inside the step."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net
        self.losses: dict[str, list[float]] = {"fit": [], "validate": [], "test": []}
        self.seen: dict[str, tuple[torch.dtype, ...]] = {}

    def _record(self, batch, stage):
        self.seen.setdefault(stage, (batch[0].dtype, batch[1].dtype, torch.get_default_dtype()))

    def _loss(self, batch, stage):
        self._record(batch, stage)
        x, y = batch
        # /16 with lr=1: see test_pure_plans_run_every_stage_as_lightnings_true_precision
        loss = mse(self.net(x), y) / 16
        self.losses[stage].append(loss.item())
        return loss

    def training_step(self, batch, batch_idx):
        return self._loss(batch, "fit")

    def validation_step(self, batch, batch_idx):
        self._loss(batch, "validate")

    def test_step(self, batch, batch_idx):
        self._loss(batch, "test")

    def predict_step(self, batch, batch_idx):
        self._record(batch, "predict")
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=1.0)


def every_stage(net, batches, **precision):
    """fit, validate, test and predict on one Trainer (``plugins=`` or ``precision=``)."""
    lit = LitSteps(copy.deepcopy(net))
    t = L.Trainer(accelerator="cpu", devices=1, max_steps=len(batches), logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **precision)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.fit(lit, loader(batches))
        t.validate(lit, loader(batches), verbose=False)
        t.test(lit, loader(batches), verbose=False)
        predictions = t.predict(lit, loader(batches))
    return lit, predictions


@pytest.mark.parametrize("plan", sorted(TRUE_PRECISION))
def test_pure_plans_run_every_stage_as_lightnings_true_precision(plan):
    """bf16-pure / fp16-pure against Lightning's own bf16-true / 16-true: the same batch and
    step dtypes in every stage, the same losses, predictions and weights, bit for bit.

    The math is the same when the updates are: plain SGD with lr=1 (the loss is divided by 16
    instead) and no loss scaling (16-true has none). With another lr the runs part by one unit
    in the last place here and there, and mixprec's is the correctly rounded one: torch's
    ``param.add_(grad, alpha=-lr)`` on bf16/fp16 rounds lr to the parameter's dtype, and on
    fp16 CPU tensors of some lengths rounds lr*grad to fp16 before adding (a product below
    fp16's normal range loses bits), where mixprec's optimizer computes p - lr*g in fp32 and
    rounds once. Momentum and Adam differ the same way (their constants and state are rounded
    at each op in bf16-true).
    """
    true_precision, dtype = TRUE_PRECISION[plan]
    net, data = TinyMLP(), mlp_data(8)
    got, got_pred = every_stage(net, data, plugins=[MixprecPrecision(MixedPrecision(plan, scaler=NoOpScaler()))])
    want, want_pred = every_stage(net, data, precision=true_precision)
    stages = {stage: (dtype, dtype, dtype) for stage in ("fit", "validate", "test", "predict")}
    assert got.seen == want.seen == stages
    for stage in ("fit", "validate", "test"):
        assert len(got.losses[stage]) == 8
        assert_close_losses(got.losses[stage], want.losses[stage], exact=True)
    assert all(torch.equal(g, w) and g.dtype == dtype for g, w in zip(got_pred, want_pred, strict=True))
    assert_same_params(dict(got.net.named_parameters()), dict(want.net.named_parameters()))
    assert next(got.net.parameters()).dtype == dtype


@pytest.mark.parametrize("plan", sorted(TRUE_PRECISION))
def test_pure_plans_train_as_mixprec_loop_with_accumulation_and_clipping(plan):
    """training_step calls self.net(x): the same losses and weights as mixprec's own loop with
    the plan as it is (fp16-pure with its dynamic loss scale). The Trainer converts the whole
    batch, targets included, as bf16-true does; the reference rounds its targets the same way."""
    dtype = TRUE_PRECISION[plan][1]
    model, data = TinyMLP(), mlp_data(24)
    want = reference_run(model, data, lambda m, b: mse(m(b[0]), b[1].to(dtype)), plan, grad_accum_steps=2, clip=0.5)
    got = lightning_run(copy.deepcopy(model), data, plan, gas=2, clip=0.5)
    assert_close_losses(got["losses"], want["losses"], exact=True)
    assert got["mp"].optimizer_steps == want["mp"].optimizer_steps
    assert got["mp"].optimizer_steps + got["mp"].scaler.skipped_steps == 12
    assert got["lr"] == want["lr"]
    assert_same_params(got["params"], want["params"])


class ManualSteps(L.LightningModule):
    """Manual optimisation: backward, clipping and the step run inside training_step."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = net
        self.losses: list[float] = []
        self.dtypes: set[torch.dtype] = set()  # default dtype: in the step, in on_before_optimizer_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        self.dtypes.add(torch.get_default_dtype())
        loss = mse(self.net(x), y)
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()
        self.losses.append(loss.item())

    def on_before_optimizer_step(self, optimizer):
        self.dtypes.add(torch.get_default_dtype())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters(), lr=1e-2)


@pytest.mark.parametrize("plan", sorted(TRUE_PRECISION))
def test_pure_plans_manual_optimisation_steps_as_mixprec_loop(plan):
    """Backward and step inside training_step (under the plan's default dtype) run as in
    mixprec's own loop: the hooks around the step see the loop's default dtype."""
    dtype = TRUE_PRECISION[plan][1]
    model, data = TinyMLP(), mlp_data(12)
    opt_factory = lambda m: (torch.optim.AdamW(m.parameters(), lr=1e-2), None)  # noqa: E731
    want = reference_run(model, data, lambda m, b: mse(m(b[0]), b[1].to(dtype)), plan, clip=0.5, opt_factory=opt_factory)
    lit = ManualSteps(copy.deepcopy(model))
    plugin = MixprecPrecision(plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(plugin, max_steps=len(data)).fit(lit, loader(data))
    assert lit.dtypes == {dtype, torch.float32}
    assert_close_losses(lit.losses, want["losses"], exact=True)
    assert plugin.mp.optimizer_steps == want["mp"].optimizer_steps
    assert_same_params(dict(lit.net.state_dict()), want["params"])


class Probe(torch.nn.LayerNorm):
    """A LayerNorm (made an fp32 island) that records its input and the default dtype inside it."""

    def forward(self, x):
        self.seen = (x.dtype, x.abs().max().item(), torch.ones(1).dtype)
        return super().forward(x)


class IdsNet(torch.nn.Module):
    """Token ids through an embedding; float features straight into an island."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 4)
        self.feats = Probe(4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, ids, feats):
        return self.head(self.emb(ids) + self.feats(feats))


class LitIds(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = IdsNet()
        self.losses: list[float] = []
        self.ids_dtypes: set[torch.dtype] = set()

    def forward(self, ids, feats):  # Fabric calls the model
        return self.net(ids, feats)

    def _loss(self, batch):
        ids, feats, y = batch
        self.ids_dtypes.add(ids.dtype)
        loss = mse(self.net(ids, feats), y)
        self.losses.append(loss.item())
        return loss

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self._loss(batch)

    def predict_step(self, batch, batch_idx):
        self.ids_dtypes.add(batch[0].dtype)
        return self.net(batch[0], batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.1)


def ids_batches(n=4):
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(4 * n, 4, generator=g)
    feats[:, 0] = 1e5  # inf in fp16: the island must see the batch's own value
    return torch.randint(0, 16, (4 * n,), generator=g), feats, torch.randn(4 * n, 1, generator=g)


@pytest.mark.parametrize("frontend", ["trainer", "fabric"])
@pytest.mark.parametrize("plan", sorted(TRUE_PRECISION))
def test_pure_plans_keep_token_ids_integer_and_feed_islands_fp32(plan, frontend):
    """Integer inputs stay integer; an fp32 island fed a batch tensor directly gets its fp32
    value (1e5, not fp16's inf) and creates fp32 tensors, though the step's default is low."""
    dtype = TRUE_PRECISION[plan][1]
    lit = LitIds()
    plugin = MixprecPrecision(mixprec.get_plan(plan, fp32_modules=["net.feats"]))
    ids, feats, y = ids_batches()
    if frontend == "trainer":
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, feats, y), batch_size=4)
        t = trainer(plugin, max_steps=4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t.fit(lit, data)
            t.validate(lit, data, verbose=False)
            out = t.predict(lit, data)[0]
    else:
        fabric = L.Fabric(plugins=[plugin], accelerator="cpu", devices=1)
        model, opt = setup(fabric, lit, torch.optim.SGD(lit.parameters(), lr=0.1))
        for i in range(4):
            batch = slice(4 * i, 4 * i + 4)
            loss = mse(model(ids[batch], feats[batch]), y[batch])
            lit.losses.append(loss.item())
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
        lit.ids_dtypes.add(ids.dtype)
        out = model(ids[:4], feats[:4])
    assert lit.ids_dtypes == {torch.int64}
    assert lit.net.feats.seen == (torch.float32, 1e5, torch.float32)
    assert lit.net.feats.weight.dtype == torch.float32 and lit.net.head.weight.dtype == dtype
    assert out.dtype == dtype
    assert len(lit.losses) >= 4 and all(torch.isfinite(torch.tensor(lit.losses)))
    assert plugin.mp.optimizer_steps + plugin.mp.scaler.skipped_steps == 4


class PositionNet(torch.nn.Module):
    """Builds a float tensor in its forward (a position feature) and feeds it to a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(9, 1)

    def forward(self, x):
        position = (torch.arange(x.shape[0]) / x.shape[0]).unsqueeze(1)  # the default dtype
        return self.fc(torch.cat([x, position], dim=1))


def fabric_positions(batches, **precision):
    torch.manual_seed(0)
    net = PositionNet()
    fabric = L.Fabric(accelerator="cpu", devices=1, **precision)
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    model, opt = (setup(fabric, net, opt) if "plugins" in precision else fabric.setup(net, opt))
    losses = []
    for x, y in batches:
        loss = mse(model(x), y) / 16  # lr=1: see test_pure_plans_run_every_stage_as_lightnings_true_precision
        losses.append(loss.item())
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
    return losses, dict(net.named_parameters())


@pytest.mark.parametrize("plan", sorted(TRUE_PRECISION))
def test_fabric_pure_plans_create_forward_tensors_in_the_plan_dtype(plan):
    """Tensors made in the forward take the plan's dtype (Fabric's forward_context), as with
    Fabric's own bf16-true / 16-true: the same losses and weights, bit for bit."""
    true_precision, dtype = TRUE_PRECISION[plan]
    data = mlp_data(8)
    got = fabric_positions(data, plugins=[MixprecPrecision(MixedPrecision(plan, scaler=NoOpScaler()))])
    want = fabric_positions(data, precision=true_precision)
    assert_close_losses(got[0], want[0], exact=True)
    assert_same_params(got[1], want[1])
    assert got[1]["fc.weight"].dtype == dtype
    assert torch.get_default_dtype() == torch.float32


class _SaveAfterFirstMicroBatch(L.Callback):
    def __init__(self, path):
        self.path, self.saved = path, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0 and not self.saved:  # between the two micro-batches of the first step
            trainer.save_checkpoint(self.path)
            self.saved = True


@pytest.mark.parametrize("plan", ["fp16-mixed", "bf16-master"])
def test_checkpoint_between_micro_batches_saves_the_state_of_the_last_step(plan, tmp_path):
    """Before: mixprec refused ("middle of gradient accumulation") and the fit failed."""
    model, data = TinyMLP(), mlp_data(8)
    want = reference_run(model, data, lambda m, b: mse(m(b[0]), b[1]), make_plan(plan), grad_accum_steps=2)
    callback = _SaveAfterFirstMicroBatch(tmp_path / "mid.ckpt")
    lit = LitMLP(copy.deepcopy(model))
    plugin = MixprecPrecision(make_plan(plan))
    t = trainer(plugin, 4, accumulate_grad_batches=2, callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.fit(lit, loader(data))
    assert callback.saved
    assert_same_params({k: v.detach() for k, v in lit.net.state_dict().items()}, want["params"])  # saving changed nothing
    saved = torch.load(tmp_path / "mid.ckpt", weights_only=False)
    fresh = MixedPrecision(make_plan(plan))
    state = saved["MixprecPrecision"]  # Lightning keys a precision plugin's state by its class name
    assert state["optimizer_steps"] == 0  # as of the last step: none taken yet
    fresh.validate_state_dict(state)

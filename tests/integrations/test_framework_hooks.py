"""The framework internals mixprec's integrations rely on still exist in the installed versions.

``mixprec.integrations`` overrides some private (underscore) methods of the frameworks, calls
others, reads private attributes, and overrides framework hooks whose names the frameworks
may change. An override of a method the framework no longer has (or no longer calls) is
never run: nothing fails, the mixprec state is simply not saved, or not restored. These
tests name each such method and the framework version where it went missing.

Each framework is skipped when it is not installed; ``make test-min`` runs them at the
lowest versions pyproject.toml accepts (docs/versions.md).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.integration


def _module_source(cls: type) -> str:
    return inspect.getsource(importlib.import_module(cls.__module__))


def _check_method(
    problems: list[str],
    where: str,
    cls: type,
    name: str,
    why: str,
    *,
    called: bool = False,
    args: tuple[Any, ...] | None = None,
) -> None:
    """Record a problem unless ``cls.name`` exists (and, if asked, takes ``args`` and is
    called as ``self.name(`` somewhere in the module that defines ``cls``)."""
    label = f"{where}: {cls.__name__}.{name}"
    method = getattr(cls, name, None)
    if not callable(method):
        problems.append(f"{label} does not exist; {why}")
        return
    if args is not None:
        # a plain function takes self first; getattr gives static and class methods without it
        unbound = not isinstance(inspect.getattr_static(cls, name), staticmethod | classmethod)
        try:
            inspect.signature(method).bind(*((None,) if unbound else ()), *args)
        except TypeError as exc:
            problems.append(f"{label}{inspect.signature(method)} cannot take {len(args)} argument(s) ({exc}); {why}")
    if called and f"self.{name}(" not in _module_source(cls):
        problems.append(f"{label} exists but {cls.__module__} never calls it any more; {why}")


def _report(problems: list[str]) -> None:
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------ transformers
def test_transformers_trainer_methods():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import Trainer

    where = f"transformers {transformers.__version__}"
    problems: list[str] = []
    # private methods MixprecTrainer overrides (and calls through super())
    _check_method(problems, where, Trainer, "_save_scaler", "MixprecTrainer overrides it to write mixprec.pt "
                  "into every checkpoint", called=True, args=("output_dir",))
    _check_method(problems, where, Trainer, "_load_scaler", "MixprecTrainer overrides it to restore mixprec.pt "
                  "on train(resume_from_checkpoint=...)", called=True, args=("checkpoint",))
    _check_method(problems, where, Trainer, "_save", "MixprecTrainer overrides it to write the fp32 masters "
                  "(mp.export_fp32_state_dict()) for from_pretrained", called=True, args=("dir",))
    _check_method(problems, where, Trainer, "_load_optimizer_and_scheduler", "MixprecTrainer overrides it to "
                  "check the plan first and resume plain checkpoints", called=True, args=("ckpt",))
    _check_method(problems, where, Trainer, "_load_from_checkpoint", "MixprecTrainer calls it to reload a plain "
                  "checkpoint's fp32 weights for Kahan compensation", args=("ckpt",))
    # public hooks MixprecTrainer overrides
    _check_method(problems, where, Trainer, "prediction_step", "MixprecTrainer overrides it to return fp32 "
                  "logits and losses", called=True)
    _check_method(problems, where, Trainer, "create_accelerator_and_postprocess", "MixprecTrainer overrides it "
                  "to attach mixprec to the Trainer's Accelerator", called=True, args=())
    _check_method(problems, where, Trainer, "create_optimizer", "MixprecTrainer.create_optimizer calls "
                  "super().create_optimizer(model) to wrap the optimizer for the plan", called=True, args=(None,))
    _check_method(problems, where, Trainer, "autocast_smart_context_manager", "MixprecTrainer overrides it to "
                  "run the forward and the loss under the plan's autocast", called=True)
    _report(problems)


# ------------------------------------------------------------------------------- accelerate
def test_accelerate_methods_and_attributes():
    accelerate = pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import AcceleratorState, GradientState

    where = f"accelerate {accelerate.__version__}"
    problems: list[str] = []
    # private: called by the doctest of mixprec.integrations.accelerate (process-wide state reset)
    _check_method(problems, where, AcceleratorState, "_reset_state", "mixprec's accelerate doctest resets "
                  "the process-wide state with it", args=(True,))
    _check_method(problems, where, GradientState, "_reset_state", "mixprec's accelerate doctest resets the "
                  "process-wide state with it", args=())
    # public Accelerator methods the attached accelerator (mixprec's mixin) overrides
    _check_method(problems, where, Accelerator, "prepare_optimizer", "mixprec's accelerator wraps optimizers "
                  "in MixprecAcceleratedOptimizer there", called=True, args=("optimizer",))
    for name, args in (("backward", ("loss",)), ("unscale_gradients", ()), ("clip_grad_norm_", ("params", 1.0)),
                       ("clip_grad_value_", ("params", 1.0))):
        _check_method(problems, where, Accelerator, name, "mixprec's accelerator overrides it to run the plan's "
                      "loss scaling / unscaling / clipping", args=args)
    try:
        inspect.signature(AcceleratedOptimizer.__init__).bind(None, "optimizer", device_placement=False, scaler=None)
    except TypeError as exc:
        problems.append(f"{where}: AcceleratedOptimizer(optimizer, device_placement=, scaler=) no longer binds "
                        f"({exc}); MixprecAcceleratedOptimizer.__init__ calls it so")
    if "_is_accelerate_prepared" not in _module_source(Accelerator):
        problems.append(f"{where}: accelerate.accelerator no longer sets optimizer._is_accelerate_prepared; "
                        "mixprec's prepare_optimizer reads it to leave prepared optimizers alone")

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        accelerator = Accelerator(cpu=True)
        # private attribute: mixprec's prepare_optimizer appends its wrapped optimizers to it
        if not isinstance(getattr(accelerator, "_optimizers", None), list):
            problems.append(f"{where}: Accelerator()._optimizers is no longer a list; mixprec's prepare_optimizer "
                            "registers the optimizers it wraps there (save_state / free_memory see them)")
        opt = AcceleratedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1),
                                   device_placement=False, scaler=None)
        if not hasattr(getattr(opt, "gradient_state", None), "sync_gradients"):
            problems.append(f"{where}: AcceleratedOptimizer().gradient_state.sync_gradients is gone; "
                            "MixprecAcceleratedOptimizer.step() steps only when it is True")
    finally:  # accelerate's state is process-wide: leave none behind
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    _report(problems)


# -------------------------------------------------------------------------------- lightning
def test_lightning_methods_and_attributes(tmp_path):
    L = pytest.importorskip("lightning")
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.precision import Precision

    where = f"lightning {L.__version__}"
    problems: list[str] = []
    # private method MixprecPrecision.optimizer_step calls
    _check_method(problems, where, Precision, "_after_closure", "MixprecPrecision.optimizer_step calls it to "
                  "run on_before_optimizer_step and gradient clipping after unscaling", args=("model", "optimizer"))
    # public Precision hooks MixprecPrecision overrides
    for name in ("convert_module", "connect", "forward_context", "pre_backward", "backward", "post_backward",
                 "optimizer_step", "unscale_gradients", "main_params", "clip_gradients", "clip_grad_by_norm",
                 "clip_grad_by_value", "state_dict", "load_state_dict", "convert_input"):
        _check_method(problems, where, Precision, name, "MixprecPrecision overrides it")

    try:
        from lightning.fabric.wrappers import _FabricOptimizer
    except ImportError as exc:
        problems.append(f"{where}: lightning.fabric.wrappers._FabricOptimizer cannot be imported ({exc}); "
                        "mixprec.integrations.lightning imports it to unwrap Fabric's optimizers")
        _FabricOptimizer = None

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    if getattr(LightningOptimizer(sgd), "_optimizer", None) is not sgd:
        problems.append(f"{where}: LightningOptimizer(opt)._optimizer is no longer opt; mixprec unwraps "
                        "Lightning's optimizers through it")

    fabric = L.Fabric(accelerator="cpu", devices=1)
    if getattr(fabric, "_precision", None) is None:
        problems.append(f"{where}: Fabric()._precision is gone; mixprec.integrations.lightning.setup() finds "
                        "the MixprecPrecision plugin there")
    model = torch.nn.Linear(1, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    _, wrapped = fabric.setup(model, inner)
    if _FabricOptimizer is not None and not isinstance(wrapped, _FabricOptimizer):
        problems.append(f"{where}: Fabric.setup() no longer returns a _FabricOptimizer ({type(wrapped).__name__}); "
                        "mixprec unwraps Fabric's optimizers by that class")
    if getattr(wrapped, "_optimizer", None) is not inner:
        problems.append(f"{where}: _FabricOptimizer._optimizer is no longer the wrapped optimizer; mixprec "
                        "unwraps Fabric's optimizers through it")

    if "_trainer" not in vars(L.LightningModule()):
        problems.append(f"{where}: LightningModule()._trainer is gone; MixprecPrecision reads it to tell an "
                        "accumulation micro-batch from a boundary")
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    epoch_loop = trainer.fit_loop.epoch_loop
    if not callable(getattr(epoch_loop, "_should_accumulate", None)):
        problems.append(f"{where}: {type(epoch_loop).__name__}._should_accumulate (trainer.fit_loop.epoch_loop) "
                        "no longer exists; MixprecPrecision calls it to accumulate micro-batches in fp32")
    _report(problems)

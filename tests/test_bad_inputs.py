"""Bad input is refused where it is given, with the argument, the value and the fix,
never accepted and then failing later (at the first step, inside the first batch, deep
inside a run with an AttributeError); and ``import mixprec`` works where torch's
compiler cannot make its cache folder."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import mixprec
from mixprec import ConstantLossScaler, DynamicLossScaler, MixedPrecision, OpPolicy, fp8
from mixprec.diagnostics import (
    HeadroomMonitor,
    advise,
    compare,
    estimate_memory,
    headroom,
    measure_memory,
    memory_report,
    training_state_bytes_per_param,
)
from mixprec.distributed import distributed_loader, epoch_batches
from mixprec.policy import compare_with_torch, default_table, normalize_op_name

SRC = Path(__file__).resolve().parents[1] / "src"


def _default_sigint() -> None:
    """In the child: Ctrl-C at its default, whatever the runner inherited (a job started in the
    background by a shell ignores SIGINT, and Python then keeps ignoring it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC), **(env or {})}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=300, preexec_fn=_default_sigint)


def _raises(exc: type[Exception], message: str, fn: Callable[[], Any]) -> None:
    with pytest.raises(exc, match=f"^{re.escape(message)}$"):
        fn()


# ------------------------------------------------ an unusable TORCHINDUCTOR_CACHE_DIR
_IMPORT_AND_TRAIN_MODE_FORWARD = """
    import signal, sys, warnings
    import torch
    import mixprec
    from mixprec import compiling
    assert "torch._dynamo" not in sys.modules, "torch's compiler is imported on first use, not with mixprec"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "a program's Ctrl-C is left alone"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert compiling.compile_works("cpu") is False
    assert len(caught) == 1, caught
    print(caught[0].message)
    # a model with buffers: its snapshot hook keeps out of compiled graphs where a compiler exists
    mp = mixprec.MixedPrecision("bf16-mixed")
    model = mp.prepare_model(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    with mp.autocast():
        assert model(torch.randn(3, 4)).dtype == torch.bfloat16
"""


@pytest.mark.parametrize("kind", ["a file", "a path inside a file", "a read-only folder"])
def test_import_mixprec_works_where_the_inductor_cache_folder_is_unusable(tmp_path: Path, kind: str) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    if kind == "a file":
        cache = blocker
    elif kind == "a path inside a file":
        cache = blocker / "cache"
    else:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
        if os.access(folder, os.W_OK):  # root writes anywhere: the folder is not read-only for it
            folder.chmod(stat.S_IRWXU)
            pytest.skip("this user can write into a read-only folder (root)")
        cache = folder / "cache"
    try:
        proc = _python(_IMPORT_AND_TRAIN_MODE_FORWARD, {"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    finally:
        if kind == "a read-only folder":
            (tmp_path / "read-only").chmod(stat.S_IRWXU)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("torch.compile is unavailable on cpu (OSError: "), proc.stdout
    assert "TORCHINDUCTOR_CACHE_DIR, must be a writable folder" in proc.stdout


def test_import_mixprec_leaves_torch_compiler_unimported_and_compile_still_works() -> None:
    proc = _python("""
        import sys
        import torch
        import mixprec
        from mixprec import compiling
        assert "torch._dynamo" not in sys.modules
        print(compiling.compile_works("cpu", probe=False), "torch._dynamo" in sys.modules)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]


# ------------------------------------------------------------------ loss scalers
_PG_FIX = (
    "pass None (the default group when torch.distributed runs more than one rank) or a group object, "
    "e.g. torch.distributed.group.WORLD or torch.distributed.new_group(...)"
)


@pytest.mark.parametrize(
    ("make", "shown"),
    [
        (lambda: DynamicLossScaler(process_group="world"), "'world' (str)"),
        (lambda: DynamicLossScaler("cuda", process_group=0), "0 (int)"),
        (lambda: ConstantLossScaler(1024.0, process_group="world"), "'world' (str)"),
    ],
)
def test_a_process_group_that_is_not_a_group_is_refused_when_the_scaler_is_built(make: Callable[[], Any], shown: str) -> None:
    _raises(TypeError, f"process_group must be a torch.distributed.ProcessGroup or None, got {shown}; {_PG_FIX}", make)


def test_process_group_none_is_still_the_default() -> None:
    assert DynamicLossScaler(process_group=None).get_scale() == 2.0**16


# ------------------------------------------------------------------ fp8 recipe
def test_an_amax_history_too_long_to_allocate_is_refused_at_the_recipe() -> None:
    _raises(
        ValueError,
        "DelayedScaling(amax_history_len=1099511627776): at most 65536 (2**16) past iterations are kept (each "
        "layer holds that many fp32 amaxes per tensor kind); pass e.g. amax_history_len=1024 "
        "(TransformerEngine's default) or 16",
        lambda: fp8.DelayedScaling(amax_history_len=2**40),
    )
    assert fp8.DelayedScaling(amax_history_len=2**16).history_len == fp8.recipe.MAX_AMAX_HISTORY_LEN


# ------------------------------------------------------------------ op policy
@pytest.mark.parametrize(
    ("call", "exc", "message"),
    [
        (lambda: OpPolicy().precision_of(3), TypeError,
         "precision_of() takes op names (str) such as 'linear' or 'softmax', got 3 of type int"),
        (lambda: OpPolicy().precision_of("softmx"), ValueError,
         "unknown op name 'softmx' in precision_of(): neither mixprec's autocast tables nor torch.ops.aten know "
         "it; did you mean 'softmax', '_softmax', 'log_softmax'?"),
        (lambda: OpPolicy().precision_of("linear", 3), TypeError,
         "device_type must be a device type name (str) such as 'cpu' or 'cuda', got 3 (int); pass e.g. 'cpu' or 'cuda'"),
        (lambda: OpPolicy().effective(torch.device("cpu")), TypeError,
         "device_type must be a device type name (str) such as 'cpu' or 'cuda', got device(type='cpu') (device); "
         "pass device.type"),
        (lambda: default_table(["cpu"]), TypeError,
         "device_type must be a device type name (str) such as 'cpu' or 'cuda', got ['cpu'] (list); pass e.g. 'cpu' or 'cuda'"),
        (lambda: compare_with_torch(3), TypeError,
         "device_type must be a device type name (str) such as 'cpu' or 'cuda', got 3 (int); pass e.g. 'cpu' or 'cuda'"),
        (lambda: compare_with_torch("tpu"), ValueError,
         "no autocast op table for device_type='tpu', dtype=bf16; tables exist for device types cpu, cuda and "
         "dtypes bf16, fp16"),
        (lambda: normalize_op_name(None), TypeError,
         "an op name is a str such as 'linear' or 'aten::softmax', got None of type NoneType"),
        (lambda: OpPolicy(dtype=3), TypeError,
         "OpPolicy(dtype=3): expected a torch.dtype or a dtype name, got 3; pass torch.bfloat16 or torch.float16"),
    ],
)
def test_op_policy_queries_refuse_what_they_cannot_answer(call: Callable[[], Any], exc: type[Exception], message: str) -> None:
    _raises(exc, message, call)


def test_op_policy_answers_known_names_as_before() -> None:
    policy = OpPolicy(fp32_ops=["linear"])
    assert policy.precision_of("aten::linear") is mixprec.Precision.FP32
    assert policy.precision_of("relu") is None  # an aten op autocast leaves alone


# ------------------------------------------------------------------ diagnostics
_NET = nn.Linear(4, 2)
_X = torch.randn(3, 4)
_MODEL_FIX = "pass the model itself"
_BATCH_FIX = (
    "pass one batch: the inputs (a tensor, a tuple of positional arguments or a dict of keyword arguments), or "
    "(inputs, targets) with a criterion; () for a model without inputs"
)
_CRIT_FIX = "pass e.g. criterion=torch.nn.CrossEntropyLoss()"


@pytest.mark.parametrize(
    ("call", "exc", "message"),
    [
        (lambda: compare(None, _X, "bf16-mixed"), TypeError,
         f"compare(): model must be a torch.nn.Module, got None (NoneType); {_MODEL_FIX}"),
        (lambda: compare(_NET, None, "bf16-mixed"), TypeError, f"compare(): batch is None; {_BATCH_FIX}"),
        (lambda: compare(_NET, (_X, _X), "bf16-mixed", criterion="mse"), TypeError,
         "compare(): criterion must be a callable criterion(output, targets) -> loss or None, got 'mse' (str); "
         f"{_CRIT_FIX}"),
        (lambda: compare(_NET, _X, "bf16-mixed", seed=1.5), TypeError,
         "compare(): seed must be an int, got 1.5 (float); pass e.g. seed=0"),
        (lambda: compare(_NET, _X, "bf16-mixed", local="no"), TypeError,
         "compare(): local must be True or False, got 'no' (str); pass local=True or local=False"),
        (lambda: advise(None, _X, "bf16-mixed"), TypeError,
         f"advise(): model must be a torch.nn.Module, got None (NoneType); {_MODEL_FIX}"),
        (lambda: advise(_NET, _X, "bf16-mixed", max_param_fraction="half"), TypeError,
         "max_param_fraction must be a number in (0, 1], got 'half'; pass e.g. 0.5"),
        (lambda: advise(_NET, _X, "bf16-mixed", tolerance=True), ValueError,
         "tolerance must be a positive number, got True"),
        (lambda: headroom(None, _X), TypeError,
         f"headroom(): model must be a torch.nn.Module, got None (NoneType); {_MODEL_FIX}"),
        (lambda: HeadroomMonitor(_NET, loss_scale=float("inf")), ValueError,
         "loss_scale must be a finite positive number or a callable returning one, got inf; pass e.g. "
         "loss_scale=65536.0 (fp16's usual starting scale) or loss_scale=scaler.get_scale"),
        (lambda: HeadroomMonitor(_NET, gradients="no"), TypeError,
         "HeadroomMonitor(): gradients must be True or False, got 'no' (str); pass gradients=True or gradients=False"),
        (lambda: estimate_memory(None, "bf16-mixed"), TypeError,
         f"estimate_memory(): model must be a torch.nn.Module, got None (NoneType); {_MODEL_FIX}"),
        (lambda: estimate_memory(_NET, "bf16-mixed", optimizer=3), TypeError,
         "optimizer must be one of 'adamw', 'adam', 'sgd', 'sgd-momentum' or a callable params -> "
         "torch.optim.Optimizer, got 3 (int); pass e.g. optimizer='adamw'"),
        (lambda: estimate_memory(_NET, "bf16-mixed", batch=(_X, _X), criterion=3), TypeError,
         f"estimate_memory(): criterion must be a callable criterion(output, targets) -> loss or None, got 3 (int); {_CRIT_FIX}"),
        (lambda: training_state_bytes_per_param(None, None), TypeError,
         f"training_state_bytes_per_param(): model must be a torch.nn.Module, got None (NoneType); {_MODEL_FIX}"),
        (lambda: training_state_bytes_per_param(_NET, "adamw"), TypeError,
         "training_state_bytes_per_param(): optimizer must be the torch.optim.Optimizer prepare() returned (or "
         "None for no optimizer state), got 'adamw' (str)"),
        (lambda: measure_memory(_NET, "bf16-mixed", lambda: _X), TypeError,
         "measure_memory(): model_factory must be a function that builds a fresh model on every call, got the "
         "Linear module itself; pass e.g. model_factory=lambda: MyModel()"),
        (lambda: measure_memory(lambda: None, "bf16-mixed", lambda: _X), TypeError,
         "measure_memory(): model_factory() returned None (NoneType), not a torch.nn.Module; it must build and "
         "return a fresh model, e.g. model_factory=lambda: MyModel()"),
        (lambda: measure_memory(lambda: nn.Linear(4, 2), "bf16-mixed", None), TypeError,
         "measure_memory(): batch_fn must be a function that builds a fresh batch on every call, got None "
         "(NoneType); pass e.g. batch_fn=lambda: torch.randn(8, 32)"),
        (lambda: memory_report(None), TypeError,
         "memory_report(): model_factory must be a function that builds a fresh model on every call, got None "
         "(NoneType); pass e.g. model_factory=lambda: MyModel()"),
        (lambda: memory_report(lambda: nn.Linear(4, 2), "bf16-mixed", measure=False), TypeError,
         "memory_report(): plans must be a sequence of plan names or Plans, got 'bf16-mixed' (str); pass e.g. "
         "plans=('bf16-mixed',)"),
    ],
)
def test_diagnostics_refuse_bad_arguments_before_any_run(call: Callable[[], Any], exc: type[Exception], message: str) -> None:
    _raises(exc, message, call)


def test_memory_report_checks_every_plan_name_before_building_anything() -> None:
    built: list[int] = []

    def factory() -> nn.Module:
        built.append(1)
        return nn.Linear(4, 2)

    with pytest.raises(ValueError, match=r"^unknown precision plan 'nope'"):
        memory_report(factory, ("fp32", "nope"), measure=False)
    assert built == []


# ------------------------------------------------------------------ resume
def test_a_state_dict_whose_fingerprint_is_a_string_is_refused_and_changes_nothing() -> None:
    model = nn.Linear(4, 4)
    mp = MixedPrecision("fp16-mixed")
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    sd = mp.state_dict()
    sd["fingerprint"] = "fp16-mixed"
    sd["scaler"] = {**sd["scaler"], "scale": 8.0}
    message = (
        "state_dict['fingerprint'] must be a dict (what Plan.fingerprint() returns), got 'fp16-mixed' (str): the "
        "checkpoint is corrupt or was not written by MixedPrecision.state_dict(); load an intact checkpoint"
    )
    for allow in (True, False):
        _raises(ValueError, message, lambda allow=allow: mp.load_state_dict(sd, allow_plan_change=allow))
    assert mp.scaler.get_scale() == 2.0**16


# ------------------------------------------------------------------ data loading
def _loader(**kwargs: Any) -> Any:
    return distributed_loader(TensorDataset(torch.arange(12.0)), 2, num_replicas=1, rank=0, **kwargs)


@pytest.mark.parametrize(
    ("call", "exc", "message"),
    [
        (lambda: epoch_batches(_loader(), start_step=1.5), TypeError,
         "epoch_batches(): start_step must be an int, got 1.5 (float); pass e.g. start_step=0 (or the global step "
         "to resume at)"),
        (lambda: epoch_batches(_loader(), start_step=-1), ValueError,
         "epoch_batches(): start_step must be >= 0, got -1; pass 0 or the global step to resume at"),
        (lambda: epoch_batches(None), TypeError,
         "epoch_batches() needs a loader made by distributed_loader() (a ResumableDistributedSampler), got None "
         "(NoneType)"),
        (lambda: _loader(seed=1.5), TypeError,
         "distributed_loader(): seed must be an int, got 1.5 (float); pass e.g. seed=0 (the same on every rank)"),
        (lambda: _loader(shuffle="no"), TypeError,
         "distributed_loader(): shuffle must be True or False, got 'no' (str); pass shuffle=True or shuffle=False"),
        (lambda: distributed_loader(TensorDataset(torch.arange(4.0)), 2, num_replicas=2, rank=0.5), TypeError,
         "distributed_loader(): rank must be an int, got 0.5 (float); pass e.g. rank=None (this process's rank)"),
        (lambda: distributed_loader(TensorDataset(torch.arange(4.0)), 2, num_replicas=0, rank=0), ValueError,
         "distributed_loader(): num_replicas must be >= 1, got 0; pass num_replicas=None (the world size)"),
        (lambda: _loader().sampler.set_start(1.5), TypeError,
         "set_start(): start must be an int, got 1.5 (float); pass e.g. set_start(0)"),
    ],
)
def test_data_loading_refuses_bad_arguments_at_the_call_not_at_the_first_batch(
    call: Callable[[], Any], exc: type[Exception], message: str
) -> None:
    _raises(exc, message, call)  # the call itself raises: no next() on a generator needed


def test_epoch_batches_still_resumes_mid_epoch() -> None:
    batches = epoch_batches(_loader(shuffle=False), start_step=4)
    first = next(batches)
    assert (first.step, first.epoch) == (4, 0)
    assert torch.equal(first.batch[0], torch.tensor([8.0, 9.0]))


# ------------------------------------------------------------------ the command's start
@pytest.mark.parametrize(
    ("orig_argv", "argv0", "expected"),
    [
        (["python", "-m", "mixprec", "demo"], "-m", True),
        (["python", "-X", "dev", "-m", "mixprec.cli", "demo"], "-m", True),
        (["python", "-IBm", "mixprec"], "-m", True),
        (["python", "/venv/bin/mixprec", "demo"], "/venv/bin/mixprec", True),
        (["python", "-m", "pytest", "-m", "mixprec"], "-m", False),
        (["python", "-c", "import mixprec"], "-c", False),
        (["python", "train.py", "-m", "mixprec"], "train.py", False),
        (["python"], "", False),
    ],
)
def test_only_the_mixprec_command_counts_as_launched_as_the_command(
    orig_argv: list[str], argv0: str, expected: bool
) -> None:
    from mixprec.startup import launched_as_command

    assert launched_as_command(orig_argv, argv0) is expected


def test_a_program_that_imports_mixprec_keeps_its_own_ctrl_c() -> None:
    proc = _python("""
        import signal
        import mixprec
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            print("KeyboardInterrupt")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "KeyboardInterrupt\n"


@pytest.mark.parametrize("plan", ["bf16-mixed", "fp32", "auto"])
def test_session_process_group_is_checked_where_it_is_given(plan: str) -> None:
    """Before: accepted, then AttributeError ('str' has no 'allreduce') at the first step of bf16/fp32 plans."""
    with pytest.raises(TypeError, match=r"process_group must be a torch.distributed.ProcessGroup or None, got 'world'"):
        mixprec.MixedPrecision(plan, process_group="world")


@pytest.mark.parametrize("plan", ["fp32", "bf16-mixed", "bf16-master", "bf16-kahan", "fp16-master"])
def test_an_optimizer_over_replaced_parameters_is_refused_at_the_first_step(plan):
    """The model's parameters swapped after prepare() (as sharding does): the optimizer would step
    tensors the model no longer uses, training nothing. The first step says so; the model is untouched."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for layer in model:
        layer.weight = torch.nn.Parameter(layer.weight.detach().clone())
        layer.bias = torch.nn.Parameter(layer.bias.detach().clone())
    before = [p.detach().clone() for p in model.parameters()]
    with mp.autocast():
        loss = model(torch.randn(3, 4)).float().sum()
    mp.backward(loss)
    with pytest.raises(RuntimeError, match=r"no longer has.*fully_shard_model"):
        mp.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_an_optimizer_whose_part_got_no_gradient_this_step_is_not_mistaken_for_a_stale_one():
    """Two optimizers, one backward through one part only (as a GAN's alternating steps): the
    idle optimizer holds the model's current parameters, so it is not refused."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 2), "b": torch.nn.Linear(4, 2)})
    mp = MixedPrecision("bf16-master")
    model, opt_a, opt_b = mp.prepare(
        model, torch.optim.SGD(model["a"].parameters(), lr=0.1), torch.optim.SGD(model["b"].parameters(), lr=0.1)
    )
    before = model["a"].weight.detach().clone()
    with mp.autocast():
        loss = model["a"](torch.randn(3, 4)).float().sum()
    mp.backward(loss)
    assert mp.step().stepped
    assert not torch.equal(before, model["a"].weight)

"""Bad input to the public API: each call either works or raises ValueError/TypeError naming the argument.

A table of hand-picked probes (get_plan, OpPolicy, autocast, register_op,
save_checkpoint / load_checkpoint, the command line), then hypothesis fuzzing of
``get_plan(name, **overrides)`` and ``OpPolicy(...)``. Nothing may escape as
AttributeError, KeyError, IndexError, a raw torch error or a traceback.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec
from mixprec import OpPolicy, get_plan, load_checkpoint, save_checkpoint
from mixprec.cli import main
from mixprec.plans import ALIASES, PLANS, Plan

_OK = object()


def _check(call: Callable[[], Any], names: tuple[str, ...]) -> Any:
    """Run ``call``: it returns, or raises ValueError/TypeError whose message names one of ``names``."""
    try:
        return call()
    except (ValueError, TypeError) as exc:
        message = str(exc)
        assert any(name in message for name in names), f"{type(exc).__name__} does not name {names}: {message}"
        return exc


# ------------------------------------------------------------------ the table
_NOWHERE = "/nonexistent-mixprec-folder/x.pt"  # argument checks come before any file access
_NEVER_WRITTEN = os.path.join(tempfile.gettempdir(), "mixprec-probe-never-written.pt")  # refused before writing


def _model() -> nn.Module:
    return nn.Linear(2, 2)


PROBES: list[tuple[str, Callable[[], Any], tuple[str, ...]]] = [
    # get_plan
    ("get_plan(None)", lambda: get_plan(None), ("plan name",)),  # type: ignore[arg-type]
    ("get_plan(3)", lambda: get_plan(3), ("plan name",)),  # type: ignore[arg-type]
    ("get_plan('')", lambda: get_plan(""), ("precision plan",)),
    ("get_plan('bf16-mixed', policy='x')", lambda: get_plan("bf16-mixed", policy="x"), ("policy",)),
    ("policy=[]", lambda: get_plan("bf16-mixed", policy=[]), ("policy",)),
    ("policy dtype mismatch", lambda: get_plan("bf16-mixed", policy=OpPolicy(torch.float16)), ("policy", "OpPolicy")),
    ("compute_dtype=int8", lambda: get_plan("bf16-mixed", compute_dtype=torch.int8), ("compute_dtype",)),
    ("compute_dtype=float64", lambda: get_plan("bf16-master", compute_dtype=torch.float64), ("compute_dtype",)),
    ("compute_dtype=fp16 unscaled", lambda: get_plan("bf16-pure", compute_dtype=torch.float16), ("compute_dtype",)),
    ("compute_dtype='e4m3'", lambda: get_plan("bf16-mixed", compute_dtype="e4m3"), ("compute_dtype",)),
    ("compute_dtype=None", lambda: get_plan("bf16-mixed", compute_dtype=None), ("compute_dtype",)),
    ("reduce_dtype='x'", lambda: get_plan("bf16-mixed", reduce_dtype="x"), ("reduce_dtype",)),
    ("unknown override", lambda: get_plan("fp16-mixed", lossscale=2), ("lossscale",)),
    ("loss_scale=0", lambda: get_plan("fp16-mixed", loss_scale=0), ("loss_scale",)),
    ("loss_scale=-inf", lambda: get_plan("fp16-mixed", loss_scale=-math.inf), ("loss_scale",)),
    ("loss_scale='static'", lambda: get_plan("fp16-mixed", loss_scale="static"), ("loss_scale",)),
    ("loss_scale=[1]", lambda: get_plan("fp16-mixed", loss_scale=[1]), ("loss_scale",)),
    ("init_scale on bf16", lambda: get_plan("bf16-mixed", init_scale=2.0), ("init_scale",)),
    ("growth_interval=0", lambda: get_plan("fp16-mixed", growth_interval=0), ("growth_interval",)),
    ("backoff_factor=2", lambda: get_plan("fp16-mixed", backoff_factor=2.0), ("backoff_factor",)),
    ("hysteresis='2'", lambda: get_plan("fp16-mixed", hysteresis="2"), ("hysteresis",)),
    ("min_scale > max_scale", lambda: get_plan("fp16-mixed", min_scale=8.0, max_scale=2.0), ("min_scale", "max_scale")),
    ("rounding=None", lambda: get_plan("bf16-kahan", rounding=None), ("rounding",)),
    ("state_dtype=int8", lambda: get_plan("bf16-kahan", state_dtype=torch.int8), ("state_dtype",)),
    ("tf32='yes'", lambda: get_plan("tf32", tf32="yes"), ("tf32",)),
    ("lower_ops=5", lambda: get_plan("bf16-mixed", lower_ops=5), ("lower_ops",)),
    ("fp32_ops=['nope_op']", lambda: get_plan("bf16-mixed", fp32_ops=["nope_op"]), ("fp32_ops",)),
    ("fp32_modules=[3]", lambda: get_plan("bf16-mixed", fp32_modules=[3]), ("fp32_modules",)),
    ("policy and lower_ops", lambda: get_plan("bf16-mixed", policy=OpPolicy(), lower_ops=["softmax"]), ("policy=",)),
    ("fp32 plan with lower_ops", lambda: get_plan("fp32", lower_ops=["softmax"]), ("lower_ops",)),
    ("tf32 plan with fp32_modules", lambda: get_plan("tf32", fp32_modules=["head"]), ("fp32_modules",)),
    # OpPolicy
    ("OpPolicy(dtype=fp32)", lambda: OpPolicy(torch.float32), ("dtype",)),
    ("OpPolicy(dtype=3)", lambda: OpPolicy(3), ("dtype",)),  # type: ignore[arg-type]
    ("OpPolicy(dtype='x')", lambda: OpPolicy("x"), ("dtype",)),  # type: ignore[arg-type]
    ("OpPolicy(lower_ops=3)", lambda: OpPolicy(lower_ops=3), ("lower_ops",)),  # type: ignore[arg-type]
    ("OpPolicy(lower_ops=[3])", lambda: OpPolicy(lower_ops=[3]), ("lower_ops",)),  # type: ignore[list-item]
    ("OpPolicy op in both", lambda: OpPolicy(lower_ops=["softmax"], fp32_ops=["softmax"]), ("lower_ops", "fp32_ops")),
    ("OpPolicy(fp32_modules=3)", lambda: OpPolicy(fp32_modules=3), ("fp32_modules",)),  # type: ignore[arg-type]
    ("OpPolicy(fp32_modules=[int])", lambda: OpPolicy(fp32_modules=[int]), ("fp32_modules",)),  # type: ignore[list-item]
    # autocast
    ("autocast(enabled='false')", lambda: mixprec.autocast(torch.bfloat16, device_type="cpu", enabled="false"),
     ("enabled",)),
    ("autocast(dtype=int8)", lambda: mixprec.autocast(torch.int8, device_type="cpu"), ("dtype",)),
    ("autocast(dtype='cpu')", lambda: mixprec.autocast("cpu"), ("dtype",)),
    ("autocast(device_type=3)", lambda: mixprec.autocast(device_type=3), ("device_type",)),  # type: ignore[arg-type]
    ("autocast(device_type='gpu')", lambda: mixprec.autocast(device_type="gpu"), ("device_type",)),
    ("autocast(cache_enabled=1)", lambda: mixprec.autocast(device_type="cpu", cache_enabled=1), ("cache_enabled",)),
    ("autocast(policy='x')", lambda: mixprec.autocast(device_type="cpu", policy="x"), ("policy",)),  # type: ignore[arg-type]
    ("autocast(fp32_ops=None)", lambda: mixprec.autocast(device_type="cpu", fp32_ops=None), ("fp32_ops",)),  # type: ignore[arg-type]
    ("autocast()(3)", lambda: mixprec.autocast(device_type="cpu")(3), ("callable",)),  # type: ignore[arg-type]
    # register_op
    ("register_op('nosuchns::op')", lambda: mixprec.register_op("nosuchns::op", "fp32"), ("nosuchns::op",)),
    ("register_op('aten::linear')", lambda: mixprec.register_op("aten::linear", "fp32"), ("aten::linear",)),
    ("register_op(3)", lambda: mixprec.register_op(3, "fp32"), ("register_op",)),
    ("register_op precision", lambda: mixprec.register_op(lambda x: x, "half"), ("precision",)),
    # checkpoints
    ("save path=3", lambda: save_checkpoint(3, model=_model()), ("path",)),  # type: ignore[arg-type]
    ("save model=dict", lambda: save_checkpoint(_NOWHERE, model={}), ("model",)),  # type: ignore[arg-type]
    ("save optimizers=opt", lambda: save_checkpoint(
        _NOWHERE, model=_model(), optimizers=torch.optim.SGD(_model().parameters(), lr=0.1)), ("optimizers",)),
    ("save optimizers=[3]", lambda: save_checkpoint(_NOWHERE, model=_model(), optimizers=[3]), ("optimizers",)),
    ("save mp='bf16'", lambda: save_checkpoint(_NOWHERE, model=_model(), mp="bf16"), ("mp",)),  # type: ignore[arg-type]
    ("save extra=[1]", lambda: save_checkpoint(_NOWHERE, model=_model(), extra=[1]), ("extra",)),  # type: ignore[arg-type]
    ("save extra={'x': object()}", lambda: save_checkpoint(_NEVER_WRITTEN, model=_model(), extra={"x": object()}),
     ("extra['x']",)),
    ("save into a folder", lambda: save_checkpoint("/tmp", model=_model()), ("path",)),
    ("load path=None", lambda: load_checkpoint(None, model=_model()), ("path",)),  # type: ignore[arg-type]
    ("load mp=3", lambda: load_checkpoint(_NOWHERE, model=_model(), mp=3), ("mp",)),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("label", "call", "names"), PROBES, ids=[p[0] for p in PROBES])
def test_bad_input_probe(label: str, call: Callable[[], Any], names: tuple[str, ...]) -> None:
    result = _check(call, names)
    assert isinstance(result, ValueError | TypeError), f"{label} was accepted: {result!r}"
    assert not os.path.exists(_NEVER_WRITTEN)


CLI_PROBES: list[tuple[list[str], str]] = [
    (["demo", "--lr", "inf"], "--lr"),
    (["demo", "--lr", "0"], "--lr"),
    (["demo", "--lr", "abc"], "--lr"),
    (["demo", "--seed", str(2**70)], "--seed"),
    (["demo", "--seed", "-1"], "--seed"),
    (["demo", "--steps", "1e3"], "--steps"),
    (["demo", "--batch-size", "0"], "--batch-size"),
    (["demo", "--threads", "0"], "--threads"),
    (["demo", "--plans", "bf17"], "bf17"),
    (["demo", "--size", "huge"], "--size"),
    (["bench", "--repeats", "-3"], "--repeats"),
    (["bench", "--memory-budget", "12parsecs"], "12parsecs"),
    (["explain", "nope"], "nope"),
    (["memory", "--model", "nosuch"], "nosuch"),
    (["nosuchcommand"], "nosuchcommand"),
]


@pytest.mark.parametrize(("argv", "name"), CLI_PROBES, ids=[" ".join(a) for a, _ in CLI_PROBES])
def test_bad_command_line_exits_2_with_one_line(argv: list[str], name: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert name in err, err


# ------------------------------------------------------------------- fuzzing
_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.bool, torch.float8_e4m3fn]
_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=2**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["dynamic", "none", "kahan", "stochastic", "consecutive", "since_growth", "bf16", "fp16",
                     "fp32", "fp8", "", "softmax", "*.attn"]),
    st.sampled_from(_DTYPES),
    st.lists(st.sampled_from(["softmax", "linear", "layer_norm", "nope", 3]), max_size=3),
    st.just(OpPolicy()),
)
_OVERRIDE_NAMES = [
    "compute_dtype", "reduce_dtype", "policy", "loss_scale", "init_scale", "growth_factor", "backoff_factor",
    "growth_interval", "hysteresis", "hysteresis_mode", "min_scale", "max_scale", "lower_ops", "fp32_ops",
    "fp32_modules", "state_dtype", "rounding", "seed", "tf32", "accumulate_grads_in_fp32_hooks", "not_an_override",
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from([*PLANS, *ALIASES]),
    overrides=st.dictionaries(st.sampled_from(_OVERRIDE_NAMES), _VALUES, max_size=3),
)
def test_get_plan_fuzz(name: str, overrides: dict[str, Any]) -> None:
    result = _check(lambda: get_plan(name, **overrides), (*overrides, "policy="))
    if isinstance(result, Plan):
        # an accepted plan is usable: it explains itself, has a fingerprint, makes its scaler
        assert result.explain().startswith(f"plan {result.name}")
        assert result.fingerprint()
        result.make_scaler()
        assert result.compute_dtype in (torch.float32, torch.bfloat16, torch.float16)
        if result.compute_dtype == torch.float16 and "loss_scale" not in overrides:
            assert result.scaling.kind != "none"  # fp16 never runs unscaled unless asked for


_OPS = st.sampled_from(["softmax", "linear", "matmul", "layer_norm", "conv2d", "softmx", "", "aten::mm", 3, None])


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.one_of(st.sampled_from(_DTYPES), st.sampled_from(["bf16", "half", "fp32", "x"]), st.integers(), st.none()),
    lower_ops=st.one_of(st.lists(_OPS, max_size=3), st.sampled_from(["softmax", 3, None])),
    fp32_ops=st.one_of(st.lists(_OPS, max_size=3), st.sampled_from(["linear", 3])),
    fp32_modules=st.one_of(
        st.lists(st.sampled_from([nn.LayerNorm, nn.Linear, "*.attn", "", int, 3]), max_size=3),
        st.sampled_from([nn.LayerNorm, "head", 3, None]),
    ),
)
def test_op_policy_fuzz(dtype: Any, lower_ops: Any, fp32_ops: Any, fp32_modules: Any) -> None:
    names = ("dtype", "lower_ops", "fp32_ops", "fp32_modules")
    result = _check(
        lambda: OpPolicy(dtype, lower_ops=lower_ops, fp32_ops=fp32_ops, fp32_modules=fp32_modules), names
    )
    if isinstance(result, OpPolicy):
        assert result.dtype in (torch.bfloat16, torch.float16)
        assert not set(result.lower_ops) & set(result.fp32_ops)
        assert result.explain("cpu")
        assert re.match(r"OpPolicy\(dtype=(bf16|fp16)\)", result.explain("cpu"))

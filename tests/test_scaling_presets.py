"""Other systems' loss scalers, reproduced bit for bit: DeepSpeed, Paddle, Megatron-LM, apex.

Two kinds of evidence, both exact (``==`` on every scale):

- Peer tests ported as data: each system's own unit tests (the overflow pattern and the
  scales they assert), written out below with the test they come from.
- Oracles: each system's scale update transcribed from its source (file and function named
  in the docstring; the arithmetic kept in the same precision: Python floats for DeepSpeed
  and apex, fp32 for Paddle and Megatron), run side by side with mixprec on random overflow
  patterns.
"""

from __future__ import annotations

import io
import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec import ConstantLossScaler, DynamicLossScaler, NoOpScaler

INF = float("inf")


class _Run:
    """One tiny parameter; each step injects an inf gradient (overflow) or a finite one."""

    def __init__(self, scaler: DynamicLossScaler, device: str = "cpu") -> None:
        self.scaler = scaler
        self.w = torch.nn.Parameter(torch.ones(2, device=device))
        self.opt = torch.optim.SGD([self.w], lr=0.0)

    def step(self, overflow: bool) -> float:
        loss = (self.w * (INF if overflow else 1.0)).sum()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad()
        return self.scaler.get_scale()


def _scales(scaler, pattern: str) -> list[float]:
    """Scale after each step of ``pattern`` ("o": overflow, "c": clean)."""
    run = _Run(scaler)
    return [run.step(ch == "o") for ch in pattern]


def _f32(x: float) -> float:
    return float(np.float32(x))


# ------------------------------------------------------------------ oracles
class _DeepSpeedZeRO:
    """deepspeed/runtime/fp16/loss_scaler.py, DynamicLossScaler.update_scale (ZeRO 1-3), without logging."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis):
        self.cur_scale, self.scale_window, self.min_scale = init_scale, scale_window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.consecutive = consecutive_hysteresis
        self.cur_iter, self.last_overflow_iter = 0, -1

    def update(self, overflow: bool) -> float:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:  # raise_error_at_min_scale=True (DeepSpeed's default)
                    raise RuntimeError("Current loss scale already at minimum")
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2.0
        self.cur_iter += 1
        return self.cur_scale


class _DeepSpeedStage0:
    """deepspeed/runtime/fp16/fused_optimizer.py (and unfused_optimizer.py), FP16_Optimizer._update_scale."""

    def __init__(self, init_scale, scale_window, min_scale):
        self.cur_scale, self.scale_window, self.min_scale = init_scale, scale_window, min_scale
        self.cur_iter, self.last_overflow_iter = 0, -1

    def update(self, overflow: bool) -> float:
        if overflow:
            self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            self.last_overflow_iter = self.cur_iter
        else:
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                self.cur_scale *= 2.0
        self.cur_iter += 1
        return self.cur_scale


class _Paddle:
    """Paddle's update in fp32. static: paddle/phi/kernels/impl/amp_kernel_impl.h, Update (floor 1, a
    non-finite growth is dropped); dygraph: python/paddle/amp/grad_scaler.py, AmpScaler._update."""

    def __init__(self, api, init, incr_ratio, decr_ratio, incr_every_n_steps, decr_every_n_nan_or_inf):
        self.api, self.scale = api, np.float32(init)
        self.incr, self.decr = np.float32(incr_ratio), np.float32(decr_ratio)
        self.n_incr, self.n_decr = incr_every_n_steps, decr_every_n_nan_or_inf
        self.good = self.bad = 0

    def update(self, found_inf: bool) -> float:
        if found_inf:
            self.good, self.bad = 0, self.bad + 1
            if self.bad == self.n_decr:
                new = np.float32(self.scale * self.decr)
                self.scale = max(new, np.float32(1)) if self.api == "static" else new
                self.bad = 0
        else:
            self.bad, self.good = 0, self.good + 1
            if self.good == self.n_incr:
                new = np.float32(self.scale * self.incr)
                self.scale = new if (self.api == "dygraph" or np.isfinite(new)) else self.scale
                self.good = 0
        return float(self.scale)


class _Megatron:
    """megatron/core/optimizer/grad_scaler.py, DynamicGradScaler.update (fp32 tensors, on CPU)."""

    def __init__(self, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis):
        f32 = torch.float32
        self.scale = torch.tensor([initial_scale], dtype=f32)
        self.min_scale = torch.tensor([min_scale], dtype=f32)
        self.growth_factor = torch.tensor([growth_factor], dtype=f32)
        self.backoff_factor = torch.tensor([backoff_factor], dtype=f32)
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

    def update(self, found_inf: bool) -> float:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = torch.max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker, self.hysteresis_tracker = 0, self.hysteresis
                self.scale = self.scale * self.growth_factor
        return float(self.scale.item())


class _Apex:
    """apex/amp/scaler.py, LossScaler.__init__ and update_scale (Python floats)."""

    def __init__(self, init_scale=2.0**16, scale_window=2000, min_loss_scale=None, max_loss_scale=2.0**24):
        self.loss_scale = min(max_loss_scale, init_scale)
        self.window, self.min, self.max = scale_window, min_loss_scale, max_loss_scale
        self.unskipped = 0

    def update(self, overflow: bool) -> float:
        if overflow:
            self.loss_scale = max(self.min, self.loss_scale / 2.0) if self.min else self.loss_scale / 2.0
            self.unskipped = 0
        else:
            self.unskipped += 1
        if self.unskipped == self.window:
            self.loss_scale = min(self.max, self.loss_scale * 2.0)
            self.unskipped = 0
        return self.loss_scale


def _compare(ours, oracle, pattern: list[bool]) -> None:
    """Step both; every scale equal; an oracle that raises (DeepSpeed at min scale) raises in mixprec too."""
    run = _Run(ours)
    for i, bad in enumerate(pattern):
        try:
            expected = oracle.update(bad)
        except RuntimeError:
            with pytest.raises(RuntimeError, match="already at its minimum"):
                run.step(bad)
            return
        got = run.step(bad)
        assert got == expected, f"step {i}: mixprec {got!r} vs reference {expected!r} (pattern {pattern[: i + 1]})"


_patterns = st.lists(st.booleans(), min_size=1, max_size=40)


# ------------------------------------------------------------------ DeepSpeed: ported tests
def _ds(fp16: dict, zero_stage: int | None = None) -> dict:
    config = {"train_batch_size": 1, "steps_per_print": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 0.00015}}, "fp16": {"enabled": True, "loss_scale": 0, **fp16}}
    if zero_stage is not None:
        config["zero_optimization"] = {"stage": zero_stage}
    return config


# tests/unit/runtime/half_precision/test_dynamic_loss_scale.py (ZeRO stage 0: FP16_Optimizer with Adam,
# FP16_UnfusedOptimizer with Lamb). The hysteresis key is absent, so DeepSpeed's default 2 applies, and
# stage 0 ignores it: every overflow backs off. "o" = an inf/-inf/nan gradient, "c" = a finite one.
DEEPSPEED_STAGE0_TESTS = [
    # TestFused/TestUnfused.test_no_overflow: the scale doubles whenever cur_iter (after the step) is even
    ("test_no_overflow", {"initial_scale_power": 8, "loss_scale_window": 2}, "c" * 10,
     [256, 256, 512, 512, 1024, 1024, 2048, 2048, 4096, 4096]),
    # TestFused.test_all_overflow: expected = max(expected / 2, 1) after each of 8 overflows
    ("TestFused.test_all_overflow", {"initial_scale_power": 4, "loss_scale_window": 2}, "o" * 8,
     [8, 4, 2, 1, 1, 1, 1, 1]),
    # TestUnfused.test_all_overflow: min_loss_scale 2
    ("TestUnfused.test_all_overflow", {"initial_scale_power": 4, "loss_scale_window": 2, "min_loss_scale": 2.0},
     "o" * 8, [8, 4, 2, 2, 2, 2, 2, 2]),
    # test_some_overflow: two overflows (/4), scale_window + 1 clean steps grow once, one overflow (/2)
    ("test_some_overflow", {"initial_scale_power": 8, "loss_scale_window": 2}, "oo" + "ccc" + "o",
     [128, 64, 64, 64, 128, 64]),
]

# tests/unit/runtime/half_precision/test_zero_optim_overflow.py, TestZeROFloat16 (stages 1 and 2).
DEEPSPEED_ZERO_TESTS = [
    # test_no_overflow: hysteresis absent (2), ten clean steps
    ("test_no_overflow", {"initial_scale_power": 8, "loss_scale_window": 2}, "c" * 10,
     [256, 256, 512, 512, 1024, 1024, 2048, 2048, 4096, 4096]),
    # test_all_overflow: initial_scale_power = len(overflow_gradients) = 8, hysteresis 1
    ("test_all_overflow", {"initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}, "o" * 8,
     [128, 64, 32, 16, 8, 4, 2, 1]),
    # test_some_overflow: hysteresis 1
    ("test_some_overflow", {"initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}, "oo" + "ccc" + "o",
     [128, 64, 64, 64, 128, 64]),
]


@pytest.mark.parametrize(("name", "fp16", "pattern", "expected"), DEEPSPEED_STAGE0_TESTS, ids=[t[0] for t in DEEPSPEED_STAGE0_TESTS])
def test_deepspeed_dynamic_loss_scale_tests(name, fp16, pattern, expected):
    scaler = DynamicLossScaler.from_deepspeed(_ds(fp16))  # no zero_optimization: stage 0
    assert _scales(scaler, pattern) == expected, name


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize(("name", "fp16", "pattern", "expected"), DEEPSPEED_ZERO_TESTS, ids=[t[0] for t in DEEPSPEED_ZERO_TESTS])
def test_deepspeed_zero_optim_overflow_tests(stage, name, fp16, pattern, expected):
    scaler = DynamicLossScaler.from_deepspeed(_ds(fp16, zero_stage=stage))
    assert _scales(scaler, pattern) == expected, name


def test_issue_pattern_consecutive_hysteresis():
    # The issue: o o o o o c o o o c o with hysteresis 2; DeepSpeed 256,128,64,32,16... where the
    # "consecutive" mode (Paddle's rule) gives 256,128,128,64,64...
    pattern = "ooooocoooco"
    fp16 = {"initial_scale_power": 8, "hysteresis": 2, "consecutive_hysteresis": True}
    expected = [256, 128, 64, 32, 16, 16, 16, 8, 4, 4, 4]
    assert _scales(DynamicLossScaler.from_deepspeed(_ds(fp16, 2)), pattern) == expected
    oracle = _DeepSpeedZeRO(256.0, 1000, 1, 2, True)
    assert [oracle.update(ch == "o") for ch in pattern] == expected
    paddle_rule = DynamicLossScaler(init_scale=256.0, hysteresis=2)
    assert _scales(paddle_rule, pattern)[:5] == [256, 128, 128, 64, 64]


def test_issue_pattern_without_consecutive_hysteresis():
    # consecutive_hysteresis=False: the budget refills only when the scale grows (a clean step does not).
    pattern = "ooooocoooco"
    scaler = DynamicLossScaler.from_deepspeed(_ds({"initial_scale_power": 8, "hysteresis": 2}, 2))
    assert scaler.hysteresis_mode == "since_growth"
    assert _scales(scaler, pattern) == [256, 128, 64, 32, 16, 16, 8, 4, 2, 2, 1]


def test_deepspeed_grows_on_clean_step_window_plus_one_then_every_window():
    fp16 = {"initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 1}
    # From the start: the 4th clean step grows, then every 3rd; after an overflow again the 4th.
    pattern = "cccc" + "ccc" + "o" + "cccc"
    expected = [256, 256, 256, 512, 512, 512, 1024, 512, 512, 512, 512, 1024]
    assert _scales(DynamicLossScaler.from_deepspeed(_ds(fp16, 1)), pattern) == expected
    # torch (and mixprec by default) grows one step earlier:
    assert _scales(DynamicLossScaler(init_scale=256.0, growth_interval=3), "ccc") == [256, 256, 512]


def test_deepspeed_growth_window_one():
    scaler = DynamicLossScaler.from_deepspeed(_ds({"initial_scale_power": 4, "loss_scale_window": 1, "hysteresis": 1}, 3))
    assert _scales(scaler, "cccocc") == [16, 32, 64, 32, 32, 64]


def test_deepspeed_zero_raises_at_min_scale_and_changes_nothing():
    scaler = DynamicLossScaler.from_deepspeed(_ds({"initial_scale_power": 2, "hysteresis": 1}, 2))
    run = _Run(scaler)
    assert [run.step(True), run.step(True)] == [2.0, 1.0]
    before = scaler.state_dict()
    message = ("update(): the loss scale is already at its minimum (1.0) and this overflow would back it off again "
               "(raise_at_min_scale=True, DeepSpeed's raise_error_at_min_scale); nothing was changed. The gradients "
               "overflow at the smallest allowed scale: find the inf/NaN source (mixprec.diagnostics), lower "
               "min_scale, or pass raise_at_min_scale=False to keep skipping")
    with pytest.raises(RuntimeError, match=re.escape(message)):
        run.step(True)
    assert scaler.state_dict() == before
    # Without ZeRO (stage 0) DeepSpeed stays at the minimum and skips.
    stage0 = DynamicLossScaler.from_deepspeed(_ds({"initial_scale_power": 2}))
    assert _scales(stage0, "oooo") == [2.0, 1.0, 1.0, 1.0]
    # With hysteresis the raise waits until the budget is spent, as in DeepSpeed.
    oracle = _DeepSpeedZeRO(2.0, 1000, 1, 2, False)
    _compare(DynamicLossScaler.from_deepspeed(_ds({"initial_scale_power": 1, "hysteresis": 2}, 1)), oracle, [True] * 5)


@settings(max_examples=40, deadline=None)
@given(
    pattern=_patterns,
    power=st.integers(1, 12),
    window=st.integers(1, 4),
    hysteresis=st.integers(1, 3),
    consecutive=st.booleans(),
    min_loss_scale=st.sampled_from([1, 2, 3]),
    stage=st.sampled_from([0, 1, 3]),
)
def test_deepspeed_matches_its_update_scale(pattern, power, window, hysteresis, consecutive, min_loss_scale, stage):
    if 2**power < min_loss_scale:
        return
    fp16 = {"initial_scale_power": power, "loss_scale_window": window, "hysteresis": hysteresis,
            "consecutive_hysteresis": consecutive, "min_loss_scale": min_loss_scale}
    ours = DynamicLossScaler.from_deepspeed(_ds(fp16, stage))
    oracle = (_DeepSpeedStage0(2.0**power, window, min_loss_scale) if stage == 0
              else _DeepSpeedZeRO(2.0**power, window, min_loss_scale, hysteresis, consecutive))
    _compare(ours, oracle, pattern)


def test_deepspeed_static_disabled_and_section_forms():
    assert isinstance(DynamicLossScaler.from_deepspeed({"fp16": {"enabled": True, "loss_scale": 128}}), ConstantLossScaler)
    assert DynamicLossScaler.from_deepspeed({"loss_scale": 128.0}).get_scale() == 128.0
    assert isinstance(DynamicLossScaler.from_deepspeed({"fp16": {"enabled": False}, "bf16": {"enabled": True}}), NoOpScaler)
    # The fp16 section alone counts as ZeRO (hysteresis and raise apply) unless zero_stage says otherwise.
    section = {"enabled": True, "initial_scale_power": 8, "hysteresis": 2, "consecutive_hysteresis": True}
    zero = DynamicLossScaler.from_deepspeed(section)
    assert (zero.hysteresis, zero.hysteresis_mode, zero.growth_delay) == (2, "deepspeed", 1)
    assert DynamicLossScaler.from_deepspeed(section, zero_stage=0).hysteresis == 1
    defaults = DynamicLossScaler.from_deepspeed({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    assert (defaults.get_scale(), defaults.get_growth_interval(), defaults.hysteresis) == (65536.0, 1000, 2)


# ------------------------------------------------------------------ state
def test_deepspeed_state_dict_round_trip_mid_sequence_is_bit_for_bit():
    config = _ds({"initial_scale_power": 10, "loss_scale_window": 2, "hysteresis": 3, "consecutive_hysteresis": True}, 2)
    pattern = "coocccoooccocccccooo"
    full = _scales(DynamicLossScaler.from_deepspeed(config), pattern)
    for cut in (1, 2, 3, 6, 9, 13):
        first = DynamicLossScaler.from_deepspeed(config)
        head = _scales(first, pattern[:cut])
        buffer = io.BytesIO()
        torch.save(first.state_dict(), buffer)
        buffer.seek(0)
        resumed = DynamicLossScaler(init_scale=1.0)  # settings come from the checkpoint
        resumed.load_state_dict(torch.load(buffer, weights_only=True))
        assert head + _scales(resumed, pattern[cut:]) == full, f"cut at {cut}"


def test_state_dict_carries_the_deepspeed_counters():
    scaler = DynamicLossScaler.from_deepspeed(_ds({"initial_scale_power": 8, "hysteresis": 2, "consecutive_hysteresis": True}, 1))
    sd = scaler.state_dict()
    assert (sd["_growth_tracker"], sd["_hysteresis_tracker"], sd["growth_delay"], sd["raise_at_min_scale"]) == (-1, 2, 1, True)
    _scales(scaler, "co")
    sd = scaler.state_dict()
    assert (sd["_growth_tracker"], sd["_hysteresis_tracker"], sd["hysteresis_mode"]) == (-1, 1, "deepspeed")


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"_growth_tracker": -2}, "scaler state_dict['_growth_tracker'] must be >= -1, got -2"),
        ({"growth_delay": -1}, "scaler state_dict['growth_delay'] must be >= 0, got -1"),
        ({"raise_at_min_scale": "yes"}, "scaler state_dict['raise_at_min_scale'] must be True or False, got 'yes'"),
        ({"_hysteresis_tracker": 3}, "scaler state_dict['_hysteresis_tracker']=3 must be <= 2 for hysteresis=2, "
                                     "hysteresis_mode='deepspeed'"),
        ({"growth_delay": 0}, "scaler state_dict['_growth_tracker'] must be >= 0, got -1"),
    ],
)
def test_load_refuses_bad_deepspeed_state_and_changes_nothing(patch, message):
    source = DynamicLossScaler.from_deepspeed(_ds({"initial_scale_power": 8, "hysteresis": 2, "consecutive_hysteresis": True}, 1))
    target = DynamicLossScaler(init_scale=4.0)
    before = target.state_dict()
    with pytest.raises(ValueError, match=re.escape(message)):
        target.load_state_dict({**source.state_dict(), **patch})
    assert target.state_dict() == before


def test_constructor_settings_for_deepspeed_mode():
    scaler = DynamicLossScaler(init_scale=64.0, hysteresis=2, hysteresis_mode="deepspeed", growth_interval=2)
    # Refilled by each clean step; once spent, every further overflow backs off; torch's growth timing.
    assert _scales(scaler, "oocooocc") == [64, 32, 32, 32, 16, 8, 8, 16]
    with pytest.raises(TypeError, match=re.escape("growth_delay must be an integer, got 1.0 (float)")):
        DynamicLossScaler(growth_delay=1.0)
    with pytest.raises(ValueError, match=re.escape("growth_delay must be in [0, 2**31-1], got -1")):
        DynamicLossScaler(growth_delay=-1)
    with pytest.raises(TypeError, match=re.escape("raise_at_min_scale must be True or False, got 1 (int)")):
        DynamicLossScaler(raise_at_min_scale=1)
    assert "growth_delay=1, raise_at_min_scale=True" in repr(DynamicLossScaler(growth_delay=1, raise_at_min_scale=True))


# ------------------------------------------------------------------ Paddle
def test_paddle_update_loss_scaling_op_tests():
    # test/legacy_test/test_update_loss_scaling_op.py: prev scale 2048, good steps 999, bad steps 1,
    # incr_every_n_steps 1000, decr_every_n_nan_or_inf 2, incr_ratio 2, decr_ratio 0.8.
    # TestUpdateLossScalingOp: finite -> 2048 * 2; TestUpdateLossScalingOpBad: inf -> 2048 * 0.8 (fp32).
    backed = float((np.array([2048], np.float32) * np.float32(0.8))[0])
    for found_inf, expected in ((False, 4096.0), (True, backed)):
        scaler = DynamicLossScaler.from_paddle({"init_loss_scaling": 2048.0, "incr_every_n_steps": 1000,
                                                "decr_every_n_nan_or_inf": 2, "incr_ratio": 2.0, "decr_ratio": 0.8},
                                               api="static")
        sd = scaler.state_dict()
        scaler.load_state_dict({**sd, "_growth_tracker": 999, "_hysteresis_tracker": 1})
        assert _Run(scaler).step(found_inf) == expected
        assert (scaler.state_dict()["_growth_tracker"], scaler.state_dict()["_hysteresis_tracker"]) == (0, 0)


@settings(max_examples=30, deadline=None)
@given(
    pattern=_patterns,
    api=st.sampled_from(["static", "dygraph"]),
    init=st.sampled_from([2.0**15, 1000.0, 98304.0, 3.0]),
    incr_ratio=st.sampled_from([2.0, 1.5, 3.0]),
    decr_ratio=st.sampled_from([0.8, 0.5, 0.9, 0.3]),
    incr_every=st.integers(1, 3),
    decr_every=st.integers(1, 3),
)
def test_paddle_matches_its_update(pattern, api, init, incr_ratio, decr_ratio, incr_every, decr_every):
    ours = DynamicLossScaler.from_paddle(init_loss_scaling=init, incr_ratio=incr_ratio, decr_ratio=decr_ratio,
                                         incr_every_n_steps=incr_every, decr_every_n_nan_or_inf=decr_every, api=api)
    _compare(ours, _Paddle(api, init, incr_ratio, decr_ratio, incr_every, decr_every), pattern)


def test_paddle_fp32_decr_ratio_needs_the_fp32_factor():
    # What the migration guide says: backoff_factor=0.8 is rounded in fp64 and drifts from Paddle's fp32
    # product; backoff_factor=float(np.float32(0.8)) is exact (the fp64 product of two fp32 numbers is
    # exact), and from_paddle does that itself.
    oracle = _Paddle("dygraph", 2.0**16, 2.0, 0.8, 1000, 1)
    expected = [oracle.update(True) for _ in range(20)]
    preset = _scales(DynamicLossScaler.from_paddle(decr_ratio=0.8), "o" * 20)
    fixed = _scales(DynamicLossScaler(init_scale=2.0**16, backoff_factor=float(np.float32(0.8))), "o" * 20)
    plain = _scales(DynamicLossScaler(init_scale=2.0**16, backoff_factor=0.8), "o" * 20)
    assert preset == fixed == expected
    assert plain != expected


def test_paddle_defaults_and_other_forms():
    dygraph = DynamicLossScaler.from_paddle()
    assert (dygraph.get_scale(), dygraph.get_growth_interval(), dygraph.hysteresis, dygraph.get_backoff_factor()) == (
        65536.0, 2000, 1, 0.5)
    fleet = {"init_loss_scaling": 32768, "decr_every_n_nan_or_inf": 2, "incr_every_n_steps": 1000, "incr_ratio": 2.0,
             "use_dynamic_loss_scaling": True, "decr_ratio": 0.5, "custom_white_list": ["softmax"],
             "custom_black_list": ["tanh"]}
    static = DynamicLossScaler.from_paddle(fleet, api="static")
    assert (static.get_scale(), static.hysteresis, static.state_dict()["min_scale"]) == (32768.0, 2, 1.0)
    assert isinstance(DynamicLossScaler.from_paddle(use_dynamic_loss_scaling=False, init_loss_scaling=1024), ConstantLossScaler)
    assert isinstance(DynamicLossScaler.from_paddle(enable=False), NoOpScaler)



def _fp32(x: float) -> float:
    """``x`` rounded to fp32, in pure Python (what a C++ ``float`` holds)."""
    import struct

    return struct.unpack("f", struct.pack("f", x))[0]


def _paddle_kernel(init, incr_ratio, decr_ratio, incr_every_n_steps, decr_every_n_nan_or_inf, pattern):
    """The scale after each step of Paddle's update_loss_scaling kernel (paddle/phi/kernels/impl/
    amp_kernel_impl.h, Update), in pure Python: fp32 products, a backoff below 1 gives 1, a growth
    to inf is dropped, and the good / bad step counters as the kernel keeps them."""
    scale, good, bad, out = _fp32(init), 0, 0, []
    incr, decr = _fp32(incr_ratio), _fp32(decr_ratio)
    for found_inf in pattern:
        if found_inf:
            good, bad = 0, bad + 1
            if bad == decr_every_n_nan_or_inf:
                new = _fp32(scale * decr)
                scale = 1.0 if new < 1.0 else new
                bad = 0
        else:
            bad, good = 0, good + 1
            if good == incr_every_n_steps:
                new = _fp32(scale * incr)
                scale = new if math.isfinite(new) else scale
                good = 0
        out.append(scale)
    return out


def test_paddle_static_scale_floors_at_1_keeps_skipping_and_training():
    """From a small init scale, overflows back the static preset's scale off to exactly 1.0 and no
    further; at 1 an overflow still skips its step (no raise) and a clean one still trains, as Paddle's
    kernel keeps running at 1. The whole sequence is the kernel's, over generated overflow patterns."""
    import random

    rng = random.Random(0)
    patterns = ["o" * 12 + "c" * 5 + "o" * 6 + "c" + "o" * 3]  # long overflow streaks at the floor
    for _ in range(12):  # overflow bursts (p=0.7) between clean runs (p=0.2)
        patterns.append("".join("o" if rng.random() < (0.7 if i // 6 % 2 == 0 else 0.2) else "c" for i in range(40)))
    for init, incr, decr, n_incr, n_decr in [(4.0, 2.0, 0.5, 3, 1), (2.0, 2.0, 0.8, 2, 2), (3.0, 1.5, 0.3, 1, 1),
                                             (1.0, 2.0, 0.5, 4, 3), (8.0, 3.0, 0.9, 2, 1)]:
        for pattern in patterns:
            scaler = DynamicLossScaler.from_paddle(init_loss_scaling=init, incr_ratio=incr, decr_ratio=decr,
                                                   incr_every_n_steps=n_incr, decr_every_n_nan_or_inf=n_decr,
                                                   api="static")
            assert scaler.min_scale == 1.0 and not scaler.state_dict()["raise_at_min_scale"]
            w = torch.nn.Parameter(torch.ones(2))
            opt = torch.optim.SGD([w], lr=0.125)
            scales = []
            for ch in pattern:
                before = w.detach().clone()
                scaler.scale((w * (INF if ch == "o" else 1.0)).sum()).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                assert scaler.last_step_skipped == (ch == "o")
                assert torch.equal(w.detach(), before) == (ch == "o")  # skipped, else trained (at 1 too)
                scales.append(scaler.get_scale())
            expected = _paddle_kernel(init, incr, decr, n_incr, n_decr, [ch == "o" for ch in pattern])
            assert scales == expected, (init, incr, decr, n_incr, n_decr, pattern)
            assert min(scales) >= 1.0
    # the first pattern's streak reaches the floor and stays at exactly 1.0
    streak = _scales(DynamicLossScaler.from_paddle(init_loss_scaling=4.0, decr_ratio=0.5, api="static"), "o" * 12)
    assert streak[-1] == 1.0 and streak.count(1.0) >= 8


# ------------------------------------------------------------------ Megatron-LM
def test_megatron_exact_sequence():
    # hysteresis 2: overflow tolerated once, then each overflow backs off (x0.5) down to min_scale;
    # two clean steps (growth_interval) grow and refill the budget.
    scaler = DynamicLossScaler.from_megatron(initial_scale=16.0, min_scale=4.0, growth_factor=2.0,
                                             backoff_factor=0.5, growth_interval=2, hysteresis=2)
    assert _scales(scaler, "ooooccocoo") == [16, 8, 4, 4, 4, 8, 8, 8, 4, 4]


@settings(max_examples=30, deadline=None)
@given(
    pattern=_patterns,
    initial=st.sampled_from([2.0**16, 1000.0, 3.0]),
    growth=st.sampled_from([2.0, 1.5, 1.1]),
    backoff=st.sampled_from([0.5, 0.8, 0.7]),
    interval=st.integers(1, 3),
    hysteresis=st.integers(1, 3),
    min_scale=st.sampled_from([1.0, 0.1]),
)
def test_megatron_matches_dynamic_grad_scaler(pattern, initial, growth, backoff, interval, hysteresis, min_scale):
    ours = DynamicLossScaler.from_megatron(initial_scale=initial, min_scale=min_scale, growth_factor=growth,
                                           backoff_factor=backoff, growth_interval=interval, hysteresis=hysteresis)
    _compare(ours, _Megatron(initial, min_scale, growth, backoff, interval, hysteresis), pattern)


def test_megatron_config_names_and_constant():
    cfg = DynamicLossScaler.from_megatron({"initial_loss_scale": 2.0**12, "min_loss_scale": 1.0,
                                           "loss_scale_window": 500.0, "hysteresis": 3, "loss_scale": None})
    assert (cfg.get_scale(), cfg.get_growth_interval(), cfg.hysteresis, cfg.hysteresis_mode) == (4096.0, 500, 3, "since_growth")
    defaults = DynamicLossScaler.from_megatron()
    assert (defaults.get_scale(), defaults.get_growth_interval(), defaults.hysteresis) == (2.0**32, 1000, 2)
    assert isinstance(DynamicLossScaler.from_megatron(loss_scale=1024.0), ConstantLossScaler)
    assert isinstance(DynamicLossScaler.from_megatron(loss_scale=0), DynamicLossScaler)  # falsy: dynamic, as Megatron


# ------------------------------------------------------------------ apex
@settings(max_examples=30, deadline=None)
@given(
    pattern=_patterns,
    init=st.sampled_from([2.0**16, 2.0**30, 3.0]),
    window=st.integers(1, 3),
    min_loss_scale=st.sampled_from([None, 0, 1.0, 2.0**14]),
    max_loss_scale=st.sampled_from([2.0**24, 2.0**17]),
)
def test_apex_matches_its_loss_scaler(pattern, init, window, min_loss_scale, max_loss_scale):
    if min_loss_scale and min_loss_scale > min(init, max_loss_scale):
        return
    ours = DynamicLossScaler.from_apex(loss_scale="dynamic", init_scale=init, scale_window=window,
                                       min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale)
    _compare(ours, _Apex(init, window, min_loss_scale, max_loss_scale), pattern)


def test_apex_opt_levels_and_static_scale():
    assert DynamicLossScaler.from_apex({"opt_level": "O2", "keep_batchnorm_fp32": True}).get_scale() == 65536.0
    assert DynamicLossScaler.from_apex(init_scale=2.0**30).get_scale() == 2.0**24  # min(max_loss_scale, init_scale)
    o3 = DynamicLossScaler.from_apex(opt_level="O3")
    assert isinstance(o3, ConstantLossScaler) and o3.get_scale() == 1.0
    assert DynamicLossScaler.from_apex(loss_scale="128.0").get_scale() == 128.0
    assert isinstance(DynamicLossScaler.from_apex(enabled=False), NoOpScaler)


# ------------------------------------------------------------------ refused input
@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: DynamicLossScaler.from_deepspeed({"fp16": {"enabled": True, "loss_scale_windw": 10}}), ValueError,
         "DeepSpeed fp16 configuration has unknown key(s) 'loss_scale_windw'; the accepted keys are ['auto_cast', "
         "'consecutive_hysteresis', 'enabled', 'fp16_master_weights_and_grads', 'hysteresis', 'initial_scale_power', "
         "'loss_scale', 'loss_scale_window', 'min_loss_scale']; pass the 'fp16' section of a DeepSpeed config, or the "
         "whole config (with an 'fp16' key)"),
        (lambda: DynamicLossScaler.from_deepspeed({"train_batch_size": 8, "bf16": {"enabled": True}}), ValueError,
         "DeepSpeed fp16 configuration has unknown key(s) 'train_batch_size', 'bf16'"),
        (lambda: DynamicLossScaler.from_deepspeed({"fp16": {"enabled": "auto"}}), TypeError,
         "fp16.enabled must be true or false, got 'auto' (str); fp16.enabled='auto' is a placeholder Hugging Face "
         "fills in from TrainingArguments: pass the resolved value"),
        (lambda: DynamicLossScaler.from_deepspeed({"fp16": {}, "zero_optimization": {"stage": 2}}, zero_stage=0),
         ValueError, "from_deepspeed(zero_stage=0) contradicts the config's zero_optimization.stage=2; drop one"),
        (lambda: DynamicLossScaler.from_deepspeed({"loss_scale_window": 0}), ValueError,
         "from_deepspeed(): the keys translate to DynamicLossScaler(init_scale=65536.0, growth_factor=2.0, "
         "backoff_factor=0.5, growth_interval=0, hysteresis=2, hysteresis_mode='since_growth', min_scale=1.0, "
         "growth_delay=1, raise_at_min_scale=True), which refuses them: growth_interval must be an integer >= 1, got 0"),
        (lambda: DynamicLossScaler.from_deepspeed({"initial_scale_power": 200}), ValueError,
         "fp16.initial_scale_power=200 puts 2**200 outside the fp32 scale range; pass a power in [-126, 127]"),
        (lambda: DynamicLossScaler.from_paddle(strategy_amp=True), ValueError,
         "Paddle (dygraph) configuration has unknown key(s) 'strategy_amp'; the accepted keys are "
         "['decr_every_n_nan_or_inf', 'decr_ratio', 'enable', 'incr_every_n_steps', 'incr_ratio', 'init_loss_scaling', "
         "'use_dynamic_loss_scaling']"),
        (lambda: DynamicLossScaler.from_paddle({"custom_white_list": ["softmax"]}), ValueError,
         "Paddle (dygraph) configuration has unknown key(s) 'custom_white_list'"),
        (lambda: DynamicLossScaler.from_paddle({"custom_white_list": ["softmax"]}), ValueError,
         "; for Fleet's strategy.amp_configs or paddle.static.amp.decorate pass api='static'"),
        (lambda: DynamicLossScaler.from_paddle(api="fleet"), ValueError,
         "from_paddle(api='fleet'): pass api='dygraph' (paddle.amp.GradScaler) or api='static'"),
        (lambda: DynamicLossScaler.from_paddle({"incr_ratio": 2.0}, incr_ratio=3.0), ValueError,
         "Paddle (dygraph) keys ['incr_ratio'] are given both in the mapping and as keyword arguments; pass each once"),
        (lambda: DynamicLossScaler.from_megatron(initial_scale=8.0, initial_loss_scale=8.0), ValueError,
         "Megatron-LM keys 'initial_loss_scale' and 'initial_scale' are the same setting; pass one of them"),
        (lambda: DynamicLossScaler.from_megatron(scale_window=5), ValueError,
         "Megatron-LM configuration has unknown key(s) 'scale_window'; the accepted keys are ['backoff_factor', "
         "'growth_factor', 'growth_interval', 'hysteresis', 'initial_loss_scale', 'initial_scale', 'loss_scale', "
         "'loss_scale_window', 'min_loss_scale', 'min_scale']"),
        (lambda: DynamicLossScaler.from_megatron(loss_scale_window=100.5), ValueError,
         "growth_interval must be an integer, got 100.5"),
        (lambda: DynamicLossScaler.from_apex(scale_factor=3.0), ValueError,
         "scale_factor=3.0: apex's LossScaler stores scale_factor but its update_scale always doubles and halves"),
        (lambda: DynamicLossScaler.from_apex(opt_level="O4"), ValueError,
         "opt_level must be 'O0', 'O1', 'O2' or 'O3', got 'O4'"),
        (lambda: DynamicLossScaler.from_apex(loss_scale="big"), ValueError,
         "loss_scale must be 'dynamic' or a number, got 'big'"),
        (lambda: DynamicLossScaler.from_apex(min_loss_scale=1.0, max_loss_scale=0.5), ValueError,
         "min_scale=1.0 is larger than max_scale=0.5"),
        (lambda: DynamicLossScaler.from_apex(loss_scale=0.0), ValueError,
         "from_apex: loss_scale=0.0 as a constant scale: scale must be a finite positive number, got 0.0"),
        (lambda: DynamicLossScaler.from_apex(["loss_scale"]), TypeError,
         "apex configuration must be a mapping (a dict of its keys), got list"),
    ],
)
def test_bad_keys_and_values_are_refused(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


def test_presets_round_factors_to_fp32_only_where_the_system_does():
    assert DynamicLossScaler.from_megatron(backoff_factor=0.8).get_backoff_factor() == _f32(0.8)
    assert DynamicLossScaler.from_paddle(incr_ratio=1.1).get_growth_factor() == _f32(1.1)
    for scaler in (DynamicLossScaler.from_deepspeed({}), DynamicLossScaler.from_apex()):
        assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (2.0, 0.5)
    assert math.isclose(_f32(0.8), 0.8, rel_tol=1e-7) and _f32(0.8) != 0.8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the scale then lives on the GPU")
def test_presets_on_cuda_match_the_references():
    rng = np.random.default_rng(0)
    pattern = [bool(b) for b in rng.random(200) < 0.3]
    cases = [
        (DynamicLossScaler.from_deepspeed(_ds({"initial_scale_power": 12, "loss_scale_window": 3, "hysteresis": 2,
                                               "consecutive_hysteresis": True}, 2)),
         _DeepSpeedZeRO(2.0**12, 3, 1, 2, True)),
        (DynamicLossScaler.from_paddle(init_loss_scaling=98304.0, decr_ratio=0.8, incr_ratio=1.5, incr_every_n_steps=2),
         _Paddle("dygraph", 98304.0, 1.5, 0.8, 2, 1)),
        (DynamicLossScaler.from_megatron(initial_scale=1000.0, backoff_factor=0.7, growth_factor=1.1, growth_interval=2),
         _Megatron(1000.0, 1.0, 1.1, 0.7, 2, 2)),
    ]
    for ours, oracle in cases:
        run = _Run(ours, "cuda")
        for i, bad in enumerate(pattern):
            try:
                expected = oracle.update(bad)
            except RuntimeError:
                with pytest.raises(RuntimeError, match="already at its minimum"):
                    run.step(bad)
                break
            assert run.step(bad) == expected, f"step {i}"
        assert ours.device.type == "cuda"

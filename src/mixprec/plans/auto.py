"""``precision="auto"``: the plan this hardware (and this model) runs fastest without losing accuracy.

The choice reads :func:`mixprec.hardware.device_facts`, a sub-second timing of one GEMM
per dtype next to the device facts, so it follows what the device *does* rather than
what its flags say:

- a low-precision dtype is worth it only where its GEMM is at least
  :data:`MIN_SPEEDUP` times faster than fp32's; bf16 first (no loss scaling, fp32's
  range), then fp16 (with dynamic loss scaling: GPUs of compute capability 7.x);
- otherwise fp32: on a CPU without bf16 instructions a bf16 plan trains several times
  slower (memory-bound users may still pick ``"bf16-kahan"`` by name);
- fp8-mixed only on GPUs with native fp8 GEMMs: where the package holds a measured pay-off
  table for the GPU kind (:mod:`mixprec.fp8.payoff`, written by
  ``benchmarks/bench_fp8_shapes.py --table``), for a model whose Linear GEMM time is
  predicted at least :data:`FP8_MIN_GAIN` times shorter with the layers that pay in fp8
  (the plan's filter keeps the others in bf16) at :data:`FP8_TOKENS` tokens per step;
  without a table, for a model whose ``nn.Linear`` layers are at least
  :data:`FP8_MIN_WIDTH` wide for most of their weights (None: no width measured, never).

The chosen plan is an ordinary plan (its name, not "auto", goes into checkpoints), and
``plan.explain()`` ends with why it was chosen:

>>> from mixprec.hardware import DeviceFacts
>>> slow_bf16 = DeviceFacts("cpu", "test cpu", gemm_size=256, gemm_ms={"fp32": 1.0, "bf16": 30.0, "fp16": 90.0})
>>> choice = choose_plan(slow_bf16)
>>> choice.plan
'fp32'
>>> fast_bf16 = DeviceFacts("cpu", "test cpu", bf16_instructions=True, gemm_size=256,
...                         gemm_ms={"fp32": 1.0, "bf16": 0.4, "fp16": 90.0})
>>> choose_plan(fast_bf16).plan
'bf16-mixed'
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.hardware import DeviceFacts

__all__ = [
    "AUTO",
    "FP8_MIN_GAIN",
    "FP8_MIN_WIDTH",
    "FP8_TOKENS",
    "MIN_SPEEDUP",
    "AutoChoice",
    "choose_plan",
    "fp8_share",
    "is_auto",
]

AUTO = "auto"
MIN_SPEEDUP = 1.2
"""A low-precision GEMM must beat fp32 by this factor: below it, casts and the optimizer's
extra passes eat the gain (the demo's bf16 plans ran at 0.85x of fp32 where a bf16 GEMM
was 0.25x of fp32, and gained where it was 2x or more)."""
FP8_MIN_WIDTH: int | None = None
"""The smallest ``min(in_features, out_features)`` at which mixprec's fp8 linear layer was
measured faster than a bf16 one (``benchmarks/bench_fp8_shapes.py``); None: no width
measured so (BENCHMARKS.md, "fp8 layer vs bf16 by width"), so "auto" never picks fp8."""


FP8_MIN_GAIN = 1.1
"""With a measured pay-off table: fp8-mixed is chosen when the model's Linear GEMM time is
predicted at least this many times shorter (the layers that pay in fp8, the rest in bf16):
below it the fp8 state, the per-step scale update and the risk of range trouble are not
worth the gain."""
FP8_TOKENS = 8192
"""The tokens per step (rows of each Linear layer's input) the prediction assumes, as the
fp8-mixed plan's ``tokens`` default."""


def _gpu_kind(facts: DeviceFacts) -> str | None:
    if facts.device_type != "cuda" or facts.cuda_capability is None:
        return None
    return f"sm{facts.cuda_capability[0]}{facts.cuda_capability[1]}"


def is_auto(name: object) -> bool:
    """Whether ``name`` asks for ``precision="auto"`` (any case, surrounding spaces ignored)."""
    return isinstance(name, str) and name.strip().lower() == AUTO


@dataclass(frozen=True)
class AutoChoice:
    """The plan ``"auto"`` resolved to, and why (one reason per line)."""

    plan: str
    reasons: tuple[str, ...]
    facts: DeviceFacts

    def text(self) -> str:
        return "\n".join(self.reasons)


def fp8_share(model: torch.nn.Module, min_width: int) -> float:
    """The fraction of the weights of ``model``'s ``nn.Linear`` layers held by layers at
    least ``min_width`` wide in both dimensions (0.0 without Linear layers)."""
    total = wide = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            n = module.in_features * module.out_features
            total += n
            if min(module.in_features, module.out_features) >= min_width:
                wide += n
    return wide / total if total else 0.0


def choose_plan(facts: DeviceFacts, model: torch.nn.Module | None = None) -> AutoChoice:
    """The plan for a device with ``facts`` (and, where given, ``model``)."""
    bf16, fp16 = facts.speedup(torch.bfloat16) or 0.0, facts.speedup(torch.float16) or 0.0
    where = facts.describe()
    measured = f"measured on {where}"
    if facts.bf16_supported and bf16 >= MIN_SPEEDUP:
        plan = "bf16-mixed"
        reasons = [
            f"auto chose bf16-mixed: a bf16 GEMM runs {bf16:.2f}x as fast as fp32 here (at least "
            f"{MIN_SPEEDUP}x pays), and bf16 keeps fp32's range, so no loss scaling is needed ({measured})."
        ]
        fp8 = _fp8_reason(facts, model)
        if fp8 is not None:
            plan, reason = fp8
            reasons.append(reason)
    elif fp16 >= MIN_SPEEDUP:
        plan = "fp16-mixed"
        reasons = [
            f"auto chose fp16-mixed: bf16 GEMMs run at {bf16:.2f}x of fp32 here and fp16 at {fp16:.2f}x, so fp16 "
            f"with dynamic loss scaling is the fast choice ({measured})."
        ]
    else:
        plan = "fp32"
        slow = f"bf16 GEMMs run at {bf16:.2f}x and fp16 at {fp16:.2f}x of fp32's speed here"
        reasons = [
            f"auto chose fp32: {slow} (below the {MIN_SPEEDUP}x that pays), so a low-precision plan would "
            f"train slower ({measured}).",
            "Low precision still saves memory here: name 'bf16-mixed' (about half the activation memory) or "
            "'bf16-kahan' (10 bytes of training state per parameter with AdamW instead of 16) to trade speed "
            "for it; their accuracy does not depend on the hardware.",
        ]
    return AutoChoice(plan=plan, reasons=tuple(reasons), facts=facts)


def _fp8_reason(facts: DeviceFacts, model: torch.nn.Module | None) -> tuple[str, str] | None:
    """On GPUs with native fp8 GEMMs: the plan (fp8-mixed or still bf16-mixed) and why; else None."""
    if not facts.native_fp8:
        return None
    from mixprec.fp8.payoff import model_payoff, table_of_kind

    kind = _gpu_kind(facts)
    table = None if kind is None else table_of_kind(kind)
    if table is not None:
        measured = f"the measured pay-off table of {table.kind} ({table.device}; {table.source})"
        if model is None:
            return (
                "bf16-mixed",
                f"fp8-mixed not chosen: no model given to predict its Linear layers' fp8 speedup from {measured}; "
                "MixedPrecision('auto').prepare(model) decides with the model.",
            )
        payoff = model_payoff(model, table, FP8_TOKENS)
        paying = sum(1 for p in payoff.predictions.values() if p.speedup >= 1.0)
        detail = (
            f"{paying} of {len(payoff.predictions)} eligible Linear layers, {payoff.share:.0%} of the Linear GEMM "
            f"work at {FP8_TOKENS} tokens, are predicted to run faster in fp8, for a predicted {payoff.speedup:.2f}x "
            f"of bf16 GEMM time over all Linear layers ({measured})"
        )
        if payoff.speedup < FP8_MIN_GAIN:
            return (
                "bf16-mixed",
                f"fp8-mixed not chosen: {detail}, below the {FP8_MIN_GAIN}x that pays; name 'fp8-mixed' to use it "
                "anyway (its filter keeps the layers that do not pay in bf16).",
            )
        return (
            "fp8-mixed",
            f"auto chose fp8-mixed over bf16-mixed: {detail}; the others stay bf16 (explain() lists them).",
        )
    if FP8_MIN_WIDTH is None:
        return (
            "bf16-mixed",
            "fp8-mixed not chosen: this GPU has native fp8 GEMMs, but mixprec's fp8 linear layers have not "
            f"measured faster than bf16 ones here yet (no pay-off table for {kind or 'this GPU kind'}: "
            "benchmarks/bench_fp8_shapes.py --table, BENCHMARKS.md); name 'fp8-mixed' to use them anyway.",
        )
    if model is None:
        return (
            "bf16-mixed",
            f"fp8-mixed not chosen: no model given to judge its Linear widths (fp8 pays from {FP8_MIN_WIDTH} wide); "
            "MixedPrecision('auto').prepare(model) decides with the model.",
        )
    share = fp8_share(model, FP8_MIN_WIDTH)
    if share < 0.5:
        return (
            "bf16-mixed",
            f"fp8-mixed not chosen: only {share:.0%} of the model's Linear weights sit in layers at least "
            f"{FP8_MIN_WIDTH} wide, where fp8 layers measured faster than bf16.",
        )
    return (
        "fp8-mixed",
        f"auto chose fp8-mixed over bf16-mixed: this GPU has native fp8 GEMMs and {share:.0%} of the model's "
        f"Linear weights sit in layers at least {FP8_MIN_WIDTH} wide, where fp8 layers measured faster than bf16.",
    )

"""Overflow explained without asking: the first-overflow tracer turns itself on when steps keep skipping.

A skipped step says *that* something overflowed; :class:`~mixprec.diagnostics.OverflowTracer`
says *where*, at the cost of hooks on every module. :class:`OverflowExplainer` keeps the
cost at zero while nothing overflows and installs a tracer only on signs that a loss scale
cannot settle:

- a step skipped because the loss itself was inf/NaN (the forward overflowed: no scale
  fixes that) or because an fp8 layer saw one;
- a gradient overflow with the scale near its floor (at or below 1, or within 2x of the
  scaler's ``min_scale``): the gradients overflow (almost) unscaled. Back-offs at healthy
  scales (a fresh scale coming down, one per growth interval, gradients growing in warm-up)
  never arm it.

The next skipped step is then traced; mixprec warns once, naming the module, forward or
backward, and the fp32 island that would keep it in range, and removes the hooks. A
model whose forward does not run the hooks (compiled after ``prepare``) is not traced: the
hooks are removed without a word rather than blaming the wrong module. A run that stops
overflowing is untraced again after :data:`ARMED_STEPS` steps. The diagnosis also goes into
the error ``max_consecutive_skips`` raises. Under DDP every rank traces its own part.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from mixprec.tracing import OverflowFinding, OverflowTracer

__all__ = ["ARMED_STEPS", "OverflowExplainer", "suggestion"]

#: steps a tracer stays installed waiting for an overflow before it is removed again
ARMED_STEPS = 200


def _islands(plan: Any) -> list[str]:
    policy = getattr(plan, "policy", None)
    rules = getattr(policy, "fp32_modules", ()) or ()
    return [rule for rule in rules if isinstance(rule, str)]  # (class rules cannot be named in a suggestion)


def suggestion(finding: OverflowFinding, plan: Any, known_plans: tuple[str, ...] = ()) -> str:
    """The fix for ``finding`` under ``plan``, in one sentence."""
    if finding.in_input:
        return ("check the data: the batch held inf/NaN before the model ran (no precision setting fixes that; "
                "filter such batches, or find where the loader produces them)")
    fp16 = getattr(plan, "compute_dtype", None) == torch.float16
    bf16 = " or use a bf16 plan, whose range is fp32's (on hardware with fast bf16)" if fp16 else ""
    if finding.what == "gradient of its output":
        return ("compute the loss in fp32 (it, or code outside the model's modules, overflowed: pass the criterion "
                f"as prepare(..., criterion=...)), scale it down, or lower the learning rate;{bf16}").rstrip(";")
    if finding.module == "":
        return ("keep the model's own forward code (outside its submodules, where the overflow is) in fp32, or lower "
                f"the learning rate;{bf16}").rstrip(";")
    existing = _islands(plan)
    module = finding.module
    if module in existing and "." in module:
        module = module.rsplit(".", 1)[0]  # an island already: its output, cast back, overflows; widen its parent
    islands = [*existing, module] if module not in existing else existing
    name = getattr(plan, "name", str(plan))
    how = (f"get_plan({name!r}, fp32_modules={islands})" if name in known_plans
           else f"fp32_modules={islands} in the plan's policy")
    return f"keep {module!r} in fp32 with {how},{bf16}".rstrip(",") if bf16 else f"keep {module!r} in fp32 with {how}"


class OverflowExplainer:
    """Watches a session's step outcomes; traces and explains overflows once they persist.

    Args:
        model: the user's module (inside DDP / ``torch.compile`` wrappers) the tracer hooks.
        plan: the session's plan (its name, islands and compute dtype go into the suggestion).
        enabled: False never traces (a user tracer already runs, or ``compile=True``).
        min_scale: the scaler's lower bound (a gradient overflow within 2x of it arms).
        known_plans: registered plan names (a suggestion names ``get_plan(name, ...)`` only for those).
    """

    def __init__(
        self, model: torch.nn.Module, plan: Any, *, enabled: bool = True, min_scale: float | None = None,
        known_plans: tuple[str, ...] = (),
    ) -> None:
        self.model = model
        self.plan = plan
        self.enabled = enabled
        self.min_scale = min_scale
        self.known_plans = known_plans
        self.tracer: OverflowTracer | None = None
        self.finding: OverflowFinding | None = None
        self._steps = 0
        self._armed_at = 0
        self._last: tuple[Any, OverflowFinding | None] | None = None
        self._forward_seen = False
        self._first_traced: Any = None
        self._probe: Any = None

    @property
    def armed(self) -> bool:
        """Whether a tracer is installed now."""
        return self.tracer is not None

    def diagnosis(self) -> str | None:
        """The explained overflow, for an error message (None before one was traced)."""
        if self.finding is None:
            return None
        return f"the first traced overflow: {self.finding}; {suggestion(self.finding, self.plan, self.known_plans)}"

    def after_step(
        self, decided: Any, reason: str | None, scale: float | None, first_traced: Any = None,
    ) -> OverflowFinding | None:
        """Take the decided step ``decided`` (a key new at each step, increasing; ``reason``: None when it
        stepped, else why it was skipped; ``scale``: the loss scale it ran with, read only for a
        skipped step). ``first_traced``: the key of the first step whose forward a tracer installed
        now would see (the host learns outcomes a step late: the next forward may have run already);
        steps before it are not judged by that tracer. Returns the finding when this step explained
        one. The same ``decided`` again (a step interrupted after this call and finished again)
        returns what it returned then."""
        if self._last is not None and self._last[0] == decided:
            return self._last[1]
        found = self._after_step(decided, reason, scale, first_traced)
        self._last = (decided, found)
        return found

    def _after_step(self, decided: Any, reason: str | None, scale: float | None, first_traced: Any) -> OverflowFinding | None:
        self._steps += 1
        if not self.enabled or self.finding is not None:
            return None
        if self.tracer is not None:
            if self._first_traced is not None and decided is not None and decided < self._first_traced:
                return None  # its forward ran before the tracer was installed: nothing to judge
            return self._traced(reason)
        if reason is None or reason == "nonfinite_weights":
            return None  # a clean step; or weights outgrowing their dtype: no activation to trace
        if reason == "overflow":
            floor = max(1.0, 2 * self.min_scale) if self.min_scale is not None else 1.0
            if scale is None or scale > floor:
                return None  # a scale backing off where it has room: dynamic scaling at work
        self.tracer = OverflowTracer(self.model)
        self._first_traced = first_traced
        self._forward_seen = False
        self._probe = self.model.register_forward_pre_hook(_ForwardProbe(self))
        self._armed_at = self._steps
        return None

    def _traced(self, reason: str | None) -> OverflowFinding | None:
        tracer = self.tracer
        assert tracer is not None
        if not self._forward_seen:  # the hooks did not run (a model compiled after prepare): trust nothing
            self.remove()
            self.enabled = False
            return None
        finding = tracer.first_overflow() if reason is not None else None
        if finding is not None:
            finding = dataclasses.replace(finding, step=self._steps - 1)  # the run's step, not the tracer's
            self.finding = finding
            self.remove()
            warnings.warn(
                f"mixprec: steps are being skipped for inf/NaN values; traced the next one: {finding}. To fix it, "
                f"{suggestion(finding, self.plan, self.known_plans)}. (Found by the overflow tracer mixprec installs by "
                "itself once skips persist, removed again now; MixedPrecision(trace_overflow=True) traces every step.)",
                RuntimeWarning,
                stacklevel=7,  # _traced <- _after_step <- after_step <- _settle <- settle_outcome <- step() <- the loop
            )
            return finding
        tracer.reset()
        self._forward_seen = False
        if self._steps - self._armed_at >= ARMED_STEPS:
            self.remove()  # it stopped overflowing: no hooks again, until skips persist again
        return None

    def remove(self) -> None:
        """Remove the tracer's hooks (if one is installed)."""
        if self.tracer is not None:
            self.tracer.remove()
            self.tracer = None
        if self._probe is not None:
            self._probe.remove()
            self._probe = None


class _ForwardProbe:
    """The root's forward pre-hook telling the explainer that the model's hooks run. A copy or a
    pickle of the model carries a no-op in its place (it belongs to this run, not the copy)."""

    __slots__ = ("explainer",)

    def __init__(self, explainer: OverflowExplainer) -> None:
        self.explainer = explainer

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        self.explainer._forward_seen = True

    def __reduce__(self) -> tuple[Any, ...]:
        return (_NoProbe, ())


class _NoProbe:
    """What a copied or unpickled model holds instead of a :class:`_ForwardProbe`."""

    __slots__ = ()

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        return None

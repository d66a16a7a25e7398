"""Overflow explained without asking: the first-overflow tracer turns itself on when steps start to skip.

A skipped step says *that* something overflowed; :class:`~mixprec.diagnostics.OverflowTracer`
says *where*, at the cost of hooks on every module. :class:`OverflowExplainer` keeps the
cost at zero while nothing overflows and installs a tracer only when skips stop looking
like a loss scale settling:

- a step skipped because the loss itself was inf/NaN (the forward overflowed: no scale
  fixes that) or because an fp8 layer saw one;
- :data:`SKIPS` gradient overflows within :data:`WINDOW` steps after the first step that
  stepped (a dynamic scale backs off once per growth interval; a fresh fp16 run skips a few
  steps in a row while its scale comes down, before any step is taken: neither arms it);
- a gradient overflow with the scale at or below 1 (the gradients overflow unscaled).

The next skipped step is then traced; mixprec warns once, naming the module, forward or
backward, and the fp32 island that would keep it in range, and removes the hooks. A
run that stops overflowing before that is untraced again after :data:`ARMED_STEPS` steps.
The diagnosis also goes into the error ``max_consecutive_skips`` raises.
"""

from __future__ import annotations

import warnings
from collections import deque
from typing import Any

import torch

from mixprec.tracing import OverflowFinding, OverflowTracer

__all__ = ["ARMED_STEPS", "SKIPS", "WINDOW", "OverflowExplainer", "suggestion"]

#: gradient-overflow skips within :data:`WINDOW` steps that arm the tracer
SKIPS = 3
WINDOW = 100
#: steps a tracer stays installed waiting for an overflow before it is removed again
ARMED_STEPS = 200


def suggestion(finding: OverflowFinding, plan: Any) -> str:
    """The fix for ``finding`` under ``plan``, in one sentence."""
    if finding.module == "":
        return ("the model's own code, outside its submodules, overflowed: keep that computation in fp32, lower the "
                "learning rate, or use a bf16 plan")
    name = getattr(plan, "name", str(plan))
    island = f"get_plan({name!r}, fp32_modules=[{finding.module!r}])"
    if getattr(plan, "compute_dtype", None) not in (torch.float16, torch.bfloat16):
        island = f"an fp32 island for {finding.module!r} (fp32_modules=[...] of a '*-mixed' plan)"
    return (f"keep {finding.module!r} in fp32 with {island}, or use a bf16 plan, whose range is fp32's "
            "(on hardware with fast bf16)")


class OverflowExplainer:
    """Watches a session's step outcomes; traces and explains overflows once they recur.

    Args:
        model: the user's module (inside DDP / ``torch.compile`` wrappers) the tracer hooks.
        plan: the session's plan (its name and compute dtype go into the suggestion).
        enabled: False never traces (a user tracer already runs, or ``torch.compile``:
            hooks added after compiling recompile the model).
    """

    def __init__(self, model: torch.nn.Module, plan: Any, *, enabled: bool = True) -> None:
        self.model = model
        self.plan = plan
        self.enabled = enabled
        self.tracer: OverflowTracer | None = None
        self.finding: OverflowFinding | None = None
        self._steps = 0
        self._stepped = False
        self._recent: deque[int] = deque()
        self._armed_at = 0

    @property
    def armed(self) -> bool:
        """Whether a tracer is installed now."""
        return self.tracer is not None

    def diagnosis(self) -> str | None:
        """The explained overflow, for an error message (None before one was traced)."""
        if self.finding is None:
            return None
        return f"the first traced overflow: {self.finding}; {suggestion(self.finding, self.plan)}"

    def after_step(self, reason: str | None, scale: float) -> OverflowFinding | None:
        """Take one decided step (``reason``: None when it stepped, else why it was skipped;
        ``scale``: the loss scale it ran with). Returns the finding when this step explained one."""
        self._steps += 1
        if not self.enabled or self.finding is not None:
            return None
        if self.tracer is not None:
            return self._traced(reason)
        if reason is None:
            self._stepped = True
            return None
        if reason == "overflow":
            if not self._stepped:
                return None  # a new scale settling: not yet a sign of anything
            self._recent.append(self._steps)
            while self._recent and self._recent[0] <= self._steps - WINDOW:
                self._recent.popleft()
            if len(self._recent) < SKIPS and scale > 1.0:
                return None
        elif reason not in ("nonfinite_loss", "nonfinite_plan"):
            return None  # weights outgrowing their dtype: no activation to trace
        self.tracer = OverflowTracer(self.model)
        self._armed_at = self._steps
        return None

    def _traced(self, reason: str | None) -> OverflowFinding | None:
        tracer = self.tracer
        assert tracer is not None
        finding = tracer.first_overflow() if reason is not None else None
        if finding is not None:
            self.finding = finding
            self.remove()
            warnings.warn(
                f"mixprec: steps are being skipped for inf/NaN values; traced the next one: {finding}. "
                f"To fix it, {suggestion(finding, self.plan)}. (Found by the overflow tracer mixprec installs "
                "by itself once skips recur, removed again now; MixedPrecision(trace_overflow=True) traces every step.)",
                RuntimeWarning,
                stacklevel=5,
            )
            return finding
        tracer.reset()
        if self._steps - self._armed_at >= ARMED_STEPS:
            self.remove()  # it stopped overflowing: no hooks again, until skips recur
            self._recent.clear()
        return None

    def remove(self) -> None:
        """Remove the tracer's hooks (if one is installed)."""
        if self.tracer is not None:
            self.tracer.remove()
            self.tracer = None

"""The public halves of a step in random orders, against a reference loop (hypothesis.stateful).

A machine drives one MixedPrecision through ``backward``, ``scale_loss`` + backward +
``micro_batch_done`` (with and without a declared boundary), ``unscale_``, ``grad_norm``,
``clip_grad_norm_``, ``step`` (sometimes interrupted by a KeyboardInterrupt, then run
again), ``state_dict`` and a backward that raises halfway. It keeps its own model of
where the step stands, so it knows for each call whether it must work or raise, and with
which message. At each real step a reference session on an identical model runs the
canonical loop over the same micro-batches (``backward(loss / grad_accum_steps)`` each,
one ``clip_grad_norm_`` if the step was clipped, ``step()``); the two must agree bit for
bit: parameters, the StepResult, the learning rate. Between steps the session must hold
no stale state: no recorded losses, and its tensors (model, gradients, optimizer state,
its own) stay within a fixed multiple of the parameter bytes.

Three plans, and optimizer-in-backward for the plans that support it (accumulation and
clipping are refused there, each backward is its own step).
"""

from __future__ import annotations

import gc
import math
import re

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from mixprec import MixedPrecision

SETTINGS = settings(
    max_examples=20,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,  # the same sequences on every run: CI is reproducible
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

_INDEX = st.integers(0, 5)
_BAD = st.integers(0, 7).map(lambda k: k == 0)  # one micro-batch in eight has an inf loss
_BOUNDARY = st.sampled_from([None, None, True, False])


def _session(plan: str, accum: int, in_backward: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    mp = MixedPrecision(plan, grad_accum_steps=accum, optimizer_in_backward=in_backward)
    model, _, sched = mp.prepare(model, opt, scheduler=sched)
    return mp, model, sched


def _loss(mp: MixedPrecision, model: torch.nn.Module, i: int, bad: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    with mp.autocast():
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    return loss * float("inf") if bad else loss


def _same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _same_float(a: float | None, b: float | None) -> bool:
    return a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))


def _same_state(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _held_bytes(root: object) -> int:
    """Bytes of the distinct tensor storages reachable from ``root`` through containers and
    mixprec / torch objects (model, gradients, optimizer state, the session's own state)."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.grad is not None:
                stack.append(obj.grad)
            if obj.layout == torch.strided and obj.device.type != "meta":
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend(obj)
        elif type(obj).__module__.startswith(("mixprec", "torch.nn", "torch.optim", "collections")):
            stack.extend(r for r in gc.get_referents(obj) if not callable(r) or isinstance(r, torch.nn.Module))
    return sum(storages.values())


class _StepMachine(RuleBasedStateMachine):
    PLAN = "bf16-mixed"
    IN_BACKWARD = False

    def __init__(self) -> None:
        super().__init__()
        self.accum = 1 if self.IN_BACKWARD else 2
        self.mp, self.model, self.sched = _session(self.PLAN, self.accum, self.IN_BACKWARD)
        # the reference: the canonical loop, one backward per micro-batch, then step()
        self.ref_mp, self.ref, self.ref_sched = _session(self.PLAN, 1, False)
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.last = "idle"  # "idle" (nothing yet, or a step dropped) or "stepped" (a step() finished)
        self._new_step()

    def _new_step(self) -> None:
        self.window: list[tuple[int, bool]] = []  # micro-batches whose backward ran in this step
        self.pending = False  # a scale_loss() + backward not yet counted by micro_batch_done()
        self.micro = 0
        self.boundary = False
        self.explicit = False
        self.unscaled = False
        self.clipped_to: float | None = None

    # ----------------------------------------------------------- expectations
    def _backward_refusal(self, caller: str) -> str | None:
        if self.IN_BACKWARD:
            if self.micro:
                return "before step(): under optimizer_in_backward=True"
            if self.pending:
                return "before the last backward was counted"
            return None
        if self.unscaled:
            return "a backward after unscale_() in the same step"
        if self.boundary and not self.explicit and self.accum > 1:
            return f"{caller} called after the accumulation boundary"
        return None

    def _boundary_refusal(self, name: str) -> str | None:
        if self.IN_BACKWARD:
            return "does not work with optimizer_in_backward=True"
        if self.pending:
            return f"{name} called between scale_loss() and micro_batch_done()"
        if self.boundary:
            return None
        if self.micro:
            return f"{name} called in the middle of gradient accumulation ({self.micro} of {self.accum} micro-batches)"
        if self.last == "idle":
            return f"{name} called before any backward()"
        return f"{name} called after step() with no backward since"

    def _expect_error(self, message: str, call, exc: type[Exception] = RuntimeError, *, regex: bool = False) -> None:
        with pytest.raises(exc, match=message if regex else re.escape(message)):
            call()

    def _counted(self, boundary: bool | None) -> None:
        self.pending = False
        self.micro += 1
        self.explicit = boundary is not None
        self.boundary = boundary if boundary is not None else self.micro % self.accum == 0

    # ------------------------------------------------------------------ rules
    @rule(i=_INDEX, bad=_BAD)
    def backward(self, i: int, bad: bool) -> None:
        loss = _loss(self.mp, self.model, i, bad)
        if (refusal := self._backward_refusal("backward()")) is not None:
            self._expect_error(refusal, lambda: self.mp.backward(loss))
            return
        self.mp.backward(loss)
        self.window.append((i, bad))
        self._counted(None)

    @rule(i=_INDEX, bad=_BAD, done=st.booleans(), boundary=_BOUNDARY)
    def halves(self, i: int, bad: bool, done: bool, boundary: bool | None) -> None:
        loss = _loss(self.mp, self.model, i, bad)
        if (refusal := self._backward_refusal("scale_loss()")) is not None:
            self._expect_error(refusal, lambda: self.mp.scale_loss(loss / self.accum))
            return
        with self.mp.backward_context():
            self.mp.scale_loss(loss / self.accum).backward()
        self.window.append((i, bad))
        self.pending = True
        if done:
            self.micro_batch_done(boundary)

    @rule(boundary=_BOUNDARY)
    def micro_batch_done(self, boundary: bool | None) -> None:
        if not self.pending:
            self._expect_error(
                "micro_batch_done() called without a backward since the last one",
                lambda: self.mp.micro_batch_done(boundary=boundary),
            )
            return
        if self.IN_BACKWARD and boundary is False:
            self._expect_error(
                "micro_batch_done(boundary=False) under optimizer_in_backward=True",
                lambda: self.mp.micro_batch_done(boundary=boundary),
                ValueError,
            )
            return
        self.mp.micro_batch_done(boundary=boundary)
        self._counted(boundary)

    @rule(which=st.sampled_from(["unscale_", "grad_norm"]))
    def true_gradients(self, which: str) -> None:
        call = getattr(self.mp, which)
        if (refusal := self._boundary_refusal(f"{which}()")) is not None:
            self._expect_error(refusal, call)
            return
        call()
        self.unscaled = True

    @rule(max_norm=st.sampled_from([0.05, 0.5]))
    def clip(self, max_norm: float) -> None:
        refusal = self._boundary_refusal("clip_grad_norm_()")
        if refusal is None and self.clipped_to is not None and max_norm < self.clipped_to:
            refusal = "a second clip"
        if refusal is not None:
            self._expect_error(refusal, lambda: self.mp.clip_grad_norm_(max_norm))
            return
        self.mp.clip_grad_norm_(max_norm)
        self.unscaled = True
        if self.clipped_to is None:
            self.clipped_to = max_norm

    @rule(mid=st.booleans())
    def state_dict(self, mid: bool) -> None:
        in_step = self.micro > 0 or self.pending
        if self.IN_BACKWARD and in_step:  # the weights already hold the update of this step
            self._expect_error(
                "optimizer_in_backward=True" if mid else "optimizer_in_backward=True|middle of gradient accumulation",
                lambda: self.mp.state_dict(mid_accumulation=mid),
                regex=True,
            )
        elif in_step and not mid:
            self._expect_error(
                "state_dict() called in the middle of gradient accumulation", lambda: self.mp.state_dict()
            )
        else:  # the state as of the last step: the reference's
            assert _same_state(self.mp.state_dict(mid_accumulation=mid), self.ref_mp.state_dict())

    @rule(i=_INDEX)
    def backward_that_raises(self, i: int) -> None:
        """A backward an exception stops halfway: the step and its gradients are dropped."""
        if self._backward_refusal("backward()") is not None:
            return
        loss = _loss(self.mp, self.model, i, False)

        def boom(_: torch.Tensor) -> None:
            raise RuntimeError("boom")

        handle = self.model[2].weight.register_post_accumulate_grad_hook(boom)
        try:
            self._expect_error("boom", lambda: self.mp.backward(loss))
        finally:
            handle.remove()
        assert all(p.grad is None for p in self.model.parameters())
        assert _same_params(self.model, self.ref)  # nothing of the dropped step was applied
        self.last = "idle"
        self._new_step()

    @rule(interrupt=st.integers(0, 3).map(lambda k: k == 0))
    def step(self, interrupt: bool) -> None:
        if self.pending:
            self._expect_error("step() called between scale_loss() and micro_batch_done()", self.mp.step)
            return
        if not self.micro:
            message = (
                "step() called before any backward()" if self.last == "idle"
                else "step() called again with no backward since the last step()"
            )
            self._expect_error(message, self.mp.step)
            return
        if not self.boundary:
            result = self.mp.step()
            assert result.accumulating and not result.stepped and not result.skipped
            return
        # the reference step over the same micro-batches
        self.ref_state = self.ref_mp.state_dict()
        for i, bad in self.window:
            self.ref_mp.backward(_loss(self.ref_mp, self.ref, i, bad) / self.accum)
        if self.clipped_to is not None:
            self.ref_mp.clip_grad_norm_(self.clipped_to)
        expected = self.ref_mp.step()
        if interrupt and not self.IN_BACKWARD and expected.stepped:
            opt = self.mp.optimizers[0]
            # the update's entry: step(), or step_skipping() where a wrapper skips on the device
            names = ("step", "step_skipping") if hasattr(opt, "step_skipping") else ("step",)
            own = {name: vars(opt).get(name) for name in names}  # torch may keep a patched step on the instance

            def interrupted(*args, **kwargs):
                raise KeyboardInterrupt

            for name in names:
                setattr(opt, name, interrupted)
            try:
                with pytest.raises(KeyboardInterrupt):
                    self.mp.step()
            finally:
                for name in names:
                    if own[name] is None:
                        delattr(opt, name)
                    else:
                        setattr(opt, name, own[name])
            assert _same_state(self.mp.state_dict(), self.ref_state)  # a Ctrl-C handler saves the last step
        result = self.mp.step()
        assert (result.stepped, result.skipped, result.skip_reason, result.optimizer_steps, result.scale) == (
            expected.stepped, expected.skipped, expected.skip_reason, expected.optimizer_steps, expected.scale
        ), (result, expected)
        if not self.IN_BACKWARD:
            assert _same_float(result.grad_norm, expected.grad_norm), (result, expected)
        assert _same_params(self.model, self.ref)
        assert self.sched.get_last_lr() == self.ref_sched.get_last_lr()
        self.last = "stepped"
        self._new_step()
        # nothing of the step is left behind
        assert not self.mp._decision._losses
        held = _held_bytes(self.mp)
        assert held <= 8 * self.param_bytes, (held, self.param_bytes)

    @invariant()
    def phase_matches(self) -> None:
        phase = self.mp.phase.value
        if self.micro == 0:
            assert phase in ("idle", "stepped", "skipped"), phase
        elif not self.boundary:
            assert phase == "accumulating", phase
        else:
            assert phase in ("backward done", "unscaled", "clipped"), phase


def _machine(plan: str, in_backward: bool):
    return type(f"Machine_{plan}_{in_backward}", (_StepMachine,), {"PLAN": plan, "IN_BACKWARD": in_backward})


@pytest.mark.parametrize("plan", ["bf16-mixed", "fp16-master", "bf16-kahan"])
def test_the_halves_in_any_order_match_the_reference_loop(plan: str) -> None:
    run_state_machine_as_test(_machine(plan, False), settings=SETTINGS)


@pytest.mark.parametrize("plan", ["bf16-kahan", "bf16-pure"])
def test_optimizer_in_backward_through_any_order_matches_the_reference_loop(plan: str) -> None:
    run_state_machine_as_test(_machine(plan, True), settings=SETTINGS)

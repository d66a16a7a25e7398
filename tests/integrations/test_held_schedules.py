"""HeldSchedules (mixprec.integrations.schedules) alone: what a skipped step puts back, and when.

The reference for each case is the loop that reads the skip at once and does not step the
scheduler on a skipped step; everything else in the loop happens the same."""

from __future__ import annotations

import warnings

import pytest
import torch

from mixprec import StepResult
from mixprec.integrations.schedules import HeldSchedules

pytestmark = pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")


def skipped(flag: bool) -> StepResult:
    return StepResult.lazy(lambda: {"skipped": flag})


def sgd() -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9, weight_decay=0.01)


def held_step(held: HeldSchedules, sched, flag: bool) -> None:
    held.step(sched, type(sched).step, skipped(flag))


def test_a_skipped_step_puts_back_only_what_its_scheduler_changed():
    """Before: every group setting was put back as it was before the scheduler's step, so a weight
    decay a callback set meanwhile (a weight-decay schedule) was undone. Now only the lr, which the
    scheduler changed, goes back; the weight decay keeps the callback's value, without a warning."""
    opt = sgd()
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    held = HeldSchedules()
    held_step(held, sched, True)
    opt.param_groups[0]["weight_decay"] = 0.04  # a callback, before the next update
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        held.settle()
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["weight_decay"] == 0.04
    assert sched.last_epoch == 0
    held_step(held, sched, False)
    held.settle()  # a step that was taken stays
    assert opt.param_groups[0]["lr"] == 0.05 and sched.last_epoch == 1


def test_an_epoch_scheduler_that_settles_first_sees_the_skipped_step_put_back():
    """A step-interval scheduler held, an epoch-interval one on the same optimizer stepped right
    after the skipped step (as Lightning does at an epoch's end): it settles first, so it halves
    the lr of the reference (0.1 * 0.5), not the held step's (0.1 * 0.9 * 0.5, put back to 0.1)."""
    opt = sgd()
    every_step = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    every_epoch = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    held = HeldSchedules()
    held.settle_before_stepping(every_epoch)
    held_step(held, every_step, True)
    every_epoch.step()
    held.settle()
    assert opt.param_groups[0]["lr"] == 0.1 * 0.5
    assert every_step.last_epoch == 0 and every_epoch.last_epoch == 1


def test_a_setting_something_else_changed_since_is_left_with_a_warning():
    """A second scheduler of the optimizer that is not held (Accelerate: not prepared) halves the lr
    between the skipped step and the settle: mixprec cannot tell what it would have done with the
    lr that was put back, so it leaves the lr as it found it and says so, once."""
    opt = sgd()
    every_step = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    other = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    held = HeldSchedules()
    for _ in range(2):
        held_step(held, every_step, True)
        other.step()
        if _ == 0:
            with pytest.warns(UserWarning, match=r"\['lr'\] changed between a skipped step and the next update"):
                held.settle()
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                held.settle()
    assert every_step.last_epoch == 0  # the held scheduler itself is put back
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.9 * 0.5 * 0.9 * 0.5)


def test_the_optimizers_state_dict_settles_first_and_a_load_forgets_the_held_steps():
    """A hand-written checkpoint taking optimizer.state_dict() before anything else, right after a
    skipped step, saves the lr the scheduler's state says (before: the advanced one). A load of
    the optimizer or of the scheduler replaces what a held step would put back: it is forgotten
    (before: the next settle wrote the pre-load state over the loaded one)."""
    opt = sgd()
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    held = HeldSchedules()
    held.hold(sched, lambda _: skipped(True))
    sched.step()
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.1  # settled first
    assert sched.state_dict()["last_epoch"] == 0

    other = sgd()
    other_sched = torch.optim.lr_scheduler.ExponentialLR(other, gamma=0.5)
    other_sched.step()
    other_sched.step()  # lr 0.025, last_epoch 2: the checkpoint to roll back to
    saved_opt, saved_sched = other.state_dict(), other_sched.state_dict()
    for load_scheduler_too in (False, True):
        sched.step()  # held, and skipped
        opt.load_state_dict(saved_opt)
        if load_scheduler_too:
            sched.load_state_dict(saved_sched)
        held.settle()
        assert opt.param_groups[0]["lr"] == 0.025
    assert sched.last_epoch == 2


def test_a_model_and_an_optimizer_watched_by_held_schedules_still_pickle():
    """``torch.save(model)`` pickles the model's hooks. Before: the settling hook was a bound method
    of the HeldSchedules, whose held scheduler classes (made at run time) cannot be pickled, so
    saving the whole model failed under Lightning or Accelerate with a step scheduler, as did
    saving the held scheduler itself. Now the hook pickles as one that does nothing (the live one
    still settles), and a held scheduler as one of its own class."""
    import io

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    held = HeldSchedules()
    held.hold(sched, lambda _: skipped(True))
    held.settle_before_saving(model)
    sched.step()  # held, and skipped
    for obj in (model, opt, sched):
        torch.save(obj, io.BytesIO())
    assert type(torch.load(_saved(sched), weights_only=False)) is torch.optim.lr_scheduler.ExponentialLR  # not held
    copy = torch.load(_saved(model), weights_only=False)
    copy.state_dict()  # (its hook does nothing)
    assert opt.param_groups[0]["lr"] == 0.05
    model.state_dict()  # the live hook settles
    assert opt.param_groups[0]["lr"] == 0.1


def _saved(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_a_scheduler_held_again_is_taken_over_and_given_back_by_release():
    """A scheduler passed to a second run (a second MixprecTrainer given the same optimizers=) is
    held by that run, with its results, not the first's; released, it steps as it did. Before: the
    held class kept the first run's results for good, so the second run's scheduler held on the
    first run's last skip."""
    opt = sgd()
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    first, second = HeldSchedules(), HeldSchedules()
    first.hold(sched, lambda _: skipped(True))
    sched.step()
    first.settle()
    assert sched.last_epoch == 0
    first.release(sched)
    assert type(sched) is torch.optim.lr_scheduler.ExponentialLR
    second.hold(sched, lambda _: skipped(False))
    sched.step()
    second.settle()
    assert sched.last_epoch == 1
    first.release(sched)  # not the first's to give back
    assert type(sched) is not torch.optim.lr_scheduler.ExponentialLR
    second.release(sched)
    sched.step()
    assert type(sched) is torch.optim.lr_scheduler.ExponentialLR and sched.last_epoch == 2


def test_loading_only_the_optimizer_or_only_the_scheduler_keeps_the_other_put_back():
    """Right after a skipped step, a load of the optimizer alone keeps its lr and the scheduler
    still goes back a step; a load of the scheduler alone keeps its state and the lr still goes
    back. Before: either load forgot both, leaving the scheduler a step ahead, or the lr."""
    def setup():
        opt = sgd()
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
        held = HeldSchedules()
        held.hold(sched, lambda _: skipped(True))
        return opt, sched, held

    opt, sched, held = setup()
    saved = {k: v for k, v in opt.state_dict().items()}
    saved["param_groups"][0]["lr"] = 0.3
    sched.step()
    opt.load_state_dict(saved)
    held.settle()
    assert opt.param_groups[0]["lr"] == 0.3 and sched.last_epoch == 0

    opt, sched, held = setup()
    other = torch.optim.lr_scheduler.ExponentialLR(sgd(), gamma=0.5)
    for _ in range(3):
        other.step()
    sched.step()
    sched.load_state_dict(other.state_dict())
    held.settle()
    assert sched.last_epoch == 3 and opt.param_groups[0]["lr"] == 0.1


def test_a_second_held_scheduler_reads_nothing_of_the_step_being_taken():
    """Two step-interval schedulers of one optimizer: the second one's step keeps the state to put
    back without settling (that would read the outcome of the step just taken, a wait for the
    device). Before: its snapshot went through the held class's settling state_dict."""
    opt = sgd()
    a = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    b = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    held = HeldSchedules()
    reads: list[int] = []
    results: list[StepResult] = []

    def result_for(_):
        return results[-1]

    held.hold(a, result_for)
    held.hold(b, result_for)
    for step in range(3):
        held.settle()  # (before the next update: the last step's outcome is read there)
        results.append(StepResult.lazy(lambda step=step: reads.append(step) or {"skipped": step == 1}))
        a.step()
        b.step()
        assert step not in reads
    held.settle()
    assert reads == [0, 1, 2]
    assert a.last_epoch == b.last_epoch == 2


class SlottedScheduler:
    """A framework-style scheduler of one's own, with slots (no weak references, no __dict__)."""

    __slots__ = ("optimizer", "steps")

    def __init__(self, optimizer):
        self.optimizer, self.steps = optimizer, 0

    def step(self):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def test_a_scheduler_that_cannot_be_held_is_left_as_it_is():
    """A scheduler whose class cannot change (slots) is not held (False) and steps as before, rather
    than failing the framework's setup."""
    sched = SlottedScheduler(sgd())
    held = HeldSchedules()
    assert held.hold(sched, lambda _: skipped(True)) is False
    assert held.settle_before_stepping(sched) is False
    assert type(sched) is SlottedScheduler
    sched.step()
    held.release(sched)
    assert sched.steps == 1
    other = torch.optim.lr_scheduler.ExponentialLR(sgd(), gamma=0.5)
    assert held.hold(other, lambda _: skipped(True)) is True

"""Run by torchrun from test_accelerate_fsdp2.py: Accelerate with an FSDP2 plugin
(``FullyShardedDataParallelPlugin(fsdp_version=2)``) under mixprec, on 2 gloo ranks.

Accelerate runs FSDP only on GPUs; on a CPU it sets the plugin aside and runs DDP. So that its
FSDP2 code path (``Accelerator.prepare``'s FSDP2 branch, ``save_state`` / ``load_state`` of
sharded models) runs here, each run sets the accelerator's state to FSDP with the plugin, as
Accelerate itself does on GPUs. For each plan: 10 steps of ``mixprec.integrations.accelerate.prepare``
(mixprec shards with the plan's policy, Accelerate keeps the sharded model), then
``save_state`` after 5 and ``load_state`` into a fresh run for the last 5 again. Under fp16
plans rank 1 plants an inf in its own gradient shard at INF_STEP. Writes each rank's results to
``<out>/rank<r>.pt``.

Usage: torchrun --nproc_per_node 2 accelerate_fsdp2.py OUT
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import FullyShardedDataParallelPlugin  # noqa: E402

from mixprec import MixedPrecision  # noqa: E402
from mixprec.integrations.accelerate import attach, prepare  # noqa: E402
from tests.integrations._common import run_fsdp  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from lightning_model_parallel import MICRO, STEPS, data, net  # noqa: E402

PLANS = ("bf16-mixed", "bf16-master", "bf16-kahan", "bf16-sr", "bf16-pure", "fp16-pure", "fp16-master", "fp8-mixed")
INF_STEP = 3


def accelerator(**plugin_kwargs) -> Accelerator:
    """An Accelerator running FSDP2 as on GPUs (see the module's docstring)."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    plugin = FullyShardedDataParallelPlugin(**{"fsdp_version": 2, **plugin_kwargs})
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    run_fsdp(acc, plugin)
    return acc



class WithRows(torch.nn.Sequential):
    """The tiny net with two parameters of one row, which add zero to its output (their gradients
    are zero): on 2 ranks rank 1 holds an empty shard of each, whose data pointers are both 0."""

    def __init__(self) -> None:
        super().__init__(*net())
        self.row = torch.nn.Parameter(torch.ones(1, 4))
        self.one = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0.0 * (self.row.sum() + self.one.sum())


def model_with_empty_shards() -> torch.nn.Module:
    return WithRows()


def session(plan: str):
    acc = accelerator(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Linear"])
    mp = MixedPrecision(plan)
    model = model_with_empty_shards()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = prepare(acc, mp, model, opt)
    return acc, mp, model, opt


def run(plan: str, out: str) -> dict:
    acc, mp, model, opt = session(plan)
    x, y = data()
    rank = acc.process_index
    inf_step = INF_STEP if plan.startswith("fp16") else -1
    skipped: list[bool] = []
    scales: list[float] = []

    def train(model, opt, steps: range) -> list[float]:
        losses = []
        for step in steps:
            rows = torch.arange(step * 2 * MICRO, (step + 1) * 2 * MICRO)[rank::2]
            loss = (model(x[rows]).float() - y[rows]).pow(2).mean()
            acc.backward(loss)
            if step == inf_step and rank == 1:  # this rank's own shard only
                model[0].weight.grad.to_local().view(-1)[0] = float("inf")
            opt.step()
            opt.zero_grad()
            skipped.append(bool(opt.step_was_skipped))
            scales.append(float(mp.scaler.get_scale()))
            losses.append(float(loss.detach()))
        return losses

    def weights(model) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}

    first = train(model, opt, range(5))
    acc.save_state(os.path.join(out, f"state-{plan}"))
    straight = train(model, opt, range(5, STEPS))
    after = weights(model)
    result = {"losses": first + straight, "params": after, "skipped": list(skipped), "scales": list(scales),
              "sharded": type(next(model.parameters())).__name__,
              "dtypes": sorted({str(p.dtype) for p in model.parameters()})}
    acc, mp, model, opt = session(plan)  # a new run, resumed
    acc.load_state(os.path.join(out, f"state-{plan}"))
    result["resumed"] = train(model, opt, range(5, STEPS))
    result["resumed_params"] = weights(model)
    result["resumed_scales"] = scales[STEPS:]
    return result


def refusals() -> dict[str, str]:
    found = {}
    for option, value in (("activation_checkpointing", True), ("fsdp_version", 1), ("cpu_ram_efficient_loading", True)):
        try:
            acc = accelerator(**{option: value})
            model = net()
            prepare(acc, MixedPrecision("bf16-master"), model, torch.optim.SGD(model.parameters(), lr=0.1))
            found[option] = "accepted"
        except ValueError as exc:
            found[option] = str(exc)
        os.environ.pop("FSDP_CPU_RAM_EFFICIENT_LOADING", None)  # (the plugin sets it for the plugins after it)
    calls = {
        "two optimizers": lambda acc, model: prepare(acc, MixedPrecision("bf16-master"), model,
                                                     torch.optim.SGD(model[0].parameters(), lr=0.1),
                                                     torch.optim.SGD(model[2].parameters(), lr=0.1)),
        "auto": lambda acc, model: prepare(acc, MixedPrecision("auto"), model,
                                           torch.optim.SGD(model.parameters(), lr=0.1)),
        "model alone": lambda acc, model: (attach(acc, MixedPrecision("bf16-master")), acc.prepare(model)),
    }
    # as Accelerate itself leaves it on CPU: the plugin set aside, DDP
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    try:
        model = net()
        prepare(acc, MixedPrecision("bf16-master"), model, torch.optim.SGD(model.parameters(), lr=0.1))
        found["ddp instead"] = "accepted"
    except ValueError as exc:
        found["ddp instead"] = str(exc)
    for name, call in calls.items():
        try:
            call(accelerator(), net())
            found[name] = "accepted"
        except ValueError as exc:
            found[name] = str(exc)
    return found


def main() -> None:
    out = sys.argv[1]
    results: dict = {plan: run(plan, out) for plan in PLANS}
    results["refusals"] = refusals()
    torch.save(results, os.path.join(out, f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    main()

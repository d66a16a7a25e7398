"""Step time of each integration vs the framework's own bf16 precision, side by side.

Every row trains the same small model on the same generated data with the framework's
loop twice: once with mixprec's ``bf16-mixed`` plan through the integration, once with the
framework's own bf16 (``TrainingArguments(bf16=True)``, Lightning ``precision="bf16-mixed"``,
``Accelerator(mixed_precision="bf16")``). Runs alternate (mixprec, native, mixprec, ...)
in ABBA order so machine noise and warm-up effects hit both sides alike; a step is timed from the framework's own hooks
(batch start to batch end), the first steps of each run are warm-up, and the median
step time over all rounds is reported with the ratio mixprec / native. Each round's own
ratio (its mixprec median over its native median) is also kept: their quartiles show how
far one round moves on this machine, which a single ratio hides.

    python benchmarks/bench_integrations.py                    # all three, Markdown table
    python benchmarks/bench_integrations.py --frameworks accelerate --steps 40 --rounds 5
    python benchmarks/bench_integrations.py --frameworks lightning --interleave   # + one-Trainer A/B
    python benchmarks/bench_integrations.py --frameworks lightning --interleave --control --floor

Separate runs of the tiny model differ by several percent from one another on this
machine (each run allocates its model and buffers afresh). ``--interleave`` adds a
Lightning row measured inside one Trainer whose precision plugin alternates every step
between mixprec's and Lightning's own, so both sides share the model and its memory.
``--control`` alternates Lightning's own plugin with itself; ``--floor`` alternates it with
two minimal hand-written plugins (a loss check; a loss check and one gradient norm), which
show what any step that can be skipped costs before library code runs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

SEQ, BATCH, VOCAB = 32, 8, 256
LAYERS, WIDTH = 2, 128
# --size: (layers, width, sequence length); "tiny" shows the fixed per-step cost, "small" a
# model whose step is ~10x longer.
SIZES = {"tiny": (2, 128, 32), "small": (4, 256, 128)}


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=0))


def _tokens(n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n * BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def _reset_accelerate() -> None:
    with contextlib.suppress(ImportError):
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()


# ----------------------------------------------------------------- transformers
def run_transformers(mixprec: bool, steps: int) -> list[float]:
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from mixprec.integrations.transformers import MixprecTrainer

    hf_logging.set_verbosity_error()
    _reset_accelerate()
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.t0)

    rows = [{"input_ids": t, "labels": t} for t in _tokens(steps)]
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=BATCH, max_steps=steps, report_to=[],
        use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, bf16=not mixprec,
    )
    kwargs = {"model": _gpt2(), "args": args, "train_dataset": rows, "callbacks": [Clock()]}
    trainer = MixprecTrainer(precision="bf16-mixed", **kwargs) if mixprec else Trainer(**kwargs)
    trainer.train()
    return times


# -------------------------------------------------------------------- lightning
def _fit_lightning(steps: int, callback, **precision) -> None:
    """Train the model ``steps`` steps with a Lightning ``Trainer`` (``precision``: its
    ``plugins=`` or ``precision=``), ``callback`` timing the steps."""
    import lightning as L

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _gpt2()

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.model(input_ids=x, labels=x).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], **precision)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_tokens(steps)), batch_size=BATCH)
    trainer.fit(LM(), loader)


def run_lightning(mixprec: bool, steps: int) -> list[float]:
    import lightning as L

    from mixprec.integrations.lightning import MixprecPrecision

    times: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_start(self, *args):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *args):
            times.append(time.perf_counter() - self.t0)

    precision = {"plugins": [MixprecPrecision("bf16-mixed")]} if mixprec else {"precision": "bf16-mixed"}
    _fit_lightning(steps, Clock(), **precision)
    return times


def _floor_plugins() -> dict[str, type]:
    """Two Lightning precision plugins written by hand for this benchmark: Lightning's own bf16
    plus the least a step that can be skipped must do. They bound what any integration costs.

    ``loss``: copy the loss at backward, read it once before the step, step if it is finite
    (no gradient check). ``norm``: the same with one fp32 norm over every gradient read
    together with the loss: the inf/NaN check mixprec makes, nothing else of mixprec's.
    """
    import math

    from lightning.pytorch.plugins.precision import MixedPrecision as NativeMixedPrecision

    class LossCheck(NativeMixedPrecision):
        def backward(self, tensor, model, *args, **kwargs):
            self.loss = tensor.detach().clone()
            super().backward(tensor, model, *args, **kwargs)

        def values(self, optimizer) -> list[float]:
            return [self.loss.item()]

        def optimizer_step(self, optimizer, model=None, closure=None, **kwargs):
            result = self._wrap_closure(model, optimizer, closure)  # closure, then clipping and hooks
            if all(map(math.isfinite, self.values(optimizer))):
                optimizer.step()
            return result

    class NormCheck(LossCheck):
        def values(self, optimizer) -> list[float]:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)), 2.0)
            return torch.stack([self.loss, norm]).tolist()

    return {"loss": LossCheck, "norm": NormCheck}


def run_lightning_interleaved(steps: int, parity: int = 0, side: str = "mixprec") -> tuple[list[float], list[float]]:
    """One Lightning ``Trainer`` whose precision plugin alternates every step between mixprec's
    and Lightning's own bf16 (``MixedPrecision("bf16-mixed")``): both sides run on the same
    model, data and memory, so what separate runs differ by (allocation, layout) cancels.
    With ``bf16-mixed`` mixprec converts nothing and wraps nothing, so either plugin can
    take any step. mixprec takes the batches whose index has this ``parity`` (callers
    run both: a side that always ran the even steps would keep whatever those cost).
    ``side`` is what alternates with Lightning's own plugin: ``"mixprec"``; ``"control"``,
    a second instance of Lightning's own plugin (what the alternation itself leaves in the
    ratio); ``"loss"`` or ``"norm"``, a plugin of :func:`_floor_plugins`.
    Returns (that side's step times, native step times)."""
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision as NativeMixedPrecision

    from mixprec.integrations.lightning import MixprecPrecision

    times: dict[bool, list[float]] = {True: [], False: []}
    if side == "mixprec":
        ours = MixprecPrecision("bf16-mixed")
    elif side == "control":
        ours = NativeMixedPrecision("bf16-mixed", "cpu")
    else:
        ours = _floor_plugins()[side]("bf16-mixed", "cpu")
    native = NativeMixedPrecision("bf16-mixed", "cpu")

    class Alternate(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.side = batch_idx % 2 == parity
            trainer.strategy.precision_plugin = ours if self.side else native
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *args):
            times[self.side].append(time.perf_counter() - self.t0)

    _fit_lightning(steps, Alternate(), plugins=[ours])
    if side == "mixprec" and ours.mp.optimizer_steps != len(times[True]):
        raise RuntimeError("the mixprec side did not step every one of its batches")
    return times[True], times[False]


# ------------------------------------------------------------------- accelerate
def run_accelerate(mixprec: bool, steps: int) -> list[float]:
    from accelerate import Accelerator

    from mixprec.integrations.accelerate import prepare

    _reset_accelerate()
    accelerator = Accelerator(cpu=True, mixed_precision="no" if mixprec else "bf16")
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_tokens(steps)), batch_size=BATCH)
    if mixprec:
        model, opt, loader = prepare(accelerator, "bf16-mixed", model, opt, loader)
    else:
        model, opt, loader = accelerator.prepare(model, opt, loader)
    times = []
    for (x,) in loader:
        t0 = time.perf_counter()
        with accelerator.accumulate(model):
            loss = model(input_ids=x, labels=x).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times


RUNNERS: dict[str, tuple[Callable[[bool, int], list[float]], str]] = {
    "transformers": (run_transformers, "Trainer(TrainingArguments(bf16=True))"),
    "lightning": (run_lightning, 'Trainer(precision="bf16-mixed")'),
    "accelerate": (run_accelerate, 'Accelerator(mixed_precision="bf16")'),
}


def _print_row(name: str, native: str, rounds: list[tuple[list[float], list[float]]]) -> None:
    """One table row: pooled median step times of (mixprec, native) over all rounds, their
    ratio, and the quartiles of each round's own ratio."""
    ours = [t for mine, _ in rounds for t in mine]
    theirs = [t for _, native_times in rounds for t in native_times]
    pairs = [statistics.median(mine) / statistics.median(native_times) for mine, native_times in rounds]
    a, b = statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3
    q = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [pairs[0]] * 3
    print(f"| {name} | {native} | {b:.1f} | {a:.1f} | {a / b:.3f} | {q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", nargs="+", default=list(RUNNERS), choices=list(RUNNERS))
    parser.add_argument("--steps", type=int, default=30, help="steps per run (default: 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed first steps of each run (default: 5)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating run pairs (default: 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--size", default="tiny", choices=list(SIZES), help="model size (default: tiny)")
    parser.add_argument("--interleave", action="store_true",
                        help="also time Lightning with the two plugins alternating step by step in one Trainer "
                             "(per round two Trainers of 2x --steps steps: mixprec on the even steps, then the odd)")
    parser.add_argument("--control", action="store_true",
                        help="with --interleave: also a row alternating Lightning's own plugin with itself "
                             "(what the method leaves in a ratio; ideally 1.000)")
    parser.add_argument("--floor", action="store_true",
                        help="with --interleave: also rows for two hand-written minimal plugins (Lightning's bf16 "
                             "plus a loss check; plus a loss check and one gradient norm): what a skippable step costs at least")
    args = parser.parse_args(argv)
    if (args.control or args.floor) and not args.interleave:
        parser.error("--control and --floor add rows to --interleave; pass it too")
    global LAYERS, WIDTH, SEQ
    LAYERS, WIDTH, SEQ = SIZES[args.size]
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    print(f"GPT-2 {LAYERS}x{WIDTH}, batch {BATCH}x{SEQ}, CPU, {args.steps} steps x {args.rounds} rounds per side, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| framework | native bf16 | native ms/step | mixprec bf16-mixed ms/step | ratio | round ratios: quartiles |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.frameworks:
        runner, native = RUNNERS[name]
        rounds = []
        for round_ in range(args.rounds):  # ABBA order: a side that runs first gains or loses nothing
            times = {}
            for side in ((True, False) if round_ % 2 == 0 else (False, True)):
                times[side] = runner(side, args.steps)[args.warmup:]
                gc.collect()  # the previous run's trainer, model and graphs must not slow the next one
            rounds.append((times[True], times[False]))
        _print_row(name, f"`{native}`", rounds)
    if args.interleave:
        rows = [("lightning, alternating steps in one Trainer", "mixprec")]
        if args.control:
            rows.append(("control: Lightning's own plugin alternating with itself", "control"))
        if args.floor:
            rows.append(("floor: Lightning's own plugin + a loss check (hand-written)", "loss"))
            rows.append(("floor: Lightning's own plugin + a loss check + one gradient norm (hand-written)", "norm"))
        for title, side in rows:
            rounds = []
            for _ in range(args.rounds):
                both: tuple[list[float], list[float]] = ([], [])
                for parity in (0, 1):  # the measured side on the even steps, then on the odd ones
                    mine, theirs = run_lightning_interleaved(2 * args.steps, parity=parity, side=side)
                    both[0].extend(mine[args.warmup:])
                    both[1].extend(theirs[args.warmup:])
                    gc.collect()
                rounds.append(both)
            _print_row(title, '`MixedPrecision("bf16-mixed")`', rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Built-in tasks: shapes, determinism, and a real learning signal at the tiny size."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch

from mixprec.cli.models import (
    GPT,
    SIZES,
    TASKS,
    GPTConfig,
    MarkovLanguage,
    Task,
    accuracy,
    build_task,
)

# (steps, learning rate, accuracy floor on the held-out batch) for the tiny size.
# Floors sit well above chance (gpt 1/64, cnn and vit 1/10, mlp 1/5) and well below
# what the runs reach, so they test "it learns", not the exact trajectory.
TRAINING = {
    "gpt": (40, 3e-3, 0.45),
    "cnn": (60, 3e-3, 0.6),
    "vit": (90, 2e-3, 0.6),
    "mlp": (120, 3e-3, 0.7),
    "fragile": (120, 3e-3, 0.7),
    "chargpt": (60, 3e-3, 0.33),  # real text: the most frequent character (a space) alone is 0.17
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and lose much on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_task_names_and_sizes() -> None:
    assert TASKS == ("gpt", "cnn", "vit", "mlp", "fragile", "chargpt")
    assert SIZES == ("tiny", "small")
    assert set(TRAINING) == set(TASKS)


@pytest.mark.parametrize("name", TASKS)
def test_tiny_forward_backward(name: str) -> None:
    task = build_task(name, size="tiny", seed=0)
    assert isinstance(task, Task)
    assert (task.name, task.size, task.seed) == (name, "tiny", 0)
    assert 0.0 < task.chance < 1.0
    assert task.default_batch_size > 0
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in task.model.parameters())

    inputs, targets = task.batch(4, _gen())
    assert inputs.shape[0] == targets.shape[0] == 4
    outputs = task.model(inputs)
    assert outputs.shape[:-1] == targets.shape
    loss = task.criterion(outputs, targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in task.model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
    assert 0.0 <= task.accuracy(outputs, targets) <= 1.0


@pytest.mark.parametrize("name", TASKS)
def test_tiny_bf16_autocast_forward(name: str) -> None:
    task = build_task(name, size="tiny", seed=0)
    inputs, targets = task.batch(4, _gen())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = task.model(inputs)
        loss = task.criterion(outputs, targets)
    assert outputs.dtype == torch.bfloat16
    assert torch.isfinite(loss)
    loss.backward()


def test_shapes_per_task() -> None:
    gpt = build_task("gpt", size="tiny")
    x, y = gpt.batch(3, _gen())
    assert x.dtype == y.dtype == torch.long
    assert x.shape == y.shape == (3, 32)
    assert gpt.model(x).shape == (3, 32, 64)
    assert gpt.chance == pytest.approx(1 / 64)
    for name in ("cnn", "vit"):
        task = build_task(name, size="tiny")
        x, y = task.batch(3, _gen())
        assert x.shape == (3, 3, 32, 32) and x.dtype == torch.float32
        assert y.shape == (3,) and y.dtype == torch.long
        assert task.model(x).shape == (3, 10)
        assert task.chance == pytest.approx(0.1)
    mlp = build_task("mlp", size="tiny")
    x, y = mlp.batch(3, _gen())
    assert x.shape == (3, 32) and y.shape == (3,)
    assert mlp.model(x).shape == (3, 5)


def test_small_gpt_matches_the_documented_shape() -> None:
    task = build_task("gpt", size="small")
    assert isinstance(task.model, GPT)
    assert task.model.config == GPTConfig(
        vocab_size=512, seq_len=256, num_layers=6, dim=512, num_heads=8
    )
    assert task.default_batch_size == 8
    assert task.eval_batch_size == 32
    x, y = task.batch(1, _gen())
    assert x.shape == y.shape == (1, 256)
    with torch.no_grad():
        assert task.model(x).shape == (1, 256, 512)


@pytest.mark.parametrize("name", ["cnn", "vit", "mlp"])
def test_small_forward(name: str) -> None:
    task = build_task(name, size="small")
    x, y = task.batch(2, _gen())
    with torch.no_grad():
        assert task.criterion(task.model(x), y).isfinite()


@pytest.mark.parametrize("name", TASKS)
def test_same_seed_same_params_and_batches(name: str) -> None:
    a = build_task(name, size="tiny", seed=3)
    b = build_task(name, size="tiny", seed=3)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    for xa, xb in zip(a.batch(5, _gen(7)), b.batch(5, _gen(7)), strict=True):
        assert torch.equal(xa, xb)
    for xa, xb in zip(a.eval_batch(16), b.eval_batch(16), strict=True):
        assert torch.equal(xa, xb)

    c = build_task(name, size="tiny", seed=4)
    assert any(
        not torch.equal(p, q)
        for p, q in zip(a.model.parameters(), c.model.parameters(), strict=True)
    )


@pytest.mark.parametrize("name", TASKS)
def test_batches_differ_across_draws(name: str) -> None:
    task = build_task(name, size="tiny")
    g = _gen()
    x1, _ = task.batch(8, g)
    x2, _ = task.batch(8, g)
    assert not torch.equal(x1, x2)
    x_eval, _ = task.eval_batch(8)
    assert not torch.equal(x1, x_eval)


@pytest.mark.parametrize("name", TASKS)
def test_eval_batch_is_fixed(name: str) -> None:
    task = build_task(name, size="tiny")
    x1, y1 = task.eval_batch()
    assert x1.shape[0] == y1.shape[0] == 256
    x1.zero_()  # callers own the returned tensors; the held-out batch is unchanged
    x2, y2 = task.eval_batch()
    x3, y3 = task.eval_batch()
    assert torch.equal(x2, x3) and torch.equal(y2, y3)
    assert not torch.equal(x1, x2)


def test_building_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_task("vit", size="tiny", seed=5)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", TASKS)
def test_tiny_task_learns(name: str) -> None:
    steps, lr, floor = TRAINING[name]
    task = build_task(name, size="tiny", seed=0)
    model = task.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    g = _gen(1)
    model.train()
    for _ in range(steps):
        inputs, targets = task.batch(task.default_batch_size, g)
        loss = task.criterion(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    inputs, targets = task.eval_batch()
    with torch.no_grad():
        acc = task.accuracy(model(inputs), targets)
    assert acc >= floor, (
        f"{name}: accuracy {acc:.3f} after {steps} steps (chance {task.chance:.3f})"
    )
    assert acc >= task.chance + (0.3 if name == "chargpt" else 0.4)


def test_markov_language_ceiling() -> None:
    lang = MarkovLanguage(16, 64, seed=0)
    inputs, targets = lang.sample(512, _gen())
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    # Predicting each token's most likely successor achieves about profile[0].
    predicted = lang.successors[inputs, 0]
    acc = predicted.eq(targets).float().mean().item()
    assert acc == pytest.approx(lang.best_accuracy, abs=0.02)


def test_gpt_tied_weights() -> None:
    model = GPT(
        GPTConfig(vocab_size=32, seq_len=8, num_layers=1, dim=16, num_heads=2, tie_weights=True)
    )
    assert model.head.weight is model.tok_emb.weight
    with pytest.raises(ValueError, match=re.escape("GPT: sequence of length 9 exceeds seq_len=8")):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_accuracy() -> None:
    logits = torch.tensor([[2.0, 1.0], [0.0, 3.0], [1.0, 0.0], [0.0, 1.0]])
    assert accuracy(logits, torch.tensor([0, 1, 1, 0])) == 0.5
    assert accuracy(logits.view(2, 2, 2), torch.tensor([[0, 1], [0, 1]])) == 1.0
    with pytest.raises(ValueError, match=re.escape("do not match targets of shape (3,)")):
        accuracy(logits, torch.tensor([0, 1, 1]))


def test_unknown_task_name() -> None:
    msg = "unknown task 'resnet'; expected one of: gpt, cnn, vit, mlp"
    with pytest.raises(ValueError, match=re.escape(msg)):
        build_task("resnet")


def test_unknown_size() -> None:
    msg = "unknown size 'large' for task 'gpt'; expected one of: tiny, small"
    with pytest.raises(ValueError, match=re.escape(msg)):
        build_task("gpt", size="large")


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_batch_size(bad: object) -> None:
    task = build_task("mlp", size="tiny")
    msg = f"Task.batch(): batch_size must be a positive int, got {bad!r}"
    with pytest.raises(ValueError, match=re.escape(msg)):
        task.batch(bad, _gen())  # type: ignore[arg-type]


def test_bad_seed() -> None:
    with pytest.raises(ValueError, match=re.escape("seed must be a non-negative int, got -1")):
        build_task("mlp", seed=-1)


def test_fragile_model_breaks_fp16_and_bf16_where_documented() -> None:
    """fp32 is finite and well scaled; fp16 overflows in ``overflow.proj``; bf16 rounds away
    ``cancel.proj``'s signal; each fragile projection computed in fp32 is fine."""
    from mixprec.cli.models import FRAGILE_GAIN, FragileMLP, ScaledNormProjection

    task = build_task("fragile", size="tiny", seed=0)
    assert isinstance(task.model, FragileMLP)
    x, _ = task.batch(16, _gen())
    h = task.model.blocks(task.model.embed(x))
    proj = task.model.overflow.proj
    assert isinstance(proj, ScaledNormProjection) and proj.gain == FRAGILE_GAIN
    pre_norm = torch.nn.functional.linear(task.model.overflow.ln(h), proj.weight, proj.bias) * proj.gain
    assert pre_norm.abs().max() > torch.finfo(torch.float16).max  # exceeds fp16's range
    out32 = task.model(x)
    assert torch.isfinite(out32).all()
    with torch.autocast("cpu", dtype=torch.float16):
        assert not torch.isfinite(task.model.overflow.proj(task.model.overflow.ln(h))).all()
    cancel_in = task.model.cancel.ln(task.model.overflow(h))
    exact = task.model.cancel.proj(cancel_in)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rounded = task.model.cancel.proj(cancel_in).float()
    assert (rounded - exact).norm() / exact.norm() > 0.3  # the signal is lost under the offset


def test_python_docs_text_is_real_text_with_a_held_out_tail() -> None:
    from mixprec.cli.models import build_task
    from mixprec.cli.models.data import PythonDocsText

    data = PythonDocsText(96, 64)
    assert data.chars[0] == " " and "e" in data.chars[:5]  # English: a space, then e, t, a, ...
    assert len(data.heldout) == pytest.approx(0.1 * (len(data.train) + len(data.heldout)), rel=1e-3)
    x, y = data.sample(8, _gen())
    assert x.shape == (8, 64) and torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 96
    # the held-out batch is drawn from the held-out tail (windows of it, token for token)
    task = build_task("chargpt", size="tiny", seed=0)
    held, _ = task.eval_batch(16)
    tail = "".join(map(chr, data.heldout.tolist()))
    assert all("".join(map(chr, row.tolist())) in tail for row in held)

"""The task registry: the only place task and size names become models and data."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mixprec.cli.models.cnn import ResNet, ResNetConfig
from mixprec.cli.models.data import GaborImages, MarkovLanguage, PythonDocsText, Spirals
from mixprec.cli.models.gpt import GPT, GPTConfig, TokenCrossEntropy
from mixprec.cli.models.mlp import MLP, FragileMLP, MLPConfig
from mixprec.cli.models.task import Task
from mixprec.cli.models.vit import ViT, ViTConfig

__all__ = ["SIZES", "TASKS", "build_task"]

SIZES: tuple[str, ...] = ("tiny", "small")

_MODEL_STREAM, _DATA_STREAM, _EVAL_STREAM = 0, 1, 2


def _stream_seed(seed: int, stream: int) -> int:
    """Independent-looking seeds for the model, the data world and the held-out batch."""
    return (seed * 0x9E3779B97F4A7C15 + stream * 0xBF58476D1CE4E5B9 + 1) % 2**63


def _gpt(size: str, seed: int) -> Task:
    config, batch = {
        "tiny": (GPTConfig(vocab_size=64, seq_len=32, num_layers=2, dim=64, num_heads=4), 32),
        "small": (GPTConfig(vocab_size=512, seq_len=256, num_layers=6, dim=512, num_heads=8), 8),
    }[size]
    data = MarkovLanguage(config.vocab_size, config.seq_len, seed=_stream_seed(seed, _DATA_STREAM))
    return Task(
        name="gpt",
        size=size,
        seed=seed,
        model=GPT(config),
        criterion=TokenCrossEntropy(),
        chance=1.0 / config.vocab_size,
        default_batch_size=batch,
        eval_batch_size={"tiny": 256, "small": 32}[size],
        data=data,
        eval_seed=_stream_seed(seed, _EVAL_STREAM),
    )


def _chargpt(size: str, seed: int) -> Task:
    """A character-level GPT on real text (:class:`~mixprec.cli.models.data.PythonDocsText`)."""
    config, batch = {
        "tiny": (GPTConfig(vocab_size=96, seq_len=64, num_layers=2, dim=64, num_heads=4), 32),
        "small": (GPTConfig(vocab_size=96, seq_len=256, num_layers=6, dim=512, num_heads=8), 8),
    }[size]
    return Task(
        name="chargpt",
        size=size,
        seed=seed,
        model=GPT(config),
        criterion=TokenCrossEntropy(),
        chance=1.0 / config.vocab_size,
        default_batch_size=batch,
        eval_batch_size={"tiny": 256, "small": 32}[size],
        data=PythonDocsText(config.vocab_size, config.seq_len),
        eval_seed=_stream_seed(seed, _EVAL_STREAM),
    )


def _cnn(size: str, seed: int) -> Task:
    config, batch = {
        "tiny": (ResNetConfig(widths=(16, 32), blocks_per_stage=1), 32),
        "small": (ResNetConfig(widths=(32, 64, 128), blocks_per_stage=1), 64),
    }[size]
    return Task(
        name="cnn",
        size=size,
        seed=seed,
        model=ResNet(config),
        criterion=nn.CrossEntropyLoss(),
        chance=1.0 / GaborImages.num_classes,
        default_batch_size=batch,
        eval_batch_size=256,
        data=GaborImages(seed=_stream_seed(seed, _DATA_STREAM)),
        eval_seed=_stream_seed(seed, _EVAL_STREAM),
    )


def _vit(size: str, seed: int) -> Task:
    config, batch = {
        "tiny": (ViTConfig(image_size=32, patch_size=8, num_layers=2, dim=64, num_heads=4), 32),
        "small": (ViTConfig(image_size=32, patch_size=4, num_layers=6, dim=128, num_heads=4), 64),
    }[size]
    return Task(
        name="vit",
        size=size,
        seed=seed,
        model=ViT(config),
        criterion=nn.CrossEntropyLoss(),
        chance=1.0 / GaborImages.num_classes,
        default_batch_size=batch,
        eval_batch_size=256,
        data=GaborImages(seed=_stream_seed(seed, _DATA_STREAM)),
        eval_seed=_stream_seed(seed, _EVAL_STREAM),
    )


def _mlp(size: str, seed: int, *, fragile: bool = False) -> Task:
    num_classes, dim = 5, 32
    config, batch = {
        "tiny": (MLPConfig(in_features=dim, width=64, num_blocks=2, num_classes=num_classes), 128),
        "small": (
            MLPConfig(in_features=dim, width=256, num_blocks=4, num_classes=num_classes),
            256,
        ),
    }[size]
    return Task(
        name="fragile" if fragile else "mlp",
        size=size,
        seed=seed,
        model=FragileMLP(config) if fragile else MLP(config),
        criterion=nn.CrossEntropyLoss(),
        chance=1.0 / num_classes,
        default_batch_size=batch,
        eval_batch_size=256,
        data=Spirals(seed=_stream_seed(seed, _DATA_STREAM), num_classes=num_classes, dim=dim),
        eval_seed=_stream_seed(seed, _EVAL_STREAM),
    )


_BUILDERS: dict[str, Callable[[str, int], Task]] = {
    "gpt": _gpt,
    "cnn": _cnn,
    "vit": _vit,
    "mlp": _mlp,
    "fragile": lambda size, seed: _mlp(size, seed, fragile=True),
    "chargpt": _chargpt,
}

TASKS: tuple[str, ...] = tuple(_BUILDERS)


def build_task(name: str, *, size: str = "small", seed: int = 0) -> Task:
    """Build the task ``name`` (one of :data:`TASKS`) at ``size`` (one of :data:`SIZES`).

    The model is fp32 on CPU and, like the data distribution and the held-out batch,
    a deterministic function of ``seed``. Building does not touch the global RNG.

    >>> task = build_task("mlp", size="tiny", seed=0)
    >>> x, y = task.batch(8, torch.Generator().manual_seed(0))
    >>> task.model(x).shape
    torch.Size([8, 5])
    """
    builder = _BUILDERS.get(name)
    if builder is None:
        raise ValueError(f"unknown task {name!r}; expected one of: {', '.join(TASKS)}")
    if size not in SIZES:
        raise ValueError(
            f"unknown size {size!r} for task {name!r}; expected one of: {', '.join(SIZES)}"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"build_task(): seed must be a non-negative int, got {seed!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_stream_seed(seed, _MODEL_STREAM))
        return builder(size, seed)

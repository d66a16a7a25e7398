"""Built-in models and synthetic datasets with a real learning signal.

Five tasks, each at two sizes, for benchmarks, the CLI demo and tests of precision
plans. Data is generated deterministically from a seed; nothing is downloaded.

>>> from mixprec.models import TASKS, build_task
>>> TASKS
('gpt', 'cnn', 'vit', 'mlp', 'fragile')
>>> task = build_task("gpt", size="tiny", seed=0)
>>> inputs, targets = task.eval_batch(4)
>>> loss = task.criterion(task.model(inputs), targets)
"""

from mixprec.models.cnn import ResNet, ResNetConfig
from mixprec.models.data import GaborImages, MarkovLanguage, Spirals
from mixprec.models.gpt import GPT, GPTConfig, TokenCrossEntropy
from mixprec.models.mlp import (
    FRAGILE_GAIN,
    FRAGILE_OFFSET,
    MLP,
    FragileMLP,
    MLPConfig,
    ScaledNormProjection,
)
from mixprec.models.task import DataSource, Task, accuracy
from mixprec.models.tasks import SIZES, TASKS, build_task
from mixprec.models.vit import ViT, ViTConfig

__all__ = [
    "FRAGILE_GAIN",
    "FRAGILE_OFFSET",
    "GPT",
    "MLP",
    "SIZES",
    "TASKS",
    "DataSource",
    "FragileMLP",
    "GPTConfig",
    "GaborImages",
    "MLPConfig",
    "MarkovLanguage",
    "ResNet",
    "ResNetConfig",
    "ScaledNormProjection",
    "Spirals",
    "Task",
    "TokenCrossEntropy",
    "ViT",
    "ViTConfig",
    "accuracy",
    "build_task",
]

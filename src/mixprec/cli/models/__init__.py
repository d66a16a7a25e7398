"""Built-in models and datasets with a real learning signal.

Six tasks, each at two sizes, for benchmarks, the CLI demo and tests of precision
plans. Five draw synthetic data deterministically from a seed; ``chargpt`` reads real
text that ships with Python (:class:`~mixprec.cli.models.data.PythonDocsText`). Nothing is
downloaded.

>>> from mixprec.cli.models import TASKS, build_task
>>> TASKS
('gpt', 'cnn', 'vit', 'mlp', 'fragile', 'chargpt')
>>> task = build_task("gpt", size="tiny", seed=0)
>>> inputs, targets = task.eval_batch(4)
>>> loss = task.criterion(task.model(inputs), targets)
"""

from mixprec.cli.models.cnn import ResNet, ResNetConfig
from mixprec.cli.models.data import GaborImages, MarkovLanguage, Spirals
from mixprec.cli.models.gpt import GPT, GPTConfig, TokenCrossEntropy
from mixprec.cli.models.mlp import (
    FRAGILE_GAIN,
    FRAGILE_OFFSET,
    MLP,
    FragileMLP,
    MLPConfig,
    ScaledNormProjection,
)
from mixprec.cli.models.task import DataSource, Task, accuracy
from mixprec.cli.models.tasks import SIZES, TASKS, build_task
from mixprec.cli.models.vit import ViT, ViTConfig

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

"""The examples in docstrings and in the README run and print what they say."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import mixprec

ROOT = Path(__file__).resolve().parent.parent
_SKIP = ("mixprec.__main__", "mixprec.cli.__main__")  # importing them runs the command (test_cli.py runs them)


def _modules() -> list[str]:
    names = [mixprec.__name__]
    for info in pkgutil.walk_packages(mixprec.__path__, prefix="mixprec."):
        if info.name not in _SKIP:
            names.append(info.name)
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


def test_readme_tour_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "the README has no Python examples"
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)  # the training-loop tour
    exec(compile(blocks[2], "README.md", "exec"), namespace)  # explain()
    exec(compile(blocks[4], "README.md", "exec"), namespace)  # custom op lists
    assert str(namespace["y"].dtype) == "torch.float32" and str(namespace["p"].dtype) == "torch.bfloat16"
    exec(compile(blocks[5], "README.md", "exec"), namespace)  # a loop the user does not own
    lr = namespace["optimizer"].param_groups[0]["lr"]
    assert lr == (0.1 if namespace["result"].skipped else 0.1 * 0.1)  # the scheduler moved only on a real step

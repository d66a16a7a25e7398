"""The CUDA tier: every test here is marked ``cuda`` and skipped, with the reason, without a GPU.

The test modules also declare ``pytestmark`` themselves; the hook below makes sure a test
added here without it is still marked and skipped, so the default suite (``pytest``) only
ever reports these as skips on a machine without CUDA.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent

NO_CUDA_REASON = "needs a CUDA GPU (torch.cuda.is_available() is False)"


def cuda_skip_reason() -> str | None:
    """Why the CUDA tier cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        return NO_CUDA_REASON
    return None


@pytest.hookimpl(tryfirst=True)  # before ``-m cuda`` selects: an unmarked test here still counts
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = cuda_skip_reason()
    for item in items:
        if HERE not in Path(item.path).parents:
            continue
        if item.get_closest_marker("cuda") is None:
            item.add_marker(pytest.mark.cuda)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _cuda_state_restored() -> Iterator[None]:
    """Every test starts with full-fp32 matmuls, no sync debugging, and leaves them so."""
    if not torch.cuda.is_available():
        yield
        return
    before = (
        torch.get_float32_matmul_precision(),
        torch.backends.cudnn.allow_tf32,
        torch.cuda.get_sync_debug_mode(),
    )
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before[2])
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]
        torch.cuda.synchronize()


@pytest.fixture(autouse=True)
def _same_cudnn_algorithms() -> Iterator[None]:
    """cuDNN picks a convolution algorithm per call unless told to be deterministic; two
    calls on the same fp32 inputs (the oracle and the tested path) must run the same one
    for a bitwise comparison (conv_transpose3d once differed in its last bits)."""
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved

"""Test-wide settings."""

import torch

# The test models are tiny: one intra-op thread is fastest for them, and it keeps the
# suite's run time steady when the machine is busy (OpenMP threads spin-wait badly
# when oversubscribed).
torch.set_num_threads(1)

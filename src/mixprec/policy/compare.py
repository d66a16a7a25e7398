"""The pinned tables against the installed PyTorch: which ops each side autocasts.

This compares op membership only, read from the dispatcher; the classes of the running
torch come from running the ops (:func:`mixprec.policy.torch_table`).

>>> from mixprec.policy import compare_with_torch
>>> diff = compare_with_torch("cpu")
>>> diff is None or diff.device_type == "cpu"
True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.policy.tables import TABLES_TORCH_VERSION, check_device_type, pinned_table

__all__ = ["TableDiff", "compare_with_torch", "torch_autocast_ops"]


def torch_autocast_ops(device_type: str) -> frozenset[str] | None:
    """Op names the installed PyTorch gives an autocast kernel on ``device_type``.

    Read from the dispatcher (overloads folded); None when this PyTorch does not
    expose its registrations. A name torch does not know as a device type is a ValueError.
    """
    try:
        key = "Autocast" + torch._C._dispatch_key_for_device(check_device_type(device_type))
    except RuntimeError:
        raise ValueError(
            f"device_type={device_type!r} is not a device type torch knows; pass e.g. 'cpu' or 'cuda'"
        ) from None
    try:
        registered = torch._C._dispatch_get_registrations_for_dispatch_key(key)
    except (AttributeError, RuntimeError):
        return None
    return frozenset(
        name.partition("::")[2].partition(".")[0]
        for name in registered
        if name.startswith("aten::")
    )


@dataclass(frozen=True)
class TableDiff:
    """Ops in mixprec's pinned table but not autocast by the installed torch, and vice versa."""

    device_type: str
    torch_version: str
    only_in_mixprec: frozenset[str]
    only_in_torch: frozenset[str]

    @property
    def empty(self) -> bool:
        return not self.only_in_mixprec and not self.only_in_torch

    def __str__(self) -> str:
        if self.empty:
            return (
                f"{self.device_type}: mixprec's tables (torch {TABLES_TORCH_VERSION}) match "
                f"torch {self.torch_version}"
            )
        return "\n".join([
            f"{self.device_type}: mixprec's tables (torch {TABLES_TORCH_VERSION}) differ from "
            f"torch {self.torch_version}",
            "  only in mixprec: " + (", ".join(sorted(self.only_in_mixprec)) or "-"),
            "  only in torch:   " + (", ".join(sorted(self.only_in_torch)) or "-"),
        ])  # fmt: skip


def compare_with_torch(device_type: str) -> TableDiff | None:
    """Which ops differ between the pinned table and the installed torch's autocast kernels.

    This compares op membership (the dispatcher does not say which class an op is
    in; :func:`mixprec.policy.table_changes` has the classes, found by running the
    ops). None when the registrations cannot be read.

    >>> from mixprec.policy import compare_with_torch
    >>> diff = compare_with_torch("cpu")
    >>> diff is None or isinstance(str(diff), str)
    True
    """
    pinned = pinned_table(device_type, torch.bfloat16).ops  # refuses a device type without tables
    registered = torch_autocast_ops(device_type)
    if registered is None:
        return None
    return TableDiff(
        device_type=device_type,
        torch_version=torch.__version__,
        only_in_mixprec=pinned - registered,
        only_in_torch=registered - pinned,
    )

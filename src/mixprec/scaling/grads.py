"""An optimizer's gradients as the loss scalers see them: iterated, unscaled and checked in place.

>>> import torch
>>> from mixprec.scaling.grads import unscale_and_check
>>> w = torch.nn.Parameter(torch.ones(2))
>>> w.grad = torch.tensor([8.0, float("inf")])
>>> opt = torch.optim.SGD([w], lr=0.1)
>>> unscale_and_check(opt, torch.tensor(0.125), torch.device("cpu")), w.grad
(tensor(1.), tensor([1., inf]))
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch

from mixprec.nested import by_device_dtype, shard_local

__all__ = ["grad_tensors", "unscale_and_check"]

_IS_SPARSE = operator.attrgetter("is_sparse")


def grad_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The gradient values of every parameter of ``optimizer`` (sparse ones coalesced if low precision)."""
    grads = [g for group in optimizer.param_groups for p in group["params"] if (g := p.grad) is not None]
    if not any(map(_IS_SPARSE, grads)):  # the common case, without a Python step per gradient
        return grads
    return list(_with_sparse(optimizer))


def _with_sparse(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                # Duplicate indices are summed by coalesce(); in fp16 that sum can overflow
                # although every stored value is finite, so check the coalesced values.
                if grad.dtype in (torch.float16, torch.bfloat16) and not grad.is_coalesced():
                    grad = grad.coalesce()
                    param.grad = grad
                yield grad._values()
            else:
                yield grad


def unscale_and_check(
    optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """Multiply every gradient of ``optimizer`` by ``inv_scale`` in place; return a 0/1 found-inf flag.

    One foreach kernel per (device, dtype) group; the flag (fp32, 0-dim) lives on ``device``.
    This rank only: the caller all-reduces the flag where ranks must agree.
    """
    with torch.no_grad():
        # FSDP2 shards as this rank's local tensors: the check is per rank (the caller all-reduces)
        groups = by_device_dtype([shard_local(g) for g in grad_tensors(optimizer)])
        per_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        for (grad_device, dtype), grads in groups.items():
            if dtype.is_complex:  # unscaled and checked as their real and imaginary parts
                grads = [torch.view_as_real(g) for g in grads]
            if grad_device not in per_device:
                per_device[grad_device] = (
                    torch.zeros((), dtype=torch.float32, device=grad_device),
                    inv_scale.to(grad_device),
                )
            dev_found, dev_inv = per_device[grad_device]
            torch._amp_foreach_non_finite_check_and_unscale_(grads, dev_found, dev_inv)
        if len(per_device) == 1 and device in per_device:
            return per_device[device][0]
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        for dev_found, _ in per_device.values():
            found_inf = torch.maximum(found_inf, dev_found.to(found_inf.device))
    return found_inf

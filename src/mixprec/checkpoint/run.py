"""What a checkpoint's save and load both read of the run: the user's module inside its
wrappers (:func:`unwrap_model`), the RNG states, and the process group a sharded (FSDP2)
checkpoint is saved or loaded over."""

from __future__ import annotations

import sys
from typing import Any

import torch

from mixprec.session import MixedPrecision

__all__ = ["group_of", "rng_state", "set_rng_state", "unwrap_model"]


def _wrapper_types() -> tuple[type[torch.nn.Module], ...]:
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    types: list[type[torch.nn.Module]] = [DistributedDataParallel, DataParallel]
    if "torch._dynamo" not in sys.modules:  # nothing was compiled (and the compiler may not import here)
        return tuple(types)
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover - torch without dynamo
        pass
    else:
        types.append(OptimizedModule)
    return tuple(types)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside ``torch.compile`` / DistributedDataParallel / DataParallel wrappers.

    Only those wrapper types are unwrapped: a user module that happens to have a
    ``module`` attribute is the model itself. (FSDP models are not unwrapped: their
    ``state_dict()`` is the one to save.)
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    wrappers = _wrapper_types()
    while isinstance(model, wrappers):
        inner = model._orig_mod if hasattr(model, "_orig_mod") else model.module
        if not isinstance(inner, torch.nn.Module):  # pragma: no cover - defensive
            break
        model = inner
    return model


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def group_of(path: str, mp: MixedPrecision | None, what: str) -> Any:
    """The process group a sharded checkpoint is saved or loaded over: the session's, else the default."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"cannot {what} checkpoint {path!r}: the model holds FSDP2 shards but no process group is "
                         "initialised; call it on every rank after init_process_group")
    group = getattr(mp, "process_group", None)
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        raise ValueError(
            f"cannot {what} checkpoint {path!r} over the session's process group of {dist.get_world_size(group)} of "
            f"{dist.get_world_size()} ranks: a sharded checkpoint's parts are named and switched in by every rank "
            "of the world. Save with a MixedPrecision whose process_group spans all ranks (the default)"
        )
    return group if group is not None else dist.group.WORLD

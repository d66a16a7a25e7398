"""Checkpoints of FSDP2-sharded training: one file per rank, switched in together.

:func:`~mixprec.save_checkpoint` and :func:`~mixprec.load_checkpoint` take an FSDP2 model
(``fully_shard``, DTensor parameters) as they take any other, called on every rank with
the same ``path``:

- each rank writes its own part (its shards of the weights, of the optimizer state, the
  masters or Kahan compensation, its rounding noise and RNG state) to
  ``<path>.shards/<save id>/rank<r>-of-<world>.pt``, as a whole checkpoint of its own
  (checked, fsynced, read back, checksummed);
- only once every rank has written its part does rank 0 replace ``<path>`` itself, a small
  file naming the save id and the world size, and remove the parts of earlier saves. A save
  that fails or is interrupted on any rank leaves ``<path>`` naming the previous save, whose
  parts are untouched;
- a load reads ``<path>``, then this rank's part, and checks that every rank's part belongs
  to that save and is sharded as the model is now. The resumed run continues bit for bit.
  A run on another number of ranks is refused, naming both (gather the weights with
  ``full_tensor()`` and re-shard them in a new run instead).

``path`` must be on a filesystem every rank sees (as for ``torch.distributed.checkpoint``).
DTensors are stored as their local tensors with the list of places where they were;
the load makes them DTensors again, sharded like the model's parameters.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from mixprec.optim.shards import is_dtensor, local_of, wrap_like

__all__ = ["PeerFailed", "agree", "check_world", "is_sharded", "localize", "part_path", "restore_dtensors", "save_id",
           "shards_folder"]

Path = tuple[Any, ...]


def is_sharded(module: torch.nn.Module) -> bool:
    """True when ``module`` holds DTensor parameters (FSDP2)."""
    return any(is_dtensor(p) for p in module.parameters())


def shards_folder(path: str) -> str:
    return f"{path}.shards"


def part_path(path: str, save: str, rank: int, world: int) -> str:
    """Where rank ``rank`` of ``world`` keeps its part of save ``save`` of checkpoint ``path``."""
    return os.path.join(shards_folder(path), save, f"rank{rank:05d}-of-{world:05d}.pt")


def save_id(group: Any) -> str:
    """A new id for one save, the same on every rank of ``group`` (its first rank draws it)."""
    box = [uuid.uuid4().hex if dist.get_rank(group) == 0 else None]
    src = dist.get_global_rank(group, 0) if group is not None and group is not dist.group.WORLD else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return str(box[0])


def localize(obj: Any, found: list[list[Any]], path: Path = ()) -> Any:
    """``obj`` with every DTensor replaced by its local tensor; their paths appended to ``found``."""
    if is_dtensor(obj):
        found.append(list(path))
        return local_of(obj)
    if isinstance(obj, dict):
        return {k: localize(v, found, (*path, k)) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        out = [localize(v, found, (*path, i)) for i, v in enumerate(obj)]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def _get(obj: Any, path: Sequence[Any]) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def _set(obj: Any, path: Sequence[Any], value: Any) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


def _param_index(path: Sequence[Any]) -> int | None:
    """The parameter index in an optimizer state_dict path: its last int (``state/3/exp_avg``,
    ``<wrapper>/compensation/3``, ``param_groups/0/<wrapper>/compensation/3``)."""
    ints = [k for k in path if isinstance(k, int) and not isinstance(k, bool)]
    return ints[-1] if ints else None


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def restore_dtensors(path: str, payload: dict[str, Any], module: torch.nn.Module,
                     optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Make the DTensors :func:`localize` stored local DTensors again, in place: model entries
    like the model's own state, optimizer entries like the parameter they belong to. A part
    sharded otherwise than the model is now is refused (ValueError naming the entry)."""
    places = payload["sharded"]["dtensors"]
    current = module.state_dict()
    for key_path in places["model"]:
        key = key_path[0]
        like = current.get(key)
        local = _get(payload["model"], key_path)
        if like is None or not is_dtensor(like):
            raise ValueError(f"checkpoint {path!r}: {key!r} was sharded when saved but is not sharded in this model")
        if local_of(like).shape != local.shape:
            raise ValueError(
                f"checkpoint {path!r}: this rank's shard of {key!r} has shape {tuple(local.shape)} in the checkpoint but "
                f"{tuple(local_of(like).shape)} in this model: it was sharded otherwise (another mesh or placement)"
            )
        _set(payload["model"], key_path, wrap_like(local, like))
    for i, (opt, opt_places) in enumerate(zip(optimizers, places["optimizers"], strict=True)):
        params = _params(opt)
        for entry in opt_places:
            index = _param_index(entry)
            local = _get(payload["optimizers"][i], entry)
            if index is None or index >= len(params) or not is_dtensor(params[index]):
                raise ValueError(f"checkpoint {path!r}: optimizer {i}'s {'/'.join(map(str, entry))} was sharded when "
                                 "saved, but its parameter is not sharded in this run")
            param = params[index]
            if local.shape != local_of(param).shape:
                raise ValueError(
                    f"checkpoint {path!r}: optimizer {i}'s {'/'.join(map(str, entry))} has shape {tuple(local.shape)} on "
                    f"this rank, its parameter's shard {tuple(local_of(param).shape)}: it was sharded otherwise"
                )
            _set(payload["optimizers"][i], entry, wrap_like(local, param))


def check_world(path: str, pointer: dict[str, Any], group: Any) -> tuple[int, int]:
    """(rank, world) of this run in ``group``, refused where the checkpoint was saved by another world size."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    saved = int(pointer["world"])
    if saved != world:
        raise ValueError(
            f"checkpoint {path!r} was saved by {saved} ranks and this run has {world}: each rank's part holds its "
            f"shards. Resume with {saved} ranks, or gather the weights (DTensor.full_tensor()) in a run of {saved} "
            "and start the new run from them"
        )
    return rank, world


class PeerFailed(RuntimeError):
    """Another rank failed the save or load this rank was taking part in (its own error says why)."""


def _flag_device(group: Any) -> torch.device:
    """Where a flag for a collective over ``group`` lives: NCCL takes CUDA tensors only."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(ok: bool, what: str, group: Any) -> None:
    """One decision for every rank of ``group``: raises :class:`PeerFailed` on a rank that
    succeeded when another did not (the failing rank raises its own error)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=_flag_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if ok and not bool(flag.item()):
        raise PeerFailed(f"{what} failed on another rank (see its error); nothing was changed here either")


def remove_old_saves(path: str, keep: str) -> None:
    """Remove the parts of every save of ``path`` but ``keep``."""
    folder = shards_folder(path)
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            if name != keep:
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)

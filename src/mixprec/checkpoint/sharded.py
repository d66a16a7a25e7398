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
- a run on another number of ranks (or another mesh) reads every part: each part records how
  its tensors were split (global shape, mesh shape, this rank's coordinate, placements), so
  every sharded entry (weights, optimizer state, Kahan compensation) is put together from the
  parts holding its shards, one replica's under HSDP, and cut as this run shards its
  parameter: exactly the saved state. Every rank reads every part, so while it loads each rank
  holds the whole saved state in host memory (a node of 8 ranks: 8 copies). Per-rank state
  follows the new ranks: rank ``r`` keeps the RNG state of the saved rank ``r`` (none where
  there was none), stochastic rounding the noise of shard ``r`` (re-seeded where there was
  none). The run goes on from the same state, not bit for bit as on the old number of ranks
  (the batch is split otherwise). Shards over two mesh dimensions of one tensor dimension, or
  placements other than Shard/Replicate, are refused.

``path`` must be on a filesystem every rank sees (as for ``torch.distributed.checkpoint``).
DTensors are stored as their local tensors with the list of places where they were;
the load makes them DTensors again, sharded like the model's parameters.
"""

from __future__ import annotations

import math
import os
import shutil
import uuid
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from mixprec.checkpoint.convert import MASTER_KEY
from mixprec.optim.checks import MASTER_INDEX_KEY
from mixprec.optim.shards import is_dtensor, local_of, wrap_like

__all__ = ["PeerFailed", "agree", "check_world", "is_sharded", "layout_of", "localize", "part_path", "reshard",
           "restore_dtensors", "save_id", "shards_folder", "split_as_saved"]

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


def localize(obj: Any, found: list[list[Any]], path: Path = (), layouts: list[dict[str, Any]] | None = None) -> Any:
    """``obj`` with every DTensor replaced by its local tensor; their paths appended to ``found``
    and, with ``layouts``, how each was sharded (:func:`layout_of`) appended to it."""
    if is_dtensor(obj):
        found.append(list(path))
        if layouts is not None:
            layouts.append(layout_of(obj))
        return local_of(obj)
    if isinstance(obj, dict):
        return {k: localize(v, found, (*path, k), layouts) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        out = [localize(v, found, (*path, i), layouts) for i, v in enumerate(obj)]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def layout_of(t: Any) -> dict[str, Any]:
    """How DTensor ``t`` is split, in plain values a checkpoint keeps: its global shape, its mesh's
    shape, this rank's coordinate in the mesh, and one placement per mesh dimension (``["S", dim]``
    for a shard of tensor dimension ``dim``, ``["R"]`` for a replica, ``["?", text]`` otherwise)."""
    placements: list[list[Any]] = []
    for placement in t.placements:
        if placement.is_shard():
            placements.append(["S", int(placement.dim)])
        elif placement.is_replicate():
            placements.append(["R"])
        else:
            placements.append(["?", str(placement)])
    mesh = t.device_mesh
    return {"shape": [int(n) for n in t.shape], "mesh": [int(n) for n in mesh.shape],
            "coordinate": [int(c) for c in (mesh.get_coordinate() or [])], "placements": placements}


def _extent(layout: dict[str, Any]) -> list[tuple[int, int]] | str:
    """(offset, length) per tensor dimension of the shard ``layout`` describes, as DTensor's
    ``Shard`` splits (``torch.chunk``: equal chunks rounded up, the last ones shorter or empty);
    or why it cannot be told."""
    extent = [(0, int(n)) for n in layout["shape"]]
    sharded_dims: set[int] = set()
    if len(layout["coordinate"]) != len(layout["mesh"]) or len(layout["placements"]) != len(layout["mesh"]):
        return "this rank was not in the mesh"
    for size, coord, placement in zip(layout["mesh"], layout["coordinate"], layout["placements"], strict=True):
        if placement[0] == "R":
            continue
        if placement[0] != "S":
            return f"placement {placement[1]}"
        dim = int(placement[1])
        if not 0 <= dim < len(extent):
            return f"a shard of dimension {dim} of a {len(extent)}-dimensional tensor"
        if dim in sharded_dims:
            return f"tensor dimension {dim} sharded over more than one mesh dimension"
        sharded_dims.add(dim)
        start, length = extent[dim]
        chunk = -(-length // size) if length else 0
        begin = min(coord * chunk, length)
        extent[dim] = (start + begin, max(0, min(chunk, length - begin)))
    return extent


def _lengths(extent: list[tuple[int, int]]) -> tuple[int, ...]:
    return tuple(length for _, length in extent)


def _slices(extent: list[tuple[int, int]]) -> tuple[slice, ...]:
    return tuple(slice(begin, begin + length) for begin, length in extent)


def _get(obj: Any, path: Sequence[Any]) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def _set(obj: Any, path: Sequence[Any], value: Any) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


def _param_index(path: Sequence[Any], state: Any = None) -> int | None:
    """The parameter index in an optimizer state_dict path: its last int (``state/3/exp_avg``,
    ``<wrapper>/compensation/3``, ``param_groups/0/<wrapper>/compensation/3``). The masters of a
    master-weight optimizer (``mixprec_master_weights/k``) are listed per master, not per
    parameter: the k-th master belongs to the parameter at the k-th of the positions the
    ``state`` dict records (``mixprec_master_index``; a tensor-parallel model keeps plain fp32
    parameters without a master between its DTensors)."""
    ints = [k for k in path if isinstance(k, int) and not isinstance(k, bool)]
    if not ints:
        return None
    if len(path) == 2 and path[0] == MASTER_KEY and isinstance(state, dict):
        positions = state.get(MASTER_INDEX_KEY)
        if isinstance(positions, list) and 0 <= ints[-1] < len(positions):
            return int(positions[ints[-1]])
    return ints[-1]


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
            index = _param_index(entry, payload["optimizers"][i])
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


def _is_replica(layout: dict[str, Any]) -> bool:
    """True where ``layout``'s rank holds a copy of a shard another rank with coordinate 0 on the
    replicated mesh dimensions also holds (HSDP's other replicas)."""
    return any(p[0] == "R" and c for p, c in zip(layout["placements"], layout["coordinate"], strict=False))


def reshard(path: str, parts: Sequence[dict[str, Any]], module: torch.nn.Module,
            optimizers: Sequence[torch.optim.Optimizer], rank: int) -> dict[str, Any]:
    """This rank's payload of a save made by ``len(parts)`` ranks (``parts``, in rank order, as
    :func:`localize` left them), for the model as it is sharded now: every DTensor entry is put
    together from the parts that hold its shards and cut as this rank's shard of the model's
    parameter is. What is not sharded comes from this rank's own part where there was one,
    else from rank 0's; the RNG state of a rank that did not save is left out. Refused
    (ValueError naming the entry and the fix) where a part does not record how it was split."""
    saved = len(parts)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    refuse = ((f"Resume with {saved} ranks" if world != saved else "Resume with the mesh and placements it was saved "
               "with") + ", or gather the weights (DTensor.full_tensor()) in a run like the one that saved it and "
              "start the new run from them")
    layouts = [part["sharded"].get("layouts") for part in parts]
    if any(not isinstance(layout, dict) for layout in layouts):
        raise ValueError(f"checkpoint {path!r} was saved by {saved} ranks and this run has a different number; its "
                         f"parts do not record how their tensors were split (an older save). {refuse}")
    places = [part["sharded"]["dtensors"] for part in parts]
    if any(p != places[0] for p in places):
        raise ValueError(f"checkpoint {path!r}: its parts hold different sharded entries, so they cannot be put "
                         f"together. {refuse}")
    # in place: each entry is read from every part before this part's entry is replaced
    payload = parts[rank] if rank < saved else parts[0]
    if rank >= saved:
        payload.pop("rng", None)

    def whole(section: str, index: int | None, n: int, entry: Sequence[Any]) -> torch.Tensor:
        pieces = []
        for k, part in enumerate(parts):
            layout = layouts[k][section][n] if index is None else layouts[k][section][index][n]
            if _is_replica(layout):
                continue
            extent = _extent(layout)
            obj = part[section] if index is None else part[section][index]
            local = _get(obj, entry)
            if local.numel() == 0 and math.prod(layout["shape"]) == 0:
                pieces.append(([(0, 0)] * local.dim(), local))
                continue
            if isinstance(extent, str) or _lengths(extent) != tuple(local.shape):
                why = extent if isinstance(extent, str) else \
                    f"shape {tuple(local.shape)} where its split gives {_lengths(extent)}"
                raise ValueError(f"checkpoint {path!r}: rank {k}'s shard of {'/'.join(map(str, entry))} cannot be "
                                 f"placed ({why}). {refuse}")
            pieces.append((extent, local))
        shape = layouts[0][section][n]["shape"] if index is None else layouts[0][section][index][n]["shape"]
        if pieces and math.prod(shape) == 0:  # (FSDP2 gives an empty tensor's shards its own shape)
            return pieces[0][1].new_empty(shape)
        if not pieces or sum(local.numel() for _, local in pieces) != math.prod(shape):
            raise ValueError(f"checkpoint {path!r}: the shards of {'/'.join(map(str, entry))} do not cover its shape "
                             f"{tuple(shape)} once. {refuse}")
        out = torch.empty(shape, dtype=pieces[0][1].dtype, device=pieces[0][1].device)
        for extent, local in pieces:
            out[_slices(extent)] = local
        return out

    def mine(full: torch.Tensor, like: torch.Tensor, what: str) -> torch.Tensor:
        if tuple(full.shape) != tuple(like.shape):
            raise ValueError(f"checkpoint {path!r}: {what} has shape {tuple(full.shape)} in the checkpoint but "
                             f"{tuple(like.shape)} in this model")
        extent = _extent(layout_of(like))
        local_shape = tuple(local_of(like).shape)
        if full.numel() == 0:
            return wrap_like(full.new_empty(local_shape), like)
        if isinstance(extent, str) or _lengths(extent) != local_shape:
            raise ValueError(f"checkpoint {path!r}: {what} is sharded in this run in a way it cannot be cut for "
                             f"({extent if isinstance(extent, str) else local_shape}). {refuse}")
        local = full[_slices(extent)].clone()
        return wrap_like(local, like)

    current = module.state_dict()
    model = payload["model"]
    for n, key_path in enumerate(places[0]["model"]):
        like = current.get(key_path[0])
        if like is None or not is_dtensor(like):
            raise ValueError(f"checkpoint {path!r}: {key_path[0]!r} was sharded when saved but is not sharded in this model")
        _set(model, key_path, mine(whole("model", None, n, key_path), like, repr(key_path[0])))
    for i, (opt, opt_places) in enumerate(zip(optimizers, places[0]["optimizers"], strict=True)):
        params = _params(opt)
        state = payload["optimizers"][i]
        for n, entry in enumerate(opt_places):
            index = _param_index(entry, payload["optimizers"][i])
            what = f"optimizer {i}'s {'/'.join(map(str, entry))}"
            if index is None or index >= len(params) or not is_dtensor(params[index]):
                raise ValueError(f"checkpoint {path!r}: {what} was sharded when saved, but its parameter is not "
                                 "sharded in this run")
            _set(state, entry, mine(whole("optimizers", i, n, entry), params[index], what))
        for index, entries in (state.get("state") or {}).items():
            sharded_param = isinstance(index, int) and index < len(params) and is_dtensor(params[index])
            for name, value in entries.items() if isinstance(entries, dict) and sharded_param else ():
                if isinstance(value, torch.Tensor) and value.numel() > 1 and [*("state", index, name)] not in opt_places:
                    raise ValueError(f"checkpoint {path!r}: optimizer {i}'s state/{index}/{name} is a plain tensor "
                                     f"of one rank's shard, which cannot be put together. {refuse}")
    return payload


def split_as_saved(payload: dict[str, Any], module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    """False where ``payload`` (one rank's part) records that a sharded entry was split otherwise
    than the model's tensor it belongs to is now (another mesh or placement on as many ranks);
    True where it matches, or where the part records nothing (:func:`restore_dtensors` checks those)."""
    layouts = payload["sharded"].get("layouts")
    if not isinstance(layouts, dict):
        return True
    places = payload["sharded"]["dtensors"]
    current = module.state_dict()

    def differs(saved: dict[str, Any], like: Any) -> bool:
        return is_dtensor(like) and any(saved[k] != v for k, v in layout_of(like).items() if k != "shape")

    for key_path, saved in zip(places["model"], layouts["model"], strict=True):
        if differs(saved, current.get(key_path[0])):
            return False
    for i, (opt, opt_places, opt_layouts) in enumerate(
            zip(optimizers, places["optimizers"], layouts["optimizers"], strict=True)):
        params = _params(opt)
        for entry, saved in zip(opt_places, opt_layouts, strict=True):
            index = _param_index(entry, payload["optimizers"][i])
            if index is not None and index < len(params) and differs(saved, params[index]):
                return False
    return True


def check_world(path: str, pointer: dict[str, Any], group: Any) -> tuple[int, int, int]:
    """(rank, world) of this run in ``group`` and the number of ranks that saved the checkpoint."""
    return dist.get_rank(group), dist.get_world_size(group), int(pointer["world"])


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

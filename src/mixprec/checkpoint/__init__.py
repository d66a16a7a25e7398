"""Save and load a whole training state atomically.

A checkpoint holds the model, every optimizer (with fp32 masters / compensation
buffers), the :class:`~mixprec.MixedPrecision` state (scaler counters, plan
fingerprint, scheduler) and the RNG states.

Saving only ever replaces a good checkpoint with one that loads:

- everything is checked to be loadable with ``weights_only=True`` first (a numpy
  scalar, a ``pathlib.Path`` or a ``datetime`` in ``extra`` raises ``TypeError``
  naming its key path; nothing is converted silently);
- the state is written to a temporary file in the same folder, fsynced, loaded
  back with ``weights_only=True``, and only then renamed over the target; a
  failed or interrupted save (a full disk, a kill) never destroys the previous
  checkpoint.
- Temporary files are named ``.<target>.<host>.<pid>.<random>.mixprec-tmp``. A
  save removes the temporary files of the *same target* left by processes that
  no longer run on this host (a killed save); files of live processes and of
  other hosts are left alone (other hosts' files only once they are a day old).
  Liveness is ``kill(pid, 0)`` on this host: a reused pid keeps a stale file a while
  longer (harmless); two containers with one hostname and separate pid namespaces
  that save to the same path at the same time could remove each other's temp file,
  which makes that save fail with an error, never corrupts the checkpoint.
- The checkpoint's permissions follow the umask, or those of the file it
  replaces.

Loading is all-or-nothing: every part (model keys and shapes, optimizer classes, groups
and hyper-parameters, MixedPrecision state, RNG state) is checked before anything
changes, and if applying still fails, what was already applied is restored.

- A CRC-32 of each part, stored beside it by the save, is checked first: a bit that
  changed on disk or in a copy is a ``ValueError`` naming the part (see
  :mod:`mixprec.checkpoint.integrity`), never different numbers. Checkpoints written
  before checksums existed load as before.
- The class of each optimizer is recorded (``"torch.optim.AdamW"``); a checkpoint of
  another class (Adam into AdamW, SGD into AdamW) is refused, as is an optimizer state
  whose parameter groups lack a hyper-parameter this optimizer's step reads.
- Master weights are never dropped: with ``allow_plan_change=True``, the fp32 masters of a
  ``*-master`` checkpoint (remainders included, or weight + compensation of a ``bf16-kahan``
  one) become the weights of a plan with fp32 weights and no masters (``bf16-mixed``,
  ``fp8-mixed``, ``fp32``) exactly, or the masters of another master form (fp32 masters,
  remainders), with one ``UserWarning`` saying so; a plan that could keep them only
  rounded (``bf16-pure``, ``bf16-sr``; ``bf16-kahan`` for masters) is refused with why.
- The MixedPrecision state is never dropped: a checkpoint saved with ``mp=`` is refused
  without it, unless ``allow_plan_change=True`` (a plain loop on purpose).

>>> import tempfile, os, torch
>>> from mixprec import MixedPrecision, save_checkpoint, load_checkpoint
>>> model = torch.nn.Linear(4, 4)
>>> mp = MixedPrecision("bf16-master")
>>> model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters()))
>>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
>>> save_checkpoint(path, model=model, optimizers=[opt], mp=mp, extra={"epoch": 3})
>>> load_checkpoint(path, model=model, optimizers=[opt], mp=mp)["epoch"]
3
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mixprec.checkpoint import files, sharded
from mixprec.checkpoint.checks import optimizer_class
from mixprec.checkpoint.files import FORMAT, stale_temp_files
from mixprec.checkpoint.integrity import checksums
from mixprec.checkpoint.loading import load_checkpoint
from mixprec.checkpoint.run import group_of, rng_state, unwrap_model
from mixprec.session import MixedPrecision

__all__ = ["load_checkpoint", "save_checkpoint", "stale_temp_files", "unwrap_model"]


# ------------------------------------------------------------------- saving
def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    mp: MixedPrecision | None = None,
    extra: Mapping[str, Any] | None = None,
    rng: bool = True,
) -> None:
    """Write the training state to ``path`` atomically.

    Checks that everything loads with ``weights_only=True`` (``TypeError`` naming the
    key path otherwise), writes a temporary file beside ``path``, fsyncs it, loads it
    back, then renames it over ``path``. A failure at any point (``OSError`` for a full
    disk) leaves the previous checkpoint as it was. Stale temporary files of earlier,
    killed saves to the same path are removed.

    Beside the state it records each optimizer's class and a CRC-32 checksum of every
    part, which :func:`load_checkpoint` verifies (hashing runs at several GB/s: a small
    fraction of the time the write takes).
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"path must be a text path, got {type(path).__name__}")
    if not path or path.endswith(os.sep) or os.path.isdir(path):
        raise ValueError(f"path must name a checkpoint file, got {path!r} (a folder)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(optimizers, torch.optim.Optimizer) or not isinstance(optimizers, Sequence):
        raise TypeError(f"optimizers must be a list of optimizers, got {type(optimizers).__name__}")
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizers[{i}] must be a torch optimizer, got {type(opt).__name__}")
    if mp is not None and not isinstance(mp, MixedPrecision):
        raise TypeError(f"mp must be a mixprec.MixedPrecision or None, got {type(mp).__name__}")
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")

    def build() -> dict[str, Any]:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"cannot save checkpoint {path!r}: folder {folder!r} does not exist; create it first")
        # The session first: after an interrupted backward under optimizer-in-backward, its
        # state_dict() undoes the half-applied updates, so the weights saved next are whole.
        mixed = None if mp is None else mp.state_dict()
        payload: dict[str, Any] = {
            "format": FORMAT,
            "model": unwrap_model(model).state_dict(),
            "optimizers": [opt.state_dict() for opt in optimizers],
            "optimizer_classes": [optimizer_class(opt) for opt in optimizers],
            "mixed_precision": mixed,
            "extra": dict(extra) if extra is not None else {},
        }
        if rng:
            payload["rng"] = rng_state()
        return payload

    if sharded.is_sharded(unwrap_model(model)):
        _save_parts(path, build, group_of(path, mp, "save"))
        return
    _write(path, build())


def _save_parts(path: str, build: Any, group: Any) -> None:
    """An FSDP2 run's checkpoint: each rank's part, then ``path`` naming them (:mod:`mixprec.checkpoint.sharded`).
    Every rank takes part in every collective, whatever fails where: one decision for all."""
    import torch.distributed as dist

    error: BaseException | None = None
    payload: dict[str, Any] = {}
    try:
        payload = build()
        places: dict[str, Any] = {"model": [], "optimizers": []}
        layouts: dict[str, Any] = {"model": [], "optimizers": []}
        payload["model"] = sharded.localize(payload["model"], places["model"], layouts=layouts["model"])
        local_opts = []
        for state in payload["optimizers"]:
            found: list[list[Any]] = []
            split: list[dict[str, Any]] = []
            local_opts.append(sharded.localize(state, found, layouts=split))
            places["optimizers"].append(found)
            layouts["optimizers"].append(split)
        payload["optimizers"] = local_opts
        payload["sharded"] = {"dtensors": places, "layouts": layouts}
    except BaseException as exc:  # every rank learns of it before anyone switches to this save
        error = exc
    save, rank, world = sharded.save_id(group), dist.get_rank(group), dist.get_world_size(group)
    if error is None:
        payload["sharded"].update(save=save, rank=rank, world=world)
        part = sharded.part_path(path, save, rank, world)
        try:
            os.makedirs(os.path.dirname(part), exist_ok=True)
            _write(part, payload)
        except BaseException as exc:
            error = exc
    sharded.agree(error is None, f"saving checkpoint {path!r}", group)
    if error is not None:
        raise error
    late: BaseException | None = None
    if rank == 0:  # every part is written: switch to this save, then drop the earlier ones
        try:
            _write(path, {"format": FORMAT, "sharded": {"save": save, "world": world}})
        except BaseException as exc:
            error = exc
        else:
            try:  # what it cannot remove stays: the switch stands
                sharded.remove_old_saves(path, save)
            except BaseException as exc:  # (an interrupt: raised after the others heard the decision)
                late = exc
    sharded.agree(error is None, f"switching checkpoint {path!r} to the new save", group)
    if error is not None:
        raise error
    if late is not None and not isinstance(late, Exception):
        raise late


def _write(path: str, payload: dict[str, Any]) -> None:
    """Check, write, fsync, read back and rename ``payload`` over ``path``: all or nothing."""
    folder = os.path.dirname(os.path.abspath(path))
    safe = files.safe_global_types()
    for key, value in payload.items():
        files.check_loadable(value, key, safe)
    payload["checksum"] = checksums(payload)

    files.remove_stale_temp_files(path)
    try:
        mode: int | None = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = None
    tmp = os.path.join(folder, files.temp_name(path))
    try:
        try:
            with files.open_temp(tmp, mode) as f:
                writer = files.RecordingWriter(f)
                try:
                    torch.save(payload, writer)  # type: ignore[arg-type]
                except RuntimeError as exc:  # torch reports a failed write as its own RuntimeError
                    raise (writer.error or exc) from exc
                f.flush()
                os.fsync(f.fileno())
        except (OSError, RuntimeError) as exc:
            raise files.write_error(path, exc) from exc
        files.verify(tmp, path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

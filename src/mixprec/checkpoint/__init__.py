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
import copy
import os
import stat
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from mixprec.checkpoint import files, sharded
from mixprec.checkpoint.checks import (
    check_model,
    check_mp,
    check_optimizer,
    check_rng,
    optimizer_class,
)
from mixprec.checkpoint.convert import ROUNDING_KEY, carry_between_plans, fp32_weights
from mixprec.checkpoint.files import FORMAT, stale_temp_files
from mixprec.checkpoint.integrity import checksums, verify_checksums
from mixprec.optim.checks import lift_wrapper_state
from mixprec.session import MixedPrecision

__all__ = ["load_checkpoint", "save_checkpoint", "stale_temp_files", "unwrap_model"]


# ------------------------------------------------------------------ wrappers
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


# -------------------------------------------------------------- RNG helpers
def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
            payload["rng"] = _rng_state()
        return payload

    if sharded.is_sharded(unwrap_model(model)):
        _save_parts(path, build, _group_of(path, mp, "save"))
        return
    _write(path, build())


def _group_of(path: str, mp: MixedPrecision | None, what: str) -> Any:
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


def _snapshot(obj: Any) -> Any:
    """A deep copy with cloned tensors (state to restore if applying fails)."""
    return copy.deepcopy(obj)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    mp: MixedPrecision | None = None,
    allow_plan_change: bool = False,
    rng: bool = True,
) -> dict[str, Any]:
    """Load what :func:`save_checkpoint` wrote: model, optimizers, RNG, then MixedPrecision.

    All-or-nothing: every part is checked before anything changes (``ValueError``
    naming the path and what does not match; ``OSError`` if the file cannot be read),
    and if applying a part still fails, every part is restored.
    Returns the ``extra`` dict that was saved.

    Refused before anything changes: a file whose checksums do not match what the save
    stored (a flipped bit); an optimizer of another class than the one saved, or whose
    saved parameter groups lack a hyper-parameter this one needs (``betas`` for AdamW,
    ``momentum`` for SGD); a checkpoint of another plan unless ``allow_plan_change``.
    With ``allow_plan_change=True``, fp32 masters (and Kahan compensation) that this run's
    optimizer does not keep are loaded into the model's fp32 weights exactly, with one
    ``UserWarning`` naming them, or the load is refused where they could only be rounded.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if isinstance(optimizers, torch.optim.Optimizer) or not isinstance(optimizers, Sequence):
        raise TypeError(f"optimizers must be a list of optimizers, got {type(optimizers).__name__}")
    if mp is not None and not isinstance(mp, MixedPrecision):
        raise TypeError(f"mp must be a mixprec.MixedPrecision or None, got {type(mp).__name__}")
    path = os.fspath(path)
    module = unwrap_model(model)
    if sharded.is_sharded(module):  # an FSDP2 run: this rank's part, one decision for every rank
        group = _group_of(str(path), mp, "load")
        error: BaseException | None = None
        try:
            pointer = files.read(str(path))
            verify_checksums(path, pointer, pointer.get("checksum"))
            if "sharded" not in pointer or "model" in pointer:
                raise ValueError(f"checkpoint {str(path)!r} was saved by an unsharded run; this model holds FSDP2 shards. "
                                 "Load it into the unsharded model, then shard")
            payload = _read_part(str(path), pointer, module, optimizers, group)
            carried = _check_payload(str(path), payload, module, optimizers, mp, allow_plan_change, rng)
        except BaseException as exc:
            error = exc
        sharded.agree(error is None, f"loading checkpoint {str(path)!r}", group)
        if error is not None:
            raise error
        return _apply(path, payload, module, optimizers, mp, allow_plan_change, rng, carried,
                      agree=lambda ok: sharded.agree(ok, f"loading checkpoint {str(path)!r}", group))
    payload = files.read(str(path))
    verify_checksums(path, payload, payload.get("checksum"))
    _lift_wrapper_entries(payload)
    if "sharded" in payload and "model" not in payload:
        raise ValueError(f"checkpoint {str(path)!r} holds FSDP2 shards (one part per rank); load it into the model "
                         "sharded as when saving, on every rank")
    carried = _check_payload(path, payload, module, optimizers, mp, allow_plan_change, rng)
    return _apply(path, payload, module, optimizers, mp, allow_plan_change, rng, carried)


def _read_part(path: str, pointer: dict[str, Any], module: torch.nn.Module,
               optimizers: Sequence[torch.optim.Optimizer], group: Any) -> dict[str, Any]:
    save = pointer["sharded"]["save"]
    rank, world, saved = sharded.check_world(path, pointer["sharded"], group)

    def read(k: int) -> dict[str, Any]:
        part = sharded.part_path(path, save, k, saved)
        payload = files.read(part)
        verify_checksums(part, payload, payload.get("checksum"))
        if payload.get("sharded", {}).get("save") != save:
            raise ValueError(f"checkpoint {path!r}: {part!r} belongs to another save; the checkpoint folder was changed "
                             "by hand")
        if len(payload["optimizers"]) != len(optimizers):
            raise ValueError(
                f"the checkpoint holds {len(payload['optimizers'])} optimizer states but {len(optimizers)} "
                "optimizers were given; pass the same optimizers, in the same order, as when saving"
            )
        return payload

    own = read(rank) if saved == world else None
    if own is not None and sharded.split_as_saved(own, module, optimizers):
        sharded.restore_dtensors(path, own, module, optimizers)
        _lift_wrapper_entries(own)
        return own
    # another number of ranks or another mesh: every part is read and each sharded entry cut again
    parts = [own if k == rank and own is not None else read(k) for k in range(saved)]
    payload = sharded.reshard(path, parts, module, optimizers, rank)
    for part in parts:  # (``payload`` is one of them)
        _lift_wrapper_entries(part)
    for i, state in enumerate(payload["optimizers"]):  # stochastic rounding: every saved shard's noise, for
        rounding = state.get(ROUNDING_KEY)             # the shard this rank holds now to pick
        if isinstance(rounding, dict) and isinstance(rounding.get("generators"), dict):
            merged = {}
            for part in parts:
                theirs = part["optimizers"][i].get(ROUNDING_KEY)
                if isinstance(theirs, dict) and isinstance(theirs.get("generators"), dict):
                    merged.update(theirs["generators"])
            state[ROUNDING_KEY] = {**rounding, "generators": merged}
    warnings.warn(
        f"checkpoint {path!r} was saved by {saved} ranks and is loaded by {world}"
        + (" sharding it otherwise" if saved == world else "") + ": its sharded tensors were put "
        "together and cut for this run (every rank read every part). "
        + ("This rank did not save: its RNG state was not restored, and its extra dict and unsharded buffers "
           "are rank 0's. " if rank >= saved else "")
        + "The run goes on from the same state, but not bit for bit as one on "
        f"{saved} ranks would: the gradients are reduced over another split of the batch",
        UserWarning, stacklevel=3,
    )
    return payload


def _lift_wrapper_entries(payload: dict[str, Any]) -> None:
    """Each optimizer state with its wrapper's own entry at the top level, where the checks and
    plan changes read it (over FSDP2 shards a wrapper keeps it in its first param group)."""
    states = payload.get("optimizers")
    if isinstance(states, list):
        payload["optimizers"] = [lift_wrapper_state(state, ROUNDING_KEY) for state in states]


def _check_payload(path: str, payload: dict[str, Any], module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                   mp: MixedPrecision | None, allow_plan_change: bool, rng: bool) -> list[str]:
    """Step 1 of a load: validate every part, changing nothing but ``payload`` (with
    ``allow_plan_change``, exact masters rewritten into the form this run's optimizers keep them
    in); returns one line per optimizer so converted."""
    # the plan first: a checkpoint of another plan explains every other mismatch
    if mp is not None:
        check_mp(path, mp, payload["mixed_precision"], allow_plan_change)
    elif payload.get("mixed_precision") is not None:
        _check_without_mp(path, payload["mixed_precision"], allow_plan_change)
    check_model(path, module, payload["model"])
    carried = carry_between_plans(path, module, optimizers, payload) if allow_plan_change else []
    if len(payload["optimizers"]) != len(optimizers):
        raise ValueError(
            f"the checkpoint holds {len(payload['optimizers'])} optimizer states but {len(optimizers)} "
            "optimizers were given; pass the same optimizers, in the same order, as when saving"
        )
    classes = payload.get("optimizer_classes")
    if classes is not None and (
        not isinstance(classes, list) or len(classes) != len(optimizers) or not all(isinstance(c, str) for c in classes)
    ):
        raise ValueError(f"checkpoint {path!r}: 'optimizer_classes' is not one class name per optimizer state")
    for i, (opt, state) in enumerate(zip(optimizers, payload["optimizers"], strict=True)):
        check_optimizer(path, i, opt, state, None if classes is None else classes[i])
    if rng and "rng" in payload:
        check_rng(path, payload["rng"])
    return carried


def _check_without_mp(path: str, saved: Any, allow_plan_change: bool) -> None:
    """A checkpoint saved with ``mp=`` loaded without one: refused (its loss scale, counters and
    scheduler would be dropped silently) unless the run leaves mixprec on purpose
    (``allow_plan_change``), which is then told what it does not get."""
    state = saved if isinstance(saved, Mapping) else {}
    held_scaler = state.get("scaler")
    scaler: Mapping[str, Any] = held_scaler if isinstance(held_scaler, Mapping) else {}
    held = [f"plan {state.get('plan')!r}"]
    if isinstance(scaler.get("scale"), int | float):
        held.append(f"loss scale {float(scaler['scale']):g}")
    held.append(f"{state.get('optimizer_steps', 0)} optimizer steps, {state.get('consecutive_skips', 0)} consecutive skips")
    if "scheduler" in state:
        held.append("the LR scheduler")
    if not allow_plan_change:
        raise ValueError(
            f"checkpoint {path!r} holds the MixedPrecision state it was saved with ({', '.join(held)}), but no mp= "
            "was given: loading would drop it silently (the loss scale would restart from its initial value, the "
            "counters from zero). Pass the run's MixedPrecision: load_checkpoint(path, model=model, "
            "optimizers=[...], mp=mp); to leave mixprec on purpose (a plain torch loop), pass allow_plan_change=True"
        )
    if "scheduler" in state:
        warnings.warn(
            f"checkpoint {path!r} holds the LR scheduler's state inside its MixedPrecision state, which this load "
            "without mp= does not restore; load it yourself: scheduler.load_state_dict(torch.load(path, "
            "weights_only=True)['mixed_precision']['scheduler'])",
            UserWarning, stacklevel=4,
        )


def _apply(path: str, payload: dict[str, Any], module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer],
           mp: MixedPrecision | None, allow_plan_change: bool, rng: bool, carried: Sequence[str] = (),
           agree: Callable[[bool], None] | None = None) -> dict[str, Any]:
    """Step 2 of a load: apply, restoring what was applied if a later part still fails (or, with
    ``agree``, an FSDP2 run's collective decision, if another rank's load failed)."""
    restore_rng = rng and "rng" in payload
    mp_before: dict[str, Any] | None = None
    try:
        model_state, converted = payload["model"], fp32_weights(path, module, optimizers, payload)
        if converted[0]:
            model_state = {**model_state, **converted[0]}
        model_before = _snapshot(module.state_dict())
        opts_before = [_snapshot(opt.state_dict()) for opt in optimizers]
        rng_before = _rng_state() if restore_rng else None
        if mp is not None:
            with contextlib.suppress(RuntimeError):  # mid-accumulation sessions have no state_dict
                mp_before = _snapshot(mp.state_dict())
    except BaseException:  # (out of memory for the copies, say) nothing applied: the other ranks undo theirs
        if agree is not None:
            agree(False)
        raise
    rng_applied = mp_touched = agreed = False
    try:
        module.load_state_dict(model_state)
        for opt, state in zip(optimizers, payload["optimizers"], strict=True):
            opt.load_state_dict(state)
        if restore_rng:
            rng_applied = True
            _set_rng_state(payload["rng"])
        if mp is not None:
            mp_touched = True
            mp.load_state_dict(payload["mixed_precision"], allow_plan_change=allow_plan_change)
        if agree is not None:
            # one decision per rank: a failure inside it is not announced again (if it fails before
            # its collective, the others wait for that collective until the group's timeout)
            agreed = True
            agree(True)  # raises PeerFailed when another rank's load failed: then undone here too
    except BaseException as exc:  # an interrupt too: undone here, and the other ranks told
        try:
            module.load_state_dict(model_before)
            # every optimizer, applied or not: a failed load may have changed the one that raised, and
            # restoring the model reaches the masters of the others (they follow loads into the model)
            for opt, before in zip(optimizers, opts_before, strict=True):
                opt.load_state_dict(before)
            if rng_applied and rng_before is not None:
                _set_rng_state(rng_before)
            if mp_touched and mp is not None and mp_before is not None:
                with contextlib.suppress(Exception):
                    mp.load_state_dict(mp_before)
        finally:
            if agree is not None and not agreed:
                agree(False)
        if not isinstance(exc, Exception) or isinstance(exc, ValueError | TypeError | OSError | sharded.PeerFailed):
            raise
        raise ValueError(f"checkpoint {path!r} could not be applied ({exc}); nothing was changed") from exc
    saved_plan = (payload.get("mixed_precision") or {}).get("plan", "a master or Kahan plan")
    if converted[1]:
        warnings.warn(
            f"checkpoint {path!r} was saved under plan {saved_plan!r}, whose optimizer kept the true values of its "
            f"low-precision weights beside them; this run's optimizer keeps none, and its weights are fp32, so "
            f"they were loaded from those values, exactly, not from the rounded weights ({'; '.join(converted[1])})",
            UserWarning,
            stacklevel=2,
        )
    if carried:
        warnings.warn(
            f"checkpoint {path!r} was saved under plan {saved_plan!r}, whose optimizer kept the true values of its "
            f"low-precision weights in another form than this run's optimizer keeps them; they were converted, "
            f"exactly ({'; '.join(carried)})",
            UserWarning,
            stacklevel=2,
        )
    return dict(payload["extra"])

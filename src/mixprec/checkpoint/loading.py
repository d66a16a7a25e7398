"""Loading a checkpoint, all or nothing: :func:`load_checkpoint` (see :mod:`mixprec.checkpoint`).

Step 1 checks every part (:mod:`mixprec.checkpoint.checks`), changing nothing; step 2
applies them, restoring what was applied if a later part still fails. An FSDP2 run reads
its rank's part (or every part, to cut them again for another number of ranks) and makes
each decision with every rank.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from mixprec.checkpoint import files, sharded
from mixprec.checkpoint.checks import check_model, check_mp, check_optimizer, check_rng
from mixprec.checkpoint.convert import ROUNDING_KEY, carry_between_plans, fp32_weights
from mixprec.checkpoint.integrity import verify_checksums
from mixprec.checkpoint.run import group_of, rng_state, set_rng_state, unwrap_model
from mixprec.optim.checks import lift_wrapper_state
from mixprec.session import MixedPrecision

__all__ = ["load_checkpoint"]


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
        group = group_of(str(path), mp, "load")
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
        rng_before = rng_state() if restore_rng else None
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
            set_rng_state(payload["rng"])
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
                set_rng_state(rng_before)
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

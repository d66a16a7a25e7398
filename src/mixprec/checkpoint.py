"""Save and load a whole training state atomically.

A checkpoint holds the model, every optimizer (with fp32 masters / compensation
buffers), the :class:`~mixprec.MixedPrecision` state (scaler counters, plan
fingerprint, scheduler) and the RNG states, written to a temporary file in the
same folder, fsynced, then renamed over the target: a failed or interrupted save
never destroys the previous checkpoint. Loading uses ``weights_only=True``.

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
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from mixprec.session import MixedPrecision

__all__ = ["load_checkpoint", "save_checkpoint", "unwrap_model"]

_FORMAT = "mixprec.checkpoint/1"


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside torch.compile / DistributedDataParallel wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    mp: MixedPrecision | None = None,
    extra: dict[str, Any] | None = None,
    rng: bool = True,
) -> None:
    """Write the training state to ``path`` atomically (temp file, fsync, rename)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot save checkpoint {path!r}: folder {folder!r} does not exist; create it first")
    payload: dict[str, Any] = {
        "format": _FORMAT,
        "model": unwrap_model(model).state_dict(),
        "optimizers": [opt.state_dict() for opt in optimizers],
        "mixed_precision": None if mp is None else mp.state_dict(),
        "extra": extra or {},
    }
    if rng:
        payload["rng"] = _rng_state()
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
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


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    mp: MixedPrecision | None = None,
    allow_plan_change: bool = False,
    rng: bool = True,
) -> dict[str, Any]:
    """Load what :func:`save_checkpoint` wrote, in the order model, optimizers, MixedPrecision.

    Returns the ``extra`` dict that was saved.
    """
    payload = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise ValueError(f"{os.fspath(path)!r} is not a mixprec checkpoint (written by mixprec.save_checkpoint)")
    if len(payload["optimizers"]) != len(optimizers):
        raise ValueError(
            f"the checkpoint holds {len(payload['optimizers'])} optimizer states but {len(optimizers)} "
            "optimizers were given; pass the same optimizers, in the same order, as when saving"
        )
    if mp is not None:
        if payload["mixed_precision"] is None:
            raise ValueError("the checkpoint has no MixedPrecision state (it was saved without mp=); pass mp=None")
        # Check the plan before touching anything, so a refused load changes nothing.
        _check_plan(mp, payload["mixed_precision"], allow_plan_change)
    unwrap_model(model).load_state_dict(payload["model"])
    for opt, state in zip(optimizers, payload["optimizers"], strict=True):
        opt.load_state_dict(state)
    if mp is not None:
        mp.load_state_dict(payload["mixed_precision"], allow_plan_change=allow_plan_change)
    if rng and "rng" in payload:
        _set_rng_state(payload["rng"])
    return dict(payload.get("extra", {}))


def _check_plan(mp: MixedPrecision, state: dict[str, Any], allow_plan_change: bool) -> None:
    if allow_plan_change or state.get("fingerprint") == mp.plan.fingerprint():
        return
    mp.load_state_dict(state, allow_plan_change=False)  # raises with the explanation

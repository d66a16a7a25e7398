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

Loading is all-or-nothing: every part (model keys and shapes, optimizer groups,
MixedPrecision state, RNG state) is checked before anything changes, and if
applying still fails, what was already applied is restored.

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

import collections
import contextlib
import copy
import errno
import inspect
import os
import pickle
import re
import secrets
import socket
import stat
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mixprec.session import MixedPrecision

__all__ = ["load_checkpoint", "save_checkpoint", "stale_temp_files", "unwrap_model"]

_FORMAT = "mixprec.checkpoint/1"
_TMP_SUFFIX = ".mixprec-tmp"
_FOREIGN_TMP_MAX_AGE_S = 24 * 3600.0


# ------------------------------------------------------------------ wrappers
def _wrapper_types() -> tuple[type[torch.nn.Module], ...]:
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    types: list[type[torch.nn.Module]] = [DistributedDataParallel, DataParallel]
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


# ------------------------------------------------- weights_only compatibility
_SCALARS: tuple[type, ...] = (type(None), bool, int, float, complex, str, bytes, bytearray)
_SPECIAL: tuple[type, ...] = (torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format)


def _safe_global_types() -> set[type]:
    out: set[type] = set()
    for entry in torch.serialization.get_safe_globals():
        obj = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(obj, type):
            out.add(obj)
    return out


def _check_loadable(value: Any, where: str, safe: set[type]) -> None:
    """Raise TypeError if ``value`` holds anything ``torch.load(weights_only=True)`` refuses."""
    kind = type(value)
    if kind in _SCALARS or kind in _SPECIAL or kind in safe:
        return
    if isinstance(value, torch.Tensor):
        return  # tensor subclasses are verified by loading the written file back
    if kind in (dict, collections.OrderedDict, collections.Counter):
        for key, item in value.items():
            if type(key) not in _SCALARS and type(key) not in _SPECIAL and type(key) not in safe:
                raise TypeError(_refusal(f"{where} key {key!r}", key))
            _check_loadable(item, f"{where}[{key!r}]", safe)
        return
    if kind in (list, tuple, set, frozenset):
        if kind is frozenset:
            raise TypeError(_refusal(where, value))
        for i, item in enumerate(value):
            _check_loadable(item, f"{where}[{i}]", safe)
        return
    raise TypeError(_refusal(where, value))


def _refusal(where: str, value: Any) -> str:
    kind = type(value)
    name = f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else kind.__qualname__
    return (
        f"save_checkpoint: {where} is a {name} ({value!r:.80}), which torch.load(weights_only=True) "
        "refuses, so the checkpoint could never be loaded; convert it to a plain type first "
        "(int/float/str/bool, a list/dict of them, or a tensor: e.g. float(x) for a numpy scalar, "
        "str(p) for a path, d.isoformat() for a datetime)"
    )


# -------------------------------------------------------------- temp files
def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64] or "host"


def _temp_name(target: str) -> str:
    base = os.path.basename(target)
    return f".{base}.{_host_tag()}.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}"


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return True
    return True


def stale_temp_files(path: str | os.PathLike[str]) -> list[str]:
    """Temporary files of earlier saves to ``path`` that no process will finish (safe to delete).

    A temporary file is stale when it matches this module's pattern for the same target
    and either its writer (host, pid) no longer runs on this host, or it comes from
    another host and is more than a day old. Files of live writers are never listed.
    """
    target = os.path.abspath(os.fspath(path))
    folder, base = os.path.split(target)
    pattern = re.compile(
        rf"^\.{re.escape(base)}\.(?P<host>[A-Za-z0-9_-]+)\.(?P<pid>\d+)\.[0-9a-f]+{re.escape(_TMP_SUFFIX)}$"
    )
    host = _host_tag()
    stale: list[str] = []
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    now = time.time()
    for name in names:
        m = pattern.match(name)
        if m is None:
            continue
        full = os.path.join(folder, name)
        pid = int(m.group("pid"))
        if m.group("host") == host:
            if pid == os.getpid() or _pid_alive(pid):
                continue
        else:
            try:
                if now - os.lstat(full).st_mtime < _FOREIGN_TMP_MAX_AGE_S:
                    continue
            except OSError:
                continue
        stale.append(full)
    return sorted(stale)


def _remove_stale_temp_files(path: str) -> None:
    for name in stale_temp_files(path):
        with contextlib.suppress(OSError):
            os.unlink(name)


def _open_temp(tmp: str, mode: int | None) -> Any:
    """Create ``tmp`` exclusively (permissions from the umask, or ``mode``) for binary writing."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


class _RecordingWriter:
    """Passes writes to ``f`` and keeps the first OSError (torch turns it into a RuntimeError)."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return int(self._f.write(data))
        except OSError as exc:
            if self.error is None:
                self.error = exc
            raise

    def flush(self) -> None:
        self._f.flush()


def _write_error(path: str, exc: BaseException) -> OSError:
    code = exc.errno if isinstance(exc, OSError) and exc.errno else errno.EIO
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "No space left" in str(exc) or code == errno.ENOSPC:
        code, why = errno.ENOSPC, "the disk is full"
    else:
        why = "writing failed"
    return OSError(
        code,
        f"cannot save checkpoint {path!r}: {why} ({text}); the previous checkpoint, if any, is unchanged",
    )


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
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot save checkpoint {path!r}: folder {folder!r} does not exist; create it first")
    payload: dict[str, Any] = {
        "format": _FORMAT,
        "model": unwrap_model(model).state_dict(),
        "optimizers": [opt.state_dict() for opt in optimizers],
        "mixed_precision": None if mp is None else mp.state_dict(),
        "extra": dict(extra) if extra is not None else {},
    }
    if rng:
        payload["rng"] = _rng_state()
    safe = _safe_global_types()
    for key, value in payload.items():
        _check_loadable(value, key, safe)

    _remove_stale_temp_files(path)
    try:
        mode: int | None = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = None
    tmp = os.path.join(folder, _temp_name(path))
    try:
        try:
            with _open_temp(tmp, mode) as f:
                writer = _RecordingWriter(f)
                try:
                    torch.save(payload, writer)  # type: ignore[arg-type]
                except RuntimeError as exc:  # torch reports a failed write as its own RuntimeError
                    raise (writer.error or exc) from exc
                f.flush()
                os.fsync(f.fileno())
        except (OSError, RuntimeError) as exc:
            raise _write_error(path, exc) from exc
        _verify(tmp, path)
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


def _verify(tmp: str, path: str) -> None:
    """Load the written file back (memory-mapped, no tensor data copied) before it replaces ``path``."""
    try:
        torch.load(tmp, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise TypeError(
            f"save_checkpoint: the state for {path!r} holds an object torch.load(weights_only=True) refuses "
            f"({str(exc).splitlines()[0]}); convert it to plain types or tensors. The previous checkpoint is unchanged"
        ) from exc
    except (OSError, RuntimeError) as exc:
        raise _write_error(path, exc) from exc


# ------------------------------------------------------------------ loading
def _read(path: str) -> dict[str, Any]:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"no checkpoint at {path!r}") from None
    except IsADirectoryError:
        raise IsADirectoryError(errno.EISDIR, f"checkpoint path {path!r} is a folder; pass the file") from None
    except PermissionError as exc:
        raise PermissionError(errno.EACCES, f"cannot read checkpoint {path!r}: {exc.strerror}") from None
    except pickle.UnpicklingError as exc:
        raise ValueError(
            f"{path!r} holds objects that torch.load(weights_only=True) refuses ({str(exc).splitlines()[0]}); "
            "it was not written by mixprec.save_checkpoint"
        ) from None
    except (RuntimeError, EOFError, ValueError, KeyError, IndexError, AttributeError, OSError) as exc:
        raise ValueError(
            f"{path!r} is not a readable checkpoint (truncated or corrupt file: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__})"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise ValueError(f"{path!r} is not a mixprec checkpoint (written by mixprec.save_checkpoint)")
    required: dict[str, type | tuple[type, ...]] = {"model": dict, "optimizers": list, "mixed_precision": (dict, type(None)), "extra": dict}
    for key, kinds in required.items():
        if key not in payload:
            raise ValueError(f"checkpoint {path!r} is missing {key!r}; it is incomplete or from another tool")
        if not isinstance(payload[key], kinds):
            raise ValueError(f"checkpoint {path!r}: {key!r} is a {type(payload[key]).__name__}, not what mixprec wrote")
    return payload


def _check_model(path: str, module: torch.nn.Module, state: dict[str, Any]) -> None:
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        raise ValueError(
            f"checkpoint {path!r} does not match the model ({'; '.join(parts)}); pass the same architecture "
            "that was saved"
        )
    for key, ours in own.items():
        saved = state[key]
        if not isinstance(ours, torch.Tensor):
            continue
        if not isinstance(saved, torch.Tensor):
            raise ValueError(f"checkpoint {path!r}: model entry {key!r} is a {type(saved).__name__}, expected a tensor")
        if saved.shape != ours.shape:
            raise ValueError(
                f"checkpoint {path!r}: model entry {key!r} has shape {tuple(saved.shape)}, the model's is "
                f"{tuple(ours.shape)}; pass the same architecture that was saved"
            )
        if saved.is_floating_point() != ours.is_floating_point() or saved.is_complex() != ours.is_complex():
            raise ValueError(
                f"checkpoint {path!r}: model entry {key!r} is {saved.dtype}, the model's is {ours.dtype}"
            )


def _check_optimizer(path: str, i: int, opt: torch.optim.Optimizer, state: Any) -> None:
    where = f"checkpoint {path!r}: optimizers[{i}]"
    if not isinstance(state, dict) or "state" not in state or "param_groups" not in state:
        raise ValueError(f"{where} is not an optimizer state_dict (needs 'state' and 'param_groups')")
    own = opt.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise ValueError(f"{where} is missing {missing}; it was saved from another kind of optimizer ({type(opt).__name__} now)")
    groups, own_groups = state["param_groups"], own["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(own_groups):
        n = len(groups) if isinstance(groups, list) else type(groups).__name__
        raise ValueError(f"{where} has {n} parameter groups, the optimizer has {len(own_groups)}")
    for g, (saved_g, own_g) in enumerate(zip(groups, own_groups, strict=True)):
        if not isinstance(saved_g, dict) or len(saved_g.get("params", ())) != len(own_g["params"]):
            got = len(saved_g.get("params", ())) if isinstance(saved_g, dict) else "?"
            raise ValueError(
                f"{where} group {g} has {got} parameters, the optimizer's has {len(own_g['params'])}"
            )
    saved_state, own_state = state["state"], own["state"]
    if not isinstance(saved_state, dict):
        raise ValueError(f"{where}['state'] is a {type(saved_state).__name__}, expected a dict")
    for pid, entry in saved_state.items():
        mine = own_state.get(pid)
        if not isinstance(mine, dict) or not isinstance(entry, dict):
            continue
        for key, value in entry.items():
            cur = mine.get(key)
            if isinstance(cur, torch.Tensor) and isinstance(value, torch.Tensor) and cur.shape != value.shape:
                raise ValueError(
                    f"{where} state {key!r} of parameter {pid} has shape {tuple(value.shape)}, the "
                    f"optimizer's is {tuple(cur.shape)}"
                )


def _check_mp(path: str, mp: MixedPrecision, state: Any, allow_plan_change: bool) -> None:
    if state is None:
        raise ValueError(f"checkpoint {path!r} has no MixedPrecision state (it was saved without mp=); pass mp=None")
    if not isinstance(state, dict) or "scaler" not in state or "format" not in state:
        raise ValueError(f"checkpoint {path!r}: the MixedPrecision state is incomplete (no 'format'/'scaler')")
    validate = getattr(mp, "validate_state_dict", None)
    if validate is not None and "allow_plan_change" in inspect.signature(validate).parameters:
        validate(state, allow_plan_change=allow_plan_change)
        return
    _check_plan(mp, state, allow_plan_change)
    if validate is not None and not allow_plan_change:
        validate(state)


def _check_rng(path: str, state: Any) -> None:
    if not isinstance(state, dict) or not isinstance(state.get("cpu"), torch.Tensor):
        raise ValueError(f"checkpoint {path!r}: the RNG state is not what save_checkpoint wrote (no 'cpu' tensor)")
    cpu = state["cpu"]
    current = torch.get_rng_state()
    if cpu.dtype != torch.uint8 or cpu.shape != current.shape:
        raise ValueError(
            f"checkpoint {path!r}: the CPU RNG state is a {cpu.dtype} tensor of shape {tuple(cpu.shape)}, "
            f"expected uint8 of shape {tuple(current.shape)}"
        )


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
    and if applying a part still fails, the parts already applied are restored.
    Returns the ``extra`` dict that was saved.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if isinstance(optimizers, torch.optim.Optimizer) or not isinstance(optimizers, Sequence):
        raise TypeError(f"optimizers must be a list of optimizers, got {type(optimizers).__name__}")
    if mp is not None and not isinstance(mp, MixedPrecision):
        raise TypeError(f"mp must be a mixprec.MixedPrecision or None, got {type(mp).__name__}")
    path = os.fspath(path)
    module = unwrap_model(model)
    payload = _read(str(path))

    # 1. validate every part (the plan first: a checkpoint of another plan explains every other mismatch)
    if mp is not None:
        _check_mp(path, mp, payload["mixed_precision"], allow_plan_change)
    _check_model(path, module, payload["model"])
    if len(payload["optimizers"]) != len(optimizers):
        raise ValueError(
            f"the checkpoint holds {len(payload['optimizers'])} optimizer states but {len(optimizers)} "
            "optimizers were given; pass the same optimizers, in the same order, as when saving"
        )
    for i, (opt, state) in enumerate(zip(optimizers, payload["optimizers"], strict=True)):
        _check_optimizer(path, i, opt, state)
    restore_rng = rng and "rng" in payload
    if restore_rng:
        _check_rng(path, payload["rng"])

    # 2. apply, restoring what was applied if a later part still fails
    model_before = _snapshot(module.state_dict())
    opts_before = [_snapshot(opt.state_dict()) for opt in optimizers]
    rng_before = _rng_state() if restore_rng else None
    mp_before: dict[str, Any] | None = None
    if mp is not None:
        with contextlib.suppress(RuntimeError):  # mid-accumulation sessions have no state_dict
            mp_before = _snapshot(mp.state_dict())
    applied: list[int] = []
    rng_applied = mp_touched = False
    try:
        module.load_state_dict(payload["model"])
        for i, (opt, state) in enumerate(zip(optimizers, payload["optimizers"], strict=True)):
            opt.load_state_dict(state)
            applied.append(i)
        if restore_rng:
            rng_applied = True
            _set_rng_state(payload["rng"])
        if mp is not None:
            mp_touched = True
            mp.load_state_dict(payload["mixed_precision"], allow_plan_change=allow_plan_change)
    except Exception as exc:
        module.load_state_dict(model_before)
        for i in applied:
            optimizers[i].load_state_dict(opts_before[i])
        if rng_applied and rng_before is not None:
            _set_rng_state(rng_before)
        if mp_touched and mp is not None and mp_before is not None:
            with contextlib.suppress(Exception):
                mp.load_state_dict(mp_before)
        if isinstance(exc, ValueError | TypeError | OSError):
            raise
        raise ValueError(f"checkpoint {path!r} could not be applied ({exc}); nothing was changed") from exc
    return dict(payload["extra"])


def _check_plan(mp: MixedPrecision, state: dict[str, Any], allow_plan_change: bool) -> None:
    if allow_plan_change or state.get("fingerprint") == mp.plan.fingerprint():
        return
    mp.load_state_dict(state, allow_plan_change=False)  # raises with the explanation

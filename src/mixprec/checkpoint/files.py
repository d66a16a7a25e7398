"""Writing a checkpoint file atomically, and reading one back.

Temporary files are named ``.<target>.<host>.<pid>.<random>.mixprec-tmp`` beside the
target. :func:`stale_temp_files` lists those that no process will finish; a save removes
them (:func:`remove_stale_temp_files`). :func:`open_temp` creates one exclusively,
:class:`RecordingWriter` keeps the first ``OSError`` that torch's writer turns into a
``RuntimeError``, :func:`write_error` makes a failed write the ``OSError`` a caller sees,
and :func:`verify` loads the written file back before it replaces the target.
:func:`check_loadable` refuses, before anything is written, what
``torch.load(weights_only=True)`` would refuse.

>>> check_loadable({"epoch": 3, "lr": [0.1, 0.01]}, "extra", safe_global_types())
>>> check_loadable({"when": object()}, "extra", safe_global_types())  # doctest: +ELLIPSIS
Traceback (most recent call last):
    ...
TypeError: save_checkpoint: extra['when'] is a object (<object object at ...>), which torch.load(weights_only=True) refuses, ...
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import pickle
import re
import secrets
import socket
import time
from typing import Any

import torch

__all__ = [
    "FORMAT",
    "RecordingWriter",
    "check_loadable",
    "host_tag",
    "open_temp",
    "read",
    "remove_stale_temp_files",
    "safe_global_types",
    "stale_temp_files",
    "temp_name",
    "verify",
    "write_error",
]

#: The ``format`` entry of every checkpoint written by :func:`~mixprec.save_checkpoint`.
FORMAT = "mixprec.checkpoint/1"
_TMP_SUFFIX = ".mixprec-tmp"
_FOREIGN_TMP_MAX_AGE_S = 24 * 3600.0


# ------------------------------------------------- weights_only compatibility
_SCALARS: tuple[type, ...] = (type(None), bool, int, float, complex, str, bytes, bytearray)
_SPECIAL: tuple[type, ...] = (torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format)


def safe_global_types() -> set[type]:
    """The types registered with ``torch.serialization.add_safe_globals``."""
    out: set[type] = set()
    for entry in torch.serialization.get_safe_globals():
        obj = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(obj, type):
            out.add(obj)
    return out


def check_loadable(value: Any, where: str, safe: set[type]) -> None:
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
            check_loadable(item, f"{where}[{key!r}]", safe)
        return
    if kind in (list, tuple, set, frozenset):
        if kind is frozenset:
            raise TypeError(_refusal(where, value))
        for i, item in enumerate(value):
            check_loadable(item, f"{where}[{i}]", safe)
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
def host_tag() -> str:
    """This host's name as it appears in temporary file names."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64] or "host"


def temp_name(target: str) -> str:
    """A fresh temporary file name (no folder) for a save to ``target``."""
    base = os.path.basename(target)
    return f".{base}.{host_tag()}.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}"


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
    host = host_tag()
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


def remove_stale_temp_files(path: str) -> None:
    """Delete the :func:`stale_temp_files` of ``path`` (errors ignored: another save may delete them too)."""
    for name in stale_temp_files(path):
        with contextlib.suppress(OSError):
            os.unlink(name)


def open_temp(tmp: str, mode: int | None) -> Any:
    """Create ``tmp`` exclusively (permissions from the umask, or ``mode``) for binary writing."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


class RecordingWriter:
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


def write_error(path: str, exc: BaseException) -> OSError:
    """The ``OSError`` (ENOSPC for a full disk) that a failed write of ``path`` raises."""
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


def verify(tmp: str, path: str) -> None:
    """Load the written file back (memory-mapped, no tensor data copied) before it replaces ``path``."""
    try:
        torch.load(tmp, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise TypeError(
            f"save_checkpoint: the state for {path!r} holds an object torch.load(weights_only=True) refuses "
            f"({str(exc).splitlines()[0]}); convert it to plain types or tensors. The previous checkpoint is unchanged"
        ) from exc
    except (OSError, RuntimeError) as exc:
        raise write_error(path, exc) from exc



# ------------------------------------------------------------------ reading
def read(path: str) -> dict[str, Any]:
    """The payload of the checkpoint at ``path``, its top-level entries checked (``ValueError`` if not mixprec's)."""
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
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path!r} is not a mixprec checkpoint (written by mixprec.save_checkpoint)")
    pointer = payload.get("sharded")
    if "model" not in payload and isinstance(pointer, dict):  # an FSDP2 run's: names the save whose parts hold it
        if not isinstance(pointer.get("save"), str) or not isinstance(pointer.get("world"), int):
            raise ValueError(f"checkpoint {path!r} names its parts wrongly ({pointer!r}); it is not what mixprec wrote")
        return payload
    required: dict[str, type | tuple[type, ...]] = {"model": dict, "optimizers": list, "mixed_precision": (dict, type(None)), "extra": dict}
    for key, kinds in required.items():
        if key not in payload:
            raise ValueError(f"checkpoint {path!r} is missing {key!r}; it is incomplete or from another tool")
        if not isinstance(payload[key], kinds):
            raise ValueError(f"checkpoint {path!r}: {key!r} is a {type(payload[key]).__name__}, not what mixprec wrote")
    return payload

"""Building and loading the native CPU kernel (:file:`native_adam.c`) of :mod:`mixprec.optim.native`.

Built once per machine with the system's C compiler (``cc -O3 -march=native``, about a second,
cached under ``$XDG_CACHE_HOME/mixprec/native``; where that folder is unusable, in
``mixprec-native-<uid>`` in the temporary directory, a folder only its user can write to; where
even that one is not, in a folder of the process's own, removed once the kernel is loaded) and
called through ``ctypes``. ``MIXPREC_NATIVE=0`` turns it off; without a working C compiler it is
off by itself (:func:`status` says why).

>>> status(build=False)[0] in (True, False)
True
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path
from typing import Any

from mixprec.compiling import NATIVE_ENV, env_switch

__all__ = ["ENV", "FLAGS_ENV", "TEMP_PREFIX", "Args", "cpu_flags", "has_f16", "library", "reset", "status"]

#: set to "0" to turn the native route off
ENV = NATIVE_ENV
#: the target flags the kernel is built with (default ``-march=native``: this machine's
#: instructions; ``-march=x86-64-v3`` builds its AVX2 loops, ``-march=x86-64`` its plain C ones)
FLAGS_ENV = "MIXPREC_NATIVE_TARGET"
_ABI = 7

class Args(ctypes.Structure):
    """native_adam.c's ``mp_args``, field for field."""

    _fields_ = [
        ("begin", ctypes.c_int64), ("end", ctypes.c_int64),
        ("w", ctypes.c_void_p), ("g", ctypes.c_void_p),
        ("m", ctypes.c_void_p), ("v", ctypes.c_void_p), ("vmax", ctypes.c_void_p),
        ("m_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p), ("vmax_scale", ctypes.c_void_p),
        ("comp", ctypes.c_void_p),
        ("ties", ctypes.c_void_p), ("n_ties", ctypes.c_int64),
        ("smap", ctypes.c_void_p), ("umap", ctypes.c_void_p),
        ("slookup", ctypes.c_void_p), ("ulookup", ctypes.c_void_p),
        ("spoints", ctypes.c_void_p), ("upoints", ctypes.c_void_p),
        ("scompact", ctypes.c_void_p), ("ucompact", ctypes.c_void_p),
        ("seed", ctypes.c_int64), ("offset", ctypes.c_int64),
        ("w_kind", ctypes.c_int32), ("g_kind", ctypes.c_int32), ("s_kind", ctypes.c_int32), ("comp_kind", ctypes.c_int32),
        ("rounding", ctypes.c_int32), ("wd_mode", ctypes.c_int32), ("amsgrad", ctypes.c_int32), ("maximize", ctypes.c_int32),
        ("lerp_weight", ctypes.c_float), ("beta2", ctypes.c_float), ("one_minus_beta2", ctypes.c_float),
        ("eps", ctypes.c_float), ("decay", ctypes.c_float), ("step_size", ctypes.c_float),
        ("bc2_sqrt", ctypes.c_float),
        ("gscales", ctypes.c_void_p), ("n_gscales", ctypes.c_int64), ("skip", ctypes.c_void_p),
    ]


_lock = threading.Lock()
_state: dict[str, Any] = {}


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mixprec" / "native"


#: the per-user folder in the temporary directory the kernel is cached in where the user's cache
#: folder is unusable: ``mixprec-native-<uid>``
TEMP_PREFIX = "mixprec-native-"


def _temp_cache_dir() -> Path | None:
    """The per-user cache folder in the temporary directory (None without user ids: Windows)."""
    if not hasattr(os, "getuid"):
        return None
    return Path(tempfile.gettempdir()) / f"{TEMP_PREFIX}{os.getuid()}"


def _private_dir(path: Path, *, shared_parent: bool = False) -> Path | None:
    """``path``, created if missing, when it is this user's and nobody else can write into it (a
    library loaded from a directory others can write to would run their code); else None.
    ``shared_parent``: ``path`` lies in a folder others write to (the temporary directory),
    where it must be a folder itself, not a link another user could point elsewhere."""
    try:
        path.mkdir(parents=not shared_parent, exist_ok=True, mode=0o700)
        st = path.lstat() if shared_parent else path.stat()
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        return None
    return path if os.access(path, os.W_OK | os.X_OK) else None


def _build_dir() -> tuple[Path, bool]:
    """(where the kernel is built and cached, whether that folder is this process's own, to be
    removed once the kernel is loaded): the user's cache folder (``$XDG_CACHE_HOME/mixprec/native``),
    else the per-user one in the temporary directory (reused by the user's later processes),
    else, where neither is usable (another user's folder of that name, say), a fresh one."""
    where = _private_dir(_cache_dir())
    if where is not None:
        return where, False
    temp = _temp_cache_dir()
    where = None if temp is None else _private_dir(temp, shared_parent=True)
    if where is not None:
        return where, False
    return Path(tempfile.mkdtemp(prefix=TEMP_PREFIX)), True


def _own_file(path: Path) -> bool:
    """Whether ``path`` exists, is this user's and is writable by nobody else."""
    try:
        st = path.stat()
    except OSError:
        return False
    return not hasattr(os, "getuid") or (st.st_uid == os.getuid() and not st.st_mode & 0o022)


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _turned_off() -> str:
    """Why the route may not be built here ("" when it may): the switch, or the platform."""
    if not env_switch(ENV, "never build or use the native optimizer kernel"):
        return f"turned off by {ENV}={os.environ[ENV]}"
    if platform.system() == "Windows":
        return "not built on Windows (no C compiler is assumed there)"
    return ""


def _compiler() -> list[str]:
    """The C compiler command: ``$CC`` (with its arguments), else cc, gcc or clang on PATH; [] if none."""
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return shlex.split(os.environ.get("CC", "")) or ([found] if found else [])


def _build() -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why not)."""
    if why := _turned_off():
        return None, why
    cc = _compiler()
    if not cc:
        return None, "no C compiler (cc, gcc or clang) on PATH"
    source = resources.files("mixprec.optim").joinpath("native_adam.c").read_bytes()
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{' '.join(cc)} --version failed: {exc}"
    target_flags = os.environ.get(FLAGS_ENV, "-march=native").split()
    key = hashlib.sha256(
        source + version + cpu_flags().encode() + platform.machine().encode() + " ".join(target_flags).encode()
    ).hexdigest()[:20]
    try:
        where, own = _build_dir()
    except OSError as exc:  # not even a folder of its own in the temporary directory
        return None, f"no folder to build the kernel in: {exc}"
    try:
        return _build_in(where, cc, source, target_flags, key)
    finally:
        if own:  # loaded (a loaded library may be unlinked) or failed: nothing is left behind
            shutil.rmtree(where, ignore_errors=True)


def _build_in(where: Path, cc: list[str], source: bytes, target_flags: list[str], key: str) -> tuple[ctypes.CDLL | None, str]:
    """The library built in (or found in) the private folder ``where``, loaded."""
    target = where / f"native_adam_{key}.so"
    if not _own_file(target):
        try:
            with tempfile.TemporaryDirectory(dir=where) as tmp:
                src = Path(tmp) / "native_adam.c"
                src.write_bytes(source)
                built = Path(tmp) / target.name
                cmd = [*cc, "-O3", *target_flags, "-ffp-contract=off", "-fno-math-errno", "-fno-strict-aliasing",
                       "-fPIC", "-shared", "-o", str(built), str(src)]
                run = subprocess.run(cmd, capture_output=True, timeout=300, check=False)
                if run.returncode != 0:
                    return None, f"{' '.join(cmd[:2])} ... failed: {run.stderr.decode(errors='replace')[-400:]}"
                os.chmod(built, 0o755)
                os.replace(built, target)  # atomic: a concurrent build of the same source gives the same file
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"building {target.name} failed: {exc}"
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        return None, f"loading {target} failed: {exc}"
    lib.mp_abi_version.restype = ctypes.c_int
    if lib.mp_abi_version() != _ABI:
        return None, f"{target} has ABI {lib.mp_abi_version()}, expected {_ABI}"
    lib.mp_compact_e0.restype = ctypes.c_int
    lib.mp_has_f16.restype = ctypes.c_int
    lib.mp_adam.restype = ctypes.c_int64
    lib.mp_adam.argtypes = [ctypes.POINTER(Args), ctypes.POINTER(ctypes.c_void_p)]
    lib.mp_free.argtypes = [ctypes.c_void_p]
    lib.mp_free.restype = None
    lib.mp_sr_bits.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    lib.mp_sr_bits.restype = None
    return lib, ""


def library() -> ctypes.CDLL | None:
    """The loaded kernel (built on the first call), or None where it is not available (:func:`status`)."""
    with _lock:
        if "lib" not in _state:
            _state["lib"], _state["why"] = _build()
            _state["f16"] = _state["lib"] is not None and bool(_state["lib"].mp_has_f16())
        return _state["lib"]


def status(build: bool = True) -> tuple[bool, str]:
    """(whether the native route is available, why not); builds the kernel on the first call.
    ``build=False`` builds nothing: before the first build it answers whether a build can be
    tried (not turned off, a C compiler on PATH), as the memory estimate wants."""
    if not build and "lib" not in _state:
        if why := _turned_off():
            return False, why
        return (True, "") if _compiler() else (False, "no C compiler (cc, gcc or clang) on PATH")
    lib = library()
    return lib is not None, _state.get("why", "")


def has_f16() -> bool:
    """Whether the kernel handles fp16 tensors (its compiler has ``_Float16``); True before a build."""
    return bool(_state.get("f16", True))


def reset() -> None:
    """Forget the loaded library's status (tests: after changing :data:`ENV`)."""
    with _lock:
        _state.clear()


def _after_fork() -> None:
    """A forked child has the parent's lock as it was (held, during a build)."""
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)

"""Unusable cache folders: torch's compiler's (``TORCHINDUCTOR_CACHE_DIR``) sends the automatic
compiled routes eagerly with one warning naming the variable, its value and the fix (an explicit
``compile=True`` raises that message); the native kernel's (``$XDG_CACHE_HOME/mixprec/native``)
falls back to a per-user folder in the temporary directory, reused by the next process, and
leaves no folder of its own behind.

Each case runs in a fresh process: the compiler's probe, its failure and the kernel's build are
once per process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _python(code: str, env: dict[str, str], *args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC), **env}
    return subprocess.run(
        [*prefix, sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, env=full_env,
        timeout=600, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _read_only_folder(tmp_path: Path) -> tuple[Path, tuple[str, ...]]:
    """A read-only folder, and the command prefix under which it is read-only to the child:
    none for a user other than root; for root, setpriv dropping its permission override
    (CAP_DAC_OVERRIDE); skips where root has no such tool."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    prefix: tuple[str, ...] = ()
    if os.access(folder, os.W_OK):  # root writes anywhere
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("this user (root) can write into a read-only folder and has no setpriv to drop that")
        prefix = (setpriv, "--bounding-set=-dac_override,-dac_read_search")
    check = subprocess.run([*prefix, sys.executable, "-c", "import os, sys; sys.exit(os.access(sys.argv[1], os.W_OK))",
                            str(folder)], capture_output=True, check=False)
    if check.returncode != 0:
        pytest.skip(f"the folder stays writable to the child ({check.stderr.decode(errors='replace')[-200:]})")
    return folder, prefix


# ------------------------------------------------ torch's compiler: TORCHINDUCTOR_CACHE_DIR
_TRAIN = """
    import json, os, sys, warnings
    import torch
    from torch import nn
    from mixprec import MixedPrecision, compiling
    from mixprec.plans import get_plan

    plan, bad, probe_first = sys.argv[1], sys.argv[2], sys.argv[3] == "1"

    def train(**options):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 4))  # 2**20 weights: "auto" compiles
        mp = MixedPrecision(get_plan(plan, **options))
        model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        x, y = torch.randn(8, 1024), torch.randint(0, 4, (8,))
        for _ in range(3):
            with mp.autocast():
                loss = nn.functional.cross_entropy(model(x).float(), y)
            mp.backward(loss)
            mp.step()
        return [p.detach().clone() for p in model.parameters()], opt

    # torch's compiler is imported here (torch.optim imports it), with a usable cache folder: with an
    # unusable one from the start, torch's own optimizers cannot be built (their import makes it)
    eager, _ = train(optimizer_compile=False)
    if probe_first:  # torch.compile worked in this process before the folder became unusable
        assert compiling.compile_works("cpu")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = bad
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto, opt = train()  # "auto": the plans' default
    try:
        train(optimizer_compile=True)
        explicit = "no error"
    except Exception as exc:
        explicit = f"{type(exc).__name__}: {exc}"
    print(json.dumps({
        # (torch's own DeprecationWarnings of the modules a compilation imports are not counted)
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught if w.category is not DeprecationWarning],
        "compiled_layouts": sorted(opt._compiled_layouts),
        "same_as_eager": all(torch.equal(a, b) for a, b in zip(auto, eager, strict=True)),
        "explicit": explicit,
    }))
"""


@pytest.mark.parametrize(
    ("plan", "kind", "probe_first"),
    [
        ("bf16-kahan", "under /dev/null", True),  # the crash of the issue: NotADirectoryError from torch.compile
        ("bf16-sr", "under /dev/null", False),
        ("bf16-kahan", "a read-only folder", False),
    ],
)
def test_an_unusable_inductor_cache_folder_steps_eagerly_with_one_warning_naming_it(
    tmp_path: Path, plan: str, kind: str, probe_first: bool
) -> None:
    prefix: tuple[str, ...] = ()
    if kind == "under /dev/null":
        bad = "/dev/null/mixprec-cache"
    else:
        folder, prefix = _read_only_folder(tmp_path)
        bad = str(folder)
    good = tmp_path / "inductor"  # the folder the process starts with (its probe compiles there)
    try:
        proc = _python(_TRAIN, {"TORCHINDUCTOR_CACHE_DIR": str(good)}, plan, bad, "1" if probe_first else "0",
                       prefix=prefix)
    finally:
        if kind != "under /dev/null":
            (tmp_path / "read-only").chmod(stat.S_IRWXU)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    fix = "point TORCHINDUCTOR_CACHE_DIR at a writable directory, or unset it"
    assert len(out["warnings"]) == 1, out["warnings"]
    warning = out["warnings"][0]
    assert warning.startswith("RuntimeWarning: torch.compile is unavailable on cpu (OSError: "), warning
    assert f"TORCHINDUCTOR_CACHE_DIR={bad!r}" in warning and fix in warning, warning
    assert out["compiled_layouts"] == []  # nothing compiled: every step took the eager route
    assert out["same_as_eager"], "the fallback steps as optimizer_compile=False does"
    # compile=True asks for the compiler: the same message, raised
    assert out["explicit"].startswith("OSError: ") and f"TORCHINDUCTOR_CACHE_DIR={bad!r}" in out["explicit"], out
    assert fix in out["explicit"], out["explicit"]


# ------------------------------------------------ the native kernel's folder
_BUILD = """
    import json, os, sys
    from mixprec.optim import native, native_build

    ok, why = native.status()
    lib = native_build.library()
    print(json.dumps({"ok": ok, "why": why, "abi": lib.mp_abi_version() if lib is not None else None}))
"""


def _counting_compiler(tmp_path: Path) -> tuple[str, Path]:
    """A $CC that logs each build of a shared library (the --version call is not one)."""
    real = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if real is None:
        pytest.skip("no C compiler on PATH")
    log = tmp_path / "builds.log"
    wrapper = tmp_path / "cc-counting"
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -shared "*) echo build >> "{log}";; esac\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper), log


def _builds(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.mark.skipif(not hasattr(os, "getuid") or sys.platform == "win32", reason="the native kernel needs a POSIX C compiler")
@pytest.mark.parametrize("per_user", ["usable", "writable by others"])
def test_an_unusable_native_cache_folder_builds_once_per_user_and_leaves_no_folder_per_process(
    tmp_path: Path, per_user: str
) -> None:
    cc, log = _counting_compiler(tmp_path)
    tmp = tmp_path / "tmp"  # a private TMPDIR: no other process's folders
    tmp.mkdir()
    shared = tmp / f"mixprec-native-{os.getuid()}"
    if per_user != "usable":  # a folder of that name others can write into: never loaded from
        shared.mkdir()
        shared.chmod(0o777)
    env = {"XDG_CACHE_HOME": "/dev/null/cache", "HOME": "/dev/null", "TMPDIR": str(tmp), "CC": cc,
           "MIXPREC_NATIVE": "1"}
    runs = []
    for _ in range(2):
        proc = _python(_BUILD, env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["ok"] and out["abi"] is not None, out
        runs.append((_builds(log), sorted(p.name for p in tmp.iterdir())))
    if per_user == "usable":
        # built once, into the per-user folder; the second process loads that build
        assert runs == [(1, [shared.name]), (1, [shared.name])], runs
        assert [p.suffix for p in shared.iterdir()] == [".so"]  # no build folder left inside
        assert stat.S_IMODE(shared.stat().st_mode) & 0o077 == 0
    else:
        # each process builds in a folder of its own and removes it once the kernel is loaded
        assert runs == [(1, [shared.name]), (2, [shared.name])], runs
        assert list(shared.iterdir()) == []

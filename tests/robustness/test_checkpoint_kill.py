"""Kill a process in the middle of save_checkpoint, many times: the last checkpoint always loads, intact.

Each round forks a child (torch is already imported, so a round takes milliseconds)
that saves checkpoints in a loop, each with every weight equal to its counter, and
reports each finished save on a pipe; the parent SIGKILLs it at a random moment,
mostly while ``torch.save`` is writing. After each kill the checkpoint must load and
be one of the last two saved states (the kill may land just after the rename), and
at most the killed writer's own temporary file may be left (the next save removes it).
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import time

import pytest
import torch
from torch import nn

from mixprec import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork to kill a writer cheaply")


def _model(fill: float) -> nn.Module:
    model = nn.Linear(512, 512)  # 1 MB of weights: a save takes a few milliseconds
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(fill)
    return model


def _writer(path: str, start: int, fd: int) -> None:  # runs in the forked child
    try:
        i = start
        while True:
            save_checkpoint(path, model=_model(float(i)), extra={"i": i})
            os.write(fd, f"{i}\n".encode())
            i += 1
    finally:
        os._exit(0)


def _temp_files(folder: str) -> list[str]:
    return [n for n in os.listdir(folder) if n != "ckpt.pt"]


def _kill_rounds(folder: str, rounds: int, seed: int) -> dict[str, int]:
    path = os.path.join(folder, "ckpt.pt")
    save_checkpoint(path, model=_model(0.0), extra={"i": 0})
    rng = random.Random(seed)
    last = 0
    counts = {"kills": 0, "saves": 0, "max_temp_files": 0, "killed_mid_write": 0}
    for _ in range(rounds):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            os.close(read_fd)
            _writer(path, last + 1, write_fd)
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as pipe:
            pipe.readline()  # the first save finished: it also removed the previous round's temp file
            # kill 0-15 ms later: somewhere inside the next save(s)
            deadline = rng.uniform(0.0, 0.015)
            time.sleep(deadline)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            reported = [int(line) for line in pipe.read().split()] or [last + 1]
        counts["kills"] += 1
        done = max(reported)
        counts["saves"] += done - last
        # The checkpoint on disk loads, is intact, and is the last reported save or the one after it.
        model = _model(-1.0)
        extra = load_checkpoint(path, model=model)
        i = extra["i"]
        assert i in (done, done + 1), (i, done)
        for name, p in model.named_parameters():
            assert torch.equal(p, torch.full_like(p, float(i))), f"{name} torn at save {i}"
        temps = _temp_files(folder)
        counts["max_temp_files"] = max(counts["max_temp_files"], len(temps))
        counts["killed_mid_write"] += len(temps)
        assert len(temps) <= 1, temps  # only the killed writer's own file
        last = i
    save_checkpoint(path, model=_model(float(last + 1)), extra={"i": last + 1})
    assert _temp_files(folder) == []  # the next save cleaned up after the last kill
    return counts


def test_twenty_kills_during_save(tmp_path):
    counts = _kill_rounds(str(tmp_path), rounds=20, seed=0)
    print(counts)
    assert counts["kills"] == 20
    assert counts["killed_mid_write"] >= 2  # most kills land inside a save, leaving its temp file


@pytest.mark.slow
def test_two_hundred_kills_during_save(tmp_path):
    counts = _kill_rounds(str(tmp_path), rounds=200, seed=1)
    print(counts)
    assert counts["kills"] == 200
    assert counts["killed_mid_write"] >= 40


# ---------------------------------------------------------------- full disk
@pytest.fixture
def tiny_tmpfs():
    """A 1 MiB tmpfs, where mounting is allowed (root with CAP_SYS_ADMIN); else skip."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a 1 MiB tmpfs needs root and mount(8)")
    folder = tempfile.mkdtemp(prefix="mixprec-full-")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", folder], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        os.rmdir(folder)
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", folder], check=False)
        os.rmdir(folder)


def test_a_save_onto_a_full_filesystem_keeps_the_old_checkpoint(tiny_tmpfs):
    path = os.path.join(tiny_tmpfs, "ckpt.pt")
    small = nn.Linear(8, 8)
    save_checkpoint(path, model=small, extra={"v": 1})
    with open(path, "rb") as f:
        good = f.read()
    with pytest.raises(OSError, match=re.escape(f"cannot save checkpoint {path!r}: the disk is full")) as info:
        save_checkpoint(path, model=nn.Linear(600, 600), extra={"v": 2})  # 1.4 MB > 1 MiB
    assert info.value.errno == errno.ENOSPC
    with open(path, "rb") as f:
        assert f.read() == good
    assert os.listdir(tiny_tmpfs) == ["ckpt.pt"]
    assert load_checkpoint(path, model=small)["v"] == 1

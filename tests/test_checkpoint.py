"""save_checkpoint / load_checkpoint: nothing saved is lost, nothing loaded is half-applied."""

from __future__ import annotations

import datetime
import errno
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import mixprec.checkpoint as ckpt
import mixprec.checkpoint.files as ckpt_files
from mixprec import MixedPrecision, load_checkpoint, save_checkpoint
from mixprec.checkpoint import unwrap_model
from mixprec.checkpoint.integrity import checksums


class _HasModuleAttr(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)


def _trained(plan: str = "fp16-mixed", seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    mp = MixedPrecision(plan)
    model, opt = mp.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for _ in range(2):
        with mp.autocast():
            loss = model(torch.randn(3, 4)).float().pow(2).mean()
        mp.backward(loss)
        mp.step()
    return model, opt, mp


def _state(model, opt):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        repr(opt.state_dict()["param_groups"]),
        {k: {n: t.clone() for n, t in s.items() if isinstance(t, torch.Tensor)} for k, s in opt.state_dict()["state"].items()},
    )


def _same(a, b) -> bool:
    ma, ga, sa = a
    mb, gb, sb = b
    return (
        ma.keys() == mb.keys()
        and all(torch.equal(ma[k], mb[k]) for k in ma)
        and ga == gb
        and sa.keys() == sb.keys()
        and all(torch.equal(sa[k][n], sb[k][n]) for k in sa for n in sa[k])
    )


# ---------------------------------------------------------------- unwrap_model
def test_a_module_attribute_is_not_a_wrapper(tmp_path):
    net = _HasModuleAttr()
    assert unwrap_model(net) is net
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=net)
    saved = torch.load(path, weights_only=True)["model"]
    assert sorted(saved) == ["head.bias", "head.weight", "module.bias", "module.weight"]


def test_real_wrappers_are_unwrapped_by_type():
    inner = nn.Linear(2, 2)
    assert unwrap_model(nn.DataParallel(inner)) is inner
    assert unwrap_model(torch.compile(inner)) is inner
    assert unwrap_model(torch.compile(nn.DataParallel(inner))) is inner
    with pytest.raises(TypeError, match=re.escape("model must be an nn.Module, got dict")):
        unwrap_model({})  # type: ignore[arg-type]


# ------------------------------------------------------- only loadable saves
@pytest.mark.parametrize(
    ("value", "type_name"),
    [
        (np.float32(1.5), "numpy.float32"),
        (np.int64(3), "numpy.int64"),
        (pathlib.Path("runs/a"), "pathlib.PosixPath" if os.name == "posix" else "pathlib.WindowsPath"),
        (datetime.datetime(2024, 1, 2), "datetime.datetime"),
    ],
)
def test_unloadable_extra_is_refused_and_the_good_checkpoint_kept(tmp_path, value, type_name):
    path = tmp_path / "c.pt"
    model = nn.Linear(2, 2)
    save_checkpoint(path, model=model, extra={"epoch": 1})
    good = path.read_bytes()
    with pytest.raises(TypeError, match=re.escape(f"save_checkpoint: extra['meta']['when'][0] is a {type_name} (")) as info:
        save_checkpoint(path, model=model, extra={"meta": {"when": [value]}})
    assert "torch.load(weights_only=True) refuses" in str(info.value)
    assert "convert it to a plain type first" in str(info.value)
    assert path.read_bytes() == good
    assert os.listdir(tmp_path) == ["c.pt"]
    assert load_checkpoint(path, model=model)["epoch"] == 1


def test_the_written_file_is_loaded_back_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    model = nn.Linear(2, 2)
    save_checkpoint(path, model=model, extra={"v": 1})
    good = path.read_bytes()
    monkeypatch.setattr(ckpt_files, "check_loadable", lambda *a, **k: None)  # only the load-back can catch it now
    with pytest.raises(TypeError, match=re.escape("holds an object torch.load(weights_only=True) refuses")):
        save_checkpoint(path, model=model, extra={"v": pathlib.Path("x")})
    assert path.read_bytes() == good
    assert os.listdir(tmp_path) == ["c.pt"]


def test_extra_must_be_a_mapping(tmp_path):
    with pytest.raises(TypeError, match=re.escape("extra must be a dict or None, got list")):
        save_checkpoint(tmp_path / "c.pt", model=nn.Linear(2, 2), extra=[1])  # type: ignore[arg-type]


# ------------------------------------------------------------ all-or-nothing
def _rewrite(path, change):
    """A crafted checkpoint: ``change`` applied, the checksums stamped again (so the checks behind them run)."""
    payload = torch.load(path, weights_only=True)
    change(payload)
    payload["checksum"] = checksums(payload)
    torch.save(payload, path)


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("bad rng", lambda p: p["rng"].__setitem__("cpu", torch.zeros(3, dtype=torch.uint8)),
         "the CPU RNG state is a torch.uint8 tensor of shape (3,)"),
        ("bad scaler", lambda p: p["mixed_precision"]["scaler"].__setitem__("format", "nope"),
         "scaler state_dict has format 'nope'"),
        ("model shape", lambda p: p["model"].__setitem__("0.weight", torch.zeros(8, 5)),
         "model entry '0.weight' has shape (8, 5), the model's is (8, 4)"),
        ("model key", lambda p: p["model"].pop("2.bias"), "missing keys ['2.bias']"),
        ("optimizer groups", lambda p: p["optimizers"][0]["param_groups"][0]["params"].pop(),
         "optimizers[0] group 0 has 3 parameters, the optimizer's has 4"),
        ("no optimizers key", lambda p: p.pop("optimizers"), "is missing 'optimizers'"),
        ("no mp state", lambda p: p["mixed_precision"].pop("scaler"), "the MixedPrecision state is incomplete"),
    ],
)
def test_a_failed_load_changes_nothing(tmp_path, name, change, message):
    path = tmp_path / "c.pt"
    model, opt, mp = _trained(seed=0)
    save_checkpoint(path, model=model, optimizers=[opt], mp=mp)
    _rewrite(path, change)
    model2, opt2, mp2 = _trained(seed=1)
    before, scale_before, rng_before = _state(model2, opt2), mp2.state_dict(), torch.get_rng_state()
    with pytest.raises(ValueError, match=re.escape(message)):
        load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2)
    assert _same(before, _state(model2, opt2)), name
    assert mp2.state_dict() == scale_before
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_a_truncated_file_is_a_clear_error(tmp_path):
    path = tmp_path / "c.pt"
    model = nn.Linear(2, 2)
    save_checkpoint(path, model=model)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=re.escape(f"{str(path)!r} is not a readable checkpoint (truncated or corrupt file")):
        load_checkpoint(path, model=model)
    with pytest.raises(FileNotFoundError, match=re.escape(f"no checkpoint at {str(tmp_path / 'none.pt')!r}")):
        load_checkpoint(tmp_path / "none.pt", model=model)


def test_a_good_load_restores_everything(tmp_path):
    path = tmp_path / "c.pt"
    model, opt, mp = _trained(seed=0)
    save_checkpoint(path, model=model, optimizers=[opt], mp=mp, extra={"epoch": 7})
    saved = _state(model, opt)
    model2, opt2, mp2 = _trained(seed=1)
    assert load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2) == {"epoch": 7}
    assert _same(saved, _state(model2, opt2))
    assert mp2.state_dict() == mp.state_dict()


# ------------------------------------------------------------ temp files, modes
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temp_files_of_the_same_target_are_removed(tmp_path):
    path = tmp_path / "c.pt"
    host = ckpt_files.host_tag()
    dead = _dead_pid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = tmp_path / f".c.pt.{host}.{dead}.0a1b2c3d.mixprec-tmp"
        alive = tmp_path / f".c.pt.{host}.{live.pid}.0a1b2c3d.mixprec-tmp"
        other_target = tmp_path / f".d.pt.{host}.{dead}.0a1b2c3d.mixprec-tmp"
        foreign_new = tmp_path / ".c.pt.otherhost.1.0a1b2c3d.mixprec-tmp"
        foreign_old = tmp_path / ".c.pt.otherhost.2.0a1b2c3d.mixprec-tmp"
        unrelated = tmp_path / ".tmp-abcd1234.pt"
        for f in (stale, alive, other_target, foreign_new, foreign_old, unrelated):
            f.write_bytes(b"x" * 100)
        os.utime(foreign_old, (0, 0))
        assert ckpt.stale_temp_files(path) == sorted([str(foreign_old), str(stale)])
        save_checkpoint(path, model=nn.Linear(2, 2))
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            ["c.pt", alive.name, other_target.name, foreign_new.name, unrelated.name]
        )
    finally:
        live.kill()
        live.wait()


def test_files_honour_the_umask_and_keep_the_replaced_files_mode(tmp_path):
    path = tmp_path / "c.pt"
    old = os.umask(0o022)
    try:
        save_checkpoint(path, model=nn.Linear(2, 2))
        assert oct(os.stat(path).st_mode & 0o777) == oct(0o644)
        os.chmod(path, 0o640)
        save_checkpoint(path, model=nn.Linear(2, 2))
        assert oct(os.stat(path).st_mode & 0o777) == oct(0o640)
        os.umask(0o077)
        save_checkpoint(tmp_path / "d.pt", model=nn.Linear(2, 2))
        assert oct(os.stat(tmp_path / "d.pt").st_mode & 0o777) == oct(0o600)
    finally:
        os.umask(old)


class _FullDisk:
    """A file that accepts ``room`` bytes, then fails as a full disk does."""

    def __init__(self, f, room: int) -> None:
        self._f, self._room = f, room

    def write(self, data) -> int:
        n = len(memoryview(data).cast("B"))
        if n > self._room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._room -= n
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.mark.parametrize("room", [0, 100, 2000])
def test_a_full_disk_raises_oserror_and_keeps_the_old_checkpoint(tmp_path, monkeypatch, room):
    path = tmp_path / "c.pt"
    model = nn.Linear(16, 16)
    save_checkpoint(path, model=model, extra={"v": 1})
    good = path.read_bytes()
    real_open = ckpt_files.open_temp
    monkeypatch.setattr(ckpt_files, "open_temp", lambda tmp, mode: _FullDisk(real_open(tmp, mode), room))
    with pytest.raises(OSError, match=re.escape(f"cannot save checkpoint {str(path)!r}: the disk is full")) as info:
        save_checkpoint(path, model=nn.Linear(16, 16), extra={"v": 2})
    assert info.value.errno == errno.ENOSPC
    assert "the previous checkpoint, if any, is unchanged" in str(info.value)
    assert path.read_bytes() == good
    assert os.listdir(tmp_path) == ["c.pt"]

"""Checksums of a checkpoint's contents: a bit that changed on disk is an error, not different numbers.

:func:`~mixprec.save_checkpoint` stores, beside the payload, one CRC-32 per part (model,
optimizers, MixedPrecision state, extra, RNG state) computed over every value it holds:
each tensor's dtype, shape and bytes, and every key, number and string. CRC-32 catches every
single-bit flip and every burst of up to 32 bits; it runs at several GB/s (zlib), a fraction
of the time writing or reading the file takes. :func:`~mixprec.load_checkpoint` recomputes
them before it checks or applies anything. A checkpoint written before checksums existed has
none and loads as before.

>>> import torch
>>> payload = {"model": {"w": torch.ones(3)}, "extra": {"epoch": 3}}
>>> stored = checksums(payload)
>>> verify_checksums("c.pt", payload, stored)
>>> payload["model"]["w"][1] = 1.0000001  # one bit of the tensor's data
>>> verify_checksums("c.pt", payload, stored)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: checkpoint 'c.pt' is corrupt: its 'model' part does not match the checksum save_checkpoint stored ...
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["ALGORITHM", "PARTS", "checksums", "verify_checksums"]

#: The ``algorithm`` entry of the stored checksums (the encoding below, CRC-32 of zlib).
ALGORITHM = "crc32/1"
#: The payload entries that are checksummed, each on its own (an error names the part).
PARTS = ("model", "optimizers", "optimizer_classes", "mixed_precision", "extra", "rng")

_SCALARS = (type(None), bool, int, float, complex, str, bytes, bytearray)


_PARALLEL_BYTES = 1 << 26  # below this, hashing on one thread is as fast


def _data_crc(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (0 where only its dtype and shape are checked)."""
    plain = type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided
    if not plain or t.is_quantized or t.device.type == "meta" or t.numel() == 0:
        return 0  # a tensor subclass' data is its own business
    data = t.detach()
    if data.device.type != "cpu":
        data = data.cpu()  # a few tensors at a time: host memory stays bounded
    data = data.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
    return zlib.crc32(memoryview(data.numpy()))  # type: ignore[arg-type]


def _tensors(obj: Any, out: dict[int, torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out[id(obj)] = obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            _tensors(value, out)
    elif isinstance(obj, list | tuple | set | frozenset):
        for item in obj:
            _tensors(item, out)


def _data_crcs(objs: list[Any]) -> dict[int, int]:
    """The :func:`_data_crc` of every tensor in ``objs``, by id, on several threads for a large
    state (zlib releases the GIL while it hashes)."""
    tensors: dict[int, torch.Tensor] = {}
    for obj in objs:
        _tensors(obj, tensors)
    items = list(tensors.items())
    size = sum(t.numel() * t.element_size() for _, t in items)
    workers = min(8, os.cpu_count() or 1)
    if workers < 2 or size < _PARALLEL_BYTES:
        return {key: _data_crc(t) for key, t in items}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip((key for key, _ in items), pool.map(_data_crc, (t for _, t in items)), strict=True))


def _crc(obj: Any, data: dict[int, int], crc: int = 0) -> int:
    """CRC-32 of ``obj``'s contents, in an encoding that pickling does not change (``data``: the
    CRC-32 of each tensor's bytes, by id)."""
    if isinstance(obj, torch.Tensor):
        crc = zlib.crc32(f"T{type(obj).__name__}{obj.dtype}{tuple(obj.shape)}{obj.layout}".encode(), crc)
        return zlib.crc32(data[id(obj)].to_bytes(4, "little"), crc)
    kind = type(obj)
    if kind in (bytes, bytearray):
        return zlib.crc32(b"B%d:" % len(obj) + bytes(obj), crc)
    if kind in _SCALARS:
        return zlib.crc32(f"{kind.__name__}:{obj!r};".encode("utf-8", "surrogatepass"), crc)
    if isinstance(obj, Mapping):
        crc = zlib.crc32(f"D{len(obj)}".encode(), crc)
        for key, value in obj.items():
            crc = _crc(value, data, _crc(key, data, crc))
        return crc
    if isinstance(obj, list | tuple):
        crc = zlib.crc32(f"{'L' if isinstance(obj, list) else 'U'}{len(obj)}".encode(), crc)
        for item in obj:
            crc = _crc(item, data, crc)
        return crc
    if isinstance(obj, set | frozenset):  # no order survives a reload: combine the items' checksums sorted
        crc = zlib.crc32(f"S{len(obj)}".encode(), crc)
        for item in sorted(_crc(x, data) for x in obj):
            crc = zlib.crc32(item.to_bytes(4, "little"), crc)
        return crc
    if isinstance(obj, torch.dtype | torch.device | torch.Size | torch.layout | torch.memory_format):
        return zlib.crc32(f"{kind.__name__}:{obj};".encode(), crc)
    return zlib.crc32(f"{kind.__module__}.{kind.__qualname__};".encode(), crc)  # registered safe globals


def checksums(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The checksums :func:`~mixprec.save_checkpoint` stores beside ``payload``: the algorithm
    and one CRC-32 per part of :data:`PARTS` that ``payload`` holds."""
    out: dict[str, Any] = {"algorithm": ALGORITHM}
    data = _data_crcs([payload[part] for part in PARTS if part in payload])
    for part in PARTS:
        if part in payload:
            out[part] = _crc(payload[part], data)
    return out


def verify_checksums(path: str, payload: Mapping[str, Any], stored: Any) -> None:
    """Raise ValueError naming the part whose contents do not match ``stored`` (the
    checksums saved with them); ``stored`` None (a checkpoint older than checksums) passes."""
    if stored is None:
        return
    if not isinstance(stored, Mapping) or stored.get("algorithm") != ALGORITHM:
        algorithm = stored.get("algorithm") if isinstance(stored, Mapping) else type(stored).__name__
        raise ValueError(
            f"checkpoint {path!r} holds checksums of an unknown kind ({algorithm!r}, this mixprec knows "
            f"{ALGORITHM!r}): it was written by a newer mixprec, or the file is corrupt; load it with that version"
        )
    data = _data_crcs([payload[part] for part in PARTS if part in payload])
    for part in PARTS:
        if part not in payload and part not in stored:
            continue
        expected = stored.get(part)
        if part not in payload or not isinstance(expected, int):
            raise ValueError(
                f"checkpoint {path!r} is corrupt: its {part!r} part or that part's checksum is missing; nothing "
                "was loaded. Restore the file from a good copy, or resume from an earlier checkpoint"
            )
        got = _crc(payload[part], data)
        if got != expected:
            raise ValueError(
                f"checkpoint {path!r} is corrupt: its {part!r} part does not match the checksum save_checkpoint "
                f"stored (CRC-32 {got:08x}, saved {expected:08x}): the file changed after it was written (a disk, "
                "copy or transfer error). Nothing was loaded; restore the file from a good copy, or resume from "
                "an earlier checkpoint"
            )

"""The one walker over nested tensors: every container kind, types kept, no copy when unchanged."""

from __future__ import annotations

import collections
import dataclasses

import torch

from mixprec.dtypes import cast_floating
from mixprec.nested import first_tensor, map_tensors, tensors

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: list
    note: str = "x"


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor


class Record(dict):
    pass


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16)


def test_every_container_kind_is_rebuilt_with_its_type() -> None:
    value = {
        "list": [torch.ones(1)],
        "tuple": (torch.ones(1), 3),
        "pair": Pair(torch.ones(1), "s"),
        "record": Record(t=torch.ones(1)),
        "dc": Out(torch.ones(1), [torch.ones(1)]),
        "frozen": Frozen(torch.ones(1)),
    }
    out = map_tensors(_bf16, value)
    assert type(out["pair"]) is Pair and out["pair"].b == "s"
    assert type(out["record"]) is Record
    assert type(out["dc"]) is Out and out["dc"].note == "x"
    assert type(out["frozen"]) is Frozen
    assert all(t.dtype == torch.bfloat16 for t in tensors(out))
    assert len(list(tensors(out))) == 7
    # the input is not modified
    assert all(t.dtype == torch.float32 for t in tensors(value))


def test_unchanged_containers_are_not_copied() -> None:
    value = {"a": [torch.ones(1, dtype=torch.int64)], "b": Pair(1, 2)}
    assert map_tensors(lambda t: t, value) is value
    assert cast_floating(value, torch.bfloat16) is value


def test_first_tensor_and_order() -> None:
    a, b = torch.ones(1, dtype=torch.int64), torch.ones(2)
    value = [None, {"k": (a, Out(b, []))}]
    assert [t is x for t, x in zip(tensors(value), (a, b), strict=True)] == [True, True]
    assert first_tensor(value, torch.Tensor.is_floating_point) is b
    assert first_tensor([1, "s"]) is None


def test_cast_floating_handles_namedtuples_and_dataclasses() -> None:
    out = cast_floating([Pair(torch.ones(1), torch.ones(1, dtype=torch.int64)), Out(torch.ones(1), [])], torch.float16)
    assert out[0].a.dtype == torch.float16 and out[0].b.dtype == torch.int64
    assert out[1].logits.dtype == torch.float16

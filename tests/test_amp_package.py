"""The autocast engine's package layout (mixprec.amp, mixprec.policy) and the uniform
nested-structure rules its walkers follow (mixprec.nested): namedtuples, dict subclasses
and dataclasses are cast and rebuilt like lists, tuples and dicts."""

from __future__ import annotations

import collections
import dataclasses
import importlib
import importlib.util
import types
from pathlib import Path

import torch
from torch import nn

import mixprec
from mixprec.amp import autocast, register_op
from mixprec.islands import apply_fp32_islands, install_input_cast
from mixprec.policy import OpPolicy

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
SRC = Path(mixprec.__file__).parent


# ------------------------------------------------------------------------ layout
def test_amp_is_a_module_whose_name_does_not_collide_with_the_autocast_class() -> None:
    amp = importlib.import_module("mixprec.amp")
    assert isinstance(amp, types.ModuleType)
    for name in ("autocast", "autocast_backward", "register_op", "unregister_op", "custom_op_precision"):
        assert getattr(amp, name) is getattr(mixprec, name), name
    assert amp.registered_ops is importlib.import_module("mixprec.policy").registered_ops
    assert isinstance(mixprec.autocast, type)  # the class, as before
    assert importlib.util.find_spec("mixprec.autocast") is None  # no module hiding behind it
    ops = importlib.import_module("mixprec.amp.ops")
    assert ops.register_op is mixprec.register_op and ops.unregister_op is mixprec.unregister_op
    assert importlib.import_module("mixprec.amp.context").autocast is mixprec.autocast
    assert importlib.import_module("mixprec.amp.mode").PolicyMode.__module__ == "mixprec.amp.mode"


def test_policy_package_keeps_its_public_names() -> None:
    policy = importlib.import_module("mixprec.policy")
    for name in policy.__all__:
        assert hasattr(policy, name), name
    assert policy.OpPolicy is mixprec.OpPolicy and policy.Precision is mixprec.Precision
    assert policy.compare_with_torch is mixprec.compare_with_torch
    assert policy.as_module_rules(nn.LayerNorm) == (nn.LayerNorm,)


# ------------------------------------------------ nested arguments of intercepted ops
Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    ids: torch.Tensor
    note: str = "kept"


class Record(collections.OrderedDict):  # a dict subclass, as model-output records are
    pass


def test_registered_op_casts_tensors_in_namedtuples_dict_subclasses_and_dataclasses() -> None:
    seen: dict[str, object] = {}

    def kernel(batch: Batch, extra: Record, pair: Pair) -> torch.Tensor:
        seen.update(batch=batch, extra=extra, pair=pair)
        return batch.x

    fp32_kernel = register_op(kernel, "fp32")
    ids = torch.arange(3)
    batch = Batch(torch.ones(3, dtype=BF16), ids)
    extra = Record(w=torch.ones(2, dtype=BF16), n=3)
    pair = Pair(torch.ones(1, dtype=BF16), [torch.ones(1, dtype=FP16)])
    with autocast(BF16, device_type="cpu"):
        out = fp32_kernel(batch, extra=extra, pair=pair)
    got_batch, got_extra, got_pair = seen["batch"], seen["extra"], seen["pair"]
    assert isinstance(got_batch, Batch) and got_batch.x.dtype == FP32 and got_batch.note == "kept"
    assert got_batch.ids is ids  # integer tensors are never cast
    assert type(got_extra) is Record and got_extra["w"].dtype == FP32 and got_extra["n"] == 3
    assert type(got_pair) is Pair and got_pair.a.dtype == FP32 and got_pair.b[0].dtype == FP32
    assert out.dtype == FP32
    assert batch.x.dtype == BF16  # the caller's objects are not modified
    with autocast(BF16, device_type="cpu", enabled=False):
        assert fp32_kernel(batch, extra=extra, pair=pair).dtype == BF16  # autocast off: untouched


def test_promote_op_finds_the_widest_input_inside_a_dataclass() -> None:
    seen: list[torch.dtype] = []

    def kernel(batch: Batch) -> torch.Tensor:
        seen.append(batch.x.dtype)
        return batch.x

    promote = register_op(kernel, "promote")
    with autocast(BF16, device_type="cpu"):
        promote(Batch(torch.ones(1, dtype=BF16), torch.ones(1)))  # ids fp32 here: widest is fp32
        promote(Batch(torch.ones(1, dtype=BF16), torch.arange(1)))
    assert seen == [FP32, BF16]


# --------------------------------------------------- islands fed nested inputs
class PairHead(nn.Module):
    """An island-to-be that takes a namedtuple; scales 1e5 down to a value fp16 holds."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1e-3))

    def forward(self, pair: Pair) -> torch.Tensor:
        return pair.a * self.scale + pair.b.sum()


def test_input_cast_hands_an_island_the_fp32_originals_inside_a_namedtuple() -> None:
    head = PairHead()
    apply_fp32_islands(head, OpPolicy(fp32_modules=[PairHead]))

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = head

        def forward(self, pair: Pair) -> torch.Tensor:
            return self.head(pair)

    root = Root()
    handles = install_input_cast(root, FP16)
    pair = Pair(torch.tensor([1e5, 2.0]), torch.tensor([0.5]))  # 1e5 is inf in fp16
    out = root(pair)
    for h in handles:
        h.remove()
    assert out.dtype == FP16  # transparent: back to the low dtype its input arrived in
    expected = (torch.tensor([1e5, 2.0]) * torch.tensor(1e-3) + 0.5).to(FP16)
    assert torch.equal(out, expected)  # finite: the island computed on 1e5, not on fp16's inf


def test_island_keeps_dict_subclass_and_dataclass_inputs_and_casts_them_to_fp32() -> None:
    seen: dict[str, object] = {}

    class Head(nn.Module):
        def forward(self, batch: Batch, extra: Record) -> torch.Tensor:
            seen.update(batch=batch, extra=extra)
            return batch.x + extra["w"]

    head = Head()
    apply_fp32_islands(head, OpPolicy(fp32_modules=[Head]))
    with autocast(BF16, device_type="cpu"):
        out = head(Batch(torch.ones(2, dtype=BF16), torch.arange(2)), extra=Record(w=torch.ones(2, dtype=BF16)))
    assert out.dtype == FP32
    batch, extra = seen["batch"], seen["extra"]
    assert isinstance(batch, Batch) and batch.x.dtype == FP32 and batch.ids.dtype == torch.int64
    assert type(extra) is Record and extra["w"].dtype == FP32


# ------------------------------------------------------------------------ op_stats
def test_op_stats_counting_mode_counts_into_its_stats() -> None:
    from mixprec.stats import OpStats

    stats = OpStats()
    with stats.counting_mode():
        torch.ones(2, dtype=BF16).add(1)
    assert stats[("add", BF16)] == 1
    torch.ones(2).add(1)  # outside the mode: not counted
    assert stats.calls("add") == 1


def test_a_plain_callable_can_be_unregistered_by_itself_or_its_wrapper() -> None:
    from mixprec.amp import register_op, registered_ops, unregister_op

    def kernel(x):
        return x + 1

    name = f"{kernel.__module__}.{kernel.__qualname__}"
    wrapper = register_op(kernel, "fp32")
    assert name in registered_ops()
    assert unregister_op(wrapper) and name not in registered_ops()
    assert not unregister_op(wrapper)  # nothing left to undo
    register_op(kernel, "low")
    assert unregister_op(kernel) and name not in registered_ops()

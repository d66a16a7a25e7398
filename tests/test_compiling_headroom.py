"""call_compiled raises dynamo's recompile limit where a recompilation can hit it: on every
call that compiles, and on every call once a function has more specialisations than
dynamo's own limit leaves room for; a function with few leaves the config alone."""

from __future__ import annotations

import contextlib

import torch

import mixprec.compiling as compiling


def test_recompile_headroom_on_compiling_calls_and_once_specialisations_crowd_the_limit(monkeypatch):
    entered: list[int] = []

    @contextlib.contextmanager
    def counting():
        entered.append(1)
        yield

    monkeypatch.setattr(compiling, "_KEYS", {})
    monkeypatch.setattr(compiling, "compiles_for", lambda x: True)
    monkeypatch.setattr(compiling, "compiled", lambda fn, dynamic: fn)  # nothing really compiles
    monkeypatch.setattr(compiling, "recompile_headroom", counting)
    monkeypatch.setattr(compiling, "_DEFAULT_LIMIT", 8)

    def fn(x: torch.Tensor, c: int) -> torch.Tensor:
        return x + c

    x = torch.zeros(2)
    assert torch.equal(compiling.call_compiled(fn, x, 0), x)  # a new specialisation compiles
    assert len(entered) == 1
    compiling.call_compiled(fn, x, 0)  # compiled, one key: room for a recompile under dynamo's limit
    assert len(entered) == 1
    for c in range(1, 5):  # keys 1..4: each compiles
        compiling.call_compiled(fn, x, c)
    assert len(entered) == 5
    compiling.call_compiled(fn, x, 0)  # five keys: a recompile each could pass dynamo's 8
    assert len(entered) == 6

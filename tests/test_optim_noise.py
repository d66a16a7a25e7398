"""Stochastic rounding draws one noise stream on every route (mixprec.optim.codecs.Noise).

Element ``i`` of a weight whose first element sits at position ``first`` of its param group's
call gets the 16 noise bits ``hash16((first + i) ^ seed32(count))``, ``count`` the wrapper's
checkpointed call count: the generic path, the eager chunks (however they are cut), the
compiled loop and the native kernel all draw these, so routes differ only by the fp32
rounding of the update itself.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mixprec.optim import StochasticRoundingOptimizer, native
from mixprec.optim.codecs import hash16, seed32


def _weights(seed: int, shapes) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).bfloat16()) for s in shapes]


def _grads(params, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).bfloat16()


def _expected_sgd(params, lr: float, count: int) -> list[torch.Tensor]:
    """SGD's fp32 update of each weight, stochastically rounded with the documented noise."""
    out, first = [], 0
    seed = seed32(count)
    for p in params:
        w32 = p.detach().float().add(p.grad.float(), alpha=-lr)  # type: ignore[union-attr]
        pos = torch.arange(first, first + p.numel(), dtype=torch.int64).view(p.shape)
        bits = (w32.view(torch.int32) + hash16(pos ^ seed)) & -65536
        out.append(bits.view(torch.float32).bfloat16())
        first += p.numel()
    return out


@pytest.mark.parametrize("route", ["generic", "eager-chunks-of-7", "eager-one-chunk"])
def test_the_noise_is_the_position_hash_of_the_call(route):
    shapes = [(5, 9), (33,), (2, 3, 4)]
    params = _weights(0, shapes)
    fast, chunk = {"generic": (False, None), "eager-chunks-of-7": (True, 7), "eager-one-chunk": (True, 10**6)}[route]
    opt = StochasticRoundingOptimizer(torch.optim.SGD(params, lr=0.01), seed=5, fast=fast, chunk_numel=chunk)
    count = opt.rounding_state()["counter"]
    assert count == (5 * 0x9E3779B9) % (1 << 32)
    for step in range(3):
        _grads(params, step)
        want = _expected_sgd(params, 0.01, count + step)
        opt.step()
        for p, w in zip(params, want, strict=True):
            assert torch.equal(p.detach().view(torch.int16), w.view(torch.int16)), (route, step)
    assert opt.rounding_state()["counter"] == count + 3  # one count per param group and step


def test_two_groups_draw_two_calls():
    a, b = _weights(1, [(40,)]), _weights(2, [(40,)])
    opt = StochasticRoundingOptimizer(torch.optim.SGD([{"params": a}, {"params": b}], lr=0.01), fast=False)
    _grads(a + b, 0)
    want = _expected_sgd(a, 0.01, 0) + _expected_sgd(b, 0.01, 1)  # each group's weights start at position 0
    opt.step()
    assert all(torch.equal(p.detach(), w) for p, w in zip(a + b, want, strict=True))
    assert opt.rounding_state()["counter"] == 2


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.view(torch.int16) == b.view(torch.int16)).float().mean().item()


def _adam_run(setting, shapes, *, state_dtype, steps=4, transposed=()):
    params = _weights(3, shapes)
    for i in transposed:  # a non-contiguous weight: neither native nor compiled takes it
        params[i] = torch.nn.Parameter(params[i].detach().t().contiguous().t())
    opt = StochasticRoundingOptimizer(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), state_dtype=state_dtype,
                                      compile=setting, fused=False)
    for step in range(steps):
        _grads(params, step)
        opt.step()
    return params, opt


@pytest.mark.skipif(not native.status()[0], reason="the native kernel is not available")
def test_native_and_eager_routes_round_alike_also_when_a_group_is_split(monkeypatch):
    """8-bit moments: the native kernel takes the contiguous weights, the eager chunks the
    transposed one; against every weight on the eager path (compile=False) the weights agree bit for bit
    but where the two routes' fp32 updates differ (native: torch's CPU vector loop's fused multiply-adds
    in the last ``numel % 16`` elements) and the noise carries such a difference across a boundary."""
    calls = []
    real = native.native_adam_step
    monkeypatch.setattr("mixprec.optim.routing.native.native_adam_step",
                        lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
    shapes = [(64, 48), (48, 64), (1000,)]
    eager, opt_e = _adam_run(False, shapes, state_dtype="8bit", transposed=(1,))
    assert not calls
    split, opt_s = _adam_run("auto", shapes, state_dtype="8bit", transposed=(1,))
    assert calls == [2] * 4  # the two contiguous weights natively, each step
    for a, b in zip(eager, split, strict=True):
        assert _same_bits(a.detach(), b.detach()) > 0.995
    assert opt_e.rounding_state() == opt_s.rounding_state()


def test_an_earlier_checkpoint_with_generator_states_loads_and_continues_the_count():
    params = _weights(4, [(64,)])
    opt = StochasticRoundingOptimizer(torch.optim.SGD(params, lr=0.01), fast=False)
    _grads(params, 0)
    opt.step()
    sd = opt.state_dict()
    old = {**sd, "mixprec_lowbit": {**sd["mixprec_lowbit"], "generators": {"cpu": torch.Generator().get_state()},
                                    "counter": 41}}
    fresh = _weights(4, [(64,)])
    with torch.no_grad():
        fresh[0].copy_(params[0])
    opt2 = StochasticRoundingOptimizer(torch.optim.SGD(fresh, lr=0.01), fast=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt2.load_state_dict(old)
    assert opt2.rounding_state() == {"seed": 0, "counter": 41}
    assert "generators" not in opt2.state_dict()["mixprec_lowbit"]
    _grads(fresh, 1)
    want = _expected_sgd(fresh, 0.01, 41)
    opt2.step()
    assert torch.equal(fresh[0].detach(), want[0])


def test_the_eager_hash_in_place_gives_the_compiled_hash():
    from mixprec.optim.codecs import hash16_

    x = torch.cat([torch.arange(-70000, 70000), torch.tensor([2**32 - 1, 2**32, 2**40 + 5, 2**62])]).to(torch.int64)
    assert torch.equal(hash16_(x.clone()), hash16(x))


@pytest.mark.parametrize("native_loop", [True, False])
def test_the_memory_estimate_counts_the_noise_of_the_generic_path(monkeypatch, native_loop):
    """The generic path rounds a whole weight at once: in torch operations its positions, their hash's
    temporary and the noise bits (20 bytes per element of the largest weight) beside the fp32 proxies;
    in the native loop nothing."""
    from mixprec.optim import LowPrecisionOptimizer, native_build

    monkeypatch.setattr(native_build, "status", lambda build=True: (native_loop, ""))
    params = _weights(5, [(300, 7), (11,)])
    nearest = LowPrecisionOptimizer(torch.optim.AdamW(params), fast=False).step_transient_bytes()
    sr = StochasticRoundingOptimizer(torch.optim.AdamW(params), fast=False).step_transient_bytes()
    assert sr - nearest == (0 if native_loop else 20 * 300 * 7)


@pytest.mark.skipif(not native.status()[0], reason="the native kernel is not available")
@pytest.mark.parametrize("fast", [True, False])
def test_the_native_loop_and_the_torch_ops_draw_the_same_noise(monkeypatch, fast):
    """The eager routes round on the CPU in the native kernel's one-pass loop (mp_sr_bits) where it is
    built, in torch operations elsewhere (no compiler, MIXPREC_NATIVE=0, a GPU): the same bits."""
    from mixprec.optim import native_build

    runs = []
    for lib in (native_build.library(), None):
        monkeypatch.setattr(native_build, "library", lambda lib=lib: lib)
        params = _weights(6, [(37, 41), (2000,), (3,)])
        opt = StochasticRoundingOptimizer(torch.optim.AdamW(params, lr=1e-2), fast=fast, chunk_numel=700, compile=False)
        for step in range(3):
            _grads(params, step)
            opt.step()
        runs.append(params)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a.detach().view(torch.int16), b.detach().view(torch.int16))


def _far(monkeypatch, offset: int) -> None:
    """Every call's positions start at ``offset``: a param group as if 2**32 elements came first."""
    from mixprec.optim import codecs

    real = codecs.call_noise

    def far(count, shard, params):
        noise = real(count, shard, params)
        return codecs.Noise(noise.seed, {k: v + offset for k, v in noise.firsts.items()})

    monkeypatch.setattr(codecs, "call_noise", far)


def _hash_of(pos: torch.Tensor, seed: int) -> torch.Tensor:
    """The documented noise, written out: the position's high 32 bits folded into its low ones."""
    x = pos ^ seed
    low = (x & 0xFFFFFFFF) ^ (((x >> 32) * 0x9E3779B1) & 0xFFFFFFFF)
    return hash16(low)


def test_positions_past_two_to_the_32_draw_other_noise_than_those_2_32_before():
    pos = torch.arange(2**32 - 1000, 2**32 + 1000, dtype=torch.int64)
    seed = seed32(3)
    near, far = hash16(pos ^ seed), hash16((pos + 2**32) ^ seed)
    assert torch.equal(near[:1000], _hash_of(pos[:1000], seed))  # below 2**32: the 32-bit hash, unchanged
    assert torch.equal(hash16((pos[:1000] & 0xFFFFFFFF) ^ seed), near[:1000])
    assert (near != far).float().mean() > 0.99
    assert (hash16(pos[1000:] ^ seed) != hash16((pos[1000:] - 2**32) ^ seed)).float().mean() > 0.99


@pytest.mark.parametrize("route", ["generic", "eager-chunks-of-7", "eager-one-chunk"])
@pytest.mark.parametrize("native_loop", [True, False])
def test_a_weight_that_straddles_position_two_to_the_32_gets_the_folded_noise(monkeypatch, route, native_loop):
    from mixprec.optim import native_build

    if native_loop and not native.status()[0]:
        pytest.skip("the native kernel is not available")
    if not native_loop:
        monkeypatch.setattr(native_build, "library", lambda: None)
    offset = 2**32 - 100  # the first weight's element 100 sits at position 2**32
    _far(monkeypatch, offset)
    params = _weights(0, [(5, 60), (33,)])
    fast, chunk = {"generic": (False, None), "eager-chunks-of-7": (True, 7), "eager-one-chunk": (True, 10**6)}[route]
    opt = StochasticRoundingOptimizer(torch.optim.SGD(params, lr=0.01), fast=fast, chunk_numel=chunk)
    count = opt.rounding_state()["counter"]
    _grads(params, 0)
    first, want = offset, []
    for p in params:
        w32 = p.detach().float().add(p.grad.float(), alpha=-0.01)  # type: ignore[union-attr]
        pos = torch.arange(first, first + p.numel(), dtype=torch.int64).view(p.shape)
        want.append(((w32.view(torch.int32) + _hash_of(pos, seed32(count))) & -65536).view(torch.float32).bfloat16())
        first += p.numel()
    opt.step()
    for p, w in zip(params, want, strict=True):
        assert torch.equal(p.detach().view(torch.int16), w.view(torch.int16)), route


@pytest.mark.skipif(not native.status()[0], reason="the native kernel is not available")
@pytest.mark.parametrize("setting", ["auto", True])
def test_the_native_and_compiled_loops_fold_the_high_bits_as_the_eager_path_does(monkeypatch, setting):
    """8-bit moments under compile='auto' step in the native kernel, compile=True in the compiled loop;
    past position 2**32 both draw the noise of the eager path's torch operations (with the 32-bit hash
    alone about half of the rounded bits would differ there)."""
    from mixprec.optim import native_build

    _far(monkeypatch, 2**32 - 3000)
    shapes = [(64, 48), (1000,)]
    with monkeypatch.context() as m:
        m.setattr(native_build, "library", lambda: None)  # the eager store's noise in torch operations
        eager, _ = _adam_run(False, shapes, state_dtype="8bit", steps=2)
    calls = []
    real = native.native_adam_step
    monkeypatch.setattr("mixprec.optim.routing.native.native_adam_step",
                        lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
    other, _ = _adam_run(setting, shapes, state_dtype="8bit", steps=2)
    assert bool(calls) == (setting == "auto")
    for a, b in zip(eager, other, strict=True):
        assert _same_bits(a.detach(), b.detach()) > 0.99

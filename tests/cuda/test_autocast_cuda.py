"""mixprec.autocast on CUDA, op by op, for fp16 and bf16.

For every op of mixprec's default CUDA table (``mixprec.policy.default_table("cuda", dtype)``:
the pinned table corrected by what this torch's CUDA autocast does, found by running
each op on the GPU once CUDA is initialized, which this module does first):

1. ``torch.autocast("cuda")`` equals explicit casts to the op's class in that table (so
   the derived class is what the installed torch does on the GPU);
2. ``mixprec.autocast`` without custom ops equals ``torch.autocast`` bitwise;
3. mixprec's engine forced to run the op itself equals ``torch.autocast``;
4. the op moved to the other class through an ``OpPolicy`` equals explicit casts with
   autocast off, bitwise.

The CPU table's cases (tests/test_policy.py) are reused for the ops both tables share,
moved to the GPU; the CUDA-only ops get cases here.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.amp import autocast
from mixprec.amp.mode import PolicyMode
from mixprec.policy import (
    OpPolicy,
    OpTable,
    Precision,
    compare_with_torch,
    default_table,
    table_changes,
    torch_autocast_ops,
    torch_table,
)
from mixprec.policy.tables import TABLES_TORCH_VERSION
from tests.test_policy import CPU_CASES, Case, _case, _flat, _map, _r, assert_bitwise

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32
DTYPES = [pytest.param(FP16, id="fp16"), pytest.param(BF16, id="bf16")]
if torch.cuda.is_available():
    torch.cuda.init()  # the probe runs the CUDA ops only in a process that uses CUDA already


def _table(dtype: torch.dtype) -> OpTable:
    """This torch's default CUDA table for ``dtype`` (derived once per process)."""
    return default_table("cuda", dtype)


TABLE_OPS = frozenset().union(*(_table(d).ops - _table(d).banned for d in (FP16, BF16)))

# torch reaches fp32 for these through their dtype argument (the kernel reads the low
# precision input and computes in fp32) instead of casting the input first; both give
# fp32 results computed in fp32, but the kernels may differ in vectorisation and so in
# the order of a reduction: compared to fp32 round-off, dtype exact.
VIA_DTYPE_ARGUMENT = frozenset({
    "cumprod", "cumsum", "linalg_matrix_norm", "linalg_vector_norm", "log_softmax", "norm",
    "prod", "softmax", "sum",
})  # fmt: skip


# What an older torch's CUDA autocast registers differently from the pinned table, as seen
# on a GPU (torch 2.11.0+cu130, H200): (only in mixprec's table, only in torch's). The
# default tables absorb them (test_the_default_cuda_table_absorbs_the_recorded_differences).
KNOWN_TORCH_DELTAS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "2.11": (frozenset({"rms_norm"}), frozenset({"_cudnn_rnn"})),
}
TORCH_MINOR = ".".join(torch.__version__.split("+")[0].split(".")[:2])


def _pos(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) + 0.5


def _unit(*shape: int, seed: int = 0) -> torch.Tensor:
    return (torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1) * 0.9


def _cuda_only_cases() -> dict[str, list[Case]]:
    """Cases for the CUDA table ops the CPU table has no case for (built on the CPU)."""
    c: dict[str, list[Case]] = {}
    x4 = _r(2, 2, 4, 4)
    h = 4
    aten = torch.ops.aten
    # --- low
    t, n, i = 3, 2, 5  # one LSTM layer (mode 2) with unflattened weights; outputs: y, hy, cy (then workspace)
    c["_cudnn_rnn"] = [
        _case(lambda *a: torch.ops.aten._cudnn_rnn(*a)[:3], _r(t, n, i), [_r(4 * h, i, seed=1), _r(4 * h, h, seed=2), _r(4 * h, seed=3), _r(4 * h, seed=4)],
              4, None, _r(1, n, h, seed=5), _r(1, n, h, seed=6), 2, h, 0, 1, False, 0.0, False, False, [], None)
    ]  # autocast by torch 2.11 (and reflattened), not by 2.13
    c["_scaled_dot_product_flash_attention"] = [
        _case(lambda *a: aten._scaled_dot_product_flash_attention(*a)[:2], _r(1, 2, 16, 16), _r(1, 2, 16, 16, seed=1), _r(1, 2, 16, 16, seed=2))
    ]  # output and logsumexp; the rest are RNG state and workspace
    c["_thnn_fused_gru_cell"] = [_case(aten._thnn_fused_gru_cell, _r(3, 3 * h), _r(3, 3 * h, seed=1), _r(3, h, seed=2), _r(3 * h, seed=3), _r(3 * h, seed=4))]
    c["_thnn_fused_lstm_cell"] = [_case(aten._thnn_fused_lstm_cell, _r(3, 4 * h), _r(3, 4 * h, seed=1), _r(3, h, seed=2), _r(4 * h, seed=3), _r(4 * h, seed=4))]
    c["addmv"] = [_case(torch.addmv, _r(4), _r(4, 5, seed=1), _r(5, seed=2))]
    c["addr"] = [_case(torch.addr, _r(4, 5), _r(4, seed=1), _r(5, seed=2))]
    c["chain_matmul"] = [_case(torch.chain_matmul, _r(4, 5), _r(5, 6, seed=1), _r(6, 3, seed=2))]
    c["convolution"] = [_case(torch.convolution, x4, _r(3, 2, 3, 3, seed=1), _r(3, seed=2), [1, 1], [0, 0], [1, 1], False, [0, 0], 1)]
    c["cudnn_convolution"] = [_case(torch.cudnn_convolution, x4, _r(4, 2, 3, 3, seed=1), [1, 1], [1, 1], [1, 1], 1, False, True, False)]
    c["cudnn_convolution_transpose"] = [
        _case(torch.cudnn_convolution_transpose, x4, _r(2, 4, 3, 3, seed=1), [0, 0], [0, 0], [1, 1], [1, 1], 1, False, True, False)
    ]
    c["einsum"] = [_case(torch.einsum, "ij,jk->ik", _r(4, 5), _r(5, 3, seed=1))]
    c["gru_cell"] = [_case(torch.gru_cell, _r(3, 5), _r(3, h, seed=1), _r(3 * h, 5, seed=2), _r(3 * h, h, seed=3), _r(3 * h, seed=4), _r(3 * h, seed=5))]
    c["linalg_multi_dot"] = [_case(torch.linalg.multi_dot, [_r(4, 5), _r(5, 6, seed=1), _r(6, 3, seed=2)])]
    c["lstm_cell"] = [
        _case(torch.lstm_cell, _r(3, 5), [_r(3, h, seed=1), _r(3, h, seed=6)], _r(4 * h, 5, seed=2), _r(4 * h, h, seed=3), _r(4 * h, seed=4), _r(4 * h, seed=5))
    ]
    c["mv"] = [_case(torch.mv, _r(4, 5), _r(5, seed=1))]
    c["rnn_relu_cell"] = [_case(torch.rnn_relu_cell, _r(3, 5), _r(3, h, seed=1), _r(h, 5, seed=2), _r(h, h, seed=3), _r(h, seed=4), _r(h, seed=5))]
    c["rnn_tanh_cell"] = [_case(torch.rnn_tanh_cell, _r(3, 5), _r(3, h, seed=1), _r(h, 5, seed=2), _r(h, h, seed=3), _r(h, seed=4), _r(h, seed=5))]
    # --- fp32
    nn_ = torch._C._nn
    x3, x5 = _r(1, 2, 8), _r(1, 1, 4, 4, 4)
    c["_upsample_bicubic2d_aa"] = [_case(nn_._upsample_bicubic2d_aa, x4, [8, 8], False)]
    c["_upsample_bilinear2d_aa"] = [_case(nn_._upsample_bilinear2d_aa, x4, [8, 8], False)]
    c["_upsample_nearest_exact1d"] = [_case(nn_._upsample_nearest_exact1d, x3, [16])]
    c["_upsample_nearest_exact2d"] = [_case(nn_._upsample_nearest_exact2d, x4, [8, 8])]
    c["_upsample_nearest_exact3d"] = [_case(nn_._upsample_nearest_exact3d, x5, [8, 8, 8])]
    c["upsample_bicubic2d"] = [_case(nn_.upsample_bicubic2d, x4, [8, 8], False)]
    c["upsample_bilinear2d"] = [_case(nn_.upsample_bilinear2d, x4, [8, 8], False)]
    c["upsample_linear1d"] = [_case(nn_.upsample_linear1d, x3, [16], False)]
    c["upsample_nearest1d"] = [_case(nn_.upsample_nearest1d, x3, [16])]
    c["upsample_nearest2d"] = [_case(nn_.upsample_nearest2d, x4, [8, 8])]
    c["upsample_nearest3d"] = [_case(nn_.upsample_nearest3d, x5, [8, 8, 8])]
    c["upsample_trilinear3d"] = [_case(nn_.upsample_trilinear3d, x5, [8, 8, 8], False)]
    for name in ("acos", "asin", "erfinv"):
        c[name] = [_case(getattr(torch, name), _unit(4, 4))]
    for name in ("cosh", "sinh", "tan", "exp", "expm1"):
        c[name] = [_case(getattr(torch, name), _unit(4, 4))]
    for name in ("log", "log10", "log1p", "log2", "reciprocal", "rsqrt"):
        c[name] = [_case(getattr(torch, name), _pos(4, 4))]
    c["pow"] = [_case(torch.pow, _pos(4, 4), 2.5), _case(torch.pow, _pos(4, 4), _r(4, 4, seed=1)), _case(torch.Tensor.__pow__, _pos(4, 4), 3)]
    c["cosine_similarity"] = [_case(torch.cosine_similarity, _r(3, 4), _r(3, 4, seed=1))]
    c["cumprod"] = [_case(torch.cumprod, _unit(4, 4) + 1, 0)]
    c["cumsum"] = [_case(torch.cumsum, _r(4, 4), 1)]
    c["dist"] = [_case(torch.dist, _r(4, 4), _r(4, 4, seed=1))]
    c["frobenius_norm"] = [_case(torch.frobenius_norm, _r(3, 4), [0, 1])]
    c["group_norm"] = [_case(F.group_norm, _r(2, 4, 3, 3), 2, _r(4, seed=1), _r(4, seed=2))]
    c["layer_norm"] = [_case(F.layer_norm, _r(3, 8), (8,), _r(8, seed=1), _r(8, seed=2))]
    c["native_layer_norm"] = [_case(torch.native_layer_norm, _r(3, 8), [8], _r(8, seed=1), _r(8, seed=2), 1e-5)]
    c["rms_norm"] = [_case(F.rms_norm, _r(3, 8), (8,), _r(8, seed=1))]
    c["linalg_matrix_norm"] = [_case(torch.linalg.matrix_norm, _r(3, 4))]
    c["linalg_vector_norm"] = [_case(torch.linalg.vector_norm, _r(3, 4)), _case(torch.linalg.vector_norm, _r(3, 4), 3, 1)]
    c["log_softmax"] = [_case(torch.log_softmax, _r(3, 8), -1), _case(F.log_softmax, _r(3, 8), dim=0)]
    c["logsumexp"] = [_case(torch.logsumexp, _r(3, 8), 1)]
    c["norm"] = [_case(torch.norm, _r(3, 4)), _case(torch.norm, _r(3, 4), dim=1)]
    c["nuclear_norm"] = [_case(torch.nuclear_norm, _r(3, 4))]
    c["pdist"] = [_case(torch.pdist, _r(4, 3))]
    c["renorm"] = [_case(torch.renorm, _r(4, 3), 2, 0, 1.0)]
    c["softmax"] = [_case(torch.softmax, _r(3, 8), -1), _case(F.softmax, _r(3, 8), dim=0), _case(torch.Tensor.softmax, _r(3, 8), -1)]
    c["softplus"] = [_case(F.softplus, _r(3, 8))]
    c["sum"] = [_case(torch.sum, _r(3, 8)), _case(torch.sum, _r(3, 8), 1)]
    # --- promote (the test makes both operand orders)
    c["addcdiv"] = [_case(torch.addcdiv, _r(4), _r(4, seed=1), _pos(4, seed=2))]
    c["addcmul"] = [_case(torch.addcmul, _r(4), _r(4, seed=1), _r(4, seed=2))]
    c["atan2"] = [_case(torch.atan2, _r(4), _r(4, seed=1))]
    c["bilinear"] = [_case(F.bilinear, _r(3, 4), _r(3, 5, seed=1), _r(6, 4, 5, seed=2), _r(6, seed=3))]
    c["cross"] = [_case(torch.cross, _r(4, 3), _r(4, 3, seed=1), dim=1)]
    c["dot"] = [_case(torch.dot, _r(4), _r(4, seed=1))]
    c["index_put"] = [_case(torch.index_put, _r(4, 3), (torch.tensor([0, 2]),), _r(2, 3, seed=1))]
    c["scatter_add"] = [_case(torch.scatter_add, _r(4, 3), 0, torch.tensor([[0, 1, 2], [3, 2, 1]]), _r(2, 3, seed=1))]
    c["tensordot"] = [_case(torch.tensordot, _r(3, 4), _r(4, 5, seed=1), dims=1)]
    c["vdot"] = [_case(torch.vdot, _r(4), _r(4, seed=1))]
    return c


def _all_cases() -> dict[str, list[Case]]:
    shared = {op: cases for op, cases in CPU_CASES.items() if op in TABLE_OPS}
    return {**shared, **_cuda_only_cases()}


with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    CUDA_CASES = _all_cases()


def test_every_cuda_table_op_has_a_case() -> None:
    assert not TABLE_OPS - set(CUDA_CASES), "a default-table op without a case"
    if TORCH_MINOR == TABLES_TORCH_VERSION:
        assert set(CUDA_CASES) - {"_cudnn_rnn"} == TABLE_OPS


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_cuda_tables_were_run_on_the_gpu(dtype: torch.dtype) -> None:
    from mixprec.amp.probe import probe_table

    registered = torch_autocast_ops("cuda") or frozenset()
    start = time.perf_counter()
    again = probe_table("cuda", dtype, registered)  # what the first use costs, the libraries loaded
    took = time.perf_counter() - start
    running = torch_table("cuda", dtype)
    print(f"torch {torch.__version__}, {dtype}: {len(registered)} ops probed in {took * 1e3:.0f} ms; unresolved "
          f"{sorted(running.unresolved)}; changes from the pinned tables: {table_changes('cuda', dtype)}")
    assert again == running  # deterministic
    assert running.source == "each op run under its autocast on cuda", running.source
    if TORCH_MINOR == TABLES_TORCH_VERSION:
        assert table_changes("cuda", dtype) == {}


def test_the_default_cuda_table_absorbs_the_recorded_differences() -> None:
    """The ops an older torch registers otherwise (KNOWN_TORCH_DELTAS) change class in the
    default table: out of it where torch no longer autocasts them, in it (or unresolved)
    where it newly does."""
    only_mixprec, only_torch = KNOWN_TORCH_DELTAS.get(TORCH_MINOR, (frozenset(), frozenset()))
    if not only_mixprec | only_torch:
        pytest.skip(f"no recorded differences for torch {TORCH_MINOR}")
    changes = table_changes("cuda", FP16)
    for op in only_mixprec:
        assert changes.get(op, ("", ""))[1] == "none", (op, changes.get(op))
    for op in only_torch:
        assert changes.get(op, ("", ""))[0] == "none", (op, changes.get(op))


def test_pinned_cuda_table_matches_this_torch() -> None:
    diff = compare_with_torch("cuda")
    if diff is None:
        pytest.skip("this torch does not expose its autocast registrations")
    if TORCH_MINOR == TABLES_TORCH_VERSION:
        assert diff.empty, str(diff)
        return
    if TORCH_MINOR not in KNOWN_TORCH_DELTAS:
        pytest.skip(f"the CUDA table is pinned to torch {TABLES_TORCH_VERSION}; no record of torch {TORCH_MINOR}'s "
                    f"differences (found: {diff})")
    only_mixprec, only_torch = KNOWN_TORCH_DELTAS[TORCH_MINOR]
    assert (set(diff.only_in_mixprec), set(diff.only_in_torch)) == (set(only_mixprec), set(only_torch)), str(diff)


# ------------------------------------------------------------------------- helpers
def _to_cuda(t: torch.Tensor) -> torch.Tensor:
    return t.to("cuda")


def _floating_to(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t


def _run(case: Case, transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Any:
    fn, args, kwargs = case
    if transform is not None:
        args, kwargs = _map(args, transform), _map(kwargs, transform)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fn(*args, **kwargs)
    return out


def _staged(case: Case, transform: Callable[[torch.Tensor], torch.Tensor] | None) -> Case:
    fn, args, kwargs = case
    args, kwargs = _map(args, _to_cuda), _map(kwargs, _to_cuda)
    if transform is not None:
        args, kwargs = _map(args, transform), _map(kwargs, transform)
    return fn, args, kwargs


def _variants(op: str, low: torch.dtype) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor] | None]]:
    """Input dtypes that make the op's class visible; both operand orders for promote ops."""
    precision = _table(low).precision_of(op)
    if precision is Precision.LOW:
        return [("fp32 inputs", None)]
    if precision is Precision.FP32:
        return [("low inputs", _floating_to(low))]
    counter = {"i": 0}

    def alternate(first: torch.dtype, second: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        def fn(t: torch.Tensor) -> torch.Tensor:
            if not t.is_floating_point():
                return t
            counter["i"] += 1
            return t.to(first if counter["i"] % 2 else second)

        return fn

    return [("low,fp32", alternate(low, FP32)), ("fp32,low", alternate(FP32, low)), ("low,low", _floating_to(low))]


def _oracle_dtype(op: str, case: Case, low: torch.dtype) -> torch.dtype:
    precision = _table(low).precision_of(op)
    if precision is Precision.LOW:
        return low
    if precision is Precision.FP32:
        return FP32
    _, args, kwargs = case
    dtypes = {t.dtype for t in _flat((args, list(kwargs.values()))) if isinstance(t, torch.Tensor) and t.is_floating_point()}
    return FP32 if FP32 in dtypes else low


def _assert_same(actual: Any, expected: Any, op: str, what: str) -> None:
    if op not in VIA_DTYPE_ARGUMENT:
        assert_bitwise(actual, expected, what)
        return
    a, e = _flat(actual), _flat(expected)
    assert len(a) == len(e), what
    for x, y in zip(a, e, strict=True):
        assert x.dtype == y.dtype, f"{what}: {x.dtype} vs {y.dtype}"
        torch.testing.assert_close(x, y, rtol=1.3e-6, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _raises(case: Case, context: Callable[[], Any]) -> bool:
    try:
        with context():
            _run(case)
    except RuntimeError:
        return True
    return False


def _needs(dtype: torch.dtype) -> None:
    if dtype == BF16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16 support")


def _case_params() -> list[Any]:
    ops = sorted(set(CUDA_CASES) & TABLE_OPS)
    return [pytest.param(op, i, id=f"{op}-{i}") for op in ops for i in range(len(CUDA_CASES[op]))]


def _class_here(op: str, dtype: torch.dtype) -> Precision:
    """The op's class in this torch's default table for ``dtype`` (a skip if it has none for it)."""
    precision = _table(dtype).precision_of(op)
    if precision is None:
        pytest.skip(f"{op} has no {dtype} class in this torch's default CUDA table ({_table(dtype).source})")
    return precision


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("op", "index"), _case_params())
def test_cuda_op_class_engine_and_torch_agree(op: str, index: int, dtype: torch.dtype) -> None:
    _needs(dtype)
    precision = _class_here(op, dtype)
    for label, transform in _variants(op, dtype):
        staged = _staged(CUDA_CASES[op][index], transform)
        target = _oracle_dtype(op, staged, dtype)
        try:
            oracle = _run(staged, _floating_to(target))
        except RuntimeError:  # no kernel for this dtype on this GPU: autocast must fail alike
            assert _raises(staged, lambda: torch.autocast("cuda", dtype=dtype)), f"{op} ({label})"
            assert _raises(staged, lambda: autocast(dtype, device_type="cuda")), f"{op} ({label})"
            continue
        with torch.autocast("cuda", dtype=dtype):
            expected = _run(staged)
        _assert_same(expected, oracle, op, f"{op} ({label}): torch.autocast('cuda') vs explicit {target} casts")
        with autocast(dtype, device_type="cuda"):
            plain = _run(staged)
        assert_bitwise(plain, expected, f"{op} ({label}): mixprec.autocast() vs torch.autocast('cuda')")
        forced = PolicyMode(dtype, {"cuda": {op: precision}}, "cuda")
        with torch.autocast("cuda", dtype=dtype), forced:
            engine = _run(staged)
        _assert_same(engine, expected, op, f"{op} ({label}): mixprec engine vs torch.autocast('cuda')")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("op", "index"), _case_params())
def test_cuda_op_moved_to_the_other_class_matches_explicit_casts(op: str, index: int, dtype: torch.dtype) -> None:
    _needs(dtype)
    precision = _class_here(op, dtype)
    transform: Callable[[torch.Tensor], torch.Tensor] | None
    if precision is Precision.LOW:
        policy, target, transform = OpPolicy(dtype, fp32_ops=[op]), FP32, None
    elif precision is Precision.FP32:
        policy, target, transform = OpPolicy(dtype, lower_ops=[op]), dtype, None
    else:
        policy, target, transform = OpPolicy(dtype, fp32_ops=[op]), FP32, _floating_to(dtype)
    staged = _staged(CUDA_CASES[op][index], transform)
    try:
        oracle = _run(staged, _floating_to(target))
    except RuntimeError:  # e.g. no low-precision kernel: mixprec must fail the same way
        assert _raises(staged, lambda: autocast(device_type="cuda", policy=policy)), op
        return
    with autocast(device_type="cuda", policy=policy):
        moved = _run(staged)
    assert_bitwise(moved, oracle, f"{op} moved from {precision.value} on cuda")


@pytest.mark.parametrize("dtype", DTYPES)
def test_refused_op_is_refused_by_both_and_runs_once_listed(dtype: torch.dtype) -> None:
    _needs(dtype)
    assert _table(dtype).banned == frozenset({"binary_cross_entropy"})
    p = torch.rand(4, 4, generator=torch.Generator().manual_seed(0)).mul(0.9).add(0.05).cuda()
    t = torch.rand(4, 4, generator=torch.Generator().manual_seed(1)).cuda()
    for ctx in (lambda: torch.autocast("cuda", dtype=dtype), lambda: autocast(dtype, device_type="cuda")):
        with pytest.raises(RuntimeError, match="unsafe to autocast"), ctx():
            F.binary_cross_entropy(p.to(dtype), t)
    with autocast(dtype, device_type="cuda", fp32_ops=["binary_cross_entropy"]):
        listed = F.binary_cross_entropy(p.to(dtype), t)
    assert listed.dtype == FP32 and torch.equal(listed, F.binary_cross_entropy(p.to(dtype).float(), t))


# ------------------------------------------------------------------ whole modules
class Block(nn.Module):
    """linear -> attention-ish softmax -> layer_norm -> linear, with a matmul (tests/test_autocast.py)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        a = F.softmax(h @ h.transpose(-1, -2), dim=-1)
        return self.out(self.norm(a @ h))


def _block_and_input() -> tuple[Block, torch.Tensor]:
    torch.manual_seed(0)
    model = Block().cuda()
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1)).cuda()
    return model, x


def _grads(model: nn.Module) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_custom_ops_is_torch_autocast_bitwise_forward_and_backward(dtype: torch.dtype) -> None:
    _needs(dtype)
    model, x = _block_and_input()
    with torch.autocast("cuda", dtype=dtype):
        ref = model(x)
    ref.float().sum().backward()
    ref_grads = _grads(model)
    with autocast(dtype, device_type="cuda"):
        out = model(x)
    out.float().sum().backward()
    assert out.dtype == ref.dtype == dtype and torch.equal(out, ref)
    for a, b in zip(_grads(model), ref_grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_custom_lists_equal_explicit_casts_forward_and_backward(dtype: torch.dtype) -> None:
    """linear in fp32, softmax and layer_norm in low precision: the same casts by hand, no autocast."""
    _needs(dtype)
    model, x = _block_and_input()
    policy = OpPolicy(dtype, fp32_ops=["linear"], lower_ops=["softmax", "layer_norm"])
    with autocast(device_type="cuda", policy=policy):
        out = model(x)
    out.float().sum().backward()
    got = _grads(model)

    def by_hand(m: Block, t: torch.Tensor) -> torch.Tensor:
        h = F.linear(t, m.inp.weight, m.inp.bias)  # fp32
        s = h.to(dtype) @ h.transpose(-1, -2).to(dtype)  # matmul: low (default table)
        a = F.softmax(s, dim=-1)  # moved to low: no upcast
        ah = a @ h.to(dtype)
        n = F.layer_norm(ah, (16,), m.norm.weight.to(dtype), m.norm.bias.to(dtype))  # moved to low
        return F.linear(n.float(), m.out.weight, m.out.bias)  # fp32

    ref = by_hand(model, x)
    ref.float().sum().backward()
    want = _grads(model)
    assert out.dtype == FP32 and torch.equal(out, ref)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)

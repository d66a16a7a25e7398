"""Op tables and OpPolicy: the pinned tables against the installed torch, the default
tables derived from the running torch (and a torch that classes ops otherwise), the
algebra, validation, explain(); and every CPU table op run through torch.autocast and
through mixprec's engine, bitwise."""

from __future__ import annotations

import math
import re
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
    DEVICE_TYPES,
    TABLES_TORCH_VERSION,
    OpPolicy,
    Precision,
    compare_with_torch,
    default_table,
    normalize_op_name,
    pinned_table,
    torch_autocast_ops,
)

BF16 = torch.bfloat16
TORCH_MINOR = ".".join(torch.__version__.split("+")[0].split(".")[:2])
SAME_TORCH = TORCH_MINOR == TABLES_TORCH_VERSION


# ----------------------------------------------------------------------------- tables
@pytest.mark.parametrize("table", [default_table, pinned_table], ids=["default", "pinned"])
@pytest.mark.parametrize("device", DEVICE_TYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tables_are_disjoint_plain_data(device: str, dtype: torch.dtype, table: Callable[..., Any]) -> None:
    t = table(device, dtype)
    assert t.device_type == device and t.dtype == dtype
    groups = [t.low, t.fp32, t.promote, t.banned, t.unresolved]
    for i, a in enumerate(groups):
        for b in groups[i + 1 :]:
            assert not (a & b), f"{device}/{dtype}: {sorted(a & b)} in two classes"
    for op in t.ops:
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", op), op
    assert t.precision_of("linear") is Precision.LOW


def test_tables_are_per_device() -> None:
    assert default_table("cuda", BF16).precision_of("softmax") is Precision.FP32
    assert default_table("cpu", BF16).precision_of("softmax") is None
    assert default_table("cpu", BF16).precision_of("cat") is Precision.PROMOTE
    assert default_table("cuda", torch.float16).banned == frozenset({"binary_cross_entropy"})


def test_unknown_table_is_an_error() -> None:
    with pytest.raises(ValueError, match=re.escape("no autocast op table for device_type='xpu'")):
        default_table("xpu", BF16)


@pytest.mark.parametrize("device", DEVICE_TYPES)
def test_tables_match_installed_torch_registrations(device: str) -> None:
    """Membership: the ops torch registers an autocast kernel for, per device."""
    diff = compare_with_torch(device)
    if diff is None:
        pytest.skip("this torch does not expose its autocast registrations")
    report = str(diff)
    print(report)  # the report is the point when torch is upgraded
    if not SAME_TORCH:
        pytest.xfail(f"tables pinned to torch {TABLES_TORCH_VERSION}; differences:\n{report}")
    assert diff.empty, report
    registered = torch_autocast_ops(device)
    assert registered is not None and "linear" in registered


# --------------------------------------------------------------------- OpPolicy algebra
def test_paddle_algebra() -> None:
    p = OpPolicy(BF16, lower_ops=["softmax", "mm"], fp32_ops=["linear", "mse_loss"])
    t = default_table("cpu", BF16)
    eff = p.effective("cpu")
    assert eff[Precision.LOW] == (t.low | {"softmax", "mm"}) - {"linear", "mse_loss"}
    assert eff[Precision.FP32] == (t.fp32 - {"softmax", "mm"}) | {"linear", "mse_loss"}
    assert eff[Precision.PROMOTE] == t.promote
    # only real moves need interception: mm is already low, mse_loss already fp32
    assert p.overrides("cpu") == {"softmax": Precision.LOW, "linear": Precision.FP32}
    assert p.precision_of("linear", "cpu") is Precision.FP32
    assert p.precision_of("softmax", "cpu") is Precision.LOW
    assert p.precision_of("relu", "cpu") is None


def test_moving_a_promote_op_and_a_banned_op() -> None:
    p = OpPolicy(torch.float16, fp32_ops=["cat", "binary_cross_entropy"])
    assert "cat" not in p.effective("cpu")[Precision.PROMOTE]
    assert p.overrides("cuda") == {"cat": Precision.FP32, "binary_cross_entropy": Precision.FP32}
    assert "cat" in p.overrides("cpu")


def test_policy_is_frozen_hashable_and_normalises() -> None:
    p = OpPolicy("bf16", lower_ops=("__matmul__", "aten::softmax"), fp32_ops="cross_entropy")
    assert p.dtype == BF16
    assert p.lower_ops == ("matmul", "softmax")
    assert p.fp32_ops == ("cross_entropy_loss",)
    assert hash(p) == hash(OpPolicy(BF16, lower_ops=["matmul", "softmax"], fp32_ops=["cross_entropy_loss"]))
    with pytest.raises(AttributeError):
        p.dtype = torch.float16  # type: ignore[misc]
    assert p.replace(fp32_ops=()).is_default is False
    assert OpPolicy().is_default


def test_op_in_both_lists_is_an_error() -> None:
    msg = "'linear' is in both lower_ops and fp32_ops; an op runs in one precision, so keep each op in one of the lists"
    with pytest.raises(ValueError, match=re.escape(msg)):
        OpPolicy(lower_ops=["linear", "mm"], fp32_ops=["linear"])


def test_unknown_op_names_close_matches() -> None:
    msg = (
        "unknown op name 'softmx' in lower_ops: neither mixprec's autocast tables nor "
        "torch.ops.aten know it; did you mean 'softmax', '_softmax', 'log_softmax'?"
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        OpPolicy(lower_ops=["softmx"])
    with pytest.raises(ValueError, match=r"unknown op name 'layernorm' in fp32_ops: .* did you mean 'layer_norm'"):
        OpPolicy(fp32_ops=["layernorm"])
    with pytest.raises(ValueError, match=re.escape("op names are given without overload; use 'softmax'")):
        OpPolicy(fp32_ops=["softmax.int"])
    with pytest.raises(TypeError, match=re.escape("fp32_ops takes op names (str)")):
        OpPolicy(fp32_ops=[torch.softmax])  # type: ignore[list-item]


def test_aten_ops_outside_the_tables_are_known() -> None:
    p = OpPolicy(lower_ops=["gelu", "add"], fp32_ops=["exp"])
    assert p.overrides("cpu") == {"gelu": Precision.LOW, "add": Precision.LOW, "exp": Precision.FP32}
    assert p.overrides("cuda") == {"gelu": Precision.LOW, "add": Precision.LOW}


def test_dtype_must_be_low_precision() -> None:
    msg = "OpPolicy dtype must be a low-precision dtype (bf16 or fp16), got fp32"
    with pytest.raises(ValueError, match=re.escape(msg)):
        OpPolicy(torch.float32)


def test_fp32_modules_validation() -> None:
    p = OpPolicy(fp32_modules=[nn.LayerNorm, "*.attn.softmax"])
    assert p.fp32_modules == (nn.LayerNorm, "*.attn.softmax")
    assert OpPolicy(fp32_modules="*.ln").fp32_modules == ("*.ln",)
    with pytest.raises(TypeError, match=re.escape("fp32_modules takes nn.Module classes")):
        OpPolicy(fp32_modules=[int])  # type: ignore[list-item]


def test_explain_is_a_table_marking_custom_entries() -> None:
    p = OpPolicy(BF16, lower_ops=["softmax"], fp32_ops=["linear"], fp32_modules=[nn.LayerNorm])
    text = p.explain("cpu")
    assert isinstance(text, str)
    lines = text.splitlines()
    assert lines[0] == (
        f"OpPolicy(dtype=bf16) on cpu: default tables of torch {torch.__version__} (each op run under its "
        f"autocast on cpu; fallback: pinned to torch {TABLES_TORCH_VERSION} (v1))"
    )
    assert lines[1].split("|")[0].strip() == "precision"
    rows = {(r.split("|")[0].strip(), r.split("|")[1].strip()): r.split("|")[2].strip() for r in lines[3:] if r.count("|") == 2 and r.split("|")[0].strip()}
    assert rows[("low (bf16)", "custom")] == "softmax"
    assert rows[("fp32", "custom")] == "linear"
    assert "linear" not in text.split("low (bf16)             | default")[1].split("fp32")[0]
    assert "torch.nn.modules.normalization.LayerNorm" in rows[("fp32 modules", "custom")]
    cuda = p.explain("cuda")
    assert "refused" in cuda and "binary_cross_entropy" in cuda


def test_normalize_op_name() -> None:
    assert normalize_op_name("__rmatmul__") == "matmul"
    assert normalize_op_name("aten::linear") == "linear"
    assert normalize_op_name("cross_entropy") == "cross_entropy_loss"


# ------------------------------------------------------------ every CPU op, run for real
def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _r(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_g(seed))


def _spd(n: int = 4, seed: int = 0) -> torch.Tensor:
    a = _r(n, n, seed=seed)
    return a @ a.T + n * torch.eye(n)


def _lu(n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.linalg.lu_factor(_spd(n))


def _qr_parts(n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.geqrf(_r(n, n))


Case = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _case(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Case:
    return fn, args, kwargs


def _mha_args() -> tuple[Any, ...]:
    n = 4
    return (
        _r(2, n, n), _r(2, n, n, seed=1), _r(2, n, n, seed=2), n, 2,
        _r(3 * n, n, seed=3), _r(3 * n, seed=4), _r(n, n, seed=5), _r(n, seed=6),
    )  # fmt: skip


def _rnn_args() -> tuple[Any, ...]:
    t, n, i, h = 3, 2, 4, 4
    return (
        _r(t, n, i), _r(4 * h, i, seed=1), _r(4 * h, h, seed=2), _r(4 * h, seed=3),
        _r(4 * h, seed=4), _r(n, h, seed=5), _r(n, h, seed=6),
        False, [], 2, h, 1, True, False, False, False,
    )  # fmt: skip


def _cases() -> dict[str, list[Case]]:
    c: dict[str, list[Case]] = {}
    x4 = _r(2, 2, 4, 4)
    lu, piv = _lu()
    a_qr, tau = _qr_parts()
    mlabel = torch.tensor([[1, 2, -1, 0], [0, -1, 0, 0]])
    _, idx = F.max_pool2d(_r(1, 1, 4, 4), 2, return_indices=True)
    _, idx3 = F.max_pool3d(_r(1, 1, 4, 4, 4), 2, return_indices=True)
    # --- low
    c["_addmm_activation"] = [_case(torch._addmm_activation, _r(4, 4), _r(4, 4, seed=1), _r(4, 4, seed=2), use_gelu=True)]
    c["_convolution"] = [_case(torch._convolution, x4, _r(3, 2, 3, 3, seed=1), _r(3, seed=2), (1, 1), (0, 0), (1, 1), False, (0, 0), 1, False, True, True)]
    c["_native_multi_head_attention"] = [_case(torch._native_multi_head_attention, *_mha_args())]
    c["addbmm"] = [_case(torch.addbmm, _r(4, 4), _r(2, 4, 4, seed=1), _r(2, 4, 4, seed=2))]
    c["addmm"] = [_case(torch.addmm, _r(4, 4), _r(4, 4, seed=1), _r(4, 4, seed=2))]
    c["baddbmm"] = [_case(torch.baddbmm, _r(2, 4, 4), _r(2, 4, 4, seed=1), _r(2, 4, 4, seed=2))]
    c["bmm"] = [_case(torch.bmm, _r(2, 4, 4), _r(2, 4, 4, seed=1))]
    c["conv1d"] = [_case(F.conv1d, _r(2, 2, 8), _r(3, 2, 3, seed=1), _r(3, seed=2)), _case(F.conv1d, _r(2, 2, 8), _r(3, 2, 3, seed=1), padding="same")]
    c["conv2d"] = [_case(F.conv2d, x4, _r(3, 2, 3, 3, seed=1)), _case(torch.conv2d, x4, _r(3, 2, 3, 3, seed=1), padding="same")]
    c["conv3d"] = [_case(F.conv3d, _r(1, 2, 4, 4, 4), _r(3, 2, 3, 3, 3, seed=1)), _case(F.conv3d, _r(1, 2, 4, 4, 4), _r(3, 2, 3, 3, 3, seed=1), padding="same")]
    c["conv_tbc"] = [_case(torch.conv_tbc, _r(10, 7, 3), _r(5, 3, 5, seed=1), _r(5, seed=2), 0)]
    c["conv_transpose1d"] = [_case(F.conv_transpose1d, _r(2, 2, 8), _r(2, 3, 3, seed=1))]
    c["conv_transpose2d"] = [_case(F.conv_transpose2d, x4, _r(2, 3, 3, 3, seed=1))]
    c["conv_transpose3d"] = [_case(F.conv_transpose3d, _r(1, 2, 4, 4, 4), _r(2, 3, 3, 3, 3, seed=1))]
    c["linalg_vecdot"] = [_case(torch.linalg.vecdot, _r(4, 4), _r(4, 4, seed=1))]
    c["linear"] = [_case(F.linear, _r(3, 4), _r(5, 4, seed=1), _r(5, seed=2))]
    c["matmul"] = [_case(torch.matmul, _r(4, 4), _r(4, 4, seed=1)), _case(torch.Tensor.__matmul__, _r(4, 4), _r(4, 4, seed=1))]
    # the fourth output is an uninitialised workspace: compare the first three
    c["mkldnn_rnn_layer"] = [_case(lambda *a: torch.mkldnn_rnn_layer(*a)[:3], *_rnn_args())]
    c["mm"] = [_case(torch.mm, _r(4, 4), _r(4, 4, seed=1)), _case(torch.Tensor.mm, _r(4, 4), _r(4, 4, seed=1))]
    c["prelu"] = [_case(F.prelu, _r(2, 3, 4), _r(3, seed=1))]
    c["scaled_dot_product_attention"] = [_case(F.scaled_dot_product_attention, _r(1, 2, 4, 8), _r(1, 2, 4, 8, seed=1), _r(1, 2, 4, 8, seed=2))]
    # --- fp32
    c["_grid_sampler_2d_cpu_fallback"] = [_case(torch._grid_sampler_2d_cpu_fallback, _r(1, 1, 4, 4), _r(1, 3, 3, 2, seed=1).tanh(), 0, 0, False)]
    c["_lu_with_info"] = [_case(torch._lu_with_info, _spd())]
    c["adaptive_avg_pool3d"] = [_case(F.adaptive_avg_pool3d, _r(1, 2, 4, 4, 4), 2)]
    c["adaptive_max_pool3d"] = [_case(torch._C._nn.adaptive_max_pool3d, _r(1, 2, 4, 4, 4), 2)]
    c["avg_pool3d"] = [_case(F.avg_pool3d, _r(1, 2, 4, 4, 4), 2)]
    c["binary_cross_entropy"] = [_case(F.binary_cross_entropy, _r(4, 4).sigmoid(), torch.rand(4, 4, generator=_g(1)))]
    c["binary_cross_entropy_with_logits"] = [_case(F.binary_cross_entropy_with_logits, _r(4, 4), torch.rand(4, 4, generator=_g(1)))]
    c["cdist"] = [_case(torch.cdist, _r(3, 4), _r(5, 4, seed=1))]
    c["cholesky"] = [_case(torch.cholesky, _spd())]
    c["cholesky_inverse"] = [_case(torch.cholesky_inverse, torch.linalg.cholesky(_spd()))]
    c["cholesky_solve"] = [_case(torch.cholesky_solve, _r(4, 2), torch.linalg.cholesky(_spd()))]
    c["cosine_embedding_loss"] = [_case(F.cosine_embedding_loss, _r(3, 4), _r(3, 4, seed=1), torch.tensor([1, -1, 1]))]
    c["cross_entropy_loss"] = [_case(F.cross_entropy, _r(4, 5), torch.tensor([0, 1, 4, 2]))]
    c["ctc_loss"] = [
        _case(F.ctc_loss, _r(6, 2, 5).log_softmax(-1), torch.tensor([[1, 2], [3, 1]]), torch.tensor([6, 5]), torch.tensor([2, 2])),
        _case(F.ctc_loss, _r(6, 2, 5).log_softmax(-1), torch.tensor([[1, 2], [3, 1]]), [6, 5], [2, 2]),
    ]
    c["fake_quantize_per_tensor_affine"] = [_case(torch.fake_quantize_per_tensor_affine, _r(4, 4), 0.1, 0, 0, 255)]
    for name, shape in [("fft", (8,)), ("fft2", (4, 4)), ("fftn", (2, 4, 4)), ("hfft", (8,)),
                        ("ifft", (8,)), ("ifft2", (4, 4)), ("ifftn", (2, 4, 4)), ("ihfft", (8,)),
                        ("irfft", (8,)), ("irfft2", (4, 4)), ("irfftn", (2, 4, 4)), ("rfft", (8,)),
                        ("rfft2", (4, 4)), ("rfftn", (2, 4, 4))]:  # fmt: skip
        c[f"fft_{name}"] = [_case(getattr(torch.fft, name), _r(*shape))]
    c["fractional_max_pool2d"] = [_case(torch._C._nn.fractional_max_pool2d, _r(1, 2, 8, 8), (2, 2), (4, 4), torch.rand(1, 2, 2, generator=_g(1)))]
    c["fractional_max_pool3d"] = [_case(torch._C._nn.fractional_max_pool3d, _r(1, 2, 8, 8, 8), (2, 2, 2), (4, 4, 4), torch.rand(1, 2, 3, generator=_g(1)))]
    c["geqrf"] = [_case(torch.geqrf, _r(4, 4))]
    c["grid_sampler"] = [_case(torch.grid_sampler, _r(1, 1, 4, 4), _r(1, 3, 3, 2, seed=1).tanh(), 0, 0, False)]
    c["grid_sampler_2d"] = [_case(torch.grid_sampler_2d, _r(1, 1, 4, 4), _r(1, 3, 3, 2, seed=1).tanh(), 0, 0, False)]
    c["grid_sampler_3d"] = [_case(torch.grid_sampler_3d, _r(1, 1, 4, 4, 4), _r(1, 2, 2, 2, 3, seed=1).tanh(), 0, 0, False)]
    c["hinge_embedding_loss"] = [_case(F.hinge_embedding_loss, _r(4, 4), torch.ones(4, 4, dtype=torch.long))]
    c["huber_loss"] = [_case(F.huber_loss, _r(4, 4), _r(4, 4, seed=1))]
    c["inverse"] = [_case(torch.inverse, _spd())]
    c["kl_div"] = [_case(F.kl_div, _r(4, 4).log_softmax(-1), _r(4, 4, seed=1).softmax(-1), reduction="batchmean")]
    c["l1_loss"] = [_case(F.l1_loss, _r(4, 4), _r(4, 4, seed=1))]
    c["linalg_cholesky"] = [_case(torch.linalg.cholesky, _spd())]
    c["linalg_cholesky_ex"] = [_case(torch.linalg.cholesky_ex, _spd())]
    c["linalg_cond"] = [_case(torch.linalg.cond, _spd()), _case(torch.linalg.cond, _spd(), "fro")]
    c["linalg_eig"] = [_case(torch.linalg.eig, _spd())]
    c["linalg_eigh"] = [_case(torch.linalg.eigh, _spd())]
    c["linalg_eigvals"] = [_case(torch.linalg.eigvals, _spd())]
    c["linalg_eigvalsh"] = [_case(torch.linalg.eigvalsh, _spd())]
    c["linalg_householder_product"] = [_case(torch.linalg.householder_product, a_qr, tau)]
    c["linalg_inv"] = [_case(torch.linalg.inv, _spd())]
    c["linalg_inv_ex"] = [_case(torch.linalg.inv_ex, _spd())]
    c["linalg_lstsq"] = [_case(torch.linalg.lstsq, _spd(), _r(4, 2, seed=1))]
    c["linalg_matrix_rank"] = [_case(torch.linalg.matrix_rank, _spd()), _case(torch.linalg.matrix_rank, _spd(), atol=0.5, rtol=0.0)]
    c["linalg_qr"] = [_case(torch.linalg.qr, _r(4, 4))]
    c["linalg_solve"] = [_case(torch.linalg.solve, _spd(), _r(4, 2, seed=1))]
    c["linalg_svd"] = [_case(torch.linalg.svd, _spd())]
    c["linalg_svdvals"] = [_case(torch.linalg.svdvals, _spd())]
    c["linalg_tensorinv"] = [_case(torch.linalg.tensorinv, _spd(), ind=1)]
    c["linalg_tensorsolve"] = [_case(torch.linalg.tensorsolve, _spd(), _r(4, seed=1))]
    c["lu_solve"] = [_case(torch.lu_solve, _r(4, 2, seed=1), lu, piv)]
    c["margin_ranking_loss"] = [_case(F.margin_ranking_loss, _r(4), _r(4, seed=1), torch.tensor([1.0, -1.0, 1.0, -1.0]))]
    c["max_pool3d"] = [_case(torch.max_pool3d, _r(1, 2, 4, 4, 4), 2)]
    c["max_unpool2d"] = [_case(torch._C._nn.max_unpool2d, _r(1, 1, 2, 2), idx, (4, 4))]
    c["max_unpool3d"] = [_case(torch._C._nn.max_unpool3d, _r(1, 1, 2, 2, 2), idx3, (4, 4, 4), (2, 2, 2), (0, 0, 0))]
    c["mse_loss"] = [_case(F.mse_loss, _r(4, 4), _r(4, 4, seed=1))]
    c["multi_margin_loss"] = [_case(F.multi_margin_loss, _r(4, 5), torch.tensor([0, 1, 4, 2]))]
    c["multilabel_margin_loss"] = [_case(F.multilabel_margin_loss, _r(2, 4), mlabel)]
    c["multilabel_margin_loss_forward"] = [_case(torch.ops.aten.multilabel_margin_loss_forward, _r(2, 4), mlabel, 1)]
    c["nanquantile"] = [_case(torch.nanquantile, _r(8), 0.5), _case(torch.nanquantile, _r(8), torch.tensor([0.25, 0.5]))]
    c["nll_loss"] = [_case(F.nll_loss, _r(4, 5).log_softmax(-1), torch.tensor([0, 1, 4, 2]))]
    c["nll_loss2d"] = [_case(torch._C._nn.nll_loss2d, _r(2, 3, 2, 2).log_softmax(1), torch.zeros(2, 2, 2, dtype=torch.long))]
    c["orgqr"] = [_case(torch.orgqr, a_qr, tau)]
    c["ormqr"] = [_case(torch.ormqr, a_qr, tau, _r(4, 3, seed=1))]
    c["pinverse"] = [_case(torch.pinverse, _spd())]
    c["poisson_nll_loss"] = [_case(F.poisson_nll_loss, _r(4, 4), torch.rand(4, 4, generator=_g(1)))]
    c["polar"] = [_case(torch.polar, torch.rand(4, generator=_g(0)), _r(4, seed=1))]
    c["prod"] = [_case(torch.prod, _r(4) * 0.5 + 1), _case(torch.prod, _r(3, 4) * 0.5 + 1, 1)]
    c["qr"] = [_case(torch.qr, _r(4, 4))]
    c["quantile"] = [_case(torch.quantile, _r(8), 0.5), _case(torch.quantile, _r(8), torch.tensor([0.25, 0.5]))]
    c["reflection_pad1d"] = [_case(torch._C._nn.reflection_pad1d, _r(1, 2, 8), (2, 2))]
    c["reflection_pad2d"] = [_case(torch._C._nn.reflection_pad2d, _r(1, 2, 4, 4), (1, 1, 1, 1))]
    c["replication_pad1d"] = [_case(torch._C._nn.replication_pad1d, _r(1, 2, 8), (2, 2))]
    c["replication_pad2d"] = [_case(torch._C._nn.replication_pad2d, _r(1, 2, 4, 4), (1, 1, 1, 1))]
    c["replication_pad3d"] = [_case(torch._C._nn.replication_pad3d, _r(1, 2, 4, 4, 4), (1, 1, 1, 1, 1, 1))]
    c["smooth_l1_loss"] = [_case(F.smooth_l1_loss, _r(4, 4), _r(4, 4, seed=1))]
    c["soft_margin_loss"] = [_case(F.soft_margin_loss, _r(4, 4), torch.ones(4, 4))]
    c["stft"] = [_case(torch.stft, _r(32), 8, return_complex=True, window=torch.hann_window(8)),
                 _case(torch.stft, _r(32), 8, return_complex=True, center=False)]  # fmt: skip
    c["svd"] = [_case(torch.svd, _spd())]
    c["trace"] = [_case(torch.trace, _r(4, 4))]
    c["triangular_solve"] = [_case(torch.triangular_solve, _r(4, 2, seed=1), torch.linalg.cholesky(_spd()), upper=False)]
    c["triplet_margin_loss"] = [_case(F.triplet_margin_loss, _r(3, 4), _r(3, 4, seed=1), _r(3, 4, seed=2))]
    c["view_as_complex"] = [_case(torch.view_as_complex, _r(4, 2))]
    # --- promote (both operand orders are generated by the test)
    c["cat"] = [_case(torch.cat, [_r(4), _r(4, seed=1)])]
    c["stack"] = [_case(torch.stack, [_r(4), _r(4, seed=1)])]
    c["index_copy"] = [_case(torch.index_copy, _r(4, 3), 0, torch.tensor([0, 2]), _r(2, 3, seed=1))]
    return c


with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    CPU_CASES = _cases()
CPU_TABLE = default_table("cpu", BF16)


def test_every_cpu_table_op_has_a_case() -> None:
    assert not CPU_TABLE.ops - CPU_TABLE.banned - set(CPU_CASES), "a default-table op without a case"
    if SAME_TORCH:  # the derived table is the pinned one here, op for op
        assert set(CPU_CASES) == set(CPU_TABLE.ops - CPU_TABLE.banned)


def _map(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list | tuple):
        return type(value)(_map(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    return value


def _floating_to(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.to(dtype) if t.is_floating_point() else t


def _flat(value: Any) -> list[Any]:
    if isinstance(value, list | tuple):
        return [y for v in value for y in _flat(v)]
    return [value]


# LAPACK's least squares is not bit-reproducible on CPU even between two plain eager
# calls on the same inputs; it is compared to float32 round-off, dtypes still exact.
NOT_BIT_REPRODUCIBLE = frozenset({"linalg_lstsq"})


def assert_bitwise(actual: Any, expected: Any, what: str) -> None:
    if re.match(r"\w+", what).group() in NOT_BIT_REPRODUCIBLE:  # type: ignore[union-attr]
        for x, y in zip(_flat(actual), _flat(expected), strict=True):
            if isinstance(x, torch.Tensor):
                torch.testing.assert_close(x, y, msg=what)
        return
    a, e = _flat(actual), _flat(expected)
    assert len(a) == len(e), what
    for i, (x, y) in enumerate(zip(a, e, strict=True)):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype, f"{what}[{i}]: {x.dtype} vs {getattr(y, 'dtype', y)}"
            if not torch.equal(x, y):
                both_nan = x.isnan() & y.isnan() if x.is_floating_point() or x.is_complex() else None
                bad = (x != y) if both_nan is None else (x != y) & ~both_nan
                if bad.any():
                    where = tuple(int(k) for k in bad.nonzero()[0])
                    raise AssertionError(f"{what}[{i}]: first difference at {where}: {x[where]} vs {y[where]}")
        else:
            assert x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)), what


def _run(case: Case, transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Any:
    fn, args, kwargs = case
    if transform is not None:
        args, kwargs = _map(args, transform), _map(kwargs, transform)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _variants(op: str, case: Case) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor] | None]]:
    """Input dtype variants: the ones that make the op's class visible, and both
    operand orders of mixed bf16 / fp32 inputs for promote ops."""
    precision = CPU_TABLE.precision_of(op)
    if precision is Precision.LOW:
        return [("fp32 inputs", None)]
    if precision is Precision.FP32:
        return [("bf16 inputs", _floating_to(BF16))]
    counter = {"i": 0}

    def alternate(first: torch.dtype, second: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        def fn(t: torch.Tensor) -> torch.Tensor:
            if not t.is_floating_point():
                return t
            counter["i"] += 1
            return t.to(first if counter["i"] % 2 else second)

        return fn

    return [("bf16,fp32", alternate(BF16, torch.float32)), ("fp32,bf16", alternate(torch.float32, BF16)),
            ("bf16,bf16", _floating_to(BF16))]  # fmt: skip


def _oracle_dtype(op: str, args: Any, kwargs: Any) -> torch.dtype:
    precision = CPU_TABLE.precision_of(op)
    if precision is Precision.LOW:
        return BF16
    if precision is Precision.FP32:
        return torch.float32
    dtypes = {t.dtype for t in _flat((args, list(kwargs.values()))) if isinstance(t, torch.Tensor) and t.is_floating_point()}
    return torch.float32 if torch.float32 in dtypes else BF16


def _eligible_to(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t


def _case_params() -> list[Any]:
    ops = sorted(set(CPU_CASES) & CPU_TABLE.ops)  # the default table: this torch's classes
    return [pytest.param(op, i, id=f"{op}-{i}") for op in ops for i in range(len(CPU_CASES[op]))]


@pytest.mark.parametrize(("op", "index"), _case_params())
def test_cpu_op_class_engine_and_torch_agree_bitwise(op: str, index: int) -> None:
    """For every op of the CPU tables:

    1. torch.autocast's result equals explicit casts to the op's pinned class
       (so the pinned class is what the installed torch does);
    2. mixprec.autocast without custom ops equals torch.autocast;
    3. mixprec's engine forced to handle the op itself equals torch.autocast, bitwise.
    """
    case = CPU_CASES[op][index]
    precision = CPU_TABLE.precision_of(op)
    assert precision is not None
    for label, transform in _variants(op, case):
        fn, args, kwargs = case
        if transform is not None:
            args, kwargs = _map(args, transform), _map(kwargs, transform)
        staged: Case = (fn, args, kwargs)
        try:
            with torch.autocast("cpu", dtype=BF16):
                expected = _run(staged)
        except RuntimeError as err:  # no bf16 kernel on this CPU (oneDNN's LSTM without bf16 instructions)
            with pytest.raises(RuntimeError), autocast(BF16, device_type="cpu"):
                _run(staged)  # mixprec fails where torch does, it does not work around it
            pytest.skip(f"{op} ({label}): torch.autocast has no kernel for it on this CPU: {str(err).splitlines()[0]}")
        target = _oracle_dtype(op, args, kwargs)
        oracle = _run(staged, _eligible_to(target))
        assert_bitwise(expected, oracle, f"{op} ({label}): torch.autocast vs explicit {target} casts")
        with autocast(BF16, device_type="cpu"):
            plain = _run(staged)
        assert_bitwise(plain, expected, f"{op} ({label}): mixprec.autocast() vs torch.autocast")
        forced = PolicyMode(BF16, {"cpu": {op: precision}}, "cpu")
        with torch.autocast("cpu", dtype=BF16), forced:
            engine = _run(staged)
        assert_bitwise(engine, expected, f"{op} ({label}): mixprec engine vs torch.autocast")


@pytest.mark.parametrize(("op", "index"), _case_params())
def test_cpu_op_float64_inputs_untouched(op: str, index: int) -> None:
    case = CPU_CASES[op][index]
    precision = CPU_TABLE.precision_of(op)
    assert precision is not None
    to64 = _floating_to(torch.float64)
    try:
        reference = _run(case, to64)
    except RuntimeError as err:  # the kernel has no float64 version on CPU
        with pytest.raises(RuntimeError), torch.autocast("cpu", dtype=BF16):
            _run(case, to64)
        pytest.skip(f"{op} has no float64 CPU kernel: {str(err).splitlines()[0]}")
    with torch.autocast("cpu", dtype=BF16):
        under_torch = _run(case, to64)
    forced = PolicyMode(BF16, {"cpu": {op: precision}}, "cpu")
    with torch.autocast("cpu", dtype=BF16), forced:
        under_engine = _run(case, to64)
    assert_bitwise(under_torch, reference, f"{op}: torch.autocast touched float64")
    assert_bitwise(under_engine, reference, f"{op}: mixprec engine touched float64")


@pytest.mark.parametrize(("op", "index"), _case_params())
def test_cpu_op_moved_to_the_other_class_matches_explicit_casts(op: str, index: int) -> None:
    """Moving each table op through the public OpPolicy (low -> fp32, fp32 -> low,
    promote -> fp32) runs it exactly as explicit casts with autocast off would."""
    case = CPU_CASES[op][index]
    precision = CPU_TABLE.precision_of(op)
    if precision is Precision.LOW:
        policy, target, transform = OpPolicy(BF16, fp32_ops=[op]), torch.float32, None
    elif precision is Precision.FP32:
        policy, target, transform = OpPolicy(BF16, lower_ops=[op]), BF16, None
    else:
        policy, target, transform = OpPolicy(BF16, fp32_ops=[op]), torch.float32, _floating_to(BF16)
    try:
        oracle = _run(case, _eligible_to(target) if transform is None else lambda t: _eligible_to(target)(transform(t)))
    except RuntimeError:  # e.g. no bf16 kernel: mixprec must fail the same way, not silently fall back
        with pytest.raises(RuntimeError), autocast(device_type="cpu", policy=policy):
            _run(case, transform)
        return
    with autocast(device_type="cpu", policy=policy):
        moved = _run(case, transform)
    assert_bitwise(moved, oracle, f"{op} moved from {precision.value}")


def test_int_inputs_untouched() -> None:
    a = torch.randint(0, 5, (4, 4))
    for policy in (OpPolicy(BF16, fp32_ops=["mm"]), OpPolicy(BF16, lower_ops=["mm"])):
        with autocast(device_type="cpu", policy=policy):
            out = torch.mm(a, a)
        assert out.dtype == torch.int64 and torch.equal(out, a @ a)


@pytest.mark.parametrize("value", [3, 2.5, object()])
def test_fp32_modules_that_is_not_a_sequence_is_a_type_error_naming_it(value) -> None:
    msg = (
        "fp32_modules takes a sequence of nn.Module classes (e.g. nn.LayerNorm) or qualified-name "
        f"globs (e.g. '*.attn.softmax'), got {value!r}"
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        OpPolicy(fp32_modules=value)


def test_explain_prints_as_the_table_at_a_prompt_and_is_a_plain_string_to_code() -> None:
    from mixprec import OpPolicy, get_plan

    for text in (OpPolicy(fp32_ops=("softmax",)).explain("cpu"), get_plan("bf16-mixed", fp32_ops=("softmax",)).explain()):
        assert isinstance(text, str) and "\n" in text
        assert repr(text) == str(text)  # what the REPL shows: the table, not a quoted one-liner
        assert "softmax" in text


# ------------------------------------------- the default tables: the running torch's
FP16, FP32 = torch.float16, torch.float32
LOW_DTYPES = [pytest.param(BF16, id="bf16"), pytest.param(FP16, id="fp16")]


REAL_OF_COMPLEX = {torch.complex32: FP16, torch.complex64: FP32, torch.complex128: torch.float64}


def _out_dtype(value: Any) -> torch.dtype | None:
    """The first floating (complex: its real) dtype in an op's result."""
    for t in _flat(value):
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            return REAL_OF_COMPLEX.get(t.dtype, t.dtype)
    return None


def _dtype_variants(low: torch.dtype) -> list[tuple[str, Callable[[], Callable[[torch.Tensor], torch.Tensor]]]]:
    def alternate(first: torch.dtype, second: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        counter = {"i": 0}

        def fn(t: torch.Tensor) -> torch.Tensor:
            if not t.is_floating_point():
                return t
            counter["i"] += 1
            return t.to(first if counter["i"] % 2 else second)

        return fn

    return [
        ("fp32 inputs", lambda: _eligible_to(FP32)),
        ("low inputs", lambda: _eligible_to(low)),
        ("low,fp32", lambda: alternate(low, FP32)),
        ("fp32,low", lambda: alternate(FP32, low)),
    ]


def _class_dtype(word: str, args: Any, kwargs: Any, low: torch.dtype) -> torch.dtype:
    if word == "low":
        return low
    if word == "fp32":
        return FP32
    floating = {t.dtype for t in _flat((args, list(kwargs.values()))) if isinstance(t, torch.Tensor) and t.is_floating_point()}
    return FP32 if FP32 in floating else low


def _all_cpu_table_ops() -> list[str]:
    ops = set()
    for dtype in (BF16, FP16):
        ops |= pinned_table("cpu", dtype).ops | default_table("cpu", dtype).ops
    return sorted(ops)


@pytest.mark.parametrize("low", LOW_DTYPES)
@pytest.mark.parametrize("op", _all_cpu_table_ops())
def test_default_cpu_table_is_what_torch_autocast_does_op_by_op(op: str, low: torch.dtype) -> None:
    """The point of deriving the tables: on the running torch, for every op of the pinned and
    the default CPU tables and inputs of every dtype mix, torch.autocast's output dtype is
    the one the default table's class gives, and mixprec.autocast with the op listed in that
    class (a move that changes nothing, so nothing is intercepted) gives the same dtype.

    The cases are tests/test_policy.py's, not the probe's samples: an independent check."""
    from mixprec.policy import table_changes
    from mixprec.policy.tables import class_name

    table = default_table("cpu", low)
    word = class_name(table, op)
    if word == "unknown":
        pytest.skip(f"{op}: torch autocasts it, the probe could not tell its class (left to torch)")
    assert word != "none", f"{op} is in a table but not in this torch's default table: {table_changes('cpu', low).get(op)}"
    lists = {"low": {"lower_ops": [op]}, "fp32": {"fp32_ops": [op]}}.get(word, {})
    assert OpPolicy(low, **lists).overrides("cpu") == {}, f"{op}: listing it in its own class intercepts it"
    checked = 0
    for case in CPU_CASES[op]:
        fn, args, kwargs = case
        for label, make in _dtype_variants(low):
            transform = make()
            a, k = _map(args, transform), _map(kwargs, transform)
            try:
                with torch.autocast("cpu", dtype=low):
                    expected = _run((fn, a, k))
            except RuntimeError:  # no kernel for this dtype mix on this CPU: mixprec fails alike
                with pytest.raises(RuntimeError), autocast(low, device_type="cpu", **lists):
                    _run((fn, a, k))
                continue
            with autocast(low, device_type="cpu", **lists):
                got = _run((fn, a, k))
            what = f"{op} ({label}, {word})"
            assert _out_dtype(got) == _out_dtype(expected), f"{what}: mixprec.autocast vs torch.autocast"
            if _out_dtype(expected) is not None:  # linalg_matrix_rank: an integer result
                assert _out_dtype(expected) == _class_dtype(word, a, k, low), f"{what}: torch.autocast vs the table's class"
                checked += 1
    if checked == 0 and op != "linalg_matrix_rank":
        pytest.skip(f"{op}: no dtype mix ran under torch.autocast on this CPU")


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_the_cpu_probe_classes_every_op_torch_autocasts(dtype: torch.dtype) -> None:
    from mixprec.policy import table_changes, torch_table

    running = torch_table("cpu", dtype)
    assert running.source == "each op run under its autocast on cpu"
    registered = torch_autocast_ops("cpu")
    if registered is not None:
        assert running.ops | running.unresolved == registered
    if SAME_TORCH:
        assert running.unresolved <= {"mkldnn_rnn_layer"}, sorted(running.unresolved)  # oneDNN's LSTM needs bf16 instructions
        assert table_changes("cpu", dtype) == {}
    else:
        print(f"torch {torch.__version__} vs the pinned {TABLES_TORCH_VERSION} tables: {table_changes('cpu', dtype)}")


def test_the_cuda_tables_without_a_gpu_are_the_pinned_classes_of_the_registered_ops() -> None:
    from mixprec.policy import table_changes, torch_table

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA is in use here: tests/cuda checks the probed CUDA tables")
    running = torch_table("cuda", torch.float16)
    assert not running.ops and "ops not run: " in running.source  # no class from a run, never a GPU initialized
    registered = torch_autocast_ops("cuda")
    table = default_table("cuda", torch.float16)
    if registered is not None:
        assert table.ops | table.unresolved == registered
    pinned = pinned_table("cuda", torch.float16)
    for op in table.ops:
        assert table.precision_of(op) is pinned.precision_of(op) and (op in table.banned) == (op in pinned.banned)
    if SAME_TORCH:
        assert table_changes("cuda") == {} and table == pinned


def test_the_simulated_cuda_probe_finds_the_pinned_cuda_classes() -> None:
    """The CUDA samples and the classification, on fake CUDA tensors (no GPU needed): every
    op the simulation can run gets its pinned class on the torch the tables are pinned to."""
    from mixprec.amp.probe import probe_table
    from mixprec.policy.tables import class_name

    registered = torch_autocast_ops("cuda")
    if registered is None:
        pytest.skip("this torch does not list its autocast registrations")
    for dtype in (torch.float16, BF16):
        simulated = probe_table("cuda", dtype, registered, simulate=True)
        assert not isinstance(simulated, str)
        pinned = pinned_table("cuda", dtype)
        # these branch on a real GPU (cuDNN checks) before they reach a fake kernel
        assert simulated.unresolved <= {"_thnn_fused_gru_cell", "cudnn_convolution", "cudnn_convolution_transpose",
                                        "grid_sampler", "gru_cell"}, sorted(simulated.unresolved)  # fmt: skip
        if SAME_TORCH:
            differ = {op: (class_name(pinned, op), class_name(simulated, op)) for op in simulated.ops
                      if class_name(pinned, op) != class_name(simulated, op)}  # fmt: skip
            assert differ == {}


def test_every_table_op_has_a_probe_sample_on_a_registered_overload() -> None:
    from mixprec.amp.samples import SAMPLES

    for device in DEVICE_TYPES:
        table = pinned_table(device)
        assert not table.ops - set(SAMPLES), f"{device}: table ops without a probe sample"
        if not SAME_TORCH:
            continue
        key = "Autocast" + torch._C._dispatch_key_for_device(device)
        for op in sorted(table.ops):
            overload = getattr(getattr(torch.ops.aten, op), SAMPLES[op][0])
            assert torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), key), f"{device}: {overload.name()}"


@pytest.fixture
def rederived() -> Any:
    """The default tables worked out again in the test, and again after it."""
    from mixprec.policy import clear_torch_tables

    clear_torch_tables()
    yield
    clear_torch_tables()


def test_a_torch_that_classes_ops_otherwise_changes_the_default_table_and_explain(monkeypatch, rederived) -> None:
    """A simulated version difference: the probe reports linear in fp32 and cannot run
    softmax, and the dispatcher no longer lists cat but lists gelu."""
    from mixprec.amp import probe
    from mixprec.policy import derived, table_changes, torch_table

    real_classify, real_registered = probe.classify_op, derived.torch_autocast_ops

    def classify(op: str, device_type: str, dtype: torch.dtype, *, simulate: bool = False) -> Any:
        if device_type == "cpu" and op == "linear":
            return Precision.FP32
        return real_classify(op, device_type, dtype, simulate=simulate)

    def registered(device_type: str) -> frozenset[str] | None:
        ops = real_registered(device_type)
        return None if ops is None else (ops - {"cat"}) | {"gelu"}

    monkeypatch.setattr(probe, "classify_op", classify)
    monkeypatch.setattr(derived, "torch_autocast_ops", registered)
    if real_registered("cpu") is None:
        pytest.skip("this torch does not list its autocast registrations")
    table = default_table("cpu", BF16)
    assert table.precision_of("linear") is Precision.FP32
    assert table.precision_of("cat") is None and "cat" not in table.ops  # torch no longer autocasts it
    assert "gelu" in table.unresolved and table.precision_of("gelu") is None  # autocast, class unknown: left to torch
    assert table.precision_of("mm") is Precision.LOW  # the rest as before
    assert pinned_table("cpu", BF16).precision_of("linear") is Precision.LOW  # the record stays
    changes = table_changes("cpu", BF16)
    assert {op: changes[op] for op in ("cat", "gelu", "linear")} == {
        "cat": ("promote", "none"), "gelu": ("none", "unknown"), "linear": ("low", "fp32"),
    }  # fmt: skip
    if SAME_TORCH:
        assert set(changes) == {"cat", "gelu", "linear"}
    assert torch_table("cpu", BF16).precision_of("linear") is Precision.FP32
    # the engine follows the corrected table: listing linear as fp32 is now no move, as low it is
    assert OpPolicy(BF16, fp32_ops=["linear"]).overrides("cpu") == {}
    assert OpPolicy(BF16, lower_ops=["linear"]).overrides("cpu") == {"linear": Precision.LOW}
    assert OpPolicy(BF16, fp32_ops=["cat"]).overrides("cpu") == {"cat": Precision.FP32}
    text = OpPolicy(BF16).explain("cpu")
    last = " ".join(line.strip() for line in text.splitlines()[-3:])
    assert "differences from the pinned torch 2.13 tables" in last
    assert "cat (promote -> none), gelu (none -> unknown)" in last and "linear (low -> fp32)" in last
    rows = {r.split("|")[0].strip(): r.split("|")[2].strip() for r in text.splitlines()[3:] if r.count("|") == 2}
    assert rows["left to torch"] == "gelu"
    with autocast(BF16, device_type="cpu", lower_ops=["linear"]):  # intercepted, so it runs in bf16
        y = F.linear(torch.ones(2, 3), torch.ones(4, 3))
    assert y.dtype == BF16


def test_an_unprobed_table_keeps_the_pinned_classes(monkeypatch, rederived) -> None:
    from mixprec.policy import set_torch_table_source, table_changes, torch_table

    previous = set_torch_table_source(lambda device, dtype, ops: "switched off in this test")
    try:
        running = torch_table("cpu", BF16)
        assert not running.ops and running.source.endswith("ops not run: switched off in this test")
        assert default_table("cpu", BF16).precision_of("linear") is Precision.LOW
        if SAME_TORCH:
            assert table_changes("cpu", BF16) == {}
        assert "switched off in this test" in OpPolicy().explain("cpu").splitlines()[0]
    finally:
        set_torch_table_source(previous)
    assert torch_table("cpu", BF16).source == "each op run under its autocast on cpu"


def test_a_failing_probe_leaves_the_pinned_classes(rederived) -> None:
    from mixprec.policy import set_torch_table_source, torch_table

    calls: list[str] = []

    def broken(device_type: str, dtype: torch.dtype, ops: frozenset[str]) -> Any:
        calls.append(device_type)
        raise RuntimeError("a probe bug")

    previous = set_torch_table_source(broken)
    try:
        assert "the table source failed (RuntimeError: a probe bug)" in torch_table("cpu", BF16).source
        assert default_table("cpu", BF16).precision_of("linear") is Precision.LOW
        with autocast(BF16, device_type="cpu", fp32_ops=["linear"]):  # autocast still works
            assert F.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == FP32
        assert calls == ["cpu"]  # failed once, not retried on every use
    finally:
        set_torch_table_source(previous)


def test_no_probe_while_torch_compile_traces(monkeypatch, rederived) -> None:
    from mixprec.policy import torch_table

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert "not run while torch.compile traces" in torch_table("cpu", BF16).source
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert torch_table("cpu", BF16).source == "each op run under its autocast on cpu"  # not kept: run now


class _Recorder(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_the_probe_leaves_no_trace(rederived) -> None:
    """Worked out inside an fp16 autocast region with a weight cache, a policy mode, a
    torch-function mode and op_stats: none of them sees it, and the RNG, the thread count
    and the autocast state are as before."""
    from mixprec import op_stats
    from mixprec.policy import torch_table

    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    threads = torch.get_num_threads()
    recorder = _Recorder()
    w = torch.ones(3, 3, requires_grad=True)
    with op_stats() as stats, autocast(FP16, device_type="cpu", fp32_ops=["softmax"]), recorder:
        before = torch.mm(w, w)
        state = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled())
        counted = {key: stats[key] for key in stats}
        recorded = len(recorder.calls)
        table = torch_table("cpu", BF16)
        assert len(recorder.calls) == recorded
        assert {key: stats[key] for key in stats} == counted
        assert (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled()) == state
        after = torch.mm(w, w)
    assert table.precision_of("mm") is Precision.LOW and table.source == "each op run under its autocast on cpu"
    assert before.dtype == after.dtype == FP16
    assert torch.equal(torch.get_rng_state(), rng) and torch.get_num_threads() == threads
    assert stats.calls("mm") == 2


def test_derived_once_per_process_fast_and_never_at_import() -> None:
    """Measured in a fresh process: import derives nothing; the first custom-list autocast
    derives the CPU table (a few hundred tiny calls); the next one reuses it."""
    import json
    import subprocess
    import sys

    code = (
        "import json, time, torch\n"
        "import mixprec\n"
        "from mixprec.policy import derived\n"
        "at_import = len(derived._TORCH) + len(derived._DEFAULT)\n"
        "t = time.perf_counter(); mixprec.autocast(torch.bfloat16, device_type='cpu', fp32_ops=['linear'])\n"
        "first = time.perf_counter() - t\n"
        "t = time.perf_counter(); mixprec.autocast(torch.bfloat16, device_type='cpu', lower_ops=['softmax'])\n"
        "second = time.perf_counter() - t\n"
        "print(json.dumps({'at_import': at_import, 'first': first, 'second': second}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stderr == "", out.stderr  # no warning printed by the probe
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"first custom-list autocast: {measured['first'] * 1e3:.0f} ms, second: {measured['second'] * 1e3:.2f} ms")
    assert measured["at_import"] == 0
    assert measured["first"] < 1.0  # typically 40-90 ms; generous for a loaded CI machine
    assert measured["second"] < 0.05


def test_concurrent_first_use_derives_one_table(rederived) -> None:
    import threading

    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(default_table("cpu", BF16))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r is results[0] for r in results)

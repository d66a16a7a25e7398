"""The default autocast op tables as plain data, pinned to one PyTorch release.

Each op name is an aten op name without overload ("linear", "softmax", "mm") and
falls in one of three classes, as in PyTorch:

- ``low``: floating inputs are cast to the autocast dtype (bf16 / fp16);
- ``fp32``: floating inputs are cast to float32;
- ``promote``: floating inputs are cast to the widest floating input type.

Ops in no table run in whatever dtype their inputs have. float64 and non-floating
tensors are never cast.

These are the pinned tables: what PyTorch :data:`TABLES_TORCH_VERSION` does. The
default tables that :class:`~mixprec.policy.OpPolicy` edits are these corrected by
what the running torch does (:mod:`mixprec.policy.derived`); the pinned ones stay the
fallback and the record.

>>> import torch
>>> from mixprec.policy.tables import pinned_table
>>> pinned_table("cpu", torch.bfloat16).precision_of("linear")
<Precision.LOW: 'low'>
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from mixprec.dtypes import dtype_name, parse_dtype

__all__ = [
    "DEVICE_TYPES",
    "OP_ALIASES",
    "PINNED_SOURCE",
    "TABLES_TORCH_VERSION",
    "TABLES_VERSION",
    "OpTable",
    "Precision",
    "all_table_ops",
    "check_device_type",
    "class_name",
    "pinned_table",
]

#: The PyTorch release the pinned tables were taken from (major.minor).
TABLES_TORCH_VERSION = "2.13"
#: Bumped whenever the tables below change.
TABLES_VERSION = 1
#: Device types with pinned tables.
DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda")


class Precision(enum.Enum):
    """The precision class an op runs in under autocast."""

    LOW = "low"
    FP32 = "fp32"
    PROMOTE = "promote"

    @classmethod
    def parse(cls, value: Precision | str) -> Precision:
        """``"low"`` / ``"fp32"`` / ``"promote"`` (or a member) -> member."""
        if isinstance(value, Precision):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            for member in cls:
                if member.value == key:
                    return member
        valid = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown precision {value!r}; expected one of {valid}")


# --------------------------------------------------------------------------- tables
# Op names are aten names without overload. Sorted, one table per line group, so a
# diff against a new PyTorch release reads as a list of added / removed names.

_CPU_LOW = (
    "_addmm_activation", "_convolution", "_native_multi_head_attention", "addbmm",
    "addmm", "baddbmm", "bmm", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "linalg_vecdot",
    "linear", "matmul", "mkldnn_rnn_layer", "mm", "prelu",
    "scaled_dot_product_attention",
)  # fmt: skip

_CPU_FP32 = (
    "_grid_sampler_2d_cpu_fallback", "_lu_with_info", "adaptive_avg_pool3d",
    "adaptive_max_pool3d", "avg_pool3d", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "cdist", "cholesky", "cholesky_inverse",
    "cholesky_solve", "cosine_embedding_loss", "cross_entropy_loss", "ctc_loss",
    "fake_quantize_per_tensor_affine", "fft_fft", "fft_fft2", "fft_fftn", "fft_hfft",
    "fft_ifft", "fft_ifft2", "fft_ifftn", "fft_ihfft", "fft_irfft", "fft_irfft2",
    "fft_irfftn", "fft_rfft", "fft_rfft2", "fft_rfftn", "fractional_max_pool2d",
    "fractional_max_pool3d", "geqrf", "grid_sampler", "grid_sampler_2d",
    "grid_sampler_3d", "hinge_embedding_loss", "huber_loss", "inverse", "kl_div",
    "l1_loss", "linalg_cholesky", "linalg_cholesky_ex", "linalg_cond", "linalg_eig",
    "linalg_eigh", "linalg_eigvals", "linalg_eigvalsh", "linalg_householder_product",
    "linalg_inv", "linalg_inv_ex", "linalg_lstsq", "linalg_matrix_rank", "linalg_qr",
    "linalg_solve", "linalg_svd", "linalg_svdvals", "linalg_tensorinv",
    "linalg_tensorsolve", "lu_solve", "margin_ranking_loss", "max_pool3d",
    "max_unpool2d", "max_unpool3d", "mse_loss", "multi_margin_loss",
    "multilabel_margin_loss", "multilabel_margin_loss_forward", "nanquantile",
    "nll_loss", "nll_loss2d", "orgqr", "ormqr", "pinverse", "poisson_nll_loss", "polar",
    "prod", "qr", "quantile", "reflection_pad1d", "reflection_pad2d",
    "replication_pad1d", "replication_pad2d", "replication_pad3d", "smooth_l1_loss",
    "soft_margin_loss", "stft", "svd", "trace", "triangular_solve",
    "triplet_margin_loss", "view_as_complex",
)  # fmt: skip

_CPU_PROMOTE = ("cat", "index_copy", "stack")

_CUDA_LOW = (
    "_convolution", "_scaled_dot_product_flash_attention", "_thnn_fused_gru_cell",
    "_thnn_fused_lstm_cell", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm",
    "chain_matmul", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "convolution", "cudnn_convolution",
    "cudnn_convolution_transpose", "einsum", "gru_cell", "linalg_multi_dot",
    "linalg_vecdot", "linear", "lstm_cell", "matmul", "mm", "mv", "prelu",
    "rnn_relu_cell", "rnn_tanh_cell", "scaled_dot_product_attention",
)  # fmt: skip

# cumprod, cumsum, linalg_*_norm, log_softmax, prod, softmax and sum reach fp32 through
# their dtype argument in PyTorch, and norm through an appended dtype; same result class.
_CUDA_FP32 = (
    "_upsample_bicubic2d_aa", "_upsample_bilinear2d_aa", "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "acos", "asin",
    "binary_cross_entropy_with_logits", "cdist", "cosh", "cosine_embedding_loss",
    "cosine_similarity", "cumprod", "cumsum", "dist", "erfinv", "exp", "expm1",
    "frobenius_norm", "group_norm", "hinge_embedding_loss", "huber_loss", "kl_div",
    "l1_loss", "layer_norm", "linalg_matrix_norm", "linalg_vector_norm", "log", "log10",
    "log1p", "log2", "log_softmax", "logsumexp", "margin_ranking_loss", "mse_loss",
    "multi_margin_loss", "multilabel_margin_loss", "native_layer_norm", "nll_loss",
    "nll_loss2d", "norm", "nuclear_norm", "pdist", "poisson_nll_loss", "pow", "prod",
    "reciprocal", "renorm", "rms_norm", "rsqrt", "sinh", "smooth_l1_loss",
    "soft_margin_loss", "softmax", "softplus", "sum", "tan", "triplet_margin_loss",
    "upsample_bicubic2d", "upsample_bilinear2d", "upsample_linear1d",
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
    "upsample_trilinear3d",
)  # fmt: skip

_CUDA_PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler",
    "index_put", "scatter_add", "tensordot", "vdot",
)  # fmt: skip

# PyTorch raises for these under CUDA autocast (unsafe to autocast); moving one to
# fp32_ops or lower_ops makes mixprec run it explicitly instead.
_CUDA_BANNED = ("binary_cross_entropy",)

#: Python-level names that are not aten op names -> the aten op they call.
OP_ALIASES: Mapping[str, str] = {
    "__matmul__": "matmul",
    "__rmatmul__": "matmul",
    "__pow__": "pow",
    "__rpow__": "pow",
    "__add__": "add",
    "__radd__": "add",
    "__sub__": "sub",
    "__rsub__": "rsub",
    "__mul__": "mul",
    "__rmul__": "mul",
    "__truediv__": "div",
    "__rtruediv__": "div",
    "__div__": "div",
    "__rdiv__": "div",
    "__floordiv__": "floor_divide",
    "__rfloordiv__": "floor_divide",
    "__mod__": "remainder",
    "__rmod__": "remainder",
    "cross_entropy": "cross_entropy_loss",
}


@dataclass(frozen=True)
class OpTable:
    """The autocast op classes of one device type and dtype (plain data).

    ``banned``: ops autocast refuses to run (unsafe to autocast); ``unresolved``: ops
    torch autocasts whose class could not be found (mixprec leaves them to torch);
    ``source``: where the table comes from, in words (not compared).
    """

    device_type: str
    dtype: torch.dtype
    low: frozenset[str]
    fp32: frozenset[str]
    promote: frozenset[str]
    banned: frozenset[str] = frozenset()
    unresolved: frozenset[str] = frozenset()
    source: str = field(default="", compare=False)

    def precision_of(self, op: str) -> Precision | None:
        """The op's class, or None when autocast leaves it alone."""
        if op in self.low:
            return Precision.LOW
        if op in self.fp32:
            return Precision.FP32
        if op in self.promote:
            return Precision.PROMOTE
        return None

    @property
    def ops(self) -> frozenset[str]:
        """Every op the table gives a class (banned ones included, unresolved ones not)."""
        return self.low | self.fp32 | self.promote | self.banned


def class_name(table: OpTable, op: str) -> str:
    """The op's entry in ``table`` in one word: "low", "fp32", "promote", "refused",
    "unknown" (unresolved) or "none" (autocast leaves it alone)."""
    precision = table.precision_of(op)
    if precision is not None:
        return precision.value
    if op in table.banned:
        return "refused"
    return "unknown" if op in table.unresolved else "none"


#: How the pinned tables describe themselves (``OpTable.source``).
PINNED_SOURCE = f"pinned to torch {TABLES_TORCH_VERSION} (v{TABLES_VERSION})"


def _table(
    device: str,
    dtype: torch.dtype,
    low: Iterable[str],
    fp32: Iterable[str],
    promote: Iterable[str],
    banned: Iterable[str] = (),
) -> OpTable:
    return OpTable(
        device,
        dtype,
        frozenset(low),
        frozenset(fp32),
        frozenset(promote),
        frozenset(banned),
        source=PINNED_SOURCE,
    )


# PyTorch uses one list per device for both dtypes; they are keyed by dtype so that a
# dtype-specific default can be pinned without changing the API.
_TABLES: dict[tuple[str, torch.dtype], OpTable] = {
    (device, dtype): _table(device, dtype, *lists)
    for device, lists in (
        ("cpu", (_CPU_LOW, _CPU_FP32, _CPU_PROMOTE)),
        ("cuda", (_CUDA_LOW, _CUDA_FP32, _CUDA_PROMOTE, _CUDA_BANNED)),
    )
    for dtype in (torch.bfloat16, torch.float16)
}


def check_device_type(device_type: object) -> str:
    """``device_type`` if it is a str (the tables then say whether they cover it); a
    TypeError naming the value and the fix otherwise."""
    if not isinstance(device_type, str):
        fix = "device.type" if isinstance(device_type, torch.device) else "e.g. 'cpu' or 'cuda'"
        raise TypeError(
            f"device_type must be a device type name (str) such as 'cpu' or 'cuda', got {device_type!r} "
            f"({type(device_type).__name__}); pass {fix}"
        )
    return device_type


def pinned_table(device_type: str, dtype: torch.dtype | str = torch.bfloat16) -> OpTable:
    """The pinned table for ``device_type`` ("cpu" / "cuda") and ``dtype``: PyTorch
    :data:`TABLES_TORCH_VERSION`'s classes, whatever torch runs.

    >>> import torch
    >>> from mixprec.policy import pinned_table
    >>> "softmax" in pinned_table("cuda", torch.float16).fp32
    True
    >>> "softmax" in pinned_table("cpu", torch.bfloat16).fp32
    False
    """
    check_device_type(device_type)
    key = (device_type, parse_dtype(dtype))
    try:
        return _TABLES[key]
    except KeyError:
        raise ValueError(
            f"no autocast op table for device_type={device_type!r}, dtype={dtype_name(key[1])}; "
            f"tables exist for device types {', '.join(DEVICE_TYPES)} and dtypes bf16, fp16"
        ) from None


@functools.cache
def all_table_ops() -> frozenset[str]:
    """Every op name any pinned table names (all devices and dtypes, banned ones included)."""
    return frozenset().union(*(t.ops for t in _TABLES.values()))

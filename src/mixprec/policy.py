"""Op precision policy: autocast op tables as plain data, and custom op lists on top.

PyTorch's autocast keeps its op lists in C++; they cannot be edited, are the same
for fp16 and bf16, and change between releases. mixprec keeps them here as data,
pinned to one PyTorch release (:data:`TABLES_TORCH_VERSION`, :data:`TABLES_VERSION`),
so an upgrade cannot change what mixprec documents and tests without a test
noticing (:func:`compare_with_torch` reports the differences).

Each op name is an aten op name without overload ("linear", "softmax", "mm") and
falls in one of three classes, as in PyTorch:

- ``low``: floating inputs are cast to the autocast dtype (bf16 / fp16);
- ``fp32``: floating inputs are cast to float32;
- ``promote``: floating inputs are cast to the widest floating input type.

Ops in no table run in whatever dtype their inputs have. float64 and non-floating
tensors are never cast.

:class:`OpPolicy` moves ops between the tables, with Paddle's algebra:
effective low = (default ∪ lower_ops) − fp32_ops and effective fp32 =
(default − lower_ops) ∪ fp32_ops.

>>> import torch
>>> from mixprec.policy import OpPolicy, default_table
>>> default_table("cpu", torch.bfloat16).precision_of("linear")
<Precision.LOW: 'low'>
>>> policy = OpPolicy(torch.bfloat16, lower_ops=["softmax"], fp32_ops=["linear"])
>>> policy.precision_of("linear", "cpu"), policy.precision_of("softmax", "cpu")
(<Precision.FP32: 'fp32'>, <Precision.LOW: 'low'>)
>>> sorted(policy.overrides("cpu"))
['linear', 'softmax']
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.dtypes import LOW_PRECISION_DTYPES, dtype_name, parse_dtype

__all__ = [
    "DEVICE_TYPES",
    "OP_ALIASES",
    "TABLES_TORCH_VERSION",
    "TABLES_VERSION",
    "OpPolicy",
    "OpTable",
    "Precision",
    "TableDiff",
    "compare_with_torch",
    "default_table",
    "known_op_names",
    "normalize_op_name",
    "registered_ops",
    "torch_autocast_ops",
]

#: The PyTorch release the default tables were taken from (major.minor).
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
    """The default autocast op classes of one device type and dtype (plain data)."""

    device_type: str
    dtype: torch.dtype
    low: frozenset[str]
    fp32: frozenset[str]
    promote: frozenset[str]
    banned: frozenset[str] = frozenset()

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
        """Every op the table names (banned ones included)."""
        return self.low | self.fp32 | self.promote | self.banned


def _table(
    device: str,
    dtype: torch.dtype,
    low: Iterable[str],
    fp32: Iterable[str],
    promote: Iterable[str],
    banned: Iterable[str] = (),
) -> OpTable:
    return OpTable(
        device, dtype, frozenset(low), frozenset(fp32), frozenset(promote), frozenset(banned)
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


def default_table(device_type: str, dtype: torch.dtype | str = torch.bfloat16) -> OpTable:
    """The pinned default table for ``device_type`` ("cpu" / "cuda") and ``dtype``.

    >>> import torch
    >>> from mixprec.policy import default_table
    >>> "softmax" in default_table("cuda", torch.float16).fp32
    True
    >>> "softmax" in default_table("cpu", torch.bfloat16).fp32
    False
    """
    key = (device_type, parse_dtype(dtype))
    try:
        return _TABLES[key]
    except KeyError:
        raise ValueError(
            f"no autocast op table for device_type={device_type!r}, dtype={dtype_name(key[1])}; "
            f"tables exist for device types {', '.join(DEVICE_TYPES)} and dtypes bf16, fp16"
        ) from None


# ------------------------------------------------------------------------ op names
@functools.cache
def _aten_op_names() -> frozenset[str]:
    names: set[str] = set()
    list_ops = getattr(torch._C, "_dispatch_get_all_op_names", None)
    if list_ops is None:  # unknown names are then checked one by one on torch.ops.aten
        return frozenset()
    for qualified in list_ops():
        namespace, _, rest = qualified.partition("::")
        if namespace == "aten":
            names.add(rest.partition(".")[0])
    return frozenset(names)


@functools.cache
def _table_op_names() -> frozenset[str]:
    return frozenset().union(*(t.ops for t in _TABLES.values()))


def known_op_names() -> frozenset[str]:
    """Every op name an :class:`OpPolicy` accepts: mixprec's tables plus torch's aten ops."""
    return _table_op_names() | _aten_op_names()


def _is_aten_op(name: str) -> bool:
    if name in _aten_op_names():
        return True
    try:  # ops registered lazily after the first scan
        getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def normalize_op_name(name: str) -> str:
    """The table name of a Python-level op name: ``"__matmul__"`` -> ``"matmul"``,
    ``"aten::softmax"`` -> ``"softmax"``, ``"cross_entropy"`` -> ``"cross_entropy_loss"``.

    >>> from mixprec.policy import normalize_op_name
    >>> normalize_op_name("__rmatmul__"), normalize_op_name("aten::linear")
    ('matmul', 'linear')
    """
    name = name.strip().removeprefix("aten::")
    return OP_ALIASES.get(name, name)


def _check_op_name(name: object, field: str) -> str:
    if not isinstance(name, str):
        raise TypeError(
            f"{field} takes op names (str) such as 'linear' or 'softmax', got {name!r} "
            f"of type {type(name).__name__}"
        )
    op = normalize_op_name(name)
    if "." in op:
        base = op.partition(".")[0]
        raise ValueError(
            f"{field} got {name!r}: op names are given without overload; use {base!r}, "
            "which covers all its overloads"
        )
    if op in _table_op_names() or _is_aten_op(op):
        return op
    close = difflib.get_close_matches(op, sorted(known_op_names()), n=3, cutoff=0.6)
    hint = (
        "did you mean " + ", ".join(repr(c) for c in close) + "?"
        if close
        else "op names are aten names as in PyTorch's autocast tables, e.g. 'linear', 'softmax'"
    )
    raise ValueError(
        f"unknown op name {name!r} in {field}: neither mixprec's autocast tables nor "
        f"torch.ops.aten know it; {hint}"
    )


def _as_names(value: Iterable[str] | str, field: str) -> tuple[str, ...]:
    items: Iterable[Any] = (value,) if isinstance(value, str) else value
    try:
        items = tuple(items)
    except TypeError:
        raise TypeError(f"{field} must be a sequence of op names, got {value!r}") from None
    return tuple(dict.fromkeys(_check_op_name(v, field) for v in items))


ModuleRule = type[nn.Module] | str


def _as_module_rules(value: Iterable[ModuleRule] | ModuleRule) -> tuple[ModuleRule, ...]:
    items: Iterable[Any] = (value,) if isinstance(value, str | type) else value
    try:
        items = tuple(items)
    except TypeError:
        raise TypeError(
            "fp32_modules takes a sequence of nn.Module classes (e.g. nn.LayerNorm) or qualified-name "
            f"globs (e.g. '*.attn.softmax'), got {value!r}"
        ) from None
    rules: list[ModuleRule] = []
    for item in items:
        if isinstance(item, str) or (isinstance(item, type) and issubclass(item, nn.Module)):
            rules.append(item)
        else:
            raise TypeError(
                "fp32_modules takes nn.Module classes (e.g. nn.LayerNorm) or qualified-name "
                f"globs (e.g. '*.attn.softmax'), got {item!r}"
            )
    return tuple(dict.fromkeys(rules))


# ------------------------------------------------------------- registered custom ops
# Precisions declared for user ops with mixprec.register_op (the engine applies them;
# this is the record explain() prints).
_REGISTERED: dict[str, Precision] = {}


def registered_ops() -> dict[str, Precision]:
    """User ops declared with :func:`mixprec.register_op`, by name -> precision."""
    return dict(_REGISTERED)


def _record_registered_op(name: str, precision: Precision | None) -> None:
    if precision is None:
        _REGISTERED.pop(name, None)
    else:
        _REGISTERED[name] = precision


# ------------------------------------------------------------------------ the policy
@dataclass(frozen=True)
class OpPolicy:
    """Which ops run in low precision and which in fp32, on top of the default tables.

    Args:
        dtype: the low-precision dtype (``torch.bfloat16`` / ``torch.float16`` or a
            name such as ``"bf16"``).
        lower_ops: op names to run in ``dtype`` (Paddle's ``custom_white_list``).
        fp32_ops: op names to run in float32 (Paddle's ``custom_black_list``).
        fp32_modules: module classes or qualified-name globs whose forward runs with
            autocast off and fp32 inputs ("islands"); applied when a model is prepared
            (:func:`mixprec.islands.apply_fp32_islands`).

    Effective low = (default ∪ lower_ops) − fp32_ops; effective fp32 =
    (default − lower_ops) ∪ fp32_ops. An op in both lists, or a name that neither
    mixprec's tables nor ``torch.ops.aten`` know, raises ``ValueError``.

    >>> import torch
    >>> from mixprec.policy import OpPolicy
    >>> OpPolicy(torch.bfloat16, lower_ops=["softmx"])
    Traceback (most recent call last):
    ...
    ValueError: unknown op name 'softmx' in lower_ops: neither mixprec's autocast tables nor torch.ops.aten know it; did you mean 'softmax', ...
    >>> print(OpPolicy(fp32_ops=["linear"]).explain("cpu").splitlines()[0])
    OpPolicy(dtype=bf16) on cpu: default tables pinned to torch 2.13 (v1)
    """

    dtype: torch.dtype = torch.bfloat16
    lower_ops: tuple[str, ...] = ()
    fp32_ops: tuple[str, ...] = ()
    fp32_modules: tuple[ModuleRule, ...] = ()

    def __post_init__(self) -> None:
        dtype = parse_dtype(self.dtype)
        if dtype not in LOW_PRECISION_DTYPES:
            raise ValueError(
                f"OpPolicy dtype must be a low-precision dtype (bf16 or fp16), got "
                f"{dtype_name(dtype)}; for fp32 compute, do not use autocast"
            )
        lower = _as_names(self.lower_ops, "lower_ops")
        fp32 = _as_names(self.fp32_ops, "fp32_ops")
        both = [op for op in lower if op in fp32]
        if both:
            names = ", ".join(repr(op) for op in both)
            verb = "is" if len(both) == 1 else "are"
            raise ValueError(
                f"{names} {verb} in both lower_ops and fp32_ops; an op runs in one precision, "
                "so keep each op in one of the lists"
            )
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "lower_ops", lower)
        object.__setattr__(self, "fp32_ops", fp32)
        object.__setattr__(self, "fp32_modules", _as_module_rules(self.fp32_modules))

    # -------------------------------------------------------------- queries
    def table(self, device_type: str) -> OpTable:
        """The pinned default table this policy edits on ``device_type``."""
        return default_table(device_type, self.dtype)

    def precision_of(self, op: str, device_type: str = "cpu") -> Precision | None:
        """The class ``op`` runs in under this policy (None: left to its inputs)."""
        op = normalize_op_name(op)
        if op in self.fp32_ops:
            return Precision.FP32
        if op in self.lower_ops:
            return Precision.LOW
        return self.table(device_type).precision_of(op)

    def effective(self, device_type: str = "cpu") -> dict[Precision, frozenset[str]]:
        """The effective op sets: ``{Precision.LOW: ..., Precision.FP32: ..., Precision.PROMOTE: ...}``."""
        table = self.table(device_type)
        lower, fp32 = frozenset(self.lower_ops), frozenset(self.fp32_ops)
        return {
            Precision.LOW: (table.low | lower) - fp32,
            Precision.FP32: (table.fp32 - lower) | fp32,
            Precision.PROMOTE: table.promote - lower - fp32,
        }

    def overrides(self, device_type: str = "cpu") -> dict[str, Precision]:
        """The ops whose class differs from the default table: what mixprec must intercept."""
        table = self.table(device_type)
        out: dict[str, Precision] = {}
        for ops, precision in ((self.lower_ops, Precision.LOW), (self.fp32_ops, Precision.FP32)):
            for op in ops:
                if table.precision_of(op) is not precision:
                    out[op] = precision
        return out

    @property
    def is_default(self) -> bool:
        """True when the policy moves no op (``fp32_modules`` aside)."""
        return not self.lower_ops and not self.fp32_ops

    def replace(self, **changes: Any) -> OpPolicy:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def explain(self, device_type: str | None = None) -> str:
        """The effective tables on ``device_type`` as a text table (custom entries marked).

        ``device_type`` defaults to "cuda" when CUDA is available, else "cpu".
        """
        device = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        table = self.table(device)
        eff = self.effective(device)
        rows: list[tuple[str, str, str]] = []
        labels = {
            Precision.LOW: f"low ({dtype_name(self.dtype)})",
            Precision.FP32: "fp32",
            Precision.PROMOTE: "promote (widest input)",
        }
        defaults = {
            Precision.LOW: table.low,
            Precision.FP32: table.fp32,
            Precision.PROMOTE: table.promote,
        }
        for precision, label in labels.items():
            ops = eff[precision]
            default = sorted(ops & defaults[precision])
            custom = sorted(ops - defaults[precision])
            if default:
                rows.append((label, "default", ", ".join(default)))
            if custom:
                rows.append((label, "custom", ", ".join(custom)))
        lifted = sorted(table.banned & (frozenset(self.lower_ops) | frozenset(self.fp32_ops)))
        if table.banned - set(lifted):
            rows.append(("refused", "default", ", ".join(sorted(table.banned - set(lifted)))))
        if self.fp32_modules:
            rules = ", ".join(_rule_name(r) for r in self.fp32_modules)
            rows.append(("fp32 modules", "custom", rules))
        custom_ops = registered_ops()
        if custom_ops:
            text = ", ".join(f"{name}={p.value}" for name, p in sorted(custom_ops.items()))
            rows.append(("registered ops", "custom", text))
        w0 = max(len("precision"), *(len(r[0]) for r in rows))
        w1 = len("default")
        lines = [
            f"OpPolicy(dtype={dtype_name(self.dtype)}) on {device}: default tables pinned to "
            f"torch {TABLES_TORCH_VERSION} (v{TABLES_VERSION})",
            f"{'precision'.ljust(w0)} | {'source'.ljust(w1)} | ops",
            f"{'-' * w0}-+-{'-' * w1}-+-----",
        ]
        indent = " " * (w0 + w1 + 6)
        for a, b, c in rows:
            wrapped = textwrap.wrap(c, width=max(40, 100 - len(indent))) or [""]
            lines.append(f"{a.ljust(w0)} | {b.ljust(w1)} | {wrapped[0]}")
            lines += [indent + more for more in wrapped[1:]]
        lines.append("other ops run in the dtype of their inputs")
        return "\n".join(lines)


def _rule_name(rule: ModuleRule) -> str:
    return rule if isinstance(rule, str) else f"{rule.__module__}.{rule.__qualname__}"


# ------------------------------------------------------------- compare with torch
def torch_autocast_ops(device_type: str) -> frozenset[str] | None:
    """Op names the installed PyTorch gives an autocast kernel on ``device_type``.

    Read from the dispatcher (overloads folded); None when this PyTorch does not
    expose its registrations.
    """
    key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    try:
        registered = torch._C._dispatch_get_registrations_for_dispatch_key(key)
    except (AttributeError, RuntimeError):
        return None
    return frozenset(
        name.partition("::")[2].partition(".")[0]
        for name in registered
        if name.startswith("aten::")
    )


@dataclass(frozen=True)
class TableDiff:
    """Ops in mixprec's pinned table but not autocast by the installed torch, and vice versa."""

    device_type: str
    torch_version: str
    only_in_mixprec: frozenset[str]
    only_in_torch: frozenset[str]

    @property
    def empty(self) -> bool:
        return not self.only_in_mixprec and not self.only_in_torch

    def __str__(self) -> str:
        if self.empty:
            return (
                f"{self.device_type}: mixprec's tables (torch {TABLES_TORCH_VERSION}) match "
                f"torch {self.torch_version}"
            )
        return "\n".join([
            f"{self.device_type}: mixprec's tables (torch {TABLES_TORCH_VERSION}) differ from "
            f"torch {self.torch_version}",
            "  only in mixprec: " + (", ".join(sorted(self.only_in_mixprec)) or "-"),
            "  only in torch:   " + (", ".join(sorted(self.only_in_torch)) or "-"),
        ])  # fmt: skip


def compare_with_torch(device_type: str) -> TableDiff | None:
    """Which ops differ between the pinned table and the installed torch's autocast kernels.

    This compares op membership (the dispatcher does not say which class an op is
    in); tests check the classes by running the ops. None when the registrations
    cannot be read.

    >>> from mixprec.policy import compare_with_torch
    >>> diff = compare_with_torch("cpu")
    >>> diff is None or isinstance(str(diff), str)
    True
    """
    registered = torch_autocast_ops(device_type)
    if registered is None:
        return None
    pinned = default_table(device_type, torch.bfloat16).ops
    return TableDiff(
        device_type=device_type,
        torch_version=torch.__version__,
        only_in_mixprec=pinned - registered,
        only_in_torch=registered - pinned,
    )

"""Tiny sample calls of every op the autocast tables name, for :mod:`mixprec.amp.probe`.

One entry per op: the aten overload it calls (the one torch registers an autocast
kernel for) and a builder that makes the call's arguments from a
:class:`SampleInputs`. The builder asks for each floating tensor in turn; the probe
decides their dtypes (all fp32, all low precision, or alternating), so the same
builder shows each class: low ops turn fp32 inputs into low-precision outputs, fp32
ops the other way round, promote ops give fp32 for mixed inputs. Values are seeded
and well conditioned (symmetric positive definite matrices for the solvers,
probabilities for the losses that need them), shapes are a few elements.

>>> import torch
>>> from mixprec.amp.samples import SAMPLES, SampleInputs
>>> overload, build = SAMPLES["mm"]
>>> args, kwargs = build(SampleInputs("cpu", lambda i: torch.float32))
>>> overload, [tuple(a.shape) for a in args], kwargs
('default', [(4, 4), (4, 4)], {})
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PYTHON_CALLS", "SAMPLES", "Builder", "SampleInputs"]

Call = tuple[tuple[Any, ...], dict[str, Any]]


class SampleInputs:
    """Makes one sample call's tensors on ``device``: the i-th floating tensor asked for
    gets ``floating_dtype(i)``; integer tensors keep their dtype.

    ``convert`` moves a CPU tensor to where the probe runs (default: ``.to(device, dtype)``).
    """

    def __init__(
        self,
        device: str,
        floating_dtype: Callable[[int], torch.dtype],
        convert: Callable[[torch.Tensor, str, torch.dtype], torch.Tensor] | None = None,
    ) -> None:
        self.device = device
        self._floating_dtype = floating_dtype
        self._convert = convert or (lambda t, device, dtype: t.to(device=device, dtype=dtype))
        self.floating = 0

    # ------------------------------------------------------------- floating tensors
    def f(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (a float32 CPU tensor) as the next floating input."""
        dtype = self._floating_dtype(self.floating)
        self.floating += 1
        return self._convert(value, self.device, dtype)

    def r(self, *shape: int, seed: int = 0) -> torch.Tensor:
        """Standard normal values."""
        return self.f(_randn(shape, seed))

    def pos(self, *shape: int, seed: int = 0) -> torch.Tensor:
        """Values in [0.5, 1.5) (logs, reciprocals, divisors)."""
        return self.f(_rand(shape, seed) + 0.5)

    def unit(self, *shape: int, seed: int = 0) -> torch.Tensor:
        """Values in (-0.9, 0.9) (acos, asin, erfinv, grids)."""
        return self.f((_rand(shape, seed) * 2 - 1) * 0.9)

    def prob(self, *shape: int, seed: int = 0) -> torch.Tensor:
        """Values in [0.05, 0.95) (probabilities)."""
        return self.f(_rand(shape, seed) * 0.9 + 0.05)

    def spd(self, n: int = 4, seed: int = 0) -> torch.Tensor:
        """A symmetric positive definite n x n matrix."""
        return self.f(_spd(n, seed))

    # ------------------------------------------------------------------- the rest
    def keep(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` moved to the device in its own (integer) dtype."""
        return self._convert(value, self.device, value.dtype)

    def long(self, values: Any) -> torch.Tensor:
        """An int64 tensor of ``values``."""
        return self.keep(torch.tensor(values, dtype=torch.long, device="cpu"))


Builder = Callable[[SampleInputs], Call]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# Explicit device and dtype: the samples do not follow torch.set_default_device / _dtype.
_F32 = torch.float32


def _randn(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed), device="cpu", dtype=_F32)


def _rand(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.rand(*shape, generator=_gen(seed), device="cpu", dtype=_F32)


def _tensor(values: Any) -> torch.Tensor:
    return torch.tensor(values, device="cpu", dtype=_F32)


def _spd(n: int, seed: int) -> torch.Tensor:
    a = _randn((n, n), seed)
    return a @ a.T + n * torch.eye(n, device="cpu", dtype=_F32)


def _a(*args: Any, **kwargs: Any) -> Call:
    return args, kwargs


def _lu_solve(s: SampleInputs) -> Call:
    lu, pivots = torch.linalg.lu_factor(_spd(4, 0))
    return _a(s.r(4, 2, seed=1), s.f(lu), s.keep(pivots))


def _householder(s: SampleInputs, *extra: int) -> Call:
    a, tau = torch.geqrf(_randn((4, 4), 0))
    more = (s.r(4, extra[0], seed=1),) if extra else ()
    return _a(s.f(a), s.f(tau), *more)


def _cholesky_factor(s: SampleInputs) -> torch.Tensor:
    return s.f(torch.linalg.cholesky(_spd(4, 0)))


def _max_unpool2d(s: SampleInputs) -> Call:
    _, idx = torch.nn.functional.max_pool2d(_randn((1, 1, 4, 4), 0), 2, return_indices=True)
    return _a(s.r(1, 1, 2, 2), s.keep(idx), [4, 4])


def _max_unpool3d(s: SampleInputs) -> Call:
    _, idx = torch.nn.functional.max_pool3d(_randn((1, 1, 4, 4, 4), 0), 2, return_indices=True)
    return _a(s.r(1, 1, 2, 2, 2), s.keep(idx), [4, 4, 4], [2, 2, 2], [0, 0, 0])


def _mha(s: SampleInputs) -> Call:
    n = 4
    return _a(
        s.r(2, n, n), s.r(2, n, n, seed=1), s.r(2, n, n, seed=2), n, 2,
        s.r(3 * n, n, seed=3), s.r(3 * n, seed=4), s.r(n, n, seed=5), s.r(n, seed=6),
    )  # fmt: skip


def _mkldnn_rnn_layer(s: SampleInputs) -> Call:
    t, n, i, h = 3, 2, 4, 4
    return _a(
        s.r(t, n, i), s.r(4 * h, i, seed=1), s.r(4 * h, h, seed=2), s.r(4 * h, seed=3),
        s.r(4 * h, seed=4), s.r(n, h, seed=5), s.r(n, h, seed=6),
        False, [], 2, h, 1, True, False, False, False,
    )  # fmt: skip


def _cudnn_rnn(s: SampleInputs) -> Call:
    t, n, i, h = 3, 2, 4, 4  # one LSTM layer (mode 2), weights unflattened
    weights = [s.r(4 * h, i, seed=1), s.r(4 * h, h, seed=2), s.r(4 * h, seed=3), s.r(4 * h, seed=4)]
    return _a(s.r(t, n, i), weights, 4, None, s.r(1, n, h, seed=5), s.r(1, n, h, seed=6),
              2, h, 0, 1, False, 0.0, False, False, [], None)  # fmt: skip


def _fft(*shape: int) -> tuple[str, Builder]:
    return "default", lambda s: _a(s.r(*shape))


def _one(make: str = "r", *shape: int) -> tuple[str, Builder]:
    shape = shape or (4, 4)
    return "default", lambda s: _a(getattr(s, make)(*shape))


def _pair(*shape: int) -> tuple[str, Builder]:
    return "default", lambda s: _a(s.r(*shape), s.r(*shape, seed=1))


_X4 = (2, 2, 4, 4)
_X5 = (1, 1, 4, 4, 4)

#: op name -> (the overload called, a builder of its arguments).
SAMPLES: dict[str, tuple[str, Builder]] = {
    # ------------------------------------------------------------- low (both tables)
    "_addmm_activation": ("default", lambda s: _a(s.r(4, 4), s.r(4, 4, seed=1), s.r(4, 4, seed=2), use_gelu=True)),
    "_convolution": ("deprecated", lambda s: _a(s.r(*_X4), s.r(3, 2, 3, 3, seed=1), s.r(3, seed=2), [1, 1], [0, 0],
                                                [1, 1], False, [0, 0], 1, False, True, True)),
    "_native_multi_head_attention": ("default", _mha),
    "addbmm": ("default", lambda s: _a(s.r(4, 4), s.r(2, 4, 4, seed=1), s.r(2, 4, 4, seed=2))),
    "addmm": ("default", lambda s: _a(s.r(4, 4), s.r(4, 4, seed=1), s.r(4, 4, seed=2))),
    "baddbmm": ("default", lambda s: _a(s.r(2, 4, 4), s.r(2, 4, 4, seed=1), s.r(2, 4, 4, seed=2))),
    "bmm": _pair(2, 4, 4),
    "conv1d": ("default", lambda s: _a(s.r(2, 2, 8), s.r(3, 2, 3, seed=1), s.r(3, seed=2))),
    "conv2d": ("default", lambda s: _a(s.r(*_X4), s.r(3, 2, 3, 3, seed=1))),
    "conv3d": ("default", lambda s: _a(s.r(1, 2, 4, 4, 4), s.r(3, 2, 3, 3, 3, seed=1))),
    "conv_tbc": ("default", lambda s: _a(s.r(10, 7, 3), s.r(5, 3, 5, seed=1), s.r(5, seed=2), 0)),
    "conv_transpose1d": ("default", lambda s: _a(s.r(2, 2, 8), s.r(2, 3, 3, seed=1))),
    "conv_transpose2d": ("input", lambda s: _a(s.r(*_X4), s.r(2, 3, 3, 3, seed=1))),
    "conv_transpose3d": ("input", lambda s: _a(s.r(1, 2, 4, 4, 4), s.r(2, 3, 3, 3, 3, seed=1))),
    "linalg_vecdot": _pair(4, 4),
    "linear": ("default", lambda s: _a(s.r(3, 4), s.r(5, 4, seed=1), s.r(5, seed=2))),
    "matmul": _pair(4, 4),
    "mkldnn_rnn_layer": ("default", _mkldnn_rnn_layer),
    "mm": _pair(4, 4),
    "prelu": ("default", lambda s: _a(s.r(2, 3, 4), s.r(3, seed=1))),
    "scaled_dot_product_attention": ("default", lambda s: _a(s.r(1, 2, 4, 8), s.r(1, 2, 4, 8, seed=1),
                                                             s.r(1, 2, 4, 8, seed=2))),
    # ---------------------------------------------------------------- low (CUDA)
    "_cudnn_rnn": ("default", _cudnn_rnn),
    "_scaled_dot_product_flash_attention": ("default", lambda s: _a(s.r(1, 2, 16, 16), s.r(1, 2, 16, 16, seed=1),
                                                                    s.r(1, 2, 16, 16, seed=2))),
    "_thnn_fused_gru_cell": ("default", lambda s: _a(s.r(3, 12), s.r(3, 12, seed=1), s.r(3, 4, seed=2),
                                                     s.r(12, seed=3), s.r(12, seed=4))),
    "_thnn_fused_lstm_cell": ("default", lambda s: _a(s.r(3, 16), s.r(3, 16, seed=1), s.r(3, 4, seed=2),
                                                      s.r(16, seed=3), s.r(16, seed=4))),
    "addmv": ("default", lambda s: _a(s.r(4), s.r(4, 5, seed=1), s.r(5, seed=2))),
    "addr": ("default", lambda s: _a(s.r(4, 5), s.r(4, seed=1), s.r(5, seed=2))),
    "chain_matmul": ("default", lambda s: _a([s.r(4, 5), s.r(5, 6, seed=1), s.r(6, 3, seed=2)])),
    "convolution": ("default", lambda s: _a(s.r(*_X4), s.r(3, 2, 3, 3, seed=1), s.r(3, seed=2), [1, 1], [0, 0],
                                            [1, 1], False, [0, 0], 1)),
    "cudnn_convolution": ("default", lambda s: _a(s.r(*_X4), s.r(4, 2, 3, 3, seed=1), [1, 1], [1, 1], [1, 1], 1,
                                                  False, True, False)),
    "cudnn_convolution_transpose": ("default", lambda s: _a(s.r(*_X4), s.r(2, 4, 3, 3, seed=1), [0, 0], [0, 0],
                                                            [1, 1], [1, 1], 1, False, True, False)),
    "einsum": ("default", lambda s: _a("ij,jk->ik", [s.r(4, 5), s.r(5, 3, seed=1)])),
    "gru_cell": ("default", lambda s: _a(s.r(3, 5), s.r(3, 4, seed=1), s.r(12, 5, seed=2), s.r(12, 4, seed=3),
                                         s.r(12, seed=4), s.r(12, seed=5))),
    "linalg_multi_dot": ("default", lambda s: _a([s.r(4, 5), s.r(5, 6, seed=1), s.r(6, 3, seed=2)])),
    "lstm_cell": ("default", lambda s: _a(s.r(3, 5), [s.r(3, 4, seed=1), s.r(3, 4, seed=6)], s.r(16, 5, seed=2),
                                          s.r(16, 4, seed=3), s.r(16, seed=4), s.r(16, seed=5))),
    "mv": ("default", lambda s: _a(s.r(4, 5), s.r(5, seed=1))),
    "rnn_relu_cell": ("default", lambda s: _a(s.r(3, 5), s.r(3, 4, seed=1), s.r(4, 5, seed=2), s.r(4, 4, seed=3),
                                              s.r(4, seed=4), s.r(4, seed=5))),
    "rnn_tanh_cell": ("default", lambda s: _a(s.r(3, 5), s.r(3, 4, seed=1), s.r(4, 5, seed=2), s.r(4, 4, seed=3),
                                              s.r(4, seed=4), s.r(4, seed=5))),
    # ------------------------------------------------------------------ fp32 (CPU)
    "_grid_sampler_2d_cpu_fallback": ("default", lambda s: _a(s.r(1, 1, 4, 4), s.unit(1, 3, 3, 2, seed=1), 0, 0,
                                                              False)),
    "_lu_with_info": ("default", lambda s: _a(s.spd())),
    "adaptive_avg_pool3d": ("default", lambda s: _a(s.r(1, 2, 4, 4, 4), [2, 2, 2])),
    "adaptive_max_pool3d": ("default", lambda s: _a(s.r(1, 2, 4, 4, 4), [2, 2, 2])),
    "avg_pool3d": ("default", lambda s: _a(s.r(1, 2, 4, 4, 4), [2, 2, 2])),
    "binary_cross_entropy": ("default", lambda s: _a(s.prob(4, 4), s.prob(4, 4, seed=1))),
    "binary_cross_entropy_with_logits": ("default", lambda s: _a(s.r(4, 4), s.prob(4, 4, seed=1))),
    "cdist": ("default", lambda s: _a(s.r(3, 4), s.r(5, 4, seed=1))),
    "cholesky": ("default", lambda s: _a(s.spd())),
    "cholesky_inverse": ("default", lambda s: _a(_cholesky_factor(s))),
    "cholesky_solve": ("default", lambda s: _a(s.r(4, 2, seed=1), _cholesky_factor(s))),
    "cosine_embedding_loss": ("default", lambda s: _a(s.r(3, 4), s.r(3, 4, seed=1), s.long([1, -1, 1]))),
    "cross_entropy_loss": ("default", lambda s: _a(s.r(4, 5), s.long([0, 1, 4, 2]))),
    "ctc_loss": ("IntList", lambda s: _a(s.f(_randn((6, 2, 5), 0).log_softmax(-1)), s.long([[1, 2], [3, 1]]),
                                         [6, 5], [2, 2])),
    "fake_quantize_per_tensor_affine": ("default", lambda s: _a(s.r(4, 4), 0.1, 0, 0, 255)),
    "fft_fft": _fft(8),
    "fft_fft2": _fft(4, 4),
    "fft_fftn": _fft(2, 4, 4),
    "fft_hfft": _fft(8),
    "fft_ifft": _fft(8),
    "fft_ifft2": _fft(4, 4),
    "fft_ifftn": _fft(2, 4, 4),
    "fft_ihfft": _fft(8),
    "fft_irfft": _fft(8),
    "fft_irfft2": _fft(4, 4),
    "fft_irfftn": _fft(2, 4, 4),
    "fft_rfft": _fft(8),
    "fft_rfft2": _fft(4, 4),
    "fft_rfftn": _fft(2, 4, 4),
    "fractional_max_pool2d": ("default", lambda s: _a(s.r(1, 2, 8, 8), [2, 2], [4, 4], s.prob(1, 2, 2, seed=1))),
    "fractional_max_pool3d": ("default", lambda s: _a(s.r(1, 2, 8, 8, 8), [2, 2, 2], [4, 4, 4],
                                                      s.prob(1, 2, 3, seed=1))),
    "geqrf": _one(),
    "grid_sampler": ("default", lambda s: _a(s.r(1, 1, 4, 4), s.unit(1, 3, 3, 2, seed=1), 0, 0, False)),
    "grid_sampler_2d": ("default", lambda s: _a(s.r(1, 1, 4, 4), s.unit(1, 3, 3, 2, seed=1), 0, 0, False)),
    "grid_sampler_3d": ("default", lambda s: _a(s.r(1, 1, 4, 4, 4), s.unit(1, 2, 2, 2, 3, seed=1), 0, 0, False)),
    "hinge_embedding_loss": ("default", lambda s: _a(s.r(4, 4), s.long([[1] * 4] * 4))),
    "huber_loss": _pair(4, 4),
    "inverse": _one("spd", 4),
    "kl_div": ("default", lambda s: _a(s.f(_randn((4, 4), 0).log_softmax(-1)), s.f(_randn((4, 4), 1).softmax(-1)))),
    "l1_loss": _pair(4, 4),
    "linalg_cholesky": _one("spd", 4),
    "linalg_cholesky_ex": _one("spd", 4),
    "linalg_cond": _one("spd", 4),
    "linalg_eig": _one("spd", 4),
    "linalg_eigh": _one("spd", 4),
    "linalg_eigvals": _one("spd", 4),
    "linalg_eigvalsh": _one("spd", 4),
    "linalg_householder_product": ("default", _householder),
    "linalg_inv": _one("spd", 4),
    "linalg_inv_ex": _one("spd", 4),
    "linalg_lstsq": ("default", lambda s: _a(s.spd(), s.r(4, 2, seed=1))),
    "linalg_matrix_rank": ("atol_rtol_float", lambda s: _a(s.spd())),  # an integer result: read the compute dtype
    "linalg_qr": _one(),
    "linalg_solve": ("default", lambda s: _a(s.spd(), s.r(4, 2, seed=1))),
    "linalg_svd": _one("spd", 4),
    "linalg_svdvals": _one("spd", 4),
    "linalg_tensorinv": ("default", lambda s: _a(s.spd(), 1)),
    "linalg_tensorsolve": ("default", lambda s: _a(s.spd(), s.r(4, seed=1))),
    "lu_solve": ("default", _lu_solve),
    "margin_ranking_loss": ("default", lambda s: _a(s.r(4), s.r(4, seed=1), s.f(_tensor([1.0, -1.0, 1.0, -1.0])))),
    "max_pool3d": ("default", lambda s: _a(s.r(1, 2, 4, 4, 4), [2, 2, 2])),
    "max_unpool2d": ("default", _max_unpool2d),
    "max_unpool3d": ("default", _max_unpool3d),
    "mse_loss": _pair(4, 4),
    "multi_margin_loss": ("default", lambda s: _a(s.r(4, 5), s.long([0, 1, 4, 2]))),
    "multilabel_margin_loss": ("default", lambda s: _a(s.r(2, 4), s.long([[1, 2, -1, 0], [0, -1, 0, 0]]))),
    "multilabel_margin_loss_forward": ("default", lambda s: _a(s.r(2, 4), s.long([[1, 2, -1, 0], [0, -1, 0, 0]]), 1)),
    "nanquantile": ("scalar", lambda s: _a(s.r(8), 0.5)),
    "nll_loss": ("default", lambda s: _a(s.f(_randn((4, 5), 0).log_softmax(-1)), s.long([0, 1, 4, 2]))),
    "nll_loss2d": ("default", lambda s: _a(s.f(_randn((2, 3, 2, 2), 0).log_softmax(1)),
                                           s.keep(torch.zeros(2, 2, 2, dtype=torch.long, device="cpu")))),
    "orgqr": ("default", _householder),
    "ormqr": ("default", lambda s: _householder(s, 3)),
    "pinverse": _one("spd", 4),
    "poisson_nll_loss": ("default", lambda s: _a(s.r(4, 4), s.prob(4, 4, seed=1), True, False, 1e-8, 1)),
    "polar": ("default", lambda s: _a(s.pos(4), s.r(4, seed=1))),
    "prod": ("default", lambda s: _a(s.pos(4))),
    "qr": _one(),
    "quantile": ("scalar", lambda s: _a(s.r(8), 0.5)),
    "reflection_pad1d": ("default", lambda s: _a(s.r(1, 2, 8), [2, 2])),
    "reflection_pad2d": ("default", lambda s: _a(s.r(1, 2, 4, 4), [1, 1, 1, 1])),
    "replication_pad1d": ("default", lambda s: _a(s.r(1, 2, 8), [2, 2])),
    "replication_pad2d": ("default", lambda s: _a(s.r(1, 2, 4, 4), [1, 1, 1, 1])),
    "replication_pad3d": ("default", lambda s: _a(s.r(1, 2, 4, 4, 4), [1, 1, 1, 1, 1, 1])),
    "smooth_l1_loss": _pair(4, 4),
    "soft_margin_loss": ("default", lambda s: _a(s.r(4, 4), s.f(torch.ones(4, 4, device="cpu", dtype=_F32)))),
    "stft": ("center", lambda s: _a(s.r(32), 8, window=s.f(torch.hann_window(8, device="cpu", dtype=_F32)), return_complex=True)),
    "svd": _one("spd", 4),
    "trace": _one(),
    "triangular_solve": ("default", lambda s: _a(s.r(4, 2, seed=1), _cholesky_factor(s), upper=False)),
    "triplet_margin_loss": ("default", lambda s: _a(s.r(3, 4), s.r(3, 4, seed=1), s.r(3, 4, seed=2))),
    "view_as_complex": _one("r", 4, 2),
    # ----------------------------------------------------------------- fp32 (CUDA)
    "_upsample_bicubic2d_aa": ("default", lambda s: _a(s.r(*_X4), [8, 8], False)),
    "_upsample_bilinear2d_aa": ("default", lambda s: _a(s.r(*_X4), [8, 8], False)),
    "_upsample_nearest_exact1d": ("default", lambda s: _a(s.r(1, 2, 8), [16])),
    "_upsample_nearest_exact2d": ("default", lambda s: _a(s.r(*_X4), [8, 8])),
    "_upsample_nearest_exact3d": ("default", lambda s: _a(s.r(*_X5), [8, 8, 8])),
    "acos": _one("unit"),
    "asin": _one("unit"),
    "cosh": _one("unit"),
    "cosine_similarity": _pair(3, 4),
    "cumprod": ("default", lambda s: _a(s.pos(4, 4), 0)),
    "cumsum": ("default", lambda s: _a(s.r(4, 4), 1)),
    "dist": _pair(4, 4),
    "erfinv": _one("unit"),
    "exp": _one("unit"),
    "expm1": _one("unit"),
    "frobenius_norm": ("dim", lambda s: _a(s.r(3, 4), [0, 1])),
    "group_norm": ("default", lambda s: _a(s.r(2, 4, 3, 3), 2, s.r(4, seed=1), s.r(4, seed=2))),
    "layer_norm": ("default", lambda s: _a(s.r(3, 8), [8], s.r(8, seed=1), s.r(8, seed=2))),
    "linalg_matrix_norm": ("str_ord", lambda s: _a(s.r(3, 4))),
    "linalg_vector_norm": ("default", lambda s: _a(s.r(3, 4))),
    "log": _one("pos"),
    "log10": _one("pos"),
    "log1p": _one("pos"),
    "log2": _one("pos"),
    "log_softmax": ("int", lambda s: _a(s.r(3, 8), -1)),
    "logsumexp": ("default", lambda s: _a(s.r(3, 8), [1])),
    "native_layer_norm": ("default", lambda s: _a(s.r(3, 8), [8], s.r(8, seed=1), s.r(8, seed=2), 1e-5)),
    "norm": ("Scalar", lambda s: _a(s.r(3, 4))),
    "nuclear_norm": _one("r", 3, 4),
    "pdist": _one("r", 4, 3),
    "pow": ("Tensor_Scalar", lambda s: _a(s.pos(4, 4), 2.5)),
    "reciprocal": _one("pos"),
    "renorm": ("default", lambda s: _a(s.r(4, 3), 2, 0, 1.0)),
    "rms_norm": ("default", lambda s: _a(s.r(3, 8), [8], s.r(8, seed=1))),
    "rsqrt": _one("pos"),
    "sinh": _one("unit"),
    "softmax": ("int", lambda s: _a(s.r(3, 8), -1)),
    "softplus": _one("r", 3, 8),
    "sum": ("default", lambda s: _a(s.r(3, 8))),
    "tan": _one("unit"),
    "upsample_bicubic2d": ("default", lambda s: _a(s.r(*_X4), [8, 8], False)),
    "upsample_bilinear2d": ("default", lambda s: _a(s.r(*_X4), [8, 8], False)),
    "upsample_linear1d": ("default", lambda s: _a(s.r(1, 2, 8), [16], False)),
    "upsample_nearest1d": ("default", lambda s: _a(s.r(1, 2, 8), [16])),
    "upsample_nearest2d": ("default", lambda s: _a(s.r(*_X4), [8, 8])),
    "upsample_nearest3d": ("default", lambda s: _a(s.r(*_X5), [8, 8, 8])),
    "upsample_trilinear3d": ("default", lambda s: _a(s.r(*_X5), [8, 8, 8], False)),
    # --------------------------------------------------------------------- promote
    "addcdiv": ("default", lambda s: _a(s.r(4), s.r(4, seed=1), s.pos(4, seed=2))),
    "addcmul": ("default", lambda s: _a(s.r(4), s.r(4, seed=1), s.r(4, seed=2))),
    "atan2": _pair(4),
    "bilinear": ("default", lambda s: _a(s.r(3, 4), s.r(3, 5, seed=1), s.r(6, 4, 5, seed=2), s.r(6, seed=3))),
    "cat": ("default", lambda s: _a([s.r(4), s.r(4, seed=1)])),
    "cross": ("default", lambda s: _a(s.r(4, 3), s.r(4, 3, seed=1), 1)),
    "dot": _pair(4),
    "index_copy": ("default", lambda s: _a(s.r(4, 3), 0, s.long([0, 2]), s.r(2, 3, seed=1))),
    "index_put": ("default", lambda s: _a(s.r(4, 3), [s.long([0, 2])], s.r(2, 3, seed=1))),
    "scatter_add": ("default", lambda s: _a(s.r(4, 3), 0, s.long([[0, 1, 2], [3, 2, 1]]), s.r(2, 3, seed=1))),
    "stack": ("default", lambda s: _a([s.r(4), s.r(4, seed=1)])),
    "tensordot": ("default", lambda s: _a(s.r(3, 4), s.r(4, 5, seed=1), [1], [0])),
    "vdot": _pair(4),
}  # fmt: skip

#: Ops whose kernels warn once (deprecations): called through their Python binding (the
#: overload named in :data:`SAMPLES`), whose warnings are Python warnings the probe
#: silences, instead of through ``torch.ops``, whose warnings C++ prints to stderr.
PYTHON_CALLS: dict[str, Callable[..., Any]] = {
    op: getattr(torch._C._VariableFunctions, op)
    for op in ("_lu_with_info", "chain_matmul", "cholesky", "lu_solve", "qr", "triangular_solve")
    if hasattr(torch._C._VariableFunctions, op)
}

"""fp8 training: delayed and current scaling, native fp8 GEMMs where the GPU has them, emulated anywhere.

>>> import torch
>>> from mixprec import fp8
>>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
>>> model = fp8.convert_to_fp8(model, fp8.DelayedScaling(fmt="hybrid", amax_history_len=16))
>>> loss = model(torch.randn(8, 32)).square().mean()
>>> loss.backward()
>>> model[0].fp8_state()["input"].format.short_name
'e4m3'
"""

from mixprec.fp8.convert import (
    all_reduce_amax,
    convert_to_fp8,
    default_module_filter,
    fp8_layers,
    nonfinite_flag,
    reset_nonfinite,
    stats,
)
from mixprec.fp8.formats import TENSOR_KINDS, Fp8Format
from mixprec.fp8.gemm import cpu_bf16_gemm_available, native_fp8_available, scaled_mm
from mixprec.fp8.linear import CASTS, Fp8Linear, Fp8TensorState, update_scales
from mixprec.fp8.payoff import (
    ModelPayoff,
    PayoffRow,
    PayoffTable,
    Prediction,
    model_payoff,
    table_for,
)
from mixprec.fp8.quantize import Quantized, quantize, quantize_with_stats
from mixprec.fp8.recipe import CurrentScaling, DelayedScaling, Fp8Recipe
from mixprec.fp8.scaling import (
    AMAX_COMPUTE_ALGOS,
    FP32_MAX,
    MAX_MARGIN,
    MIN_SCALE,
    compute_scale,
    history_amax,
    record_amax,
)

__all__ = [
    "AMAX_COMPUTE_ALGOS",
    "CASTS",
    "FP32_MAX",
    "MAX_MARGIN",
    "MIN_SCALE",
    "TENSOR_KINDS",
    "CurrentScaling",
    "DelayedScaling",
    "Fp8Format",
    "Fp8Linear",
    "Fp8Recipe",
    "Fp8TensorState",
    "ModelPayoff",
    "PayoffRow",
    "PayoffTable",
    "Prediction",
    "Quantized",
    "all_reduce_amax",
    "compute_scale",
    "convert_to_fp8",
    "cpu_bf16_gemm_available",
    "default_module_filter",
    "fp8_layers",
    "history_amax",
    "model_payoff",
    "native_fp8_available",
    "nonfinite_flag",
    "quantize",
    "quantize_with_stats",
    "record_amax",
    "reset_nonfinite",
    "scaled_mm",
    "stats",
    "table_for",
    "update_scales",
]

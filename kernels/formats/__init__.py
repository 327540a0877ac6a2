"""Block number formats (V41_SPEC.md §6): FP4-E4M3 main KV, MXFP4 indexer, FP8-UE8M0 windows, and the
checkpoint's FP8/FP4 weights. reference.py is the torch ground truth, triton.py the kernels, api.py the
validated entry points with `backend=`."""

from kernels.formats.api import (
    Backend,
    dequantize_fp4_e4m3,
    dequantize_fp8_ue8m0,
    dequantize_mxfp4,
    qdq_fp4_e4m3,
    qdq_fp8_ue8m0,
    qdq_mxfp4,
    quantize_fp4_e4m3,
    quantize_fp8_ue8m0,
    quantize_mxfp4,
)
from kernels.formats.spec import (
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    FP4_E4M3,
    FP8_UE8M0,
    MXFP4,
    BlockFormat,
)
from kernels.formats.weights import (
    GEMM_MIN_ROWS,
    LINEAR_MATH,
    PreparedWeight,
    dequantize_fp4_weight,
    dequantize_fp8_block_weight,
    fp4_linear,
    fp8_linear,
    prepare_fp4_weight,
    prepare_fp8_weight,
    prepared_linear,
)

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "E4M3_MIN_SUBNORMAL",
    "FP4_E4M3",
    "FP8_UE8M0",
    "GEMM_MIN_ROWS",
    "LINEAR_MATH",
    "MXFP4",
    "Backend",
    "BlockFormat",
    "PreparedWeight",
    "dequantize_fp4_e4m3",
    "dequantize_fp4_weight",
    "dequantize_fp8_block_weight",
    "dequantize_fp8_ue8m0",
    "dequantize_mxfp4",
    "fp4_linear",
    "fp8_linear",
    "prepare_fp4_weight",
    "prepare_fp8_weight",
    "prepared_linear",
    "qdq_fp4_e4m3",
    "qdq_fp8_ue8m0",
    "qdq_mxfp4",
    "quantize_fp4_e4m3",
    "quantize_fp8_ue8m0",
    "quantize_mxfp4",
]

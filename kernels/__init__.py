"""Number formats and hot ops: a pure-torch reference and a Triton kernel for each, chosen by `backend=`.

Knows nothing of models, caches or storage. See kernels/README.md for the derivations.
"""

from kernels.bf16_gemm import bf16_linear, bf16_linear_takes_compiled_path, pack_bf16_weight
from kernels.errors import KernelError
from kernels.formats import (
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    FP4_E4M3,
    FP8_UE8M0,
    GEMM_MIN_ROWS,
    LINEAR_MATH,
    MXFP4,
    BlockFormat,
    PreparedWeight,
    dequantize_fp4_e4m3,
    dequantize_fp4_weight,
    dequantize_fp8_block_weight,
    dequantize_fp8_ue8m0,
    dequantize_mxfp4,
    fp4_linear,
    fp8_linear,
    prepare_fp4_weight,
    prepare_fp8_weight,
    prepared_linear,
    qdq_fp4_e4m3,
    qdq_fp8_ue8m0,
    qdq_mxfp4,
    quantize_fp4_e4m3,
    quantize_fp8_ue8m0,
    quantize_mxfp4,
)
from kernels.fp32_rows import gemv_order_takes, one_row_products, one_row_products_reference, wide_fp32
from kernels.index_score import index_score, index_score_at, index_score_rows
from kernels.mhc import collapse as mhc_collapse
from kernels.mhc import expand as mhc_expand
from kernels.mhc import sinkhorn, sinkhorn_reference
from kernels.native.blocks import available as copy_blocks_available
from kernels.native.blocks import copy_blocks
from kernels.sparse_attn import sparse_attn
from kernels.sparse_attn.cpu import prepare as prepare_sparse_attn
from kernels.sparse_attn.cpu import sparse_attn_compiled
from kernels.topk import TIE_BREAKS, candidate_blocks, candidate_ids, pool_ids, select_topk

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
    "TIE_BREAKS",
    "BlockFormat",
    "PreparedWeight",
    "KernelError",
    "bf16_linear",
    "bf16_linear_takes_compiled_path",
    "candidate_blocks",
    "copy_blocks",
    "copy_blocks_available",
    "candidate_ids",
    "dequantize_fp4_e4m3",
    "dequantize_fp4_weight",
    "dequantize_fp8_block_weight",
    "dequantize_fp8_ue8m0",
    "dequantize_mxfp4",
    "fp4_linear",
    "fp8_linear",
    "gemv_order_takes",
    "one_row_products",
    "one_row_products_reference",
    "pack_bf16_weight",
    "prepare_fp4_weight",
    "prepare_fp8_weight",
    "prepared_linear",
    "index_score",
    "index_score_at",
    "index_score_rows",
    "pool_ids",
    "qdq_fp4_e4m3",
    "qdq_fp8_ue8m0",
    "qdq_mxfp4",
    "quantize_fp4_e4m3",
    "quantize_fp8_ue8m0",
    "quantize_mxfp4",
    "mhc_collapse",
    "mhc_expand",
    "select_topk",
    "sinkhorn",
    "sinkhorn_reference",
    "wide_fp32",
    "sparse_attn",
    "sparse_attn_compiled",
    "prepare_sparse_attn",
]

"""Linear layers in the checkpoint's storage formats: FP8 e4m3 with 32x32 E8M0 block scales, FP4 e2m1 with
per-32 E8M0 scales, or plain bf16/fp32 weights.

Knows nothing of layers; it picks the product from the weight dtype exactly as the official V4.1 `linear()`
does: a quantized weight takes an FP8-quantized activation (per 32 along K, power-of-two scales) and the
block-scaled GEMM of `kernels.fp8_linear` / `kernels.fp4_linear`, rounded to bf16 (conformance README §9).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import fp4_linear, fp8_linear

# K block of the FP8 activation scales and of both weight formats' scales
QUANT_BLOCK = 32
WEIGHT_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp4": torch.float4_e2m1fn_x2,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}


class Linear(nn.Module):
    """y = x W^T with W stored as in the reference checkpoint (no bias).

    Args:
        in_features: K.
        out_features: N.
        dtype: "fp8" (weight [N, K] e4m3 + scale [ceil(N/32), ceil(K/32)] e8m0), "fp4" (weight [N, K/2]
            float4_e2m1fn_x2 + scale [N, K/32] e8m0), "bf16" or "fp32" (weight [N, K], no scale).
    """

    def __init__(self, in_features: int, out_features: int, dtype: str):
        super().__init__()
        if dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight dtype must be one of {sorted(WEIGHT_DTYPES)}, got {dtype!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.kind = dtype
        if dtype == "fp8":
            weight = torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn)
            scale_shape = (-(-out_features // QUANT_BLOCK), -(-in_features // QUANT_BLOCK))
        elif dtype == "fp4":
            weight = torch.zeros(out_features, in_features // 2, dtype=torch.uint8).view(
                torch.float4_e2m1fn_x2
            )
            scale_shape = (out_features, in_features // QUANT_BLOCK)
        else:
            weight = torch.zeros(out_features, in_features, dtype=WEIGHT_DTYPES[dtype])
            scale_shape = None
        self.weight = nn.Parameter(weight, requires_grad=scale_shape is None)
        if scale_shape is None:
            self.register_parameter("scale", None)
        else:
            # 2^0 everywhere: a neutral scale until a checkpoint is loaded
            ones = torch.full(scale_shape, 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
            self.scale = nn.Parameter(ones, requires_grad=False)

    @property
    def quantized(self) -> bool:
        return self.scale is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] (bf16 for fp8/fp4/bf16 weights, fp32 for fp32 weights) -> [..., N].

        Quantized weights return bf16; plain weights return x's dtype.
        """
        if self.scale is None:
            return F.linear(x, self.weight)
        if self.kind == "fp8":
            return fp8_linear(x, self.weight, self.scale, out_dtype=torch.bfloat16)
        return fp4_linear(x, self.weight, self.scale, out_dtype=torch.bfloat16)

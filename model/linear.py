"""Linear layers in the checkpoint's storage formats: FP8 e4m3 with 32x32 E8M0 block scales, FP4 e2m1 with
per-32 E8M0 scales, or plain bf16/fp32 weights.

Knows nothing of layers; it picks the product from the weight dtype exactly as the official V4.1 `linear()`
does: a quantized weight takes an FP8-quantized activation (per 32 along K, power-of-two scales) and the
block-scaled GEMM of `kernels.fp8_linear` / `kernels.fp4_linear`, rounded to bf16 (conformance README §9).
The decoded weight is cached per module (`kernels.prepared_linear`, bitwise the same product) until the
stored weight changes; `set_linear_math(model, "fast")` opts every quantized linear into the folded-scale
single GEMM of the `fast` numerics profile (not bitwise; the caller must fingerprint it as such).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import (
    LINEAR_MATH,
    PreparedWeight,
    bf16_linear,
    bf16_linear_takes_compiled_path,
    pack_bf16_weight,
    prepare_fp4_weight,
    prepare_fp8_weight,
    prepared_linear,
)
from model.invariant import fp32_linear

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
        # "exact" (the reference's block-scaled GEMM) or "fast" (folded scales, one GEMM): set_linear_math
        self.math = "exact"
        self._prepared: PreparedWeight | None = None
        self._prepared_for: tuple | None = None
        self._packed: torch.Tensor | None = None
        self._packed_for: tuple | None = None

    @property
    def quantized(self) -> bool:
        return self.scale is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] (bf16 for fp8/fp4/bf16 weights, fp32 for fp32 weights) -> [..., N].

        Quantized weights return bf16; plain weights return x's dtype.
        """
        if self.scale is None:
            # fp32 weights (the compressor's) take the model's one fp32 product (model/invariant.py)
            if x.dtype == torch.float32:
                return fp32_linear(x, self.weight)
            if bf16_linear_takes_compiled_path(x, self.weight):
                # bitwise F.linear, compiled where it reproduces torch (kernels/bf16_gemm)
                return bf16_linear(x, self.weight, self._packed_bf16(), checked=True)
            return F.linear(x, self.weight)
        return prepared_linear(x, self.prepared_weight(), out_dtype=torch.bfloat16, math=self.math)

    def _packed_bf16(self) -> torch.Tensor | None:
        """The bf16 weight converted to fp32 once (`pack_bf16_weight`), rebuilt when the weight changes;
        None for inference tensors (no version counter) and off the CPU: `bf16_linear` then packs itself
        or runs F.linear."""
        w = self.weight
        if w.is_inference() or w.device.type != "cpu":
            return None
        key = (w.data_ptr(), w._version)
        if self._packed is None or self._packed_for != key:
            with torch.no_grad():
                self._packed = pack_bf16_weight(w.detach())
            self._packed_for = key
        return self._packed

    def prepared_weight(self) -> PreparedWeight:
        """The decoded weight (and, under math "fast", its folded form), rebuilt only when the stored
        weight or scale changed (new storage, an in-place copy such as load_state_dict, another device).
        Weights that are inference tensors (made under torch.inference_mode) are decoded on every call."""
        assert self.scale is not None
        fold = self.math == "fast"
        w, s = self.weight, self.scale
        prepare = prepare_fp8_weight if self.kind == "fp8" else prepare_fp4_weight
        if w.is_inference() or s.is_inference():
            # inference tensors keep no version counter, so an in-place update could not be seen: no cache
            return prepare(w.detach(), s.detach(), fold=fold)
        key = (w.data_ptr(), w._version, s.data_ptr(), s._version, w.device, fold)
        if self._prepared is None or self._prepared_for != key:
            with torch.no_grad():
                self._prepared = prepare(w.detach(), s.detach(), fold=fold)
            self._prepared_for = key
        return self._prepared


def set_linear_math(model: nn.Module, math: str) -> int:
    """Set the product of every quantized `Linear` in `model`: "exact" (default, bitwise the reference) or
    "fast" (the `fast` numerics profile: a model running it must carry `NumericsProfile(math="fast")` in
    its fingerprint, so its caches never meet exact ones).

    Returns:
        how many quantized linears were set.

    Raises:
        ValueError: an unknown math.
    """
    if math not in LINEAR_MATH:
        raise ValueError(f"math must be one of {LINEAR_MATH}, got {math!r}")
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.quantized:
            module.math = math
            count += 1
    return count

"""Block number formats as data: the three KV formats of V41_SPEC.md §6 and their named constants.

Knows nothing of how values are rounded (reference.py) or launched (triton.py); it only says what a
format stores and how many bytes that takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# E2M1 (FP4) magnitudes by 3-bit code; bit 3 of a 4-bit code is the sign.
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
# Largest finite float8_e4m3fn value (S.1111.110); S.1111.111 is NaN.
E4M3_MAX = 448.0
# Smallest positive float8_e4m3fn value (subnormal 0.0000.001).
E4M3_MIN_SUBNORMAL = 2.0**-9
# E8M0 scale bytes are biased exponents: byte b stands for 2^(b - 127); 0xFF is NaN.
E8M0_BIAS = 127
E8M0_NAN_BYTE = 0xFF
E4M3_NAN_BYTE = 0x7F

# Group amax floors of the reference (kernel.py K41:76-77, K41:158-164): they keep an all-zero group's
# scale finite and nonzero. 6 * 2^-9 makes the smallest E4M3 scale exactly the smallest subnormal.
FP4_E4M3_AMAX_FLOOR = E2M1_MAX * E4M3_MIN_SUBNORMAL
MXFP4_AMAX_FLOOR = E2M1_MAX * 2.0**-126
FP8_AMAX_FLOOR = 1e-4


@dataclass(frozen=True, kw_only=True)
class BlockFormat:
    """One block-scaled format: `group_size` values share one scale of `scale_dtype`.

    Attributes:
        name: the suffix of the public functions (`quantize_<name>`).
        element_bits: 4 for E2M1 codes (two per byte, even element in the low nibble), 8 for E4M3.
        group_size: values per scale, along the last dim.
        scale_dtype: dtype of the scales `quantize_<name>` returns (uint8 = E8M0 exponent bytes).
        power_of_two_scale: True for E8M0 scales 2^ceil(log2(amax / element_max)).
        element_max: the largest element magnitude (6 for E2M1, 448 for E4M3).
        amax_floor: the group amax is clamped below at this value before the scale is derived.
    """

    name: str
    element_bits: int
    group_size: int
    scale_dtype: torch.dtype
    power_of_two_scale: bool
    element_max: float
    amax_floor: float

    def __post_init__(self) -> None:
        if self.element_bits not in (4, 8):
            raise ValueError(f"element_bits must be 4 or 8, got {self.element_bits}")
        if self.group_size < 2 or self.group_size & (self.group_size - 1):
            raise ValueError(f"group_size must be a power of two >= 2, got {self.group_size}")
        if self.amax_floor <= 0:
            raise ValueError(f"amax_floor must be positive, got {self.amax_floor}")

    def payload_bytes(self, d: int) -> int:
        """Bytes of element codes for a last dim of `d` values."""
        self._check_dim(d)
        return d * self.element_bits // 8

    def scale_bytes(self, d: int) -> int:
        """Bytes of scales (one byte each) for a last dim of `d` values."""
        self._check_dim(d)
        return d // self.group_size

    def packed_bytes(self, d: int) -> int:
        """Stored bytes for one row of `d` values: payload plus scales (288 for FP4-E4M3 at d=512)."""
        return self.payload_bytes(d) + self.scale_bytes(d)

    @property
    def bytes_per_value(self) -> float:
        """Stored bytes per value, scales included (0.5625 for FP4-E4M3)."""
        return self.packed_bytes(self.group_size) / self.group_size

    def _check_dim(self, d: int) -> None:
        if d <= 0 or d % self.group_size:
            raise ValueError(f"{self.name}: last dim {d} is not a positive multiple of {self.group_size}")


# Main (compressed) KV: E2M1 codes, one E4M3 scale per 16 values (V41_SPEC.md §6.2).
FP4_E4M3 = BlockFormat(
    name="fp4_e4m3",
    element_bits=4,
    group_size=16,
    scale_dtype=torch.float8_e4m3fn,
    power_of_two_scale=False,
    element_max=E2M1_MAX,
    amax_floor=FP4_E4M3_AMAX_FLOOR,
)
# Indexer Q and K: E2M1 codes, one E8M0 scale per 32 values (§6.3).
MXFP4 = BlockFormat(
    name="mxfp4",
    element_bits=4,
    group_size=32,
    scale_dtype=torch.uint8,
    power_of_two_scale=True,
    element_max=E2M1_MAX,
    amax_floor=MXFP4_AMAX_FLOOR,
)
# Window KV and every FP8 GEMM activation: E4M3 values, one UE8M0 scale per 32 values (§6.4).
FP8_UE8M0 = BlockFormat(
    name="fp8_ue8m0",
    element_bits=8,
    group_size=32,
    scale_dtype=torch.uint8,
    power_of_two_scale=True,
    element_max=E4M3_MAX,
    amax_floor=FP8_AMAX_FLOOR,
)

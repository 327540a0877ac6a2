"""Pure-torch ground truth for the block formats of spec.py, on any device.

For finite bf16 input every function here is bit-for-bit what the official reference does
(tenstorrent/tt-metal `deepseek_v41/kernel_cpu.py`: `act_quant` with scale_fmt="ue8m0" and
`fp4_act_quant`, which port upstream kernel.py K41:41-199). Knows nothing of backends or validation:
callers pass contiguous-or-not bf16/fp32 tensors whose last dim is a multiple of the group size.

Rules beyond the reference (it is defined only for finite bf16):
- fp32 input is quantized directly, with the same fp32 arithmetic the reference applies to `x.float()`;
  it is NOT rounded to bf16 first.
- A group holding any NaN or +-inf is poisoned: its scale becomes NaN (E4M3 0x7F, E8M0 0xFF) and its
  element codes 0, so the whole group dequantizes to NaN. (The reference saturates inf in one format and
  produces NaN or zeros in the others; a KV entry with a non-finite value is corrupt, so we make that loud.)
- As in the reference, MXFP4 and FP8 QDQ of finite values near the fp32 maximum can give +-inf (a code
  rounds up past the largest float under a 2^126 scale).
"""

from __future__ import annotations

import torch

from kernels.formats.spec import (
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    E4M3_NAN_BYTE,
    E8M0_BIAS,
    E8M0_NAN_BYTE,
    FP4_E4M3,
    FP4_E4M3_AMAX_FLOOR,
    FP8_AMAX_FLOOR,
    FP8_UE8M0,
    MXFP4,
    MXFP4_AMAX_FLOOR,
)

_F32_MANTISSA_BITS = 23
_F32_MANTISSA_MASK = (1 << _F32_MANTISSA_BITS) - 1


def _f32(value: float, device: torch.device) -> torch.Tensor:
    # A 0-dim tensor on the data's device: torch's CUDA kernels turn division by a CPU scalar into a
    # multiplication by its reciprocal, which rounds differently; tensor / tensor is IEEE division.
    return torch.tensor(value, dtype=torch.float32, device=device)


def _e2m1_thresholds() -> tuple[float, ...]:
    """Seven fp32 thresholds t_i with magnitude code = #(t_i < |v|): the midpoints between codes, where
    a tie goes to the even code. Ties at 0.75, 1.75, 3.5 round up, so their threshold is the next fp32
    below the midpoint; every threshold is an fp32 value, so comparing fp32 |v| with it is exact."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
    tie_up = torch.tensor([False, True, False, True, False, True, False])
    return tuple(torch.where(tie_up, torch.nextafter(mids, torch.zeros_like(mids)), mids).tolist())


_E2M1_THRESHOLDS = _e2m1_thresholds()


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round to E2M1, ties to the even code, saturating at +-6.

    Args:
        v: fp32 [...], already divided by its scale; NaN-free.
    Returns:
        uint8 [...] codes 0..15: bit 3 is the sign bit of v (so -0.0 and tiny negatives give code 8),
        bits 0-2 index E2M1_VALUES.
    """
    magnitude = v.abs()
    code = torch.signbit(v).to(torch.uint8) << 3
    # seven compare-and-add passes: several times faster than torch.bucketize on CPU
    for threshold in _E2M1_THRESHOLDS:
        code += magnitude > threshold
    return code


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes [...] (0..15) -> fp32 values [...]; code 8 is -0.0."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    table = torch.cat([grid, -grid])
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., D] (0..15, D even) -> uint8 [..., D/2]; the even element in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D/2] -> uint8 codes [..., D]; inverse of `pack_nibbles`."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def ceil_log2_exponent(t: torch.Tensor) -> torch.Tensor:
    """fp32 [...] positive, finite -> int32 [...] k = ceil(log2(t)), exactly, from the IEEE bits.

    This is the reference's `fast_round_scale` (K41:22-38): biased exponent minus 127, plus one when the
    mantissa is nonzero. For an fp32 subnormal t it yields -126.
    """
    bits = t.contiguous().view(torch.int32)
    exponent = (bits >> _F32_MANTISSA_BITS) & 0xFF
    return exponent - E8M0_BIAS + ((bits & _F32_MANTISSA_MASK) != 0).to(torch.int32)


def pow2(k: torch.Tensor) -> torch.Tensor:
    """int32 [...] in [-126, 127] -> fp32 2^k [...] (built from the exponent bits)."""
    return ((k + E8M0_BIAS) << _F32_MANTISSA_BITS).view(torch.float32)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 bytes [...] -> fp32 2^(b-127) [...]; byte 0 is 2^-127, byte 0xFF is NaN."""
    return scales.view(torch.float8_e8m0fnu).float()


def _groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [..., D] -> (fp32 [..., D/group, group] with poisoned groups zeroed, fp32 amax [..., D/group],
    bool poisoned groups [..., D/group] or None when every value is finite)."""
    xg = x.float().unflatten(-1, (-1, group))
    amax = xg.abs().amax(dim=-1)
    # amax propagates NaN and inf, so the small amax tensor tells which groups hold a non-finite value
    bad = ~torch.isfinite(amax)
    if not bool(bad.any()):
        return xg, amax, None
    xg = xg.masked_fill(bad.unsqueeze(-1), 0.0)
    return xg, amax.masked_fill(bad, 0.0), bad


def _fp4_e4m3_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [..., D] -> (codes uint8 [..., D/16, 16], E4M3 scales [..., D/16], poisoned groups or None)."""
    xg, amax, bad = _groups(x, FP4_E4M3.group_size)
    amax = amax.clamp_min(FP4_E4M3_AMAX_FLOOR)
    # K41:158-161: amax / 6 in fp32, then one RNE cast to E4M3 (saturating: torch alone would give NaN)
    scales = (amax / _f32(E2M1_MAX, x.device)).clamp_max(E4M3_MAX).to(torch.float8_e4m3fn)
    # The clamp of v to +-6 in the reference changes no code: every |v| > 5 already maps to code 7.
    codes = e2m1_codes(xg / scales.float().unsqueeze(-1))
    if bad is not None:
        codes = codes.masked_fill(bad.unsqueeze(-1), 0)
        scales = scales.view(torch.uint8).masked_fill(bad, E4M3_NAN_BYTE).view(torch.float8_e4m3fn)
    return codes, scales, bad


def _mxfp4_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes uint8 [..., D/32, 32], E8M0 bytes uint8 [..., D/32])."""
    xg, amax, bad = _groups(x, MXFP4.group_size)
    amax = amax.clamp_min(MXFP4_AMAX_FLOOR)
    # K41:163-164 + fast_round_scale: multiply by the fp32 constant 1/6, then round up to a power of two
    k = ceil_log2_exponent(amax * _f32(1.0 / E2M1_MAX, x.device))
    codes = e2m1_codes(xg / pow2(k).unsqueeze(-1))
    exponent_bytes = (k + E8M0_BIAS).to(torch.uint8)
    if bad is not None:
        codes = codes.masked_fill(bad.unsqueeze(-1), 0)
        exponent_bytes = exponent_bytes.masked_fill(bad, E8M0_NAN_BYTE)
    return codes, exponent_bytes


def _fp8_parts(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (E4M3 values [..., D/group, group], E8M0 bytes uint8 [..., D/group])."""
    xg, amax, bad = _groups(x, group)
    amax = amax.clamp_min(FP8_AMAX_FLOOR)
    # act_quant with scale_fmt="ue8m0" (K41:76-89): 2^ceil(log2(amax * fp32(1/448))), clamp, RNE cast
    k = ceil_log2_exponent(amax * _f32(1.0 / E4M3_MAX, x.device))
    values = (xg / pow2(k).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    exponent_bytes = (k + E8M0_BIAS).to(torch.uint8)
    if bad is not None:
        values = values.view(torch.uint8).masked_fill(bad.unsqueeze(-1), 0).view(torch.float8_e4m3fn)
        exponent_bytes = exponent_bytes.masked_fill(bad, E8M0_NAN_BYTE)
    return values, exponent_bytes


def quantize_fp4_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16/fp32 [..., D] -> (packed uint8 [..., D/2], scales float8_e4m3fn [..., D/16])."""
    codes, scales, _ = _fp4_e4m3_parts(x)
    return pack_nibbles(codes.flatten(-2)), scales


def dequantize_fp4_e4m3(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed uint8 [..., D/2], scales float8_e4m3fn [..., D/16] -> dtype [..., D]."""
    values = e2m1_values(unpack_nibbles(packed)).unflatten(-1, (-1, FP4_E4M3.group_size))
    return (values * scales.float().unsqueeze(-1)).flatten(-2).to(dtype)


def qdq_fp4_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x bf16/fp32 [..., D] -> x.dtype [..., D], equal to dequantize(quantize(x)) (fp4_act_quant inplace)."""
    codes, scales, _ = _fp4_e4m3_parts(x)
    return (e2m1_values(codes) * scales.float().unsqueeze(-1)).flatten(-2).to(x.dtype)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16/fp32 [..., D] -> (packed uint8 [..., D/2], E8M0 exponent bytes uint8 [..., D/32])."""
    codes, exponent_bytes = _mxfp4_parts(x)
    return pack_nibbles(codes.flatten(-2)), exponent_bytes


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed uint8 [..., D/2], E8M0 bytes uint8 [..., D/32] -> dtype [..., D]."""
    values = e2m1_values(unpack_nibbles(packed)).unflatten(-1, (-1, MXFP4.group_size))
    return (values * e8m0_to_float(scales).unsqueeze(-1)).flatten(-2).to(dtype)


def qdq_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """x bf16/fp32 [..., D] -> x.dtype [..., D], equal to dequantize(quantize(x))."""
    codes, exponent_bytes = _mxfp4_parts(x)
    return (e2m1_values(codes) * e8m0_to_float(exponent_bytes).unsqueeze(-1)).flatten(-2).to(x.dtype)


def quantize_fp8_ue8m0(
    x: torch.Tensor, group: int = FP8_UE8M0.group_size
) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16/fp32 [..., D] -> (values float8_e4m3fn [..., D], E8M0 bytes uint8 [..., D/group])."""
    values, exponent_bytes = _fp8_parts(x, group)
    return values.flatten(-2), exponent_bytes


def dequantize_fp8_ue8m0(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, group: int = FP8_UE8M0.group_size
) -> torch.Tensor:
    """values float8_e4m3fn [..., D], E8M0 bytes uint8 [..., D/group] -> dtype [..., D]."""
    grouped = values.float().unflatten(-1, (-1, group))
    return (grouped * e8m0_to_float(scales).unsqueeze(-1)).flatten(-2).to(dtype)


def qdq_fp8_ue8m0(x: torch.Tensor, group: int = FP8_UE8M0.group_size) -> torch.Tensor:
    """x bf16/fp32 [..., D] -> x.dtype [..., D]: `act_quant(x, group, "ue8m0", inplace=True)`."""
    values, exponent_bytes = _fp8_parts(x, group)
    return (values.float() * e8m0_to_float(exponent_bytes).unsqueeze(-1)).flatten(-2).to(x.dtype)

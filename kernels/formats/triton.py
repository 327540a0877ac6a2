"""Triton kernels for the block formats: quantize, dequantize and fused QDQ, bit-for-bit reference.py.

Codes and scales are built with integer arithmetic on the IEEE bits (STYLE.md rule 8): the interpreter
truncates fp32->bf16 and mis-rounds fp32->fp8 casts, so no float cast that rounds is used. The only
float operations are ones that are correctly rounded on both the interpreter and CUDA: `div_rn`,
multiplication (by exact powers of two, or with no addition a compiler could fuse into an FMA),
comparisons, min/max. Each program handles BLOCK_G groups of GROUP contiguous values; tensors are
flattened to [n_groups, GROUP]. Knows nothing of validation (the caller in api.py does it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.formats.spec import (
    E2M1_MAX,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    FP4_E4M3_AMAX_FLOOR,
    FP8_AMAX_FLOOR,
    MXFP4_AMAX_FLOOR,
)

# Values per program: enough to keep loads wide, few enough for the interpreter's small tests.
_TILE_VALUES = 4096
# jit functions may read module globals only when they are constexpr
_E2M1_MAX = tl.constexpr(E2M1_MAX)
_E2M1_MAX_INV = tl.constexpr(1.0 / E2M1_MAX)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_E4M3_MAX_INV = tl.constexpr(1.0 / E4M3_MAX)
_E4M3_MIN_SUBNORMAL = tl.constexpr(E4M3_MIN_SUBNORMAL)
_FP4_E4M3_AMAX_FLOOR = tl.constexpr(FP4_E4M3_AMAX_FLOOR)
_MXFP4_AMAX_FLOOR = tl.constexpr(MXFP4_AMAX_FLOOR)
_FP8_AMAX_FLOOR = tl.constexpr(FP8_AMAX_FLOOR)
_F32_QUIET_NAN_BITS = tl.constexpr(0x7FC00000)


@triton.jit
def _nan_like(x):
    """A quiet fp32 NaN of x's shape."""
    return tl.full(x.shape, _F32_QUIET_NAN_BITS, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _abs_bits(x):
    """fp32 -> int32 bits of |x| (a NaN keeps its payload, so it still compares above +inf)."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _group_amax(x):
    """fp32 [BG, GROUP] -> (fp32 amax [BG], int1 non-finite [BG]) from integer bits, NaN-safe."""
    bits = _abs_bits(x)
    max_bits = tl.max(bits, axis=1)
    bad = max_bits >= 0x7F800000
    amax = tl.where(bad, 0, max_bits).to(tl.float32, bitcast=True)
    return amax, bad


@triton.jit
def _ceil_log2(t):
    """fp32 > 0, finite -> int32 ceil(log2(t)): exponent bits minus 127, plus 1 if the mantissa is nonzero."""
    bits = t.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _pow2(k):
    """int32 in [-126, 127] -> fp32 2^k."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_rne(abs_bits):
    """int32 bits of a finite fp32 in [0, 448] -> int32 E4M3 byte (no sign), round to nearest even."""
    # normal range (>= 2^-6): drop 20 mantissa bits with RNE; a carry correctly bumps the exponent
    rounded = abs_bits + 0x7FFFF + ((abs_bits >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    # subnormal range: the value in units of 2^-9 is mant24 * 2^(e - 141); shift right with RNE
    exponent = abs_bits >> 23
    mant = (abs_bits & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - exponent, 25)
    shift = tl.maximum(shift, 1)
    quotient = mant >> shift
    remainder = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up = (remainder > half) | ((remainder == half) & ((quotient & 1) == 1))
    subnormal = quotient + up.to(tl.int32)
    return tl.where(abs_bits >= (121 << 23), normal, subnormal)


@triton.jit
def _e4m3_to_f32(byte):
    """int32 E4M3 byte (0..255) -> fp32 value; 0x7F/0xFF are NaN, 0x80 is -0.0."""
    exponent = (byte >> 3) & 0xF
    mant = byte & 0x7
    normal_bits = ((exponent + 120) << 23) | (mant << 20)
    subnormal = mant.to(tl.float32) * _E4M3_MIN_SUBNORMAL
    magnitude = tl.where(exponent == 0, subnormal, normal_bits.to(tl.float32, bitcast=True))
    magnitude = tl.where((byte & 0x7F) == 0x7F, _nan_like(magnitude), magnitude)
    return tl.where((byte & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def _e8m0_to_f32(byte):
    """int32 E8M0 byte -> fp32 2^(byte-127); byte 0 is 2^-127 (subnormal), 0xFF is NaN."""
    bits = tl.where(byte == 0, 0x00400000, byte << 23)
    value = bits.to(tl.float32, bitcast=True)
    return tl.where(byte == 0xFF, _nan_like(value), value)


@triton.jit
def _e2m1_code(v, sign):
    """fp32 v (divided by its scale, NaN-free) and int32 sign bit -> int32 E2M1 code, RNE, saturating."""
    m = tl.abs(v)
    # Midpoints 0.25, 1.25, 2.5, 5 tie down (to the even code); 0.75, 1.75, 3.5 tie up.
    mag = (
        (m > 0.25).to(tl.int32)
        + (m >= 0.75).to(tl.int32)
        + (m > 1.25).to(tl.int32)
        + (m >= 1.75).to(tl.int32)
        + (m > 2.5).to(tl.int32)
        + (m >= 3.5).to(tl.int32)
        + (m > 5.0).to(tl.int32)
    )
    return mag | (sign << 3)


@triton.jit
def _e2m1_to_f32(code):
    """int32 E2M1 code 0..15 -> fp32 value; twice the magnitude is 0,1,2,3,4,6,8,12 (code 8 is -0.0)."""
    c = code & 7
    # codes 4..7 are (2 + lsb) << (c/2 - 1); the shift is kept >= 0 for the lanes where c < 4 as well
    doubled = tl.where(c < 4, c, (2 + (c & 1)) << tl.maximum((c >> 1) - 1, 0))
    value = doubled.to(tl.float32) * 0.5
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def _to_bf16_bits(y):
    """fp32 -> int32 holding the bf16 bits (low 16), round to nearest even; NaN -> canonical 0x7FC0."""
    bits = y.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, 0x7FC0, rounded & 0xFFFF)


@triton.jit
def _store_values(out_ptr, offsets, y, mask, OUT_BF16: tl.constexpr):
    if OUT_BF16:
        tl.store(out_ptr + offsets, _to_bf16_bits(y).to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + offsets, y, mask=mask)


@triton.jit
def fp4_quantize_fwd_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    qdq_ptr,
    n_groups,
    POW2_SCALE: tl.constexpr,
    QDQ: tl.constexpr,
    OUT_BF16: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """x [G, GROUP] -> packed uint8 [G, GROUP/2] + scale bytes uint8 [G] (QDQ=False), or values
    of x's dtype [G, GROUP] (QDQ=True; qdq_ptr is int16 for bf16). POW2_SCALE picks E8M0 over E4M3."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_G + tl.arange(0, BLOCK_G)
    row_ok = rows < n_groups
    offsets = rows[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    x = tl.load(x_ptr + offsets, mask=row_ok[:, None], other=0.0).to(tl.float32)
    amax, bad = _group_amax(x)
    x = tl.where(bad[:, None], 0.0, x)
    if POW2_SCALE:
        amax = tl.maximum(amax, _MXFP4_AMAX_FLOOR)
        k = _ceil_log2(amax * _E2M1_MAX_INV)
        scale = _pow2(k)
        # division by a power of two is exact, so multiplying by the exact inverse gives the same fp32
        v = x * _pow2(-k)[:, None]
        scale_byte = tl.where(bad, 0xFF, k + 127)
    else:
        amax = tl.maximum(amax, _FP4_E4M3_AMAX_FLOOR)
        ratio = tl.minimum(tl.div_rn(amax, tl.full(amax.shape, _E2M1_MAX, tl.float32)), _E4M3_MAX)
        byte = _e4m3_rne(ratio.to(tl.int32, bitcast=True))
        scale = _e4m3_to_f32(byte)
        v = tl.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
        scale_byte = tl.where(bad, 0x7F, byte)
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
    code = tl.where(bad[:, None], 0, _e2m1_code(v, sign))
    if QDQ:
        scale = tl.where(bad, _nan_like(scale), scale)
        y = _e2m1_to_f32(code) * scale[:, None]
        _store_values(qdq_ptr, offsets, y, row_ok[:, None], OUT_BF16)
    else:
        even, odd = tl.split(tl.reshape(code, (BLOCK_G, GROUP // 2, 2)))
        packed = (even | (odd << 4)).to(tl.uint8)
        packed_offsets = rows[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]
        tl.store(packed_ptr + packed_offsets, packed, mask=row_ok[:, None])
        tl.store(scale_ptr + rows, scale_byte.to(tl.uint8), mask=row_ok)


@triton.jit
def fp4_dequantize_fwd_kernel(
    packed_ptr,
    scale_ptr,
    out_ptr,
    n_groups,
    POW2_SCALE: tl.constexpr,
    OUT_BF16: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """packed uint8 [G, GROUP/2] + scale bytes uint8 [G] -> values [G, GROUP] (int16 bits for bf16)."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_G + tl.arange(0, BLOCK_G)
    row_ok = rows < n_groups
    packed_offsets = rows[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]
    packed = tl.load(packed_ptr + packed_offsets, mask=row_ok[:, None], other=0).to(tl.int32)
    byte = tl.load(scale_ptr + rows, mask=row_ok, other=0).to(tl.int32)
    if POW2_SCALE:
        scale = _e8m0_to_f32(byte)
    else:
        scale = _e4m3_to_f32(byte)
    code = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_G, GROUP))
    y = _e2m1_to_f32(code) * scale[:, None]
    offsets = rows[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    _store_values(out_ptr, offsets, y, row_ok[:, None], OUT_BF16)


@triton.jit
def fp8_quantize_fwd_kernel(
    x_ptr,
    values_ptr,
    scale_ptr,
    qdq_ptr,
    n_groups,
    QDQ: tl.constexpr,
    OUT_BF16: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """x [G, GROUP] -> E4M3 bytes uint8 [G, GROUP] + E8M0 bytes uint8 [G] (QDQ=False), or values of
    x's dtype [G, GROUP] (QDQ=True)."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_G + tl.arange(0, BLOCK_G)
    row_ok = rows < n_groups
    offsets = rows[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    x = tl.load(x_ptr + offsets, mask=row_ok[:, None], other=0.0).to(tl.float32)
    amax, bad = _group_amax(x)
    x = tl.where(bad[:, None], 0.0, x)
    amax = tl.maximum(amax, _FP8_AMAX_FLOOR)
    k = _ceil_log2(amax * _E4M3_MAX_INV)
    q = tl.minimum(tl.maximum(x * _pow2(-k)[:, None], -_E4M3_MAX), _E4M3_MAX)
    q_bits = q.to(tl.int32, bitcast=True)
    byte = _e4m3_rne(q_bits & 0x7FFFFFFF) | ((q_bits >> 24) & 0x80)
    byte = tl.where(bad[:, None], 0, byte)
    if QDQ:
        scale = tl.where(bad, _nan_like(amax), _pow2(k))
        y = _e4m3_to_f32(byte) * scale[:, None]
        _store_values(qdq_ptr, offsets, y, row_ok[:, None], OUT_BF16)
    else:
        tl.store(values_ptr + offsets, byte.to(tl.uint8), mask=row_ok[:, None])
        tl.store(scale_ptr + rows, tl.where(bad, 0xFF, k + 127).to(tl.uint8), mask=row_ok)


@triton.jit
def fp8_dequantize_fwd_kernel(
    values_ptr,
    scale_ptr,
    out_ptr,
    n_groups,
    OUT_BF16: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """E4M3 bytes uint8 [G, GROUP] + E8M0 bytes uint8 [G] -> values [G, GROUP] (int16 bits for bf16)."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_G + tl.arange(0, BLOCK_G)
    row_ok = rows < n_groups
    offsets = rows[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    byte = tl.load(values_ptr + offsets, mask=row_ok[:, None], other=0).to(tl.int32)
    scale = _e8m0_to_f32(tl.load(scale_ptr + rows, mask=row_ok, other=0).to(tl.int32))
    y = _e4m3_to_f32(byte) * scale[:, None]
    _store_values(out_ptr, offsets, y, row_ok[:, None], OUT_BF16)


def _grid(n_groups: int, group: int) -> tuple[tuple[int], int]:
    block_g = max(1, _TILE_VALUES // group)
    return (triton.cdiv(n_groups, block_g),), block_g


def _out_view(out: torch.Tensor) -> torch.Tensor:
    # bf16 results are written as their int16 bit patterns (see _to_bf16_bits)
    return out.view(torch.int16) if out.dtype == torch.bfloat16 else out


def fp4_quantize(x: torch.Tensor, group: int, pow2_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16/fp32 contiguous [..., D] -> (packed uint8 [..., D/2], scale bytes uint8 [..., D/group])."""
    n_groups = x.numel() // group
    packed = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(*x.shape[:-1], x.shape[-1] // group, dtype=torch.uint8, device=x.device)
    grid, block_g = _grid(n_groups, group)
    fp4_quantize_fwd_kernel[grid](
        x, packed, scales, packed, n_groups,
        POW2_SCALE=pow2_scale, QDQ=False, OUT_BF16=False, GROUP=group, BLOCK_G=block_g,
    )  # fmt: skip
    return packed, scales


def fp4_qdq(x: torch.Tensor, group: int, pow2_scale: bool) -> torch.Tensor:
    """x bf16/fp32 contiguous [..., D] -> x.dtype [..., D] = dequantize(quantize(x))."""
    out = torch.empty_like(x)
    grid, block_g = _grid(x.numel() // group, group)
    fp4_quantize_fwd_kernel[grid](
        x, out, out, _out_view(out), x.numel() // group,
        POW2_SCALE=pow2_scale, QDQ=True, OUT_BF16=x.dtype == torch.bfloat16, GROUP=group, BLOCK_G=block_g,
    )  # fmt: skip
    return out


def fp4_dequantize(
    packed: torch.Tensor, scales: torch.Tensor, group: int, pow2_scale: bool, dtype: torch.dtype
) -> torch.Tensor:
    """packed uint8 contiguous [..., D/2] + scale bytes uint8 [..., D/group] -> dtype [..., D]."""
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=dtype, device=packed.device)
    n_groups = out.numel() // group
    grid, block_g = _grid(n_groups, group)
    fp4_dequantize_fwd_kernel[grid](
        packed, scales, _out_view(out), n_groups,
        POW2_SCALE=pow2_scale, OUT_BF16=dtype == torch.bfloat16, GROUP=group, BLOCK_G=block_g,
    )  # fmt: skip
    return out


def fp8_quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16/fp32 contiguous [..., D] -> (float8_e4m3fn [..., D], E8M0 bytes uint8 [..., D/group])."""
    n_groups = x.numel() // group
    values = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(*x.shape[:-1], x.shape[-1] // group, dtype=torch.uint8, device=x.device)
    grid, block_g = _grid(n_groups, group)
    fp8_quantize_fwd_kernel[grid](
        x, values, scales, values, n_groups, QDQ=False, OUT_BF16=False, GROUP=group, BLOCK_G=block_g
    )
    return values.view(torch.float8_e4m3fn), scales


def fp8_qdq(x: torch.Tensor, group: int) -> torch.Tensor:
    """x bf16/fp32 contiguous [..., D] -> x.dtype [..., D] = dequantize(quantize(x))."""
    out = torch.empty_like(x)
    n_groups = x.numel() // group
    grid, block_g = _grid(n_groups, group)
    fp8_quantize_fwd_kernel[grid](
        x, out, out, _out_view(out), n_groups,
        QDQ=True, OUT_BF16=x.dtype == torch.bfloat16, GROUP=group, BLOCK_G=block_g,
    )  # fmt: skip
    return out


def fp8_dequantize(
    values: torch.Tensor, scales: torch.Tensor, group: int, dtype: torch.dtype
) -> torch.Tensor:
    """E4M3 [..., D] contiguous + E8M0 bytes uint8 [..., D/group] -> dtype [..., D]."""
    out = torch.empty(values.shape, dtype=dtype, device=values.device)
    n_groups = out.numel() // group
    grid, block_g = _grid(n_groups, group)
    fp8_dequantize_fwd_kernel[grid](
        values.view(torch.uint8), scales, _out_view(out), n_groups,
        OUT_BF16=dtype == torch.bfloat16, GROUP=group, BLOCK_G=block_g,
    )  # fmt: skip
    return out


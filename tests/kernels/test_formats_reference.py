"""kernels.formats torch reference vs an independent numpy statement of V41_SPEC.md §6 (and the
official reference's fp32 steps): every E2M1 code and tie, scale edges, odd shapes, fp32 and NaN rules."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kernels
from kernels import FP4_E4M3, FP8_UE8M0, MXFP4
from tests.shared_vectors import conformance_vectors

# ---- the oracle: numpy fp32 arithmetic + nearest-on-a-grid search, no torch casts, no bit tricks ----

E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# nonnegative finite E4M3 values by byte 0x00..0x7E (the index is the byte)
E4M3_GRID = np.array(
    [(b & 7) * 2.0**-9 if b < 8 else (1 + (b & 7) / 8) * 2.0 ** ((b >> 3) - 7) for b in range(127)]
)


def nearest_even(magnitude: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the nearest grid value to each magnitude (<= grid max); ties pick the even index."""
    m = magnitude.astype(np.float64)
    hi = np.clip(np.searchsorted(grid, m, side="left"), 0, len(grid) - 1)
    lo = np.where(grid[hi] == m, hi, np.maximum(hi - 1, 0))
    d_lo, d_hi = m - grid[lo], grid[hi] - m
    return np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))


def ceil_log2(t: np.float32) -> int:
    mantissa, exponent = math.frexp(float(t))
    return exponent - 1 if mantissa == 0.5 else exponent


def oracle_fp4(x: np.ndarray, group: int, e4m3_scale: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """fp32 [R, D] -> (codes [R, D], scale value fp32 [R, D/group], qdq fp32 [R, D]) for finite x."""
    xg = x.astype(np.float32).reshape(x.shape[0], -1, group)
    amax = np.abs(xg).max(axis=-1)
    if e4m3_scale:
        ratio = np.maximum(amax, np.float32(6 * 2.0**-9)) / np.float32(6.0)
        scale = E4M3_GRID[nearest_even(np.minimum(ratio, np.float32(448.0)), E4M3_GRID)].astype(np.float32)
    else:
        t = np.maximum(amax, np.float32(6 * 2.0**-126)) * np.float32(1.0 / 6.0)
        scale = np.array([2.0 ** ceil_log2(v) for v in t.ravel()], dtype=np.float32).reshape(t.shape)
    v = xg / scale[..., None]
    index = nearest_even(np.minimum(np.abs(v), np.float32(6.0)), E2M1_GRID)
    codes = index + 8 * np.signbit(v)
    qdq = np.where(np.signbit(v), -1.0, 1.0) * E2M1_GRID[index] * scale[..., None]
    return codes.reshape(x.shape), scale, qdq.astype(np.float32).reshape(x.shape)


def oracle_fp8(x: np.ndarray, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """fp32 [R, D] -> (E8M0 exponent bytes [R, D/group], qdq fp32 [R, D]) for finite x."""
    xg = x.astype(np.float32).reshape(x.shape[0], -1, group)
    t = np.maximum(np.abs(xg).max(axis=-1), np.float32(1e-4)) * np.float32(1.0 / 448.0)
    k = np.array([ceil_log2(v) for v in t.ravel()]).reshape(t.shape)
    scale = (2.0**k).astype(np.float32)
    v = np.clip(xg / scale[..., None], np.float32(-448.0), np.float32(448.0))
    q = np.where(np.signbit(v), -1.0, 1.0) * E4M3_GRID[nearest_even(np.abs(v), E4M3_GRID)]
    return (k + 127).astype(np.uint8), (q * scale[..., None]).astype(np.float32).reshape(x.shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The IEEE bit pattern (so -0.0 != 0.0) of a bf16/fp32/uint8/fp8 tensor."""
    views = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
    return t.view(views.get(t.dtype, torch.uint8))


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    a, e = bits(actual), bits(expected)
    diff = (a != e).nonzero()
    assert diff.numel() == 0, (
        f"{len(diff)} of {a.numel()} differ; first at {diff[0].tolist()}: "
        f"{actual[tuple(diff[0])].item()} vs {expected[tuple(diff[0])].item()}"
    )


def random_rows(rows: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal values with per-row magnitudes over 12 decades, so scales hit subnormal and saturated E4M3."""
    g = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-7, 5, rows, dtype=torch.float64)[torch.randperm(rows, generator=g)]
    return (torch.randn(rows, d, generator=g, dtype=torch.float64) * magnitudes[:, None]).to(dtype)


FORMATS = {
    "fp4_e4m3": (kernels.quantize_fp4_e4m3, kernels.dequantize_fp4_e4m3, kernels.qdq_fp4_e4m3, 16),
    "mxfp4": (kernels.quantize_mxfp4, kernels.dequantize_mxfp4, kernels.qdq_mxfp4, 32),
    "fp8_ue8m0": (kernels.quantize_fp8_ue8m0, kernels.dequantize_fp8_ue8m0, kernels.qdq_fp8_ue8m0, 32),
}


def scale_values(name: str, scales: torch.Tensor) -> torch.Tensor:
    if name == "fp4_e4m3":
        return scales.float()
    return scales.view(torch.float8_e8m0fnu).float()


@pytest.mark.parametrize("rows", [1, 63, 1000], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_quantize_matches_oracle(name: str, dtype: torch.dtype, rows: int) -> None:
    quantize, dequantize, qdq, group = FORMATS[name]
    d = group if rows == 1000 else 4 * group
    x = random_rows(rows, d, dtype, seed=rows)
    xf = x.float().numpy()
    payload, scales = quantize(x)
    out = torch.full_like(x, float("nan"))
    out.copy_(qdq(x))
    if name == "fp8_ue8m0":
        exponent_bytes, expected_qdq = oracle_fp8(xf)
        assert_bitwise(scales, torch.from_numpy(exponent_bytes))
        assert payload.shape == x.shape and payload.dtype == torch.float8_e4m3fn
    else:
        codes, scale, expected_qdq = oracle_fp4(xf, group, e4m3_scale=name == "fp4_e4m3")
        expected_codes = torch.from_numpy(codes.astype(np.uint8))
        assert_bitwise(payload, expected_codes[..., 0::2] | (expected_codes[..., 1::2] << 4))
        assert_bitwise(scale_values(name, scales), torch.from_numpy(scale))
    assert_bitwise(out, torch.from_numpy(expected_qdq).to(dtype))
    assert_bitwise(dequantize(payload, scales, dtype), out)


def test_leading_dims_are_kept() -> None:
    x = random_rows(3 * 21, 64, torch.bfloat16, seed=7).view(3, 21, 64)
    for name, (quantize, dequantize, qdq, group) in FORMATS.items():
        payload, scales = quantize(x)
        assert scales.shape == (3, 21, 64 // group), name
        assert payload.shape[:2] == (3, 21), name
        assert_bitwise(dequantize(payload, scales, torch.bfloat16), qdq(x))
        flat_payload, _ = quantize(x.view(-1, 64))
        assert_bitwise(payload.reshape(flat_payload.shape), flat_payload)
    # a non-contiguous fp32 view quantizes like its contiguous copy
    xt = random_rows(64, 32, torch.float32, seed=8).t()
    for quantize, _, qdq, _ in FORMATS.values():
        assert_bitwise(qdq(xt), qdq(xt.contiguous()))
        for a, b in zip(quantize(xt), quantize(xt.contiguous()), strict=True):
            assert_bitwise(a, b)
    empty = torch.zeros(0, 32, dtype=torch.bfloat16)
    assert kernels.qdq_mxfp4(empty).shape == (0, 32)


@pytest.mark.parametrize("name", ["fp4_e4m3", "mxfp4"])
def test_every_e2m1_code(name: str) -> None:
    """The 16 codes, +-0 included, with a group amax of 6 (scale exactly 1), packed low nibble first."""
    quantize, dequantize, _, group = FORMATS[name]
    values = [v for v in kernels.E2M1_VALUES] + [-v for v in kernels.E2M1_VALUES]
    x = torch.tensor((values * 2)[:group], dtype=torch.float32).unsqueeze(0)
    packed, scales = quantize(x)
    assert scale_values(name, scales).tolist() == [[1.0]]
    codes = list(range(16)) * 2
    assert packed[0].tolist() == [codes[i] | (codes[i + 1] << 4) for i in range(0, group, 2)]
    assert_bitwise(dequantize(packed, scales, torch.float32), x)


@pytest.mark.parametrize("name", ["fp4_e4m3", "mxfp4"])
def test_e2m1_tie_points(name: str) -> None:
    """Midpoints go to the even code: 0.75, 1.75, 3.5 round up; 0.25, 1.25, 2.5, 5 round down."""
    quantize, _, qdq, group = FORMATS[name]
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    row = mids + [-m for m in mids] + [6.0]
    x = torch.tensor(row + [0.0] * (group - len(row)), dtype=torch.float32).unsqueeze(0)
    y = qdq(x)[0].tolist()
    assert y[:7] == expected
    assert y[7:14] == [-e for e in expected]
    # one fp32 ulp either side of a midpoint decides it
    lows, highs = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0], [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for mid, low, high in zip(mids, lows, highs, strict=True):
        around = torch.tensor([mid, 6.0], dtype=torch.float32)
        below = torch.nextafter(around[:1], torch.tensor([0.0]))
        above = torch.nextafter(around[:1], torch.tensor([9.0]))
        x = torch.cat([below, above, around[1:], torch.zeros(group - 3)]).unsqueeze(0)
        assert qdq(x)[0, :2].tolist() == [low, high], mid


def test_fp4_e4m3_scale_edges() -> None:
    # all-zero group: amax floors at 6*2^-9, so the scale is the smallest subnormal E4M3 (byte 0x01)
    _, scales = kernels.quantize_fp4_e4m3(torch.zeros(1, 16, dtype=torch.bfloat16))
    assert scales.view(torch.uint8).tolist() == [[0x01]]
    assert_bitwise(kernels.qdq_fp4_e4m3(torch.zeros(1, 16)), torch.zeros(1, 16))
    # saturation: amax / 6 > 448 gives scale 448 (0x7E), and values clamp to 6 * 448 = 2688
    x = torch.tensor([[3000.0, -1e6] + [0.0] * 14])
    _, scales = kernels.quantize_fp4_e4m3(x)
    assert scales.view(torch.uint8).tolist() == [[0x7E]]
    assert kernels.qdq_fp4_e4m3(x)[0, :2].tolist() == [2688.0, -2688.0]
    # subnormal scale: amax 0.05 -> 0.05/6 = 4.27 * 2^-9 -> 4 * 2^-9 (byte 0x04)
    x = torch.tensor([[0.05] + [0.0] * 15])
    _, scales = kernels.quantize_fp4_e4m3(x)
    assert scales.view(torch.uint8).tolist() == [[0x04]]
    # RNE of the scale rounds it down here (amax/6 = 1.05 -> 1.0), and the clamp to 6 saturates the code
    x = torch.tensor([[6.3] + [0.0] * 15])
    _, scales = kernels.quantize_fp4_e4m3(x)
    assert scales.float().tolist() == [[1.0]]
    assert kernels.qdq_fp4_e4m3(x)[0, 0].item() == 6.0


def test_power_of_two_scale_edges() -> None:
    # floors: MXFP4 amax 6*2^-126 -> 2^-126 (byte 1); FP8 amax 1e-4 -> 2^ceil(log2(1e-4/448)) = 2^-22
    assert kernels.quantize_mxfp4(torch.zeros(1, 32))[1].tolist() == [[1]]
    assert kernels.quantize_fp8_ue8m0(torch.zeros(1, 32))[1].tolist() == [[127 - 22]]
    # the scale uses amax * fp32(1/448), not amax / 448: amax = 448 gives 448 * fp32(1/448) = 1 exactly
    # here, so the scale stays 2^0; amax = 6 gives 6 * fp32(1/6) = 1 as well.
    assert kernels.quantize_fp8_ue8m0(torch.full((1, 32), 448.0))[1].tolist() == [[127]]
    assert kernels.quantize_mxfp4(torch.full((1, 32), 6.0))[1].tolist() == [[127]]
    # just above a power of two the scale doubles
    above = torch.nextafter(torch.tensor(448.0), torch.tensor(1e9)).item()
    assert kernels.quantize_fp8_ue8m0(torch.full((1, 32), above))[1].tolist() == [[128]]
    # FP8: the largest bf16 values stay finite after QDQ; 1e-4 below the floor still rounds on the 2^-22 grid
    x = torch.tensor([[-3.0e38, 1.0e-6] + [0.0] * 30], dtype=torch.bfloat16)
    y = kernels.qdq_fp8_ue8m0(x)
    assert torch.isfinite(y).all()
    assert y[0, 1].item() == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_non_finite_group_is_poisoned(name: str, dtype: torch.dtype) -> None:
    """A NaN or +-inf makes its whole group NaN (NaN scale, zero codes); other groups are untouched."""
    quantize, dequantize, qdq, group = FORMATS[name]
    x = random_rows(4, 2 * group, dtype, seed=3)
    clean = qdq(x)
    x[0, 3], x[1, group + 1], x[2, 0] = float("nan"), float("inf"), float("-inf")
    payload, scales = quantize(x)
    nan_byte = 0x7F if name == "fp4_e4m3" else 0xFF
    scale_bytes = scales.view(torch.uint8)
    assert [scale_bytes[0, 0].item(), scale_bytes[1, 1].item(), scale_bytes[2, 0].item()] == [nan_byte] * 3
    y = qdq(x)
    poisoned = torch.zeros(4, 2, dtype=torch.bool)
    poisoned[0, 0] = poisoned[1, 1] = poisoned[2, 0] = True
    poisoned = poisoned.repeat_interleave(group, dim=1)
    assert torch.isnan(y).eq(poisoned).all()
    assert_bitwise(y[~poisoned], clean[~poisoned])
    assert torch.isnan(dequantize(payload, scales, dtype)).eq(poisoned).all()
    assert payload.view(torch.uint8).reshape(4, -1)[0, : payload.shape[-1] // 2].eq(0).all()


def test_fp32_input_is_quantized_directly() -> None:
    """fp32 is not rounded to bf16 first: 0.25 + 2^-20 rounds up to 0.5, where bf16(that) = 0.25 ties down."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 0.25 + 2.0**-20, 6.0
    assert kernels.qdq_mxfp4(x)[0, 0].item() == 0.5
    assert kernels.qdq_mxfp4(x.bfloat16())[0, 0].item() == 0.0
    # fp32 that is exactly a bf16 value quantizes like that bf16 value
    xb = random_rows(8, 64, torch.bfloat16, seed=11)
    for quantize, _, _, _ in FORMATS.values():
        for a, b in zip(quantize(xb), quantize(xb.float()), strict=True):
            assert_bitwise(a, b)


def test_negative_zero_and_underflow_keep_sign() -> None:
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, 0], x[0, 1], x[0, 2] = -0.0, -1e-30, 6.0
    for name in FORMATS:
        y = FORMATS[name][2](x)
        assert bits(y)[0, :2].tolist() == [bits(torch.tensor(-0.0, dtype=torch.bfloat16)).item()] * 2, name


def test_block_formats_byte_counts() -> None:
    assert FP4_E4M3.packed_bytes(512) == 288 and MXFP4.packed_bytes(128) == 68
    assert FP8_UE8M0.packed_bytes(512) == 528
    assert FP4_E4M3.packed_bytes(128) + MXFP4.packed_bytes(64) == 106
    assert FP4_E4M3.bytes_per_value == 9 / 16 and MXFP4.bytes_per_value == 17 / 32
    with pytest.raises(ValueError, match="multiple of 16"):
        FP4_E4M3.packed_bytes(24)
    with pytest.raises(ValueError, match="power of two"):
        kernels.BlockFormat(
            name="bad", element_bits=4, group_size=12, scale_dtype=torch.uint8, power_of_two_scale=True,
            element_max=6.0, amax_floor=1.0,
        )  # fmt: skip
    x = torch.randn(5, 512, dtype=torch.bfloat16)
    packed, scales = kernels.quantize_fp4_e4m3(x)
    assert packed.numel() + scales.numel() == 5 * FP4_E4M3.packed_bytes(512)


def test_qdq_fixed_points_on_conformance_caches() -> None:
    """The official reference's stored caches are QDQ outputs, so QDQ must leave them unchanged
    (FP4-E4M3: only groups whose amax >= 6 * 2^-6, see test_formats_properties)."""
    from safetensors.torch import load_file

    cache = load_file(str(conformance_vectors() / "p0_cache_prefill.safetensors"))
    checked = 0
    for key, value in cache.items():
        if key.endswith("window_kv"):
            assert_bitwise(kernels.qdq_fp8_ue8m0(value), value)
        elif key.endswith("index_k"):
            assert_bitwise(kernels.qdq_mxfp4(value), value)
        elif key.endswith("compress_kv"):
            normal = value.float().unflatten(-1, (-1, 16)).abs().amax(-1) >= 6 * 2.0**-6
            y = kernels.qdq_fp4_e4m3(value).unflatten(-1, (-1, 16))
            assert_bitwise(y[normal], value.unflatten(-1, (-1, 16))[normal])
        else:
            continue
        checked += 1
    assert checked >= 12

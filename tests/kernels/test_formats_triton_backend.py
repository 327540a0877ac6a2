"""backend="triton" is bit-for-bit backend="torch" for every format entry point, on fresh random inputs.

The CPU cases run only under TRITON_INTERPRET=1 set before triton is imported, i.e. in the separate
process that test_formats_triton.py starts; the CUDA cases carry the `gpu` marker.
"""

from __future__ import annotations

import os

import pytest
import torch

import kernels

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="no interpreter"), id="interp"),
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
]
FORMATS = {
    "fp4_e4m3": (kernels.quantize_fp4_e4m3, kernels.dequantize_fp4_e4m3, kernels.qdq_fp4_e4m3, 16),
    "mxfp4": (kernels.quantize_mxfp4, kernels.dequantize_mxfp4, kernels.qdq_mxfp4, 32),
    "fp8_ue8m0": (kernels.quantize_fp8_ue8m0, kernels.dequantize_fp8_ue8m0, kernels.qdq_fp8_ue8m0, 32),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    views = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
    return t.view(views.get(t.dtype, torch.uint8))


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bitwise equal, except that any NaN matches any NaN (payloads differ between CPU and GPU)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if actual.dtype in (torch.bfloat16, torch.float32):
        nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
        assert torch.equal(nan_a, nan_e), f"NaN at {(nan_a != nan_e).nonzero()[:5].tolist()}"
        actual, expected = actual.masked_fill(nan_a, 0), expected.masked_fill(nan_e, 0)
    diff = (bits(actual) != bits(expected)).nonzero()
    assert diff.numel() == 0, (
        f"{len(diff)} of {actual.numel()} differ; first at {diff[0].tolist()}: "
        f"{actual[tuple(diff[0])].item()} vs {expected[tuple(diff[0])].item()}"
    )


def wild(rows: int, d: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """Normals with per-row magnitudes over 14 decades (subnormal and saturated E4M3 scales), exact E2M1
    ties, +-0, and a NaN / inf group every few rows."""
    g = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-8, 6, rows, dtype=torch.float64)[torch.randperm(rows, generator=g)]
    x = torch.randn(rows, d, generator=g, dtype=torch.float64) * magnitudes[:, None]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], dtype=torch.float64)
    x[::5, :8] = ties * (2.0 ** torch.randint(-20, 10, (len(x[::5]), 1), generator=g))
    x[1::7, :4] = torch.tensor([0.0, -0.0, 1e-40, -1e-40], dtype=torch.float64)
    x[2::11, 3] = float("nan")
    x[3::13, 5] = float("inf")
    x[4::17, 7] = float("-inf")
    return x.to(dtype).to(device)


@pytest.mark.parametrize("rows", [1, 63, 1000], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("device", DEVICES)
def test_triton_quantize_matches_torch(device: str, name: str, dtype: torch.dtype, rows: int) -> None:
    quantize, dequantize, qdq, group = FORMATS[name]
    x = wild(rows, 2 * group if rows == 1000 else 128, dtype, device, seed=rows)
    expected = quantize(x)
    actual = quantize(x, backend="triton")
    for a, e in zip(actual, expected, strict=True):
        assert_same(a.view(torch.uint8), e.view(torch.uint8))
    assert actual[1].dtype == expected[1].dtype
    assert_same(qdq(x, backend="triton"), qdq(x))
    for out_dtype in (torch.bfloat16, torch.float32):
        assert_same(dequantize(*expected, out_dtype, backend="triton"), dequantize(*expected, out_dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_triton_fresh_seed_matches_torch(device: str) -> None:
    """A seed drawn per run (printed on failure), on top of the fixed-seed cases above."""
    seed = int.from_bytes(os.urandom(4), "little")
    for name, (quantize, _, qdq, _) in FORMATS.items():
        x = wild(97, 256, torch.bfloat16, device, seed=seed)
        for a, e in zip(quantize(x, backend="triton"), quantize(x), strict=True):
            try:
                assert_same(a.view(torch.uint8), e.view(torch.uint8))
            except AssertionError as error:
                raise AssertionError(f"{name}, seed {seed}: {error}") from None
        assert_same(qdq(x, backend="triton"), qdq(x))


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("device", DEVICES)
def test_triton_dequantize_any_bytes(device: str, name: str) -> None:
    """Every payload byte and every scale byte (NaN, negative and subnormal E4M3 scales, E8M0 0 and 0xFF)."""
    _, dequantize, _, group = FORMATS[name]
    g = torch.Generator().manual_seed(5)
    per_row = group // 2 if name != "fp8_ue8m0" else group
    payload = torch.randint(0, 256, (256, 2 * per_row), generator=g, dtype=torch.uint8).to(device)
    scales = torch.arange(256, dtype=torch.uint8).repeat_interleave(2).view(256, 2).to(device)
    if name == "fp4_e4m3":
        scales = scales.view(torch.float8_e4m3fn)
    if name == "fp8_ue8m0":
        payload = payload.view(torch.float8_e4m3fn)
    for out_dtype in (torch.bfloat16, torch.float32):
        expected = dequantize(payload, scales, out_dtype)
        assert_same(dequantize(payload, scales, out_dtype, backend="triton"), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_noncontiguous_and_fp8_blocks(device: str) -> None:
    x = wild(64, 256, torch.bfloat16, device, seed=9)[:, ::2]
    assert not x.is_contiguous()
    for block in (32, 64, 128):
        expected = kernels.quantize_fp8_ue8m0(x, block)
        for a, e in zip(kernels.quantize_fp8_ue8m0(x, block, backend="triton"), expected, strict=True):
            assert_same(a.view(torch.uint8), e.view(torch.uint8))
    assert_same(kernels.qdq_fp4_e4m3(x, backend="triton"), kernels.qdq_fp4_e4m3(x))


@pytest.mark.parametrize("device", DEVICES)
def test_triton_qdq_straight_through_gradient(device: str) -> None:
    x = torch.randn(2, 64, device=device, requires_grad=True)
    kernels.qdq_mxfp4(x, backend="triton").sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FORMATS))
def test_triton_large_random_matches_torch_cuda(name: str) -> None:
    quantize, _, qdq, _ = FORMATS[name]
    x = (torch.randn(4096, 512, device="cuda") * torch.logspace(-6, 4, 512, device="cuda")).bfloat16()
    for a, e in zip(quantize(x, backend="triton"), quantize(x), strict=True):
        assert_same(a.view(torch.uint8), e.view(torch.uint8))
    assert_same(qdq(x, backend="triton"), qdq(x))
    # CUDA torch reference agrees with the CPU reference too
    assert_same(qdq(x).cpu(), qdq(x.cpu()))

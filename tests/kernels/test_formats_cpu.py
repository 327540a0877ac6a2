"""The compiled CPU formats (kernels/formats/cpu.py) against their slow twin, reference.py: every output
bit on random, tied, signed-zero, subnormal, saturating and non-finite input, and on every stored byte."""

from __future__ import annotations

import time

import pytest
import torch

from kernels.formats import cpu, reference

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler: the compiled path is not built")


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bitwise equal, except that a NaN may carry any payload (both sides NaN at the same places)."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    if got.dtype in (torch.bfloat16, torch.float32):
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan), f"{what}: NaN positions differ"
        ints = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
        diff = got.view(ints)[~nan] != want.view(ints)[~nan]
        assert not diff.any(), f"{what}: {int(diff.sum())} values differ"
    else:
        diff = got.view(torch.uint8) != want.view(torch.uint8)
        assert not diff.any(), f"{what}: {int(diff.sum())} bytes differ"


def hard_input(rows: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows spanning 2^-140 .. 2^120 in magnitude, with zeros of both signs, E2M1 ties, NaN and inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=g) * torch.logspace(-42, 36, rows).unsqueeze(1)
    x = x.to(dtype)
    if rows >= 8:
        x[1] = 0.0
        x[2] = -0.0
        x[3, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75] * 4).to(dtype) * 2.0**-4
        x[4, 7] = float("nan")
        x[5, 40] = -torch.inf
        x[6, 0] = torch.inf
        x[7, :16] = 6 * 2.0**-9 * torch.linspace(0.1, 1.0, 16).to(dtype)
    return x


FORMATS = {
    "fp4_e4m3": (
        reference.quantize_fp4_e4m3,
        lambda p, s, d: reference.dequantize_fp4_e4m3(p, s.view(torch.float8_e4m3fn), d),
        lambda x: cpu.fp4_quantize(x, pow2_scale=False),
        lambda p, s, d: cpu.fp4_dequantize(p, s.view(torch.uint8), False, d),
    ),
    "mxfp4": (
        reference.quantize_mxfp4,
        reference.dequantize_mxfp4,
        lambda x: cpu.fp4_quantize(x, pow2_scale=True),
        lambda p, s, d: cpu.fp4_dequantize(p, s, True, d),
    ),
    "fp8_ue8m0": (
        reference.quantize_fp8_ue8m0,
        reference.dequantize_fp8_ue8m0,
        lambda x: cpu.fp8_quantize(x, 32),
        lambda v, s, d: cpu.fp8_dequantize(v, s, 32, d),
    ),
}


@pytest.mark.parametrize("seed", [0, None], ids=["seed0", "fresh"])
@pytest.mark.parametrize("rows", [1, 63, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", FORMATS)
def test_cpu_formats_equal_reference(name: str, dtype: torch.dtype, rows: int, seed: int | None) -> None:
    seed = seed if seed is not None else time.time_ns() % 2**31
    quantize, dequantize, fast_quantize, fast_dequantize = FORMATS[name]
    x = hard_input(rows, 96, dtype, seed)
    want = quantize(x)
    got = fast_quantize(x)
    for g, w, part in zip(got, want, ("payload", "scales"), strict=True):
        assert_same_bits(g.view(torch.uint8), w.view(torch.uint8), f"{name} {part} seed {seed}")
    for out in (torch.bfloat16, torch.float32):
        assert_same_bits(fast_dequantize(*want, out), dequantize(*want, out), f"{name} dequantize to {out}")


@pytest.mark.parametrize("name", FORMATS)
def test_cpu_dequantize_every_stored_byte(name: str) -> None:
    _, dequantize, _, fast_dequantize = FORMATS[name]
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    per_row = 8 if name == "fp4_e4m3" else (16 if name == "mxfp4" else 32)  # payload bytes of one group
    # every payload byte under every scale byte, one group per row
    payload = every.view(-1, per_row).repeat(256, 1).contiguous()  # [256 * 256 / per_row, per_row]
    scales = every.repeat_interleave(256 // per_row).view(-1, 1).contiguous()
    if name == "fp8_ue8m0":
        payload = payload.view(torch.float8_e4m3fn)
    for out in (torch.bfloat16, torch.float32):
        got, want = fast_dequantize(payload, scales, out), dequantize(payload, scales, out)
        assert_same_bits(got, want, f"{name} {out}")


def test_public_entry_points_take_the_compiled_path_and_match() -> None:
    import kernels

    x = hard_input(63, 512, torch.bfloat16, 3)
    for name in ("fp4_e4m3", "mxfp4", "fp8_ue8m0"):
        qdq = getattr(kernels, f"qdq_{name}")
        quantize, dequantize = FORMATS[name][0], FORMATS[name][1]
        assert_same_bits(qdq(x), dequantize(*quantize(x), torch.bfloat16), f"qdq_{name}")

"""Property tests (hypothesis) for kernels.formats: packed and QDQ paths agree, QDQ is idempotent
(FP4-E4M3 only for groups with a normal E4M3 scale), and a pinned counterexample for the subnormal case."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels

FORMATS = {
    "fp4_e4m3": (kernels.quantize_fp4_e4m3, kernels.dequantize_fp4_e4m3, kernels.qdq_fp4_e4m3, 16),
    "mxfp4": (kernels.quantize_mxfp4, kernels.dequantize_mxfp4, kernels.qdq_mxfp4, 32),
    "fp8_ue8m0": (kernels.quantize_fp8_ue8m0, kernels.dequantize_fp8_ue8m0, kernels.qdq_fp8_ue8m0, 32),
}
ROWS, D = 3, 64


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    diff = (bits(actual) != bits(expected)).nonzero()
    assert diff.numel() == 0, f"{len(diff)} differ; first at {diff[0].tolist()}: " + (
        f"{actual[tuple(diff[0])].item()} vs {expected[tuple(diff[0])].item()}"
    )


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """[3, 64] bf16 or fp32: either arbitrary finite bit patterns (wild magnitudes within a group), or
    small integers times a power of two (dense on the rounding grids, many exact ties)."""
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float32]))
    if draw(st.booleans()):
        patterns = draw(st.lists(st.integers(0, 0xFFFF), min_size=ROWS * D, max_size=ROWS * D))
        raw = torch.tensor(patterns, dtype=torch.int32)
        # clear the exponent of inf/NaN patterns so every value is finite
        raw = torch.where((raw & 0x7F80) == 0x7F80, raw & 0x807F, raw)
        x = raw.to(torch.int16).view(torch.bfloat16).view(ROWS, D)
        return x.to(dtype)
    ints = draw(st.lists(st.integers(-64, 64), min_size=ROWS * D, max_size=ROWS * D))
    exponent = draw(st.integers(-40, 20))
    x = torch.tensor(ints, dtype=torch.float32).view(ROWS, D) * 2.0**exponent / 8
    return x.to(dtype)


@settings(max_examples=150, deadline=None)
@given(x=tensors(), name=st.sampled_from(list(FORMATS)))
def test_qdq_equals_dequantize_of_quantize(x: torch.Tensor, name: str) -> None:
    quantize, dequantize, qdq, _ = FORMATS[name]
    payload, scales = quantize(x)
    assert_bitwise(qdq(x), dequantize(payload, scales, x.dtype))


@settings(max_examples=150, deadline=None)
@given(x=tensors(), name=st.sampled_from(list(FORMATS)))
def test_qdq_is_idempotent(x: torch.Tensor, name: str) -> None:
    _, _, qdq, group = FORMATS[name]
    once = qdq(x)
    twice = qdq(once)
    # groups whose QDQ overflowed to inf (x near the top of the fp32 range) are poisoned by the second pass
    keep = torch.isfinite(once.unflatten(-1, (-1, group))).all(-1)
    if name == "fp4_e4m3":
        # only groups whose E4M3 scale is normal, i.e. amax >= 6 * 2^-6
        keep &= x.float().unflatten(-1, (-1, group)).abs().amax(-1) >= 6 * 2.0**-6
    assert_bitwise(twice.unflatten(-1, (-1, group))[keep], once.unflatten(-1, (-1, group))[keep])


@pytest.mark.parametrize("name", ["mxfp4", "fp8_ue8m0"])
def test_qdq_can_overflow_near_float_max(name: str) -> None:
    """Like the reference, a power-of-two scale near the top of the range can round a value past the
    largest finite float: 2.9775e38 / 2^126 = 3.5 ties up to 4 for MXFP4, and 4 * 2^126 = 2^128 = inf."""
    _, _, qdq, group = FORMATS[name]
    x = torch.zeros(1, group, dtype=torch.bfloat16)
    x[0, 0] = 2.9775e38 if name == "mxfp4" else 3.3895e38
    assert torch.isinf(qdq(x)[0, 0])
    assert torch.isnan(qdq(qdq(x))).all()


def test_fp4_e4m3_subnormal_scale_is_not_idempotent() -> None:
    """amax = 9 * 2^-9: amax/6 = 1.5 * 2^-9 ties to the even subnormal 2 * 2^-9, so 9/2 = 4.5 -> 4 and
    QDQ gives 8 * 2^-9; again, 8/6 = 1.33 -> scale 2^-9 and 8 -> 6, so QDQ gives 6 * 2^-9."""
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    x[0, 0] = 9 * 2.0**-9
    once = kernels.qdq_fp4_e4m3(x)
    twice = kernels.qdq_fp4_e4m3(once)
    assert once[0, 0].item() == 8 * 2.0**-9
    assert twice[0, 0].item() == 6 * 2.0**-9


@pytest.mark.parametrize("name", list(FORMATS))
def test_qdq_straight_through_gradient(name: str) -> None:
    """Under grad mode the value is unchanged and the gradient is the identity."""
    _, _, qdq, _ = FORMATS[name]
    x = torch.randn(4, 64, dtype=torch.float32, requires_grad=True)
    y = qdq(x)
    with torch.no_grad():
        assert_bitwise(y, qdq(x))
    (y * torch.arange(64.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(64.0).expand(4, 64))

"""Public entry points of the block formats: validate at the edge, then run the chosen backend.

`backend="torch"` (the default) runs the compiled CPU path (cpu.py, built on first use) on CPU tensors
when it builds, else reference.py, its slow twin (bitwise the same results, tested); on other devices
reference.py. `backend="triton"` runs triton.py on CUDA tensors,
or on CPU tensors only when TRITON_INTERPRET=1 was set before triton was imported (tests).
Nothing is chosen at import time, and triton itself is imported on first use of that backend.

Every `qdq_*` is differentiable with a straight-through gradient: when grad mode is on and x requires
grad, d qdq(x) / dx is the identity. Its values are the same either way.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Literal

import torch

from kernels.errors import KernelError
from kernels.formats import cpu, reference
from kernels.formats.spec import FP4_E4M3, FP8_UE8M0, MXFP4

Backend = Literal["torch", "triton"]
_INPUT_DTYPES = (torch.bfloat16, torch.float32)


def _check_backend(backend: str, *tensors: torch.Tensor) -> bool:
    """True when the Triton kernels should run; raises when they cannot."""
    if backend == "torch":
        return False
    if backend != "triton":
        raise ValueError(f'backend must be "torch" or "triton", got {backend!r}')
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(f"tensors on different devices: {[str(t.device) for t in tensors]}")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise KernelError(
            'backend="triton" on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported; '
            'use backend="torch" on CPU'
        )
    if device.type not in ("cpu", "cuda"):
        raise KernelError(f'backend="triton" runs on CUDA tensors, got device {device}')
    return True


def _check_input(x: torch.Tensor, group: int, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"{name}: x must be bf16 or fp32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % group:
        raise ValueError(f"{name}: last dim of x {tuple(x.shape)} must be a positive multiple of {group}")


def _check_block(block: int) -> None:
    if not isinstance(block, int) or block < 2 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 2, got {block!r}")


def _check_output_dtype(dtype: torch.dtype, name: str) -> None:
    if dtype not in _INPUT_DTYPES:
        raise ValueError(f"{name}: dtype must be bf16 or fp32, got {dtype}")


def _check_stored(
    payload: torch.Tensor,
    payload_dtypes: tuple[torch.dtype, ...],
    values_per_element: int,
    scales: torch.Tensor,
    scale_dtypes: tuple[torch.dtype, ...],
    group: int,
    name: str,
) -> None:
    if payload.dtype not in payload_dtypes:
        raise ValueError(f"{name}: payload must be one of {payload_dtypes}, got {payload.dtype}")
    if scales.dtype not in scale_dtypes:
        raise ValueError(f"{name}: scales must be one of {scale_dtypes}, got {scales.dtype}")
    if payload.dim() == 0 or payload.shape[-1] == 0:
        raise ValueError(f"{name}: payload shape {tuple(payload.shape)} has no last dim")
    d = payload.shape[-1] * values_per_element
    expected = (*payload.shape[:-1], d // group)
    if d % group or tuple(scales.shape) != expected:
        raise ValueError(
            f"{name}: payload {tuple(payload.shape)} holds D={d} values per row, which needs "
            f"D % {group} == 0 and scales of shape {expected}, got {tuple(scales.shape)}"
        )


class _StraightThrough(torch.autograd.Function):
    """Forward: fn(x). Backward: the incoming gradient unchanged."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return fn(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _qdq(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return _StraightThrough.apply(x, fn)
    return fn(x)


def _triton():  # noqa: ANN202
    # imported on first use, so that importing kernels never imports triton (nor fixes its interpreter mode)
    from kernels.formats import triton as triton_kernels

    return triton_kernels


def quantize_fp4_e4m3(x: torch.Tensor, *, backend: Backend = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """Main-KV FP4: E2M1 codes with one E4M3 scale per 16 values (V41_SPEC.md §6.2).

    scale = E4M3_rne(max(amax, 6*2^-9) / 6), saturating at 448; code = E2M1_rne(x / scale).
    fp32 input is quantized directly (not rounded to bf16 first). A group with a NaN or inf gets the
    NaN scale 0x7F and codes 0.

    Args:
        x: bf16 or fp32 [..., D], D % 16 == 0.
        backend: "torch" or "triton".
    Returns:
        packed uint8 [..., D/2] (even element in the low nibble), scales float8_e4m3fn [..., D/16].
    Raises:
        ValueError: bad dtype, last dim or backend name. KernelError: triton unavailable for x's device.
    """
    _check_input(x, FP4_E4M3.group_size, "quantize_fp4_e4m3")
    if _check_backend(backend, x) and x.numel():
        packed, scale_bytes = _triton().fp4_quantize(x.contiguous(), FP4_E4M3.group_size, pow2_scale=False)
        return packed, scale_bytes.view(torch.float8_e4m3fn)
    if cpu.usable(x):
        packed, scale_bytes = cpu.fp4_quantize(x.detach(), pow2_scale=False)
        return packed, scale_bytes.view(torch.float8_e4m3fn)
    return reference.quantize_fp4_e4m3(x)


def dequantize_fp4_e4m3(
    packed: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    *,
    backend: Backend = "torch",
) -> torch.Tensor:
    """Inverse of `quantize_fp4_e4m3`: E2M1 value times its E4M3 scale (exact in fp32 and bf16).

    Args:
        packed: uint8 [..., D/2].
        scales: float8_e4m3fn (or its uint8 bytes) [..., D/16]; a NaN scale makes its group NaN.
        dtype: bf16 or fp32.
        backend: "torch" or "triton".
    Returns:
        dtype [..., D].
    Raises:
        ValueError: bad dtypes or shapes. KernelError: triton unavailable for the device.
    """
    _check_stored(
        packed, (torch.uint8,), 2, scales, (torch.float8_e4m3fn, torch.uint8), FP4_E4M3.group_size,
        "dequantize_fp4_e4m3",
    )  # fmt: skip
    _check_output_dtype(dtype, "dequantize_fp4_e4m3")
    if _check_backend(backend, packed, scales) and packed.numel():
        return _triton().fp4_dequantize(
            packed.contiguous(), scales.view(torch.uint8).contiguous(), FP4_E4M3.group_size, False, dtype
        )
    if cpu.usable(packed, scales):
        return cpu.fp4_dequantize(packed, scales.view(torch.uint8), False, dtype)
    return reference.dequantize_fp4_e4m3(packed, scales.view(torch.float8_e4m3fn), dtype)


def qdq_fp4_e4m3(x: torch.Tensor, *, backend: Backend = "torch") -> torch.Tensor:
    """dequantize_fp4_e4m3(quantize_fp4_e4m3(x)) in x's dtype, in one pass (the reference's
    `fp4_act_quant(x, 16, inplace=True, scale_dtype=float8_e4m3fn)`); straight-through gradient.

    Args:
        x: bf16 or fp32 [..., D], D % 16 == 0.
        backend: "torch" or "triton".
    Returns:
        x.dtype [..., D].
    Raises:
        ValueError: bad dtype, last dim or backend name. KernelError: triton unavailable.
    """
    _check_input(x, FP4_E4M3.group_size, "qdq_fp4_e4m3")
    if _check_backend(backend, x) and x.numel():
        kernels = _triton()
        return _qdq(x, lambda t: kernels.fp4_qdq(t.contiguous(), FP4_E4M3.group_size, pow2_scale=False))
    if cpu.usable(x):
        return _qdq(x, lambda t: cpu.fp4_dequantize(*cpu.fp4_quantize(t.detach(), False), False, t.dtype))
    return _qdq(x, reference.qdq_fp4_e4m3)


def quantize_mxfp4(x: torch.Tensor, *, backend: Backend = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer MXFP4: E2M1 codes with one E8M0 scale per 32 values (V41_SPEC.md §6.3).

    scale = 2^ceil(log2(max(amax, 6*2^-126) * fp32(1/6))) from the IEEE bits; code = E2M1_rne(x / scale).
    fp32 input is quantized directly. A group with a NaN or inf gets scale byte 0xFF (NaN) and codes 0.

    Args:
        x: bf16 or fp32 [..., D], D % 32 == 0.
        backend: "torch" or "triton".
    Returns:
        packed uint8 [..., D/2], scales uint8 [..., D/32] (biased exponents: 2^(b-127)).
    Raises:
        ValueError: bad dtype, last dim or backend name. KernelError: triton unavailable.
    """
    _check_input(x, MXFP4.group_size, "quantize_mxfp4")
    if _check_backend(backend, x) and x.numel():
        return _triton().fp4_quantize(x.contiguous(), MXFP4.group_size, pow2_scale=True)
    if cpu.usable(x):
        return cpu.fp4_quantize(x.detach(), pow2_scale=True)
    return reference.quantize_mxfp4(x)


def dequantize_mxfp4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    *,
    backend: Backend = "torch",
) -> torch.Tensor:
    """Inverse of `quantize_mxfp4`.

    Args:
        packed: uint8 [..., D/2].
        scales: uint8 exponent bytes (or float8_e8m0fnu) [..., D/32]; 0xFF makes its group NaN.
        dtype: bf16 or fp32.
        backend: "torch" or "triton".
    Returns:
        dtype [..., D].
    Raises:
        ValueError: bad dtypes or shapes. KernelError: triton unavailable.
    """
    _check_stored(
        packed, (torch.uint8,), 2, scales, (torch.uint8, torch.float8_e8m0fnu), MXFP4.group_size,
        "dequantize_mxfp4",
    )  # fmt: skip
    _check_output_dtype(dtype, "dequantize_mxfp4")
    scale_bytes = scales.view(torch.uint8)
    if _check_backend(backend, packed, scales) and packed.numel():
        return _triton().fp4_dequantize(
            packed.contiguous(), scale_bytes.contiguous(), MXFP4.group_size, True, dtype
        )
    if cpu.usable(packed, scales):
        return cpu.fp4_dequantize(packed, scale_bytes, True, dtype)
    return reference.dequantize_mxfp4(packed, scale_bytes, dtype)


def qdq_mxfp4(x: torch.Tensor, *, backend: Backend = "torch") -> torch.Tensor:
    """dequantize_mxfp4(quantize_mxfp4(x)) in x's dtype (the reference's `fp4_act_quant(x, 32, True)`);
    straight-through gradient.

    Args:
        x: bf16 or fp32 [..., D], D % 32 == 0.
        backend: "torch" or "triton".
    Returns:
        x.dtype [..., D].
    Raises:
        ValueError: bad dtype, last dim or backend name. KernelError: triton unavailable.
    """
    _check_input(x, MXFP4.group_size, "qdq_mxfp4")
    if _check_backend(backend, x) and x.numel():
        kernels = _triton()
        return _qdq(x, lambda t: kernels.fp4_qdq(t.contiguous(), MXFP4.group_size, pow2_scale=True))
    if cpu.usable(x):
        return _qdq(x, lambda t: cpu.fp4_dequantize(*cpu.fp4_quantize(t.detach(), True), True, t.dtype))
    return _qdq(x, reference.qdq_mxfp4)


def quantize_fp8_ue8m0(
    x: torch.Tensor, block: int = FP8_UE8M0.group_size, *, backend: Backend = "torch"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Window-KV / activation FP8: E4M3 values with one UE8M0 scale per `block` (V41_SPEC.md §6.4).

    scale = 2^ceil(log2(max(amax, 1e-4) * fp32(1/448))) from the IEEE bits; value = E4M3_rne(clamp(x /
    scale, +-448)). fp32 input is quantized directly. A group with a NaN or inf gets scale byte 0xFF
    (NaN) and values 0.

    Args:
        x: bf16 or fp32 [..., D], D % block == 0.
        block: values per scale, a power of two (32 everywhere in the model).
        backend: "torch" or "triton".
    Returns:
        values float8_e4m3fn [..., D], scales uint8 [..., D/block] (biased exponents: 2^(b-127)).
    Raises:
        ValueError: bad dtype, last dim, block or backend name. KernelError: triton unavailable.
    """
    _check_block(block)
    _check_input(x, block, "quantize_fp8_ue8m0")
    if _check_backend(backend, x) and x.numel():
        return _triton().fp8_quantize(x.contiguous(), block)
    if block <= cpu.MAX_FP8_BLOCK and cpu.usable(x):
        return cpu.fp8_quantize(x.detach(), block)
    return reference.quantize_fp8_ue8m0(x, block)


def dequantize_fp8_ue8m0(
    values: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    block: int = FP8_UE8M0.group_size,
    *,
    backend: Backend = "torch",
) -> torch.Tensor:
    """Inverse of `quantize_fp8_ue8m0`: E4M3 value times 2^(b-127), exact in fp32.

    Args:
        values: float8_e4m3fn [..., D].
        scales: uint8 exponent bytes (or float8_e8m0fnu) [..., D/block]; 0xFF makes its group NaN.
        dtype: bf16 or fp32.
        block: values per scale, a power of two.
        backend: "torch" or "triton".
    Returns:
        dtype [..., D].
    Raises:
        ValueError: bad dtypes, shapes or block. KernelError: triton unavailable.
    """
    _check_block(block)
    _check_stored(
        values, (torch.float8_e4m3fn,), 1, scales, (torch.uint8, torch.float8_e8m0fnu), block,
        "dequantize_fp8_ue8m0",
    )  # fmt: skip
    _check_output_dtype(dtype, "dequantize_fp8_ue8m0")
    scale_bytes = scales.view(torch.uint8)
    if _check_backend(backend, values, scales) and values.numel():
        return _triton().fp8_dequantize(values.contiguous(), scale_bytes.contiguous(), block, dtype)
    if cpu.usable(values, scales):
        return cpu.fp8_dequantize(values, scale_bytes, block, dtype)
    return reference.dequantize_fp8_ue8m0(values, scale_bytes, dtype, block)


def qdq_fp8_ue8m0(
    x: torch.Tensor, block: int = FP8_UE8M0.group_size, *, backend: Backend = "torch"
) -> torch.Tensor:
    """dequantize_fp8_ue8m0(quantize_fp8_ue8m0(x)) in x's dtype: the reference's
    `act_quant(x, block, "ue8m0", inplace=True)`, used on the window KV and, with block 32, equal to what
    every FP8/FP4 GEMM sees of its activation. Straight-through gradient.

    Args:
        x: bf16 or fp32 [..., D], D % block == 0.
        block: values per scale, a power of two.
        backend: "torch" or "triton".
    Returns:
        x.dtype [..., D].
    Raises:
        ValueError: bad dtype, last dim, block or backend name. KernelError: triton unavailable.
    """
    _check_block(block)
    _check_input(x, block, "qdq_fp8_ue8m0")
    if _check_backend(backend, x) and x.numel():
        kernels = _triton()
        return _qdq(x, lambda t: kernels.fp8_qdq(t.contiguous(), block))
    if block <= cpu.MAX_FP8_BLOCK and cpu.usable(x):
        return _qdq(x, lambda t: cpu.fp8_dequantize(*cpu.fp8_quantize(t.detach(), block), block, t.dtype))
    return _qdq(x, lambda t: reference.qdq_fp8_ue8m0(t, block))

"""The compiled CPU path of the block formats (cpu_formats.c): one pass per tensor, bitwise the torch
reference (reference.py, its slow twin) on every input, NaN payloads aside (a NaN output is the canonical
quiet NaN here, whatever the reference's vector or tail code gave).

Knows nothing of validation (api.py does it): it takes contiguous CPU bf16/fp32 tensors. The C file is
compiled on first use by `kernels.native.load_library` (cached by source hash and host CPU flags);
without a compiler `available()` is False and callers keep the reference.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from kernels.formats.reference import _E2M1_THRESHOLDS
from kernels.formats.spec import (
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    FP4_E4M3,
    FP4_E4M3_AMAX_FLOOR,
    FP8_AMAX_FLOOR,
    MXFP4,
    MXFP4_AMAX_FLOOR,
)
from kernels.native import load_library

_SOURCE = Path(__file__).with_name("cpu_formats.c")
# the C quantizer stages one FP8 group in a fixed buffer of this many values
MAX_FP8_BLOCK = 256
_F = ctypes.c_float
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_P = ctypes.c_void_p


@cache
def _library() -> ctypes.CDLL | None:
    lib = load_library(_SOURCE)
    if lib is None:
        return None
    lib.fp4_quantize.argtypes = [_P, _INT, _I64, _INT, _INT, _F, _F, _P, _P, _P, _P]
    lib.fp4_dequantize.argtypes = [_P, _P, _I64, _INT, _P, _P, _INT, _P]
    lib.fp8_quantize.argtypes = [_P, _INT, _I64, _INT, _F, _F, _P, _P]
    lib.fp8_dequantize.argtypes = [_P, _P, _I64, _INT, _P, _P, _INT, _P]
    return lib


@cache
def _tables() -> dict[str, torch.Tensor]:
    """The lookup tables, made by torch itself so that the C code decodes exactly as torch does."""
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    return {
        "e4m3": every_byte.view(torch.float8_e4m3fn).float().contiguous(),
        "e8m0": every_byte.view(torch.float8_e8m0fnu).float().contiguous(),
        "e2m1": torch.cat([grid, -grid]).contiguous(),
        "thresholds": torch.tensor(_E2M1_THRESHOLDS, dtype=torch.float32),
    }


def available() -> bool:
    """Whether the compiled path is built (compiling it on the first call)."""
    return _library() is not None


def usable(*tensors: torch.Tensor) -> bool:
    """Whether these tensors can take the compiled path: all on CPU, and the library builds."""
    return all(t.device.type == "cpu" for t in tensors) and available()


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


@cache
def _f32(value: float) -> float:
    # the fp32 the reference's `torch.tensor(value, dtype=float32)` / scalar clamp rounds the value to.
    # Cached: the callers pass the formats' constants, and each quantize call asked for two (a 1-row
    # decode step made 46 calls, about 140 of its 2400 dispatched ops)
    return torch.tensor(value, dtype=torch.float32).item()


def fp4_quantize(x: torch.Tensor, pow2_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16/fp32 [..., D] -> (packed uint8 [..., D/2], scale bytes uint8 [..., D/G]); G = 32 (MXFP4,
    pow2_scale) or 16 (FP4-E4M3)."""
    lib = _library()
    assert lib is not None
    fmt = MXFP4 if pow2_scale else FP4_E4M3
    x = x.contiguous()
    group = fmt.group_size
    n_groups = x.numel() // group
    packed = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=torch.uint8)
    scales = torch.empty(*x.shape[:-1], x.shape[-1] // group, dtype=torch.uint8)
    t = _tables()
    floor = MXFP4_AMAX_FLOOR if pow2_scale else FP4_E4M3_AMAX_FLOOR
    lib.fp4_quantize(_ptr(x), int(x.dtype == torch.bfloat16), n_groups, group, int(pow2_scale), _f32(floor),
                     _f32(1.0 / E2M1_MAX), _ptr(t["thresholds"]), _ptr(t["e4m3"]), _ptr(packed),
                     _ptr(scales))  # fmt: skip
    return packed, scales


def fp4_dequantize(
    packed: torch.Tensor, scales: torch.Tensor, pow2_scale: bool, dtype: torch.dtype
) -> torch.Tensor:
    """packed uint8 [..., D/2], scale bytes uint8 [..., D/G] -> dtype [..., D] (G as `fp4_quantize`)."""
    lib = _library()
    assert lib is not None
    packed, scales = packed.contiguous(), scales.contiguous()
    group = (MXFP4 if pow2_scale else FP4_E4M3).group_size
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=dtype)
    t = _tables()
    scale_table = t["e8m0"] if pow2_scale else t["e4m3"]
    lib.fp4_dequantize(_ptr(packed), _ptr(scales), out.numel() // group, group, _ptr(scale_table),
                       _ptr(t["e2m1"]), int(dtype == torch.bfloat16), _ptr(out))  # fmt: skip
    return out


def fp8_quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16/fp32 [..., D] -> (values float8_e4m3fn [..., D], scale bytes uint8 [..., D/group])."""
    lib = _library()
    assert lib is not None
    x = x.contiguous()
    values = torch.empty(x.shape, dtype=torch.uint8)
    scales = torch.empty(*x.shape[:-1], x.shape[-1] // group, dtype=torch.uint8)
    lib.fp8_quantize(_ptr(x), int(x.dtype == torch.bfloat16), x.numel() // group, group, _f32(FP8_AMAX_FLOOR),
                     _f32(1.0 / E4M3_MAX), _ptr(values), _ptr(scales))  # fmt: skip
    return values.view(torch.float8_e4m3fn), scales


def fp8_dequantize(
    values: torch.Tensor, scales: torch.Tensor, group: int, dtype: torch.dtype
) -> torch.Tensor:
    """values float8_e4m3fn [..., D], scale bytes uint8 [..., D/group] -> dtype [..., D]."""
    lib = _library()
    assert lib is not None
    values, scales = values.contiguous(), scales.contiguous()
    out = torch.empty(values.shape, dtype=dtype)
    t = _tables()
    lib.fp8_dequantize(_ptr(values.view(torch.uint8)), _ptr(scales), values.numel() // group, group,
                       _ptr(t["e4m3"]), _ptr(t["e8m0"]), int(dtype == torch.bfloat16), _ptr(out))  # fmt: skip
    return out

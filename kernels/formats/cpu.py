"""The compiled CPU path of the block formats (cpu_formats.c): one pass per tensor, bitwise the torch
reference (reference.py, its slow twin) on every input, NaN payloads aside (a NaN output is the canonical
quiet NaN here, whatever the reference's vector or tail code gave).

Knows nothing of validation (api.py does it): it takes contiguous CPU bf16/fp32 tensors. The C file is
compiled on first use with the system C compiler (`cc -O3 -ffp-contract=off -march=native`) into a
cache folder keyed by the source's hash and the host's CPU flags (`$KVRESUME_KERNEL_CACHE`, else
`~/.cache/kvresume/kernels`); without a compiler `available()` is False and callers keep the reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
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

_SOURCE = Path(__file__).with_name("cpu_formats.c")
# the C quantizer stages one FP8 group in a fixed buffer of this many values
MAX_FP8_BLOCK = 256
_F = ctypes.c_float
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_P = ctypes.c_void_p


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cache_dir() -> Path:
    root = os.environ.get("KVRESUME_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "kvresume" / "kernels"


@cache
def _library() -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    # an install that left the C source out (package data) keeps the reference, as without a compiler
    if compiler is None or not _SOURCE.is_file():
        return None
    # tuned for this host; the results do not depend on it (integer bit arithmetic and IEEE operations
    # without contraction), but the instructions do, so the cache key names the host's CPU flags
    flags = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-march=native", "-shared", "-fPIC"]
    source = _SOURCE.read_bytes()
    host = " ".join(sorted(_cpu_flags()))
    digest = hashlib.sha256(source + " ".join(flags).encode() + host.encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_formats-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # build beside the target and rename: concurrent first uses never load a half-written file
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            done = subprocess.run([compiler, *flags, str(_SOURCE), "-o", str(built), "-lm"],
                                  capture_output=True, check=False)  # fmt: skip
            if done.returncode != 0:
                return None
            os.replace(built, target)
    lib = ctypes.CDLL(str(target))
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


def _f32(value: float) -> float:
    # the fp32 the reference's `torch.tensor(value, dtype=float32)` / scalar clamp rounds the value to
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

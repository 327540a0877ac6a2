"""The compiled CPU path of bf16 linears (cpu_bf16_gemm.c): `F.linear(x, w)` on bf16 CPU tensors of two
or more rows, bit for bit, with the weight converted to fp32 once (`pack_weight`) instead of on every
call. Its slow twin is torch itself: the path is used only where torch computes with the AVX2 kernel whose
order the C file reproduces (the pinned numerics profiles), and only after a probe on this process's
torch agreed with it on wide-range inputs and on sums that cancel (`usable`).

Knows nothing of modules or validation (kernels.bf16_gemm does both).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.native import load_library

__all__ = ["covers", "linear_packed", "outputs_per_block", "pack_weight", "usable"]

_SOURCE = Path(__file__).with_name("cpu_bf16_gemm.c")
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
# outputs per transposed weight block where the library does not load (nothing packed is used then)
_AVX2_OUTPUTS_PER_BLOCK = 8
# torch's CPU capability whose bf16 dot product the C file reproduces
_CAPABILITY = "AVX2"
# The probe's shapes: K from one tail step to several 64-wide chunks plus a tail, N not a multiple of 8.
_PROBE_K = (16, 48, 64, 96, 128, 192, 320)


@cache
def _library() -> ctypes.CDLL | None:
    lib = load_library(_SOURCE)
    if lib is None:
        return None
    lib.linear_bf16.argtypes = [_P, _P, _I64, _I64, _INT, _P]
    lib.linear_bf16.restype = _INT
    lib.linear_bf16_outputs_per_block.argtypes = []
    lib.linear_bf16_outputs_per_block.restype = _INT
    return lib


@cache
def outputs_per_block() -> int:
    """Outputs per block of the packed weight: the C file's OUTS, one fp32 vector register of the
    instruction set it was built for (16 with AVX-512F, else 8). Same bits either way: each output is a
    lane of its own (the C file's comment)."""
    lib = _library()
    return int(lib.linear_bf16_outputs_per_block()) if lib is not None else _AVX2_OUTPUTS_PER_BLOCK


def covers(rows: int, k: int) -> bool:
    """Whether the C order is the measured ATen order for this shape: K a positive multiple of 16 (ATen's
    scalar tail was not measured) and two or more rows (one row goes to ATen's gemv, kept as it is)."""
    return rows > 1 and k > 0 and k % 16 == 0


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 -> fp32 [ceil(N/B), K, B]: blocks of B outputs, transposed (zeros past N), B
    the library's `outputs_per_block()`."""
    n, k = weight.shape
    per = outputs_per_block()
    blocks = -(-n // per)
    padded = weight.new_zeros(blocks * per, k, dtype=torch.float32)
    padded[:n] = weight.float()
    return padded.view(blocks, per, k).transpose(1, 2).contiguous()


def linear_packed(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor | None:
    """x [M, K] bf16 (contiguous CPU) times the weight of N outputs as `pack_weight` packed it in this
    process -> [M, N] bf16, or None when the C code could not allocate its scratch memory (the caller then
    runs torch). The C code loads the packed weight unaligned, so any contiguous tensor will do."""
    lib = _library()
    assert lib is not None
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.bfloat16)
    if lib.linear_bf16(x.data_ptr(), packed.data_ptr(), m, n, k, out.data_ptr()):
        return None
    return out


def _wide(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """bf16 values with random signs over 2^-6..2^6: the sums' order shows in far more outputs than with
    normal values."""
    exponent = torch.randint(-6, 7, shape, generator=gen).float()
    sign = torch.randint(0, 2, shape, generator=gen).float() * 2 - 1
    return (sign * torch.exp2(exponent) * (1 + torch.rand(shape, generator=gen))).bfloat16()


def cancelling(gen: torch.Generator, rows: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] and w [n, k] bf16 whose products cancel: every output's products hold +2^25 and -2^25
    at two random places among small ones (|p| <= 1.5, below half an fp32 ulp of 2^25), so a small product
    is absorbed exactly when the running sum holds one big one as it is added, and what an output ends with
    tells which partial sums met which. Any other order of the sums shows in nearly every output, where
    with wide-range values the bf16 rounding hides it (session 43: three other orders differed from torch's
    in 0-1 of 2211 wide-range outputs a shape, against 2020-2191 of these)."""
    x = (torch.randint(-3, 4, (rows, k), generator=gen) * 0.5).bfloat16()
    sign = torch.randint(0, 2, (n, k), generator=gen) * 2 - 1
    w = (sign * 0.5 * torch.randint(1, 3, (n, k), generator=gen)).bfloat16()
    up, down = torch.randperm(k, generator=gen)[:2].tolist()
    x[:, up], x[:, down] = 1, 1
    w[:, up], w[:, down] = 2.0**25, -(2.0**25)
    return x, w


@cache
def _probe() -> bool:
    gen = torch.Generator().manual_seed(20261203)
    for k in _PROBE_K:
        for x, w in ((_wide(gen, 33, k), _wide(gen, 67, k)), cancelling(gen, 33, 67, k)):
            got = linear_packed(x, pack_weight(w), 67)
            if got is None or not torch.equal(got, F.linear(x, w)):
                return False
    return True


def usable() -> bool:
    """Whether the compiled path gives torch's bits in this process: torch on its AVX2 kernels with oneDNN
    off (oneDNN's bf16 GEMM sums in another order), a library that builds, and a probe that agreed."""
    return (
        torch.backends.cpu.get_cpu_capability() == _CAPABILITY
        and not torch.backends.mkldnn.enabled
        and _library() is not None
        and _probe()
    )

"""The compiled CPU paths of one-row fp32 products (cpu_fp32_rows.c): `[F.linear(row, w) for row in x]`
in one call, either each row through the BLAS `sgemm_` that torch itself calls for a one-row product, with
the same arguments (`rows_linear`), or all rows in the summation order of MKL's matrix-vector kernel, read
off it, with the weight packed once (`gemv_order_linear`: the C file says how the order was read). Their
slow twin is that torch loop (kernels.fp32_rows).

The address of `sgemm_` is looked up in torch's own CPU library; where it is not exported (a torch built
on another BLAS, or none) or the library does not build, nothing here is used. Before a shape is first
computed here, a probe on wide-range values compares every bit with the torch loop in this process
(`agrees`), so a torch whose one-row `F.linear` takes another route is found out, not trusted.

Knows nothing of models.
"""

from __future__ import annotations

import ctypes
from functools import cache, lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.native import load_functions

__all__ = [
    "agrees",
    "agrees_gemv_order",
    "available",
    "gemv_order_linear",
    "pack_gemv_weight",
    "rows_linear",
    "rows_linear_reference",
    "wide_fp32",
]

_SOURCE = Path(__file__).with_name("cpu_fp32_rows.c")
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32
# rows of the first-use probe: more than one, odd, enough for a row of every residue mod 16
_PROBE_ROWS = 19
# outputs per packed weight block of `gemv_order_linear` (the C file's GEMV_OUTS)
_GEMV_OUTS = 8


@cache
def _library() -> ctypes.CDLL | None:
    return load_functions(
        _SOURCE,
        {
            "fp32_rows_linear": ([_P, _P, _P, _P, _I64, _I32, _I32], None),
            "fp32_rows_gemv_order": ([_P, _P, _P, _I64, _I32, _I32], None),
        },
    )


@cache
def _sgemm() -> int | None:
    """The address of the BLAS `sgemm_` in torch's CPU library, or None where it does not export one."""
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        lib = ctypes.CDLL(str(path))
        return ctypes.cast(lib.sgemm_, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def available() -> bool:
    """Whether the library builds and torch exports the BLAS call it makes."""
    return _library() is not None and _sgemm() is not None


def rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 (contiguous CPU) @ weight [N, K]^T (fp32, contiguous CPU) -> [M, N], each row one
    `sgemm_` call (check `available()` first)."""
    lib = _library()
    sgemm = _sgemm()
    assert lib is not None and sgemm is not None
    m, k = x.shape
    n = weight.size(0)
    out = torch.empty(m, n, dtype=torch.float32)
    lib.fp32_rows_linear(sgemm, weight.data_ptr(), x.data_ptr(), out.data_ptr(), m, k, n)
    return out


def gemv_order_covers(k: int, n: int) -> bool:
    """Whether `gemv_order_linear` takes weights [n, k]: the order was read for K a multiple of 4, at least
    8, and N a multiple of 4 (MKL sums the last N mod 4 outputs in yet another order). Whether it gives
    MKL's bits for a shape is `agrees_gemv_order`'s question."""
    return k >= 8 and k % 4 == 0 and n > 0 and n % 4 == 0


def pack_gemv_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] fp32 -> [ceil(N/8), K, 8]: blocks of 8 outputs, transposed (zeros past N)."""
    n, k = weight.shape
    blocks = -(-n // _GEMV_OUTS)
    padded = weight.new_zeros(blocks * _GEMV_OUTS, k)
    padded[:n] = weight
    return padded.view(blocks, _GEMV_OUTS, k).transpose(1, 2).contiguous()


def gemv_order_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] fp32 (contiguous CPU) @ the weight of N outputs that `pack_gemv_weight` packed -> [M, N],
    every row in the order of MKL's one-row product (check `available()` and `gemv_order_covers(K, N)`
    first)."""
    lib = _library()
    assert lib is not None
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.float32)
    lib.fp32_rows_gemv_order(packed.data_ptr(), x.data_ptr(), out.data_ptr(), m, k, n)
    return out


def rows_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The slow twin: x [M, K] @ weight [N, K]^T as M one-row `F.linear` calls -> [M, N]."""
    return torch.cat([F.linear(row, weight) for row in x.split(1)])


def wide_fp32(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """fp32 values of random sign over 2^-6..2^6: a product's sums show their order in far more outputs
    than with normal values (the probes of fp32 products here and in model/invariant.py)."""
    exponent = torch.randint(-6, 7, shape, generator=gen).float()
    sign = torch.randint(0, 2, shape, generator=gen).float() * 2 - 1
    return sign * torch.exp2(exponent) * (1 + torch.rand(shape, generator=gen))


@lru_cache(maxsize=64)
def agrees(k: int, n: int, threads: int) -> bool:
    """Whether, in this process (at `threads` intra-op threads), `rows_linear` gives every bit of the torch
    loop for weights [n, k]: checked once per shape on wide-range values."""
    if not available():
        return False
    gen = torch.Generator().manual_seed(20261206 + 7919 * k + n)
    weight = wide_fp32(gen, n, k)
    x = wide_fp32(gen, _PROBE_ROWS, k)
    with torch.inference_mode():
        return torch.equal(rows_linear(x, weight), rows_linear_reference(x, weight))


@lru_cache(maxsize=64)
def agrees_gemv_order(k: int, n: int, threads: int) -> bool:
    """Whether, in this process (at `threads` intra-op threads), `gemv_order_linear` gives every bit of the
    torch loop for weights [n, k]: checked once per shape on wide-range values, as `agrees`."""
    if not (available() and gemv_order_covers(k, n)):
        return False
    gen = torch.Generator().manual_seed(20261207 + 7919 * k + n)
    weight = wide_fp32(gen, n, k)
    x = wide_fp32(gen, _PROBE_ROWS, k)
    with torch.inference_mode():
        got = gemv_order_linear(x, pack_gemv_weight(weight), n)
        return torch.equal(got, rows_linear_reference(x, weight))

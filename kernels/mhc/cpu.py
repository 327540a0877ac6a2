"""The compiled CPU path of the Sinkhorn normalization (cpu_sinkhorn.c), bit for bit the torch reference
(reference.py, its slow twin). Used where the library builds (any C compiler; no instruction set needed)
and a probe at first use agreed with the reference.

Knows nothing of validation (the package's `sinkhorn` does it).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from kernels.mhc.reference import sinkhorn_reference
from kernels.native import load_library

__all__ = ["covers", "sinkhorn_cpu", "usable"]

_SOURCE = Path(__file__).with_name("cpu_sinkhorn.c")


def covers(hc: int) -> bool:
    """Whether the C order is torch's for combs of `hc` lanes: up to 4 (every model's hc_mult is 4). From 5
    lanes on, torch's row and column sums take other orders, some depending on how many combs share the
    call (measured: 5-8 and 16 lanes differ from a sum one after another)."""
    return 1 <= hc <= 4


@cache
def _library() -> ctypes.CDLL | None:
    lib = load_library(_SOURCE)
    if lib is None:
        return None
    lib.sinkhorn_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_float]
    lib.sinkhorn_f32.restype = ctypes.c_int
    return lib


def sinkhorn_cpu(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor | None:
    """The normalized comb [..., hc, hc] (a new contiguous tensor), or None when the C code could not
    allocate its scratch memory (the caller then runs the reference)."""
    lib = _library()
    assert lib is not None
    out = comb.contiguous().clone()
    hc = comb.size(-1)
    if lib.sinkhorn_f32(out.data_ptr(), out.numel() // (hc * hc), hc, iters, eps):
        return None
    return out


@cache
def _probe() -> bool:
    gen = torch.Generator().manual_seed(20261203)
    for rows in (1, 3, 37):
        comb = torch.exp(torch.randn(rows, 4, 4, generator=gen) * 4)
        got = sinkhorn_cpu(comb, 20, 1e-6)
        if got is None or not torch.equal(got, sinkhorn_reference(comb, 20, 1e-6)):
            return False
    return True


def usable() -> bool:
    """Whether the compiled path gives the reference's bits here: a library that builds and a probe that
    agreed."""
    return _library() is not None and _probe()

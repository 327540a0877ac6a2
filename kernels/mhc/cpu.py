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

__all__ = ["collapse_cpu", "covers", "expand_cpu", "lanes_cover", "lanes_usable", "sinkhorn_cpu", "usable"]

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


_LANES_SOURCE = Path(__file__).with_name("cpu_lanes.c")


@cache
def _lanes() -> ctypes.CDLL | None:
    lib = load_library(_LANES_SOURCE)
    if lib is None:
        return None
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.collapse_bf16.argtypes = [p, p, i64, i, i, p]
    lib.expand_bf16.argtypes = [p, p, p, p, i64, i, i, p]
    lib.collapse_bf16.restype = lib.expand_bf16.restype = i
    return lib


def lanes_cover(hc: int, d: int) -> bool:
    """Whether the C order is torch's: lane sums of up to 4 lanes (measured; every model's hc_mult is 4)
    of at least one element."""
    return 1 <= hc <= 4 and d >= 1


def collapse_cpu(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor | None:
    """`collapse_reference(x, pre)` for x [..., hc, d] bf16 and pre [..., hc] fp32 (CPU), or None when the
    C code could not allocate its scratch memory (the caller runs the reference)."""
    lib = _lanes()
    assert lib is not None
    hc, d = x.shape[-2:]
    x, pre = x.contiguous(), pre.contiguous()
    out = torch.empty(*x.shape[:-2], d, dtype=torch.bfloat16)
    if lib.collapse_bf16(x.data_ptr(), pre.data_ptr(), x.numel() // (hc * d), hc, d, out.data_ptr()):
        return None
    return out


def expand_cpu(
    y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor | None:
    """`expand_reference(y, residual, post, comb)` for CPU tensors of its dtypes, or None when the C code
    could not allocate its scratch memory (the caller runs the reference)."""
    lib = _lanes()
    assert lib is not None
    hc, d = residual.shape[-2:]
    y, residual, post, comb = y.contiguous(), residual.contiguous(), post.contiguous(), comb.contiguous()
    out = torch.empty(residual.shape, dtype=torch.bfloat16)
    rows = residual.numel() // (hc * d)
    if lib.expand_bf16(y.data_ptr(), residual.data_ptr(), post.data_ptr(), comb.data_ptr(), rows, hc, d,
                       out.data_ptr()):  # fmt: skip
        return None
    return out


def cancelling_lanes(gen: torch.Generator, rows: int, d: int) -> torch.Tensor:
    """x [1, rows, 4, d] bf16 whose 4 lanes at each place hold +2^25, -2^25 and two small values (|v| <= 1.5,
    below half an fp32 ulp of 2^25) in a random order: summed with weights of 1, a small value is absorbed
    exactly when the running sum holds one big one as it is added, so any other order of a lane sum shows
    in most outputs. On ordinary values the bf16 rounding hides it: a sequential, reversed, pairwise and
    exact sum each matched torch's collapse in every output of the probe's normal-valued rows (session 43)."""
    big = torch.tensor([2.0**25, -(2.0**25)]).expand(rows, d, 2)
    small = torch.randint(-3, 4, (rows, d, 2), generator=gen) * 0.5
    order = torch.argsort(torch.rand(rows, d, 4, generator=gen), dim=-1)
    lanes = torch.gather(torch.cat([big, small], dim=-1), -1, order)  # [rows, d, 4]
    return lanes.permute(0, 2, 1).unsqueeze(0).bfloat16().contiguous()


@cache
def _lanes_probe() -> bool:
    from kernels.mhc.reference import collapse_reference, expand_reference

    gen = torch.Generator().manual_seed(20261203)
    cases = [(torch.randn(1, rows, 4, 96, generator=gen).bfloat16(), torch.rand(1, rows, 4, generator=gen),
              torch.rand(1, rows, 4, 4, generator=gen), torch.randn(1, rows, 96, generator=gen).bfloat16())
             for rows in (1, 5)]  # fmt: skip
    x = cancelling_lanes(gen, 5, 96)
    cases.append((x, torch.ones(1, 5, 4), torch.ones(1, 5, 4, 4), x[:, :, 0]))
    for x, pre, comb, y in cases:
        got_c, got_e = collapse_cpu(x, pre), expand_cpu(y, x, pre, comb)
        if got_c is None or not torch.equal(
            got_c.view(torch.int16), collapse_reference(x, pre).view(torch.int16)
        ):
            return False
        want_e = expand_reference(y, x, pre, comb)
        if got_e is None or not torch.equal(got_e.view(torch.int16), want_e.view(torch.int16)):
            return False
    return True


def lanes_usable() -> bool:
    """Whether the compiled collapse / expand give the reference's bits here: a library that builds and a
    probe that agreed."""
    return _lanes() is not None and _lanes_probe()

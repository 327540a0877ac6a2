"""Batch-invariant products: the one fp32 product of the model (`fp32_linear`) and what a batched decode of
many sequences uses where torch's own kernel would make a row's sums depend on how many rows share the call.

MKL's fp32 GEMM does not give a row the same sums whatever rows share the call. Measured (1 thread, the
pinned profile, K 32-1024, N 2-4096): one row always takes a matrix-vector kernel of its own; on an AMD
EPYC Zen 4 (family 25 model 17, AVX-512, MKL 2024.2, 2026-12) two and three rows take yet another, while
every count from 4 to 40 agrees row for row. So the model computes every fp32 product through
`fp32_linear`, which runs a product of 2 or 3 rows inside a 4-row one: then every product of two or more
rows gives each row the sums of the many-row kernel, on every CPU whose GEMM probe passes
(orchestrator/numerics_probe.py). One row stays a matrix-vector product (the conformance vectors' decode
steps are), except where `fp32_rows_free` says MKL's strict mode makes it agree with the rest.

A batched decode's lone-row products go through `rowwise_linear`, equal to row-by-row `fp32_linear` bit for
bit (tests/model/test_batched.py checks it on fresh inputs). The bf16 linears are row-invariant as they are
(checked there too); the block-scaled FP8/FP4 GEMMs (kernels/formats/weights.py) run every product of
fewer than GEMM_MIN_ROWS rows, one row included, inside a GEMM_MIN_ROWS-row one: their fp32 block sums of
32 FP8 products are exact mostly, so a one-row product seldom differs from a stacked row (on the Zen 4, 283
of 16000 one-row blocks did, and a batched decode of v41-tiny drifted from the lone one), and the vectors
still match bitwise with it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

# the row count from which MKL's fp32 GEMM computes every row alike (see the module docstring); the
# block-scaled FP8/FP4 GEMMs of kernels/formats pad their small products to it too
from kernels import GEMM_MIN_ROWS, gemv_order_takes, one_row_products, wide_fp32

__all__ = [
    "GEMM_MIN_ROWS",
    "fp32_linear",
    "fp32_rows_free",
    "mkl_strict_mode",
    "rows_apart",
    "rowwise_linear",
    "set_fp32_rows_free",
    "stacked_fp32_linear",
]

# torch's CPU bmm runs products of fewer multiply-adds than this per matrix with a plain loop of its own,
# not MKL (ATen's bmm_out_or_baddbmm_: contraction * rows * cols < 400; 1024 keeps a margin), so a bmm of
# one-row problems reproduces a one-row product only above it (measured: K=96, N=2 differs).
_BMM_OWN_LOOP_BELOW = 1024


def mkl_strict_mode(environ: Mapping[str, str] | None = None) -> bool:
    """Whether MKL_CBWR (default: this process's) asks for MKL's strict CNR mode."""
    value = (os.environ if environ is None else environ).get("MKL_CBWR", "")
    return value.upper().replace(" ", "").endswith(",STRICT")


# Whether one row too may run inside a many-row product here: under MKL's strict CNR mode (the `strict`
# numerics path) one row padded to GEMM_MIN_ROWS has the sums every stacked row has (its GEMM probe checks 1
# to 96 rows against 128, and 1 against 2 threads; orchestrator/numerics_probe.py), so a batched decode
# stacks its sequences' rows into one plain product (faster, too). Elsewhere (the portable path) a lone
# row keeps the matrix-vector kernel of the conformance vectors, which the bmm of one-row problems in
# `rowwise_linear` reproduces there. It follows the mode MKL computes in, read from the environment MKL
# reads once (configure_torch sets it again from the same reading, whatever the cpu path): under strict
# MKL the bmm of one-row problems does NOT give a lone row's sums (a batched decode of v41-tiny then left
# the serial one at its 3rd token on an Intel Xeon with AMX), so a `native` command run in a process whose
# MKL is strict must keep stacking rows.
_FP32_ROWS_FREE = mkl_strict_mode()


def set_fp32_rows_free(rows_free: bool) -> None:
    """Declare whether fp32 products are row- and thread-invariant in this process (see above)."""
    global _FP32_ROWS_FREE
    _FP32_ROWS_FREE = bool(rows_free)


def fp32_rows_free() -> bool:
    """Whether one row's fp32 product runs padded, as stacked rows do, so a plain product over stacked
    rows equals each row's lone `fp32_linear`."""
    return _FP32_ROWS_FREE


def rows_apart(x: torch.Tensor) -> torch.Tensor:
    """x [..., k] as a view whose rows lie apart in memory, so that an elementwise op computes each row
    exactly as it would a lone row.

    torch's CPU elementwise loops run full SIMD blocks (2 x 8 floats) vectorized and the remainder of a
    contiguous run with the scalar function, and the two disagree in the last bit for transcendental ops
    (sigmoid, exp). A lone row of k = 4 mixes is all remainder; the same row inside a contiguous batch
    lands in a vectorized block. With the rows apart, the op's contiguous run is one row, as it is alone.
    """
    k = x.size(-1)
    buf = x.new_empty(*x.shape[:-1], k + 1)
    buf[..., :k] = x
    return buf[..., :k]


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T in fp32, every row with the sums of the many-row GEMM -> [..., N]: a
    product of fewer than GEMM_MIN_ROWS rows runs padded with zero rows (one row only where rows are free;
    elsewhere it stays the matrix-vector product the conformance vectors' decode steps have)."""
    k = x.size(-1)
    m = x.numel() // k if k else 0
    if m >= GEMM_MIN_ROWS or m == 0 or (m == 1 and not _FP32_ROWS_FREE):
        return F.linear(x, weight)
    padded = x.new_zeros(GEMM_MIN_ROWS, k)
    padded[:m] = x.reshape(m, k)
    return F.linear(padded, weight)[:m].view(*x.shape[:-1], weight.size(0))


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T with every row computed as a lone row's product (`fp32_linear` of one
    row) -> [..., N]."""
    if _FP32_ROWS_FREE:
        return fp32_linear(x, weight)
    lead = x.shape[:-1]
    k, n = x.size(-1), weight.size(0)
    if k * n < _BMM_OWN_LOOP_BELOW or gemv_order_takes(k, n):
        # a tiny product (the MoE gate of few experts): torch's bmm would not run MKL's kernel; each row its
        # own one-row product, all in one call (kernels.one_row_products: the loop over rows compiled).
        # Or a shape whose one-row products kernels.one_row_products computes all at once in MKL's
        # matrix-vector order (session 34: the head of 46 rows 2.4x, the mHC mixes 1.5x faster than bmm)
        return one_row_products(x.reshape(-1, k), weight).view(*lead, n)
    rows = x.reshape(-1, 1, x.size(-1))  # [M, 1, K]
    out = torch.bmm(rows, weight.t().unsqueeze(0).expand(rows.size(0), -1, -1))  # [M, 1, N]
    return out.view(*lead, weight.size(0))


# The row counts at which `_stacks_freely` compares a stacked product with products of two rows: the
# smallest plain product, odd and SIMD-unaligned counts, and the sizes a batched prefill's stack reaches
# (a step's budget of 512 prompt rows plus the decoder's window rows; 1536 keeps a margin).
_STACK_CHECK_ROWS = (4, 5, 24, 97, 256, 513, 1536)


@functools.lru_cache(maxsize=64)
def _stacks_freely(k: int, n: int, threads: int) -> bool:
    """Whether, in this process (at `threads` intra-op threads), a plain fp32 product of many rows gives
    every row the sums of a small product (`fp32_linear` of two rows) for weights [n, k]: checked on
    wide-range values at several row counts (`_STACK_CHECK_ROWS`) the first time a shape is asked for.
    The numerics probe checks 2-16 rows against 40; this checks the larger stacks of a batched prefill
    too. Where it fails, `stacked_fp32_linear` runs one product per sequence, as the lone passes do."""
    gen = torch.Generator().manual_seed(20261205 + 7919 * k + n)
    # wide-range values (kernels.wide_fp32; kernels/bf16_gemm has the bf16 twin)
    weight = wide_fp32(gen, n, k)
    x = wide_fp32(gen, max(_STACK_CHECK_ROWS), k)
    with torch.inference_mode():
        for m in _STACK_CHECK_ROWS:
            rows = x[:m]
            pairs = torch.cat([fp32_linear(rows[i : i + 2], weight) for i in range(0, m - m % 2, 2)])
            if not torch.equal(F.linear(rows, weight)[: pairs.size(0)], pairs):
                return False
    return True


def stacked_fp32_linear(x: torch.Tensor, weight: torch.Tensor, runs: Sequence[int]) -> torch.Tensor:
    """x [S, K] fp32 rows of N sequences one after another (sequence i: runs[i] rows) @ weight[N_out, K]^T
    -> [S, N_out], each sequence's rows bit for bit its own `fp32_linear` of runs[i] rows, in as few
    products as that allows.

    A product of two or more rows gives each row the sums of the many-row kernel (`fp32_linear` pads
    two and three rows to GEMM_MIN_ROWS), so the rows of every sequence of two or more rows go in one
    product over the stack, where `_stacks_freely` found that true for this shape and thread count. A
    sequence of one row keeps its own one-row product (a matrix-vector kernel of its own, except where
    `fp32_rows_free`). Elsewhere, one product per sequence.

    Raises:
        ValueError: runs that do not add up to the rows of x.
    """
    if x.dim() != 2 or sum(runs) != x.size(0):
        raise ValueError(f"runs {list(runs)} must add up to the rows of a 2-D x, got {tuple(x.shape)}")
    k, n = x.size(1), weight.size(0)
    if _FP32_ROWS_FREE:
        return fp32_linear(x, weight)  # every row count, one row included, has the stacked rows' sums
    # (a stack larger than the first-use check covered runs per sequence)
    if (
        any(t > 1 for t in runs)
        and len(runs) > 1
        and x.size(0) <= max(_STACK_CHECK_ROWS)
        and _stacks_freely(k, n, torch.get_num_threads())
    ):
        out = fp32_linear(x, weight)
        at = 0
        for t in runs:
            if t == 1:
                out[at : at + 1] = fp32_linear(x[at : at + 1], weight)
            at += t
        return out
    out = x.new_empty(x.size(0), n)
    at = 0
    for t in runs:
        out[at : at + t] = fp32_linear(x[at : at + t], weight)
        at += t
    return out

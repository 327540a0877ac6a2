"""Batch-invariant products: what a batched decode of many sequences uses where torch's own kernel would
make a row's sums depend on how many rows share the call.

On this project's CPUs (MKL under the pinned profile) an fp32 `F.linear` of M rows reduces differently
for M = 1 (a matrix-vector kernel) than for M > 1, so a sequence decoded among others would drift from
the same sequence decoded alone. A batched matmul of M one-row problems runs the one-row kernel per row:
`rowwise_linear` equals row-by-row `F.linear` bit for bit (tests/model/test_batched.py checks it on
fresh inputs). The bf16 and block-scaled FP8/FP4 linears are row-invariant as they are (checked there
too), so only the fp32 products go through here.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

__all__ = [
    "blocks_apart",
    "blockwise_linear",
    "fp32_rows_free",
    "rows_apart",
    "rowwise_linear",
    "set_fp32_rows_free",
]

# Whether this process's fp32 GEMM gives every row the sums of a one-row product whatever rows share the
# call and whatever the thread count: MKL's strict CNR mode (the `strict` numerics path, whose GEMM probe
# checks 1 to 16 rows against 40 and 1 against 2 threads; orchestrator/numerics_probe.py). Then one plain
# F.linear over all rows IS the lone rows' products, and the batched paths use it (it is also faster).
# Elsewhere (MKL's plain AVX2 branch) a one-row product runs a matrix-vector kernel of its own, which the
# bmm of one-row problems below reproduces. configure_torch sets it from the cpu path; the default reads
# the environment MKL read at start.
_FP32_ROWS_FREE = os.environ.get("MKL_CBWR", "").upper().replace(" ", "").endswith(",STRICT")


def set_fp32_rows_free(rows_free: bool) -> None:
    """Declare whether fp32 products are row- and thread-invariant in this process (see above)."""
    global _FP32_ROWS_FREE
    _FP32_ROWS_FREE = bool(rows_free)


def fp32_rows_free() -> bool:
    """Whether a plain fp32 F.linear over stacked rows equals each row's lone product here."""
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


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T with every row computed as a one-row product -> [..., N]."""
    if _FP32_ROWS_FREE:
        return F.linear(x, weight)
    lead = x.shape[:-1]
    rows = x.reshape(-1, 1, x.size(-1))  # [M, 1, K]
    out = torch.bmm(rows, weight.t().unsqueeze(0).expand(rows.size(0), -1, -1))  # [M, 1, N]
    return out.view(*lead, weight.size(0))


def blocks_apart(x: torch.Tensor) -> torch.Tensor:
    """x [G, ...] as a view whose G blocks (all of x[g]) each lie contiguous and apart from the others, so
    that an elementwise op computes each block exactly as it would the lone tensor x[g:g+1].

    The `rows_apart` of a batched prefill: a lone pass of T rows runs its elementwise op over one
    contiguous run of T * k values (SIMD body, then the scalar tail); G sequences of T rows stacked
    contiguous would shift where the body ends. With the blocks apart, each block is its own run.
    """
    g, shape = x.size(0), x.shape[1:]
    n = x[0].numel()
    buf = x.new_empty(g, n + 1)
    buf[:, :n] = x.reshape(g, n)
    return buf[:, :n].view(g, *shape)


def blockwise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [G, T, K] @ weight[N, K]^T with each block x[g] computed as its own T-row product -> [G, T, N]
    (what a lone pass of T rows computes; `rowwise_linear` is the T = 1 case)."""
    if _FP32_ROWS_FREE:
        return F.linear(x, weight)
    return torch.bmm(x, weight.t().unsqueeze(0).expand(x.size(0), -1, -1))

"""The mHC mixes of a batched prefill's ragged stack (N sequences of T_i rows each, consecutive along one
axis) in one pass over all rows, each sequence's coefficients bit for bit those of its lone `Block._mixes`.

Knows nothing of attention or states. Three kinds of op are in the mixes:
- row-wise exact ops (the mean square, products and divisions, the Sinkhorn sums over 4 lanes) give the
  same bits whatever the other rows: they run over the stack as they are;
- the fp32 product of the raw mixes reduces differently for different numbers of rows M below
  GEMM_MIN_ROWS: each sequence gets its own product's sums (`invariant.stacked_fp32_linear`: one product
  over the stack where checked exact, one-row sequences apart);
- the transcendental ops (sigmoid, exp) run in torch's CPU elementwise loop, which computes whole SIMD
  steps of a contiguous run vectorized and the rest of the run with the scalar function, and the two
  differ in the last bit (measured: sigmoid on this project's VMs). `lone_runs` computes each element as
  its sequence's lone run has it: vectorized when it lies in a whole step of that run, else scalar.
  rsqrt is not among them: both of its paths are a correctly rounded square root and then a correctly
  rounded division (ATen's `Vectorized::rsqrt` and its scalar `1 / std::sqrt`), so the same bits
  wherever an element lies; `decode_many`'s mixes and every RMSNorm already run it over stacked rows, and
  tests/model/test_batched_prefill.py checks the two paths on wide-range values (until session 34 it went
  through `lone_runs` too, "for safety": about 10 dispatched ops a mix, two mixes a layer).
tests/model/test_batched_prefill.py compares them with each sequence's lone ops on fresh random ragged
rows, at 1 and 2 threads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from kernels import sinkhorn
from model.invariant import stacked_fp32_linear

__all__ = ["SIMD_STEP", "lone_runs", "ragged_mixes"]

# floats per vectorized step of torch's CPU elementwise loop under the portable profile (AVX2: 2 x 8)
SIMD_STEP = 16
# from this many elements on, torch splits an elementwise op between threads (at::internal::GRAIN_SIZE),
# and each thread's part gets a scalar tail of its own
_GRAIN = 32768


def lone_runs(
    op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, runs: Sequence[int]
) -> torch.Tensor:
    """op(x) for x [S, ...] whose rows are N sequences' rows one after another (sequence i: runs[i] rows),
    every element as `op` computes it in the lone contiguous run of its sequence's rows.

    In a lone run of L elements, those before L - L % SIMD_STEP are vectorized and the rest scalar. Here
    every element is computed vectorized (one contiguous buffer padded to whole steps, in calls too short
    to be split between threads), and the scalar ones are computed again apart (runs of one element).
    A sequence whose lone run is long enough that torch would split it between threads makes the whole
    call run each sequence's op on its own rows instead (that is its lone call).
    """
    per_row = x[0].numel() if x.size(0) else 0
    if sum(runs) != x.size(0):
        raise ValueError(f"runs {list(runs)} must add up to the {x.size(0)} rows of x")
    if torch.get_num_threads() > 1 and any(t * per_row >= _GRAIN for t in runs):
        at, parts = 0, []
        for t in runs:
            parts.append(op(x[at : at + t].contiguous()))
            at += t
        return torch.cat(parts)
    flat = x.reshape(-1)
    n = flat.numel()
    pad = -n % SIMD_STEP
    # one contiguous buffer of whole SIMD steps (the padding's zeros are computed and dropped)
    buf = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat
    piece = (_GRAIN - 1) // SIMD_STEP * SIMD_STEP
    if buf.numel() <= piece:
        out = op(buf)
    else:
        out = torch.cat([op(buf[i : i + piece]) for i in range(0, buf.numel(), piece)])
    if pad:
        out = out[:n]
    tail, twice = _tail_elements(tuple(runs), per_row, x.device)
    if tail.numel():
        # each scalar element gathered twice over: as [m, 2] its first column is m runs of one element,
        # which the op computes with the scalar function (`invariant.rows_apart` lays them out the same)
        alone = flat[twice].view(-1, 2)[:, :1]
        out[tail] = op(alone).view(-1)
    return out.view(x.shape)


@functools.lru_cache(maxsize=64)
def _tail_elements(
    runs: tuple[int, ...], per_row: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat indices of the elements each run's lone call computes with the scalar function (past its
    last whole SIMD step), and the same indices each given twice in a row (`lone_runs` gathers them
    apart). Cached: a pass asks for the same runs in every layer of a half (read-only)."""
    tails: list[int] = []
    at = 0
    for t in runs:
        length = t * per_row
        tails += range(at + length - length % SIMD_STEP, at + length)
        at += length
    # normal tensors even when first asked for in inference mode, so that a later caller outside it may
    # use them as indices that autograd saves
    with torch.inference_mode(False):
        tail = torch.tensor(tails, dtype=torch.int64, device=device)
        return tail, tail.repeat_interleave(2)


def ragged_mixes(block, h: torch.Tensor, runs: Sequence[int], which: str) -> tuple[torch.Tensor, ...]:
    """`Block._mixes` of every sequence of the stack h [1, S, hc, d] (sequence i: runs[i] rows in order)
    -> pre [1, S, hc], post [1, S, hc], comb [1, S, hc, hc] fp32, each sequence's rows bit for bit its
    lone call's. which: "attn" or "ffn" (the block's coefficients)."""
    fn, scale, base = (getattr(block, f"hc_{which}_{k}") for k in ("fn", "scale", "base"))
    hc, eps, iters = block.hc, block.hc_eps, block.sinkhorn_iters
    flat = h[0].flatten(1).float()  # [S, hc*d]
    rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + block.norm_eps)  # row-wise exact (above)
    # each sequence's rows as its own T_i-row product, in one product over the stack where that is exact;
    # never as [G, T] blocks of equal-length sequences in one batched product: that equals the lone
    # products under MKL_CBWR=AVX2 at one thread, but not at two (MKL splits a lone product of 24 rows,
    # K = 1024, between the threads) nor under AVX2,STRICT for one-row blocks (measured on the Intel VM)
    m = stacked_fp32_linear(flat, fn, runs) * rsqrt  # [S, (2 + hc) * hc]
    # `mhc.split_sinkhorn` op for op, its transcendental ops as each sequence's lone run has them
    scale, base = scale.float(), base.float()
    pre = lone_runs(torch.sigmoid, m[..., :hc] * scale[0] + base[:hc], runs) + eps
    post = 2 * lone_runs(torch.sigmoid, m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc], runs)
    comb = (m[..., 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    comb = sinkhorn(lone_runs(torch.exp, comb - comb.amax(dim=-1, keepdim=True), runs), iters, eps)
    return pre.unsqueeze(0), post.unsqueeze(0), comb.unsqueeze(0)

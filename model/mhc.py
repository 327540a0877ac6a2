"""Single-pass manifold-constrained hyper-connections (mHC): the 4-lane residual stream's mixing coefficients.

Knows nothing of attention or MoE: it turns a sub-block's input lanes into pre/post/comb coefficients
(Sinkhorn-normalized comb), collapses lanes into a sublayer input and expands a sublayer output back
(V41_SPEC §8). Op order copies the official V4.1 `Block.hc_*` and the kernel port's `hc_split_sinkhorn`.
"""

from __future__ import annotations

import torch

from kernels import mhc_collapse, mhc_expand, sinkhorn
from model.invariant import rows_apart


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def split_sinkhorn(
    mixes: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc: int,
    iters: int,
    eps: float,
    *,
    rowwise: bool = False,
    apart=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split raw mixes into pre, post and a Sinkhorn-normalized comb, all fp32.

    Args:
        mixes: [..., (2 + hc) * hc] fp32.
        scale: [3] fp32 (pre, post, comb); base: [(2 + hc) * hc] fp32.
        rowwise: compute each row's transcendental ops as a lone row would (a batched decode of many
            sequences; see `model.invariant.rows_apart`).
        apart: the layout function applied before each transcendental op instead (a batched prefill
            passes `model.invariant.blocks_apart` for [G, T, ...] blocks of G sequences of T rows).

    Returns:
        pre [..., hc], post [..., hc], comb [..., hc, hc] (rows: input lane i, columns: output lane j).
    """
    m = mixes.float()
    scale = scale.float()
    base = base.float()
    if apart is None:
        apart = rows_apart if rowwise else _same
    pre = torch.sigmoid(apart(m[..., :hc] * scale[0] + base[:hc])) + eps
    post = 2 * torch.sigmoid(apart(m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc]))
    comb = (m[..., 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    comb = torch.exp(apart(comb - comb.amax(dim=-1, keepdim=True)))
    # the official loop, bit for bit; compiled on CPU (kernels/mhc: some 120 tiny ops otherwise)
    return pre, post, sinkhorn(comb, iters, eps)


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Weighted lane sum: x [B, T, hc, d] bf16, pre [B, T, hc] fp32 -> [B, T, d] in x's dtype (the
    official op order, compiled on CPU: kernels/mhc)."""
    return mhc_collapse(x, pre)


def expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """new_lane_j = post_j * y + sum_i comb[i, j] * lane_i (the official op order, compiled on CPU:
    kernels/mhc).

    Args:
        y: [B, T, d] bf16 sublayer output; residual: [B, T, hc, d] bf16 lanes;
        post: [B, T, hc] fp32; comb: [B, T, hc, hc] fp32.

    Returns:
        [B, T, hc, d] in y's dtype.
    """
    return mhc_expand(y, residual, post, comb)


def identity_pre(batch: int, rows: int, hc: int, device: torch.device) -> torch.Tensor:
    """The first block's pending pre-mix: one-hot on lane 0, [B, T, hc] fp32."""
    pre = torch.zeros(batch, rows, hc, dtype=torch.float32, device=device)
    pre[:, :, 0] = 1.0
    return pre

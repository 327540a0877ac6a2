"""The mHC ops of kernels/mhc as torch ops, op for op the official V4.1 `hc_split_sinkhorn` loop (after its
exp) and `Block.hc_pre` / `hc_post`'s lane sums: the slow twins of the compiled CPU code, and the path off
the CPU and under autograd."""

from __future__ import annotations

import torch

__all__ = ["collapse_reference", "expand_reference", "sinkhorn_reference"]


def sinkhorn_reference(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [..., hc, hc] fp32 (positive: the exp of the centred mixes) -> the normalized comb: rows divided
    by their sums plus eps, columns by their sums plus eps, then `iters - 1` more rounds of both with eps
    added to the sums (none for iters <= 1)."""
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def collapse_reference(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Weighted lane sum: x [B, T, hc, d] bf16, pre [B, T, hc] fp32 -> [B, T, d] in x's dtype."""
    return torch.sum(pre.unsqueeze(-1) * x.float(), dim=2).to(x.dtype)


def expand_reference(
    y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """new_lane_j = post_j * y + sum_i comb[i, j] * lane_i: y [B, T, d] bf16, residual [B, T, hc, d] bf16,
    post [B, T, hc] fp32, comb [B, T, hc, hc] fp32 -> [B, T, hc, d] in y's dtype."""
    mixed = torch.sum(comb.unsqueeze(-1) * residual.unsqueeze(-2), dim=2)  # [B, T, hc, d]
    return (post.unsqueeze(-1) * y.unsqueeze(-2) + mixed).type_as(y)

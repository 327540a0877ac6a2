"""The Sinkhorn normalization of the mHC comb, as torch ops: the official V4.1 `hc_split_sinkhorn` loop after
its exp (the slow twin of cpu_sinkhorn.c, and the path off the CPU)."""

from __future__ import annotations

import torch

__all__ = ["sinkhorn_reference"]


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

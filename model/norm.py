"""RMSNorm as the reference computes it: fp32 statistics, fp32 weight product, cast back to the input
dtype."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps) over the last axis.

    Args:
        dim: normalized width; the weight is bf16 [dim] as in the checkpoint.
        eps: added to the mean square.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] (bf16 in the model) -> same shape and dtype."""
        dtype = x.dtype
        xf = x.float()
        var = xf.square().mean(-1, keepdim=True)
        return (self.weight * (xf * torch.rsqrt(var + self.eps))).to(dtype)

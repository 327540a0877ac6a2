"""The mHC ops a pass runs on every row: the Sinkhorn normalization of the comb (`sinkhorn`, after
`model.mhc.split_sinkhorn`'s exp) and the lane mixes around each sub-block (`collapse`, `expand`). Each
equals its torch reference (reference.py) bit for bit and runs the compiled CPU path of cpu.py where it
can (CPU tensors of up to 4 lanes, a library that builds and a probe that agreed); elsewhere, and
wherever autograd records, the reference.
"""

from __future__ import annotations

import torch

from kernels.mhc.cpu import collapse_cpu, covers, expand_cpu, lanes_cover, lanes_usable, sinkhorn_cpu, usable
from kernels.mhc.reference import collapse_reference, expand_reference, sinkhorn_reference

__all__ = ["collapse", "collapse_reference", "expand", "expand_reference", "sinkhorn", "sinkhorn_reference"]


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [..., hc, hc] fp32, positive -> normalized (see `sinkhorn_reference`; its first round runs
    whatever iters says, as the official loop's does).

    Raises:
        ValueError: comb not [..., hc, hc] fp32.
    """
    iters = max(1, iters)
    if comb.dim() < 2 or comb.size(-1) != comb.size(-2) or comb.dtype != torch.float32:
        raise ValueError(f"comb must be [..., hc, hc] fp32, got {tuple(comb.shape)} {comb.dtype}")
    if (
        comb.device.type == "cpu"
        and covers(comb.size(-1))
        and not (torch.is_grad_enabled() and comb.requires_grad)
        and usable()
    ):
        out = sinkhorn_cpu(comb, iters, eps)
        if out is not None:
            return out
    return sinkhorn_reference(comb, iters, eps)


def _recording(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Weighted lane sum (see `collapse_reference`): x [..., hc, d] bf16, pre [..., hc] fp32 -> [..., d]."""
    if (
        x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and pre.dtype == torch.float32
        and x.dim() >= 2
        and pre.shape == x.shape[:-1]
        and lanes_cover(x.size(-2), x.size(-1))
        and not _recording(x, pre)
        and lanes_usable()
    ):
        out = collapse_cpu(x, pre)
        if out is not None:
            return out
    return collapse_reference(x, pre)


def expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The lanes after a sub-block (see `expand_reference`): y [..., d] bf16, residual [..., hc, d] bf16,
    post [..., hc] fp32, comb [..., hc, hc] fp32 -> [..., hc, d] bf16."""
    if (
        residual.device.type == "cpu"
        and y.dtype == residual.dtype == torch.bfloat16
        and post.dtype == comb.dtype == torch.float32
        and residual.dim() >= 2
        and y.shape == residual.shape[:-2] + residual.shape[-1:]
        and post.shape == residual.shape[:-1]
        and comb.shape == residual.shape[:-1] + residual.shape[-2:-1]
        and lanes_cover(residual.size(-2), residual.size(-1))
        and not _recording(y, residual, post, comb)
        and lanes_usable()
    ):
        out = expand_cpu(y, residual, post, comb)
        if out is not None:
            return out
    return expand_reference(y, residual, post, comb)

"""The Sinkhorn normalization of the mHC comb (`model.mhc.split_sinkhorn` after its exp): `sinkhorn(comb,
iters, eps)` equals the torch reference (reference.py) bit for bit and runs the compiled CPU path of cpu.py
where it can (fp32 CPU tensors of up to 4 lanes, a library that builds and a probe that agreed);
elsewhere, and wherever autograd records, the reference.
"""

from __future__ import annotations

import torch

from kernels.mhc.cpu import covers, sinkhorn_cpu, usable
from kernels.mhc.reference import sinkhorn_reference

__all__ = ["sinkhorn", "sinkhorn_reference"]


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

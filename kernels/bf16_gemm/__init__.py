"""bf16 linears on CPU: `bf16_linear(x, weight, packed)` equals `F.linear(x, weight)` bit for bit and takes
the compiled path of cpu.py where it reproduces torch (two or more rows, K a multiple of 16, the pinned
numerics profiles); everywhere else it is F.linear. A caller that keeps its weight packed
(`pack_bf16_weight`, fp32 once) saves the conversion torch repeats on every call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.bf16_gemm.cpu import covers, linear_packed, usable
from kernels.bf16_gemm.cpu import pack_weight as pack_bf16_weight

__all__ = ["bf16_linear", "bf16_linear_takes_compiled_path", "pack_bf16_weight"]


def bf16_linear_takes_compiled_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `bf16_linear(x, weight, ...)` runs the compiled path (else it is F.linear). Never where
    autograd records the product (training): the compiled path has no backward.

    Asked before every bf16 product of the model (about 90 a decode step), so the cheap tensor
    properties go first (`is_cpu`, not `device.type`, which builds a device object a call): 3.4 -> 1.8 us
    a call of 42 rows here (AMD EPYC)."""
    k = x.size(-1) if x.dim() else 0
    # one row (a lone decode's products, the commonest refusal) goes to ATen's gemv: covers() below
    if k == 0 or x.numel() < 2 * k:
        return False
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or not (x.is_cpu and weight.is_cpu):
        return False
    if weight.dim() != 2 or weight.size(1) != k:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return covers(x.numel() // k, k) and usable()


def bf16_linear(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None, *, checked: bool = False
) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T, bf16 -> [..., N] bf16, bitwise F.linear(x, weight).

    Args:
        packed: `pack_bf16_weight(weight)`, when the caller keeps it (else it is packed here).
        checked: the caller has just had `bf16_linear_takes_compiled_path(x, weight)` say yes (a caller
            that packs its weight only for the compiled path asks first; the check is not run twice).
    """
    if not checked and not bf16_linear_takes_compiled_path(x, weight):
        return F.linear(x, weight)
    k, n = weight.size(1), weight.size(0)
    if packed is None:
        packed = pack_bf16_weight(weight)
    out = linear_packed(x.reshape(-1, k).contiguous(), packed, n)
    if out is None:
        return F.linear(x, weight)
    return out.view(*x.shape[:-1], n)

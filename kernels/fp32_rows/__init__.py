"""One-row fp32 products of many rows: `one_row_products(x, w)` equals `[F.linear(row, w) for row in x]`
stacked, bit for bit, in one call (the compiled path) or in that very loop (the slow twin, wherever the
compiled path is not available or its first-use probe disagrees). kernels/README.md says why.

Knows nothing of models.
"""

from __future__ import annotations

import torch

from kernels.fp32_rows import cpu
from kernels.fp32_rows.cpu import rows_linear_reference as one_row_products_reference
from kernels.fp32_rows.cpu import wide_fp32

__all__ = ["one_row_products", "one_row_products_reference", "wide_fp32"]


def one_row_products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 @ weight [N, K]^T fp32 -> [M, N], every row bit for bit its own one-row `F.linear`.

    Raises:
        ValueError: x or weight not 2-D fp32, or their K differ.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.size(1) != weight.size(1):
        raise ValueError(f"one_row_products needs x [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")  # fmt: skip
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        raise ValueError(f"one_row_products takes fp32, got {x.dtype} and {weight.dtype}")
    # rows read where they lie (a copy would move them, and the twin reads them in place)
    compiled = (
        x.size(0) > 0
        and x.is_contiguous()
        and weight.is_contiguous()
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and cpu.agrees(x.size(1), weight.size(0), torch.get_num_threads())
    )
    if not compiled:
        return one_row_products_reference(x, weight)
    return cpu.rows_linear(x, weight)

"""One-row fp32 products of many rows: `one_row_products(x, w)` equals `[F.linear(row, w) for row in x]`
stacked, bit for bit, in one call (a compiled path) or in that very loop (the slow twin, wherever no
compiled path is available or their first-use probes disagree). The compiled paths, in the order tried:
all rows at once in the order of MKL's matrix-vector kernel, with the weight packed once and kept
(`gemv_order_takes`); one BLAS call per row from C. kernels/README.md says why.

Knows nothing of models.
"""

from __future__ import annotations

import threading
import weakref

import torch

from kernels.fp32_rows import cpu
from kernels.fp32_rows.cpu import rows_linear_reference as one_row_products_reference
from kernels.fp32_rows.cpu import wide_fp32

__all__ = ["gemv_order_takes", "one_row_products", "one_row_products_reference", "wide_fp32"]

# id(weight) -> (a weak reference to it, its version, its packed blocks): a served model's weights are
# packed once, on first use, and the entry goes with the weight (by id: a tensor's == is elementwise, so
# it cannot key a WeakKeyDictionary)
_PACKED: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}
_PACKED_LOCK = threading.Lock()


def gemv_order_takes(k: int, n: int) -> bool:
    """Whether `one_row_products` computes weights [n, k] all rows at once in MKL's matrix-vector order
    in this process (a compiler, K the order was read for, and the shape's first-use probe agreed): much
    cheaper than one BLAS call per row, which reads the whole weight for every row."""
    return cpu.agrees_gemv_order(k, n, torch.get_num_threads())


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """`cpu.pack_gemv_weight(weight)`, kept beside the weight while its version holds (an inference tensor,
    which keeps no version, is packed on every call)."""
    if weight.is_inference():
        return cpu.pack_gemv_weight(weight)
    version = weight._version
    key = id(weight)
    with _PACKED_LOCK:
        kept = _PACKED.get(key)
    if kept is not None and kept[0]() is weight and kept[1] == version:
        return kept[2]
    # packed outside inference mode, so that the kept tensor may serve calls under either mode
    with torch.inference_mode(False), torch.no_grad():
        packed = cpu.pack_gemv_weight(weight.detach())

    def forget(ref: weakref.ref[torch.Tensor]) -> None:
        with _PACKED_LOCK:
            if key in _PACKED and _PACKED[key][0] is ref:
                del _PACKED[key]

    with _PACKED_LOCK:
        _PACKED[key] = (weakref.ref(weight, forget), version, packed)
    return packed


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
    compiled = (
        x.size(0) > 0
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )
    k, n = x.size(1), weight.size(0)
    if compiled and gemv_order_takes(k, n):
        # computed from the values alone (where the rows lie in memory changes nothing in MKL's order,
        # tests/kernels/test_fp32_rows.py checks), so a copy of strided rows will do
        return cpu.gemv_order_linear(x.contiguous(), _packed(weight), n)
    # rows read where they lie (a copy would move them, and the twin reads them in place)
    if (
        compiled
        and x.is_contiguous()
        and weight.is_contiguous()
        and cpu.agrees(k, n, torch.get_num_threads())
    ):
        return cpu.rows_linear(x, weight)
    return one_row_products_reference(x, weight)

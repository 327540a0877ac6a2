"""Sparse attention over gathered KV rows with a per-head sink: `sparse_attn(..., backend=)`.

`reference.py` is the ground truth (bitwise equal to the official CPU port); `cpu.py` is its compiled
CPU twin (bitwise equal to it; the torch backend takes it wherever its first-use probe finds torch's
products summed in its order); `triton.py` is the CUDA kernel (also runs under TRITON_INTERPRET=1),
equal to the reference up to exp/summation order.
"""

from __future__ import annotations

import torch

from kernels.sparse_attn.cpu import sparse_attn_compiled
from kernels.sparse_attn.reference import SPARSE_ATTN_BLOCK, exp_alone, sparse_attn_reference

__all__ = ["SPARSE_ATTN_BLOCK", "sparse_attn"]

_BACKENDS = ("torch", "triton")


def _check_inputs(
    q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, topk_idxs: torch.Tensor
) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, D], got shape {tuple(q.shape)}")
    b, t, h, d = q.shape
    if kv.dim() != 3 or kv.size(0) != b or kv.size(2) != d:
        raise ValueError(f"kv must be [B={b}, N, D={d}], got shape {tuple(kv.shape)}")
    if attn_sink.shape != (h,):
        raise ValueError(f"attn_sink must be [H={h}], got shape {tuple(attn_sink.shape)}")
    if topk_idxs.dim() != 3 or topk_idxs.shape[:2] != (b, t):
        raise ValueError(f"topk_idxs must be [B={b}, T={t}, K], got shape {tuple(topk_idxs.shape)}")
    if topk_idxs.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_idxs must be int32 or int64, got {topk_idxs.dtype}")
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        raise ValueError(f"q and kv must be bf16, got q {q.dtype}, kv {kv.dtype}")
    devices = {q.device, kv.device, attn_sink.device, topk_idxs.device}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(str(x) for x in devices)}")


def sparse_attn(
    q: torch.Tensor,
    kv: torch.Tensor,
    attn_sink: torch.Tensor,
    topk_idxs: torch.Tensor,
    softmax_scale: float,
    *,
    backend: str = "torch",
    rowwise: bool = False,
) -> torch.Tensor:
    """One softmax per (query, head) over the indexed KV rows plus a sink that only adds to the denominator.

    Args:
        q: [B, T, H, D] bf16 queries.
        kv: [B, N, D] bf16 rows (K = V), e.g. the concatenated [window ; compressed] rows.
        attn_sink: [H] fp32 sink logits, used unscaled.
        topk_idxs: [B, T, K] int32 (or int64) ids into kv's N axis, each in [-1, N); -1 = no entry.
            Order inside a row only matters for bitwise parity (blocks of 64, running-max rounding).
        softmax_scale: factor on q·k, usually D^-0.5.
        backend: "torch" (reference, any device) or "triton" (CUDA, or CPU under TRITON_INTERPRET=1).
        rowwise: every batch row bit-identical to the same call on that row alone (B independent
            sequences stacked by a batched decode). The Triton kernel is row-wise by construction (one
            program per query row and head); the torch reference keeps its exponentials row-apart.

    Returns:
        o: [B, T, H, D] bf16; zeros where a row has no valid index.

    Raises:
        ValueError: bad shapes, dtypes, mixed devices or an unknown backend.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    _check_inputs(q, kv, attn_sink, topk_idxs)
    if backend == "torch":
        # the compiled loop where this process's torch sums as it does (its first-use probe), else the
        # reference's ops; the same bits either way
        exp = exp_alone if rowwise and q.size(0) > 1 else torch.exp
        out = sparse_attn_compiled(q, kv, attn_sink, topk_idxs, softmax_scale, exp)
        if out is not None:
            return out
        return sparse_attn_reference(q, kv, attn_sink, topk_idxs, softmax_scale, rowwise=rowwise)
    # imported here so that importing kernels never imports triton (the interpreter flag must be set first)
    from kernels.sparse_attn.triton import sparse_attn_triton

    return sparse_attn_triton(q, kv, attn_sink, topk_idxs, softmax_scale)

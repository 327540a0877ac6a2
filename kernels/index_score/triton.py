"""Triton kernel for lightning-indexer scores, sum_h w·relu(q·k), with the visibility/candidate masks fused.

Rounds to bf16 where the reference does (each q·k, each w·relu product, the head sum), so it differs
from `reference.py` only by fp32 summation order (q·k over D, and the head sum), which moves a score by
at most one bf16 ulp and rarely. Knows nothing of how the scores are selected.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# tl.dot needs at least 16 rows and columns.
_MIN_BLOCK = 16


def _interpreting() -> bool:
    """True under TRITON_INTERPRET=1, whose tl.dot multiplies bf16 bit patterns as integers (triton 3.9)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _round_to_bf16(x):
    """fp32 -> nearest-even bf16 value, still held in fp32.

    Done on the bits because the interpreter truncates fp32 -> bf16 casts; after this the cast is exact.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def index_score_fwd_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    vis_ptr,
    cand_ptr,
    out_ptr,
    T,
    N,
    H,
    D,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_wb,
    stride_wt,
    stride_vb,
    stride_cb,
    stride_ct,
    stride_ob,
    stride_ot,
    HAS_VISIBLE: tl.constexpr,
    HAS_CANDIDATES: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One program per (batch, block of query rows, block of keys); loops over the H index heads.

    DOT_FP32 feeds tl.dot fp32 copies of the bf16 operands (exact either way); only the interpreter needs it.
    """
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_t = offs_t < T
    mask_n = offs_n < N
    mask_d = offs_d < D

    k_ptrs = k_ptr + b * stride_kb + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :]
    k = tl.load(k_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BN, BD] bf16
    if DOT_FP32:
        k = k.to(tl.float32)
    q_rows = q_ptr + b * stride_qb + offs_t[:, None].to(tl.int64) * stride_qt + offs_d[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for h in range(0, H):
        q_ptrs = q_rows + h * stride_qh
        q = tl.load(q_ptrs, mask=mask_t[:, None] & mask_d[None, :], other=0.0)  # [BT, BD] bf16
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # [BT, BN] fp32
        s = tl.maximum(_round_to_bf16(s), 0.0)
        w = tl.load(w_ptr + b * stride_wb + offs_t * stride_wt + h, mask=mask_t, other=0.0).to(tl.float32)
        acc += _round_to_bf16(s * w[:, None])
    scores = _round_to_bf16(acc)
    if HAS_VISIBLE:
        vis = tl.load(vis_ptr + b * stride_vb + offs_t, mask=mask_t, other=0)
        scores = tl.where(offs_n[None, :] >= vis[:, None], float("-inf"), scores)
    if HAS_CANDIDATES:
        c_ptrs = cand_ptr + b * stride_cb + offs_t[:, None].to(tl.int64) * stride_ct + offs_n[None, :]
        cand = tl.load(c_ptrs, mask=mask_t[:, None] & mask_n[None, :], other=0)
        scores = tl.where(cand != 0, scores, float("-inf"))
    o_ptrs = out_ptr + b * stride_ob + offs_t[:, None].to(tl.int64) * stride_ot + offs_n[None, :]
    tl.store(o_ptrs, scores.to(tl.bfloat16), mask=mask_t[:, None] & mask_n[None, :])


def index_score_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    *,
    visible: torch.Tensor | None = None,
    candidates: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch `index_score_fwd_kernel`; inputs as `kernels.index_score.index_score` (validated there).

    Args:
        out: optional preallocated [B, T, N] bf16 contiguous output (tests pass one prefilled with NaN).

    Returns:
        [B, T, N] bf16.
    """
    b, t, h, d = q.shape
    n = k.size(1)
    # the kernel assumes unit stride on the last axis of every tensor
    q = q.contiguous()
    k = k.contiguous()
    weights = weights.contiguous()
    if out is None:
        out = torch.empty(b, t, n, dtype=torch.bfloat16, device=q.device)
    if b * t * n == 0:
        return out
    # a [T] count is shared by every batch row: stride 0 over B
    vis = visible.to(torch.int32).contiguous() if visible is not None else out
    stride_vb = (vis.stride(0) if vis.dim() == 2 else 0) if visible is not None else 0
    # bool is loaded as bytes; a uint8 view avoids the interpreter's bool handling
    cand = candidates.contiguous().view(torch.uint8) if candidates is not None else out
    block_t = max(_MIN_BLOCK, min(64, triton.next_power_of_2(t)))
    block_n = 64
    block_d = max(_MIN_BLOCK, triton.next_power_of_2(d))
    grid = (triton.cdiv(t, block_t), triton.cdiv(n, block_n), b)
    index_score_fwd_kernel[grid](
        q,
        k,
        weights,
        vis,
        cand,
        out,
        t,
        n,
        h,
        d,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        weights.stride(0),
        weights.stride(1),
        stride_vb,
        cand.stride(0) if candidates is not None else 0,
        cand.stride(1) if candidates is not None else 0,
        out.stride(0),
        out.stride(1),
        HAS_VISIBLE=visible is not None,
        HAS_CANDIDATES=candidates is not None,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_FP32=_interpreting(),
    )
    return out

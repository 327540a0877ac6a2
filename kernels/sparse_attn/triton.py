"""Triton kernel for sparse attention over gathered KV rows with a per-head sink.

Same math as `reference.py` (online softmax over blocks of 64 indices, running max from -1e30, fp32
denominator, probabilities rounded to bf16 against the running max before P·V, sink in the
denominator only). Not bitwise: exp and the dot-product summation order differ. Knows nothing of
where the rows come from. Anatomy follows the Triton fused-attention tutorial: jit kernel + launcher.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.sparse_attn.reference import RUNNING_MAX_INIT, SPARSE_ATTN_BLOCK

# tl.dot needs at least 16 rows; smaller head counts are padded and masked.
_MIN_BLOCK_H = 16


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
def sparse_attn_fwd_kernel(
    q_ptr,
    kv_ptr,
    sink_ptr,
    idx_ptr,
    o_ptr,
    T,
    H,
    K,
    D,
    scale,
    running_max_init,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kvb,
    stride_kvn,
    stride_ib,
    stride_it,
    stride_ob,
    stride_ot,
    stride_oh,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One program per (query row, block of heads); walks the row's K indices in blocks of BLOCK_K.

    DOT_FP32 feeds tl.dot fp32 copies of the bf16 operands (exact either way: the products of bf16
    values are exact in fp32); only the interpreter needs it.
    """
    pid_bt = tl.program_id(0)
    pid_h = tl.program_id(1)
    b = (pid_bt // T).to(tl.int64)
    t = (pid_bt % T).to(tl.int64)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, BLOCK_K)
    mask_h = offs_h < H
    mask_d = offs_d < D

    q_ptrs = q_ptr + b * stride_qb + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BH, BD] bf16

    running_max = tl.zeros([BLOCK_H], tl.float32) + running_max_init
    sum_exp = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(0, K, BLOCK_K):
        kk = start + offs_k
        idx = tl.load(idx_ptr + b * stride_ib + t * stride_it + kk, mask=kk < K, other=-1).to(tl.int64)
        valid = idx >= 0
        rows = tl.where(valid, idx, 0)
        kv_ptrs = kv_ptr + b * stride_kvb + rows[:, None] * stride_kvn + offs_d[None, :]
        kv = tl.load(kv_ptrs, mask=valid[:, None] & mask_d[None, :], other=0.0)  # [BK, BD] bf16
        if DOT_FP32:
            scores = tl.dot(q.to(tl.float32), tl.trans(kv.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(kv))  # [BH, BK] fp32
        scores = tl.where(valid[None, :], scores, float("-inf")) * scale
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp(running_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        sum_exp = sum_exp * rescale + tl.sum(p, axis=1)
        p_bf16 = _round_to_bf16(p).to(tl.bfloat16)
        if DOT_FP32:
            pv = tl.dot(p_bf16.to(tl.float32), kv.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p_bf16, kv)  # [BH, BD] fp32
        acc = acc * rescale[:, None] + pv
        running_max = new_max

    sink = tl.load(sink_ptr + offs_h, mask=mask_h, other=0.0)
    sum_exp = sum_exp + tl.exp(sink - running_max)
    out = _round_to_bf16(acc / sum_exp[:, None]).to(tl.bfloat16)
    o_ptrs = o_ptr + b * stride_ob + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out, mask=mask_h[:, None] & mask_d[None, :])


def sparse_attn_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    attn_sink: torch.Tensor,
    topk_idxs: torch.Tensor,
    softmax_scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch `sparse_attn_fwd_kernel`; inputs as `kernels.sparse_attn.sparse_attn` (validated there).

    Args:
        out: optional preallocated [B, T, H, D] bf16 contiguous output (tests pass one prefilled with NaN).

    Returns:
        [B, T, H, D] bf16.
    """
    b, t, h, d = q.shape
    k = topk_idxs.size(-1)
    # the kernel assumes unit stride on the last axis of every tensor
    q = q.contiguous()
    kv = kv.contiguous()
    topk_idxs = topk_idxs.contiguous()
    sink = attn_sink.float().contiguous()
    if out is None:
        out = torch.empty(b, t, h, d, dtype=torch.bfloat16, device=q.device)
    block_h = max(_MIN_BLOCK_H, min(64, triton.next_power_of_2(h)))
    block_d = max(16, triton.next_power_of_2(d))
    # a 64-row bf16 KV tile is 64 KiB at D = 512: fewer pipeline stages keep it inside shared memory
    num_stages, num_warps = (2, 4) if block_d <= 128 else (1, 8)
    grid = (b * t, triton.cdiv(h, block_h))
    if b * t == 0:
        return out
    sparse_attn_fwd_kernel[grid](
        q,
        kv,
        sink,
        topk_idxs,
        out,
        t,
        h,
        k,
        d,
        softmax_scale,
        RUNNING_MAX_INIT,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        kv.stride(0),
        kv.stride(1),
        topk_idxs.stride(0),
        topk_idxs.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        BLOCK_H=block_h,
        BLOCK_K=SPARSE_ATTN_BLOCK,
        BLOCK_D=block_d,
        DOT_FP32=_interpreting(),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out

"""Sparse single-KV-head attention with an attention sink, in pure torch: the ground truth for the kernel.

Knows nothing of windows, indexers or caches: it attends each query row over the KV rows its index
list names. Numerics follow the official V4.1 kernel as ported to CPU by the reference
(tenstorrent/tt-metal `deepseek_v41/kernel_cpu.py`, upstream `inference/kernel.py` lines 296-403):
online softmax over blocks of 64 indices with the running max starting at -1e30, fp32 denominator,
probabilities rounded to bf16 (relative to the running max) before P·V, and the sink in the
denominator only. Every step here is the same torch op on the same shapes and dtypes as that port, so
on CPU the output is bitwise equal to it.
"""

from __future__ import annotations

import torch

# Indices are consumed in blocks of this many; the bf16 rounding of the probabilities happens
# against the running max of the blocks seen so far, so the block size is part of the numerics.
SPARSE_ATTN_BLOCK = 64

# The kernel's finite lower bound for the running max: a row whose indices are all -1 then gives
# exp(-inf - (-1e30)) = 0 instead of NaN.
RUNNING_MAX_INIT = -1e30

# torch splits an elementwise op across threads only from this many elements on (at::internal::GRAIN_SIZE)
_TORCH_GRAIN = 32768


def exp_alone(x: torch.Tensor) -> torch.Tensor:
    """exp of x [B, ...] with every batch row computed exactly as a lone [1, ...] call computes it.

    torch's CPU loop runs whole SIMD blocks vectorized and the rest of a contiguous run with the scalar
    function, and for transcendental ops the two may disagree in the last bit; which elements fall in the
    tail depends on where the run starts and ends. A lone row is one run; here each row is kept apart in
    memory (its own run), and calls stay below the size from which torch splits a run between threads,
    unless one row alone is that large (then it splits as the lone call does).
    """
    b = x.size(0)
    if b == 1:
        return torch.exp(x)
    flat = x.reshape(b, -1)
    n = flat.size(1)
    buf = flat.new_empty(b, n + 1)
    buf[:, :n] = flat
    rows = buf[:, :n]
    per_call = max(1, (_TORCH_GRAIN - 1) // max(n, 1))
    if b <= per_call:
        out = torch.exp(rows)
    else:
        out = torch.cat([torch.exp(rows[i : i + per_call]) for i in range(0, b, per_call)])
    return out.reshape(x.shape)


def sparse_attn_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    attn_sink: torch.Tensor,
    topk_idxs: torch.Tensor,
    softmax_scale: float,
    *,
    rowwise: bool = False,
) -> torch.Tensor:
    """o[b,t,h] = sum_j exp(s_j - M) v_j / (sum_j exp(s_j - M) + exp(sink_h - M)), s_j = scale * q·kv_j.

    Args:
        q: [B, T, H, D] bf16 queries.
        kv: [B, N, D] bf16 rows; K and V are the same vector.
        attn_sink: [H] fp32 raw sink logit per head (not scaled).
        topk_idxs: [B, T, K] int32 or int64 row ids into kv's N axis; -1 means no entry.
        softmax_scale: multiplies q·k (the head_dim^-0.5 of the model).
        rowwise: compute each batch row b exactly as the call on row b alone would (`exp_alone`), so
            that stacking independent sequences (a batched decode) cannot change a bit of any of them.
            The products are per-row batched matmuls and the other elementwise ops are exactly rounded,
            so only the exponentials need it. For B = 1 both settings are the same computation.

    Returns:
        [B, T, H, D] bf16. A row whose indices are all -1 (or K = 0) is all zeros.
    """
    b, t, h, d = q.shape
    k = topk_idxs.size(-1)
    device = q.device
    scale = torch.tensor(softmax_scale, dtype=torch.float32, device=device)
    qf = q.float()
    acc_o = torch.zeros(b, t, h, d, dtype=torch.float32, device=device)
    sum_exp = torch.zeros(b, t, h, dtype=torch.float32, device=device)
    running_max = torch.full((b, t, h), RUNNING_MAX_INIT, dtype=torch.float32, device=device)
    batch = torch.arange(b, device=device).view(b, 1, 1)
    exp = exp_alone if rowwise else torch.exp
    for start in range(0, k, SPARSE_ATTN_BLOCK):
        idxs = topk_idxs[:, :, start : start + SPARSE_ATTN_BLOCK].long()
        valid = idxs != -1
        # invalid slots gather row 0 and are zeroed by the multiply, exactly as the reference port does;
        # gathering before the (exact) fp32 conversion touches only the picked rows, not all N
        kv_blk = kv[batch, idxs.clamp_min(0)].float() * valid.unsqueeze(-1)  # [B, T, blk, D]
        scores = torch.einsum("bmhd,bmkd->bmhk", qf, kv_blk)
        # the mask comes before the scale, as in the kernel: -inf * scale stays -inf
        scores = torch.where(valid.unsqueeze(2), scores, -torch.inf) * scale
        prev_max = running_max
        running_max = torch.maximum(prev_max, scores.amax(dim=-1))
        rescale = exp(prev_max - running_max)
        p = exp(scores - running_max.unsqueeze(-1))
        sum_exp = sum_exp * rescale + p.sum(dim=-1)
        p_bf16 = p.to(torch.bfloat16)
        acc_o = acc_o * rescale.unsqueeze(-1) + torch.einsum("bmhk,bmkd->bmhd", p_bf16.float(), kv_blk)
    sum_exp = sum_exp + exp(attn_sink.float() - running_max)
    return (acc_o / sum_exp.unsqueeze(-1)).to(torch.bfloat16)

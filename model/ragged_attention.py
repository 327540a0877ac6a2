"""The sparse attention of N sequences' rows stacked along one axis (sequence i: T_i consecutive rows, all
with the same number of indices), each row bit for bit what `kernels.sparse_attn` (torch backend)
gives for its sequence's lone call [1, T_i, H, D].

Knows nothing of windows or selection: the caller hands it the stacked queries, one KV buffer holding
every sequence's rows and index rows into it. `kernels/sparse_attn/reference.py` op for op (the same ops
on the same per-row shapes: the products are per-row batched matmuls of [H, D] by [D, block], the
reductions run per row, the other elementwise ops are exactly rounded), except its exponentials: a lone
call runs each over its [T_i, H, ...] values as one contiguous run, whose SIMD body and scalar tail
depend on T_i, so here they go through `ragged_mixes.lone_runs` with each sequence's rows as one run.
tests/model/test_batched_prefill.py compares it with each sequence's lone call on fresh random inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels import sparse_attn_compiled
from model.ragged_mixes import lone_runs

__all__ = ["ragged_sparse_attn"]

# the reference's block of indices and its finite start of the running max (kernels/sparse_attn)
_BLOCK = 64
_RUNNING_MAX_INIT = -1e30


def ragged_sparse_attn(
    q: torch.Tensor,
    kv: torch.Tensor,
    attn_sink: torch.Tensor,
    topk_idxs: torch.Tensor,
    softmax_scale: float,
    runs: Sequence[int],
) -> torch.Tensor:
    """q [1, S, H, D] bf16 rows of N sequences (runs[i] rows each, in order), kv [1, L, D] bf16, attn_sink
    [H] fp32, topk_idxs [1, S, K] int ids into kv (-1 none) -> o [1, S, H, D] bf16, each sequence's rows
    as `sparse_attn(q_i, kv, attn_sink, idxs_i, softmax_scale)` of its rows alone gives them.

    Raises:
        ValueError: a batch other than 1, or runs that do not add up to S.
    """
    b, t, h, d = q.shape
    if b != 1 or kv.size(0) != 1 or topk_idxs.shape[:2] != (1, t):
        raise ValueError(f"ragged_sparse_attn takes one stacked batch row, got q {tuple(q.shape)}, "
                         f"kv {tuple(kv.shape)}, ids {tuple(topk_idxs.shape)}")  # fmt: skip
    if sum(runs) != t:
        raise ValueError(f"runs {list(runs)} must add up to the {t} rows of q")

    def exp(x: torch.Tensor) -> torch.Tensor:  # [1, S, ...]: each sequence's rows one lone run
        return lone_runs(torch.exp, x[0], runs).unsqueeze(0)

    # the compiled loop (kernels/sparse_attn/cpu.py) where it runs: the same ops but for the two products,
    # which read the indexed rows where they lie; else the loop below
    compiled = sparse_attn_compiled(q, kv, attn_sink, topk_idxs, softmax_scale, exp)
    if compiled is not None:
        return compiled

    k = topk_idxs.size(-1)
    device = q.device
    scale = torch.tensor(softmax_scale, dtype=torch.float32, device=device)
    qf = q.float()
    # the buffer converted once, then gathered: the same values as converting the gathered rows (bf16 ->
    # fp32 is exact), and the buffer (each sequence's ring, rows and selections) is never longer than the
    # rows gathered from it ([S, K] of them)
    kvf = kv[0].float()
    acc_o = torch.zeros(b, t, h, d, dtype=torch.float32, device=device)
    sum_exp = torch.zeros(b, t, h, dtype=torch.float32, device=device)
    running_max = torch.full((b, t, h), _RUNNING_MAX_INIT, dtype=torch.float32, device=device)
    for start in range(0, k, _BLOCK):
        idxs = topk_idxs[0, :, start : start + _BLOCK].long()  # [S, blk]
        valid = idxs != -1
        # index_select gathers whole rows (advanced indexing copies element by element: several times
        # slower on these shapes, the same values); the multiply in place, as the reference's
        kv_blk = kvf.index_select(0, idxs.clamp_min(0).view(-1)).view(*idxs.shape, d)
        kv_blk = kv_blk.mul_(valid.unsqueeze(-1)).unsqueeze(0)  # [1, S, blk, D]
        scores = torch.einsum("bmhd,bmkd->bmhk", qf, kv_blk)
        scores = torch.where(valid.unsqueeze(0).unsqueeze(2), scores, -torch.inf) * scale
        prev_max = running_max
        running_max = torch.maximum(prev_max, scores.amax(dim=-1))
        rescale = exp(prev_max - running_max)
        p = exp(scores - running_max.unsqueeze(-1))
        sum_exp = sum_exp * rescale + p.sum(dim=-1)
        p_bf16 = p.to(torch.bfloat16)
        acc_o = acc_o * rescale.unsqueeze(-1) + torch.einsum("bmhk,bmkd->bmhd", p_bf16.float(), kv_blk)
    sum_exp = sum_exp + exp(attn_sink.float() - running_max)
    return (acc_o / sum_exp.unsqueeze(-1)).to(torch.bfloat16)

"""Lightning-indexer scores in pure torch: the ground truth for the kernel.

Knows nothing of RoPE, quantization or selection: it scores already prepared index queries against
index keys. Op order and dtypes copy the official V4.1 `Indexer.forward` (tenstorrent/tt-metal
`deepseek_v41/model.py`): a bf16 einsum of q and k, relu, times the bf16 head weights, summed over
heads in bf16; then invisible positions and, for a Reindex layer, non-candidates are set to -inf.
Same ops on the same shapes give bitwise-equal scores on CPU.
"""

from __future__ import annotations

import torch


def visibility_mask(visible: torch.Tensor, n: int) -> torch.Tensor:
    """True where position j is out of reach: j >= visible[..., t].

    Args:
        visible: [T] or [B, T] integer count of entries each query row may see.
        n: width of the score rows.

    Returns:
        [T, N] or [B, T, N] bool, broadcastable against scores [B, T, N].
    """
    return torch.arange(n, device=visible.device) >= visible.unsqueeze(-1)


def index_score_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    *,
    visible: torch.Tensor | None = None,
    candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """score[b,t,n] = sum_h weights[b,t,h] * relu(q[b,t,h] · k[b,n]), rounded to bf16 at every step.

    Args:
        q: [B, T, H, D] bf16 index queries (RoPE'd and MXFP4-QDQ'd by the caller).
        k: [B, N, D] bf16 index keys.
        weights: [B, T, H] bf16 head weights, already multiplied by D^-0.5 * H^-0.5.
        visible: optional [T] or [B, T] int; positions n >= visible[b, t] become -inf.
        candidates: optional [B, T, N] bool; positions where it is False become -inf.

    Returns:
        [B, T, N] bf16 scores.
    """
    scores = torch.einsum("bshd,btd->bsht", q, k)  # [B, T, H, N] bf16
    scores = (scores.relu_() * weights.unsqueeze(-1)).sum(dim=2)  # [B, T, N]
    if visible is not None:
        scores.masked_fill_(visibility_mask(visible, scores.size(-1)), -torch.inf)
    if candidates is not None:
        scores = scores.masked_fill(~candidates, -torch.inf)
    return scores


def index_score_at_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scores `index_score_reference` gives at the named key ids only: [B, T, P], -inf at id -1.

    The same bf16 products, relu, head weighting and bf16 head sum per (row, key) as the full scan, on
    keys gathered per row, so out[b,t,p] equals full[b,t,ids[b,t,p]] bit for bit (tested) while the
    cost is O(P) per row instead of O(N).

    Args:
        q: [B, T, H, D] bf16; k: [B, N, D] bf16; weights: [B, T, H] bf16 (as `index_score_reference`).
        ids: [B, T, P] int64 key ids in [-1, N); -1 marks an empty slot.
        visible: optional [T] or [B, T] int; ids >= visible[b, t] become -inf.

    Returns:
        [B, T, P] bf16 scores.
    """
    b = q.size(0)
    batch = torch.arange(b, device=q.device).view(b, 1, 1)
    keys = k[batch, ids.clamp_min(0)]  # [B, T, P, D]
    scores = torch.einsum("bshd,bspd->bshp", q, keys)  # [B, T, H, P] bf16
    scores = (scores.relu_() * weights.unsqueeze(-1)).sum(dim=2)  # [B, T, P]
    masked = ids < 0
    if visible is not None:
        masked = masked | (ids >= visible.unsqueeze(-1))
    return scores.masked_fill_(masked, -torch.inf)

"""Top-k selection of indexer scores into sorted entry ids, with the reference's or a deterministic tie rule.

Knows nothing of offsets into a concatenated KV buffer or of how scores were made. The reference
selection is the official V4.1 `Indexer.forward` tail (tenstorrent/tt-metal `deepseek_v41/model.py`):
torch `topk(sorted=False)`, then the picked ids sorted ascending, then ids the row cannot see -> -1.
"""

from __future__ import annotations

import torch

TIE_BREAKS = ("reference", "deterministic")


def check_tie_break(tie_break: str) -> None:
    if tie_break not in TIE_BREAKS:
        raise ValueError(f"tie_break must be one of {TIE_BREAKS}, got {tie_break!r}")


def top_indices(scores: torch.Tensor, k: int, *, tie_break: str, reference_sorted: bool) -> torch.Tensor:
    """Ids of the k best entries along the last axis, int64, in no guaranteed order.

    "reference" makes exactly the torch call the reference makes (`reference_sorted` is its `sorted=`
    argument): on CPU its choice among tied scores is implementation-defined and depends on the
    tensor's shape, so parity needs the same call on a same-shaped tensor. "deterministic" ranks by
    higher score, then lower id, and so depends only on the row's values.
    """
    if tie_break == "reference":
        return scores.topk(k, dim=-1, sorted=reference_sorted).indices
    # a stable descending sort keeps equal scores in id order
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def as_row_counts(visible: int | torch.Tensor, scores: torch.Tensor) -> int | torch.Tensor:
    """Visible counts shaped to broadcast against [B, T, X] tensors: an int, or [1|B, T, 1] int64."""
    if isinstance(visible, int):
        return visible
    b, t = scores.shape[:2]
    if visible.dtype.is_floating_point or visible.dtype == torch.bool:
        raise ValueError(f"visible must be an int or an integer tensor, got {visible.dtype}")
    if visible.shape == (t,):
        return visible.long().view(1, t, 1)
    if visible.shape == (b, t):
        return visible.long().view(b, t, 1)
    raise ValueError(f"visible must be an int, [T={t}] or [B={b}, T={t}], got shape {tuple(visible.shape)}")


def select_topk(
    scores: torch.Tensor,
    k: int,
    visible: int | torch.Tensor,
    *,
    tie_break: str = "reference",
    drop_neg_inf: bool = True,
) -> torch.Tensor:
    """The k best-scoring entry ids per row, ascending, with -1 for picks the row may not use.

    Args:
        scores: [B, T, N] indexer scores (bf16 in the model), -inf where masked.
        k: picks per row, 0 <= k <= N; the reference uses min(index_topk, entries at chunk end) for every row.
        visible: int, [T] or [B, T] count of entries each row can see; ids >= it become -1.
        tie_break: "reference" (torch CPU `topk(sorted=False)`, as the official code) or
            "deterministic" (higher score, then lower id; independent of N, T and chunking).
        drop_neg_inf: also turn picks whose score is -inf into -1 (V41_SPEC §4.2 deliberate deviation:
            the reference would keep them as valid ids; no conformance row picks one).

    Returns:
        [B, T, k] int32: valid ids ascending, then the -1s. No offset is added.

    Raises:
        ValueError: scores not 3-D, k out of range, bad visible shape/dtype or unknown tie_break.
    """
    check_tie_break(tie_break)
    if scores.dim() != 3:
        raise ValueError(f"scores must be [B, T, N], got shape {tuple(scores.shape)}")
    n = scores.size(-1)
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, N={n}], got {k}")
    counts = as_row_counts(visible, scores)
    idxs = top_indices(scores, k, tie_break=tie_break, reference_sorted=False).sort(dim=-1).values
    unusable = idxs >= counts
    if drop_neg_inf:
        unusable = unusable | (scores.gather(-1, idxs) == -torch.inf)
        # the dropped ids may sit between kept ones: push them to the end, keeping kept ids ascending
        idxs = torch.where(unusable, n, idxs).sort(dim=-1).values
        unusable = idxs == n
    return torch.where(unusable, -1, idxs).int()

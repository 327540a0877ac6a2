"""Level 1 of the hierarchical indexer: the candidate pool of score blocks each query row may pick from.

Knows nothing of layers: it turns one score row per query into a boolean mask over entries. Follows
the official V4.1 `select_candidate_blocks` (tenstorrent/tt-metal `deepseek_v41/model.py`): block score
= max over the block (the tail padded with -inf), the block holding the row's newest visible entry
pinned to +inf, the top blocks kept unless they scored -inf, expanded back to entries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.topk import cpu as _cpu
from kernels.topk.selection import as_row_counts, check_tie_break, top_indices


def block_scores(scores: torch.Tensor, visible: int | torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-block max of the scores with the newest visible block pinned to +inf.

    Args:
        scores: [B, T, N] scores, -inf where the row cannot see.
        visible: int, [T] or [B, T] entries visible per row; a row with 0 pins nothing.
        block_size: entries per block (P).

    Returns:
        [B, T, ceil(N / P)] in scores' dtype.
    """
    counts = as_row_counts(visible, scores)
    n = scores.size(-1)
    padded = F.pad(scores, (0, -n % block_size), value=-torch.inf)
    per_block = padded.unflatten(-1, (-1, block_size)).amax(dim=-1)  # [B, T, nblocks]
    newest = (counts - 1) // block_size
    return per_block.masked_fill(torch.arange(per_block.size(-1), device=scores.device) == newest, torch.inf)


def candidate_blocks(
    scores: torch.Tensor,
    visible: int | torch.Tensor,
    block_size: int,
    topk_blocks: int,
    *,
    tie_break: str = "reference",
) -> torch.Tensor:
    """Boolean candidate mask: entries inside the row's `topk_blocks` best blocks.

    Args:
        scores: [B, T, N] the candidate source's scores (bf16 in the model), -inf where invisible.
        visible: int, [T] or [B, T] entries each row can see.
        block_size: entries per block (P), >= 1.
        topk_blocks: blocks kept per row (fewer if the row has fewer), >= 1.
        tie_break: "reference" (torch CPU `topk`, sorted, as the official code) or "deterministic"
            (higher block score, then lower block id).

    Returns:
        [B, T, N] bool; False outside the kept blocks and in every block that scored -inf.

    Raises:
        ValueError: scores not 3-D, non-positive block_size/topk_blocks, bad visible or tie_break.
    """
    check_tie_break(tie_break)
    if scores.dim() != 3:
        raise ValueError(f"scores must be [B, T, N], got shape {tuple(scores.shape)}")
    if block_size < 1 or topk_blocks < 1:
        raise ValueError(f"block_size and topk_blocks must be >= 1, got {block_size}, {topk_blocks}")
    n = scores.size(-1)
    per_block = block_scores(scores, visible, block_size)
    kept = min(topk_blocks, per_block.size(-1))
    picks = top_indices(per_block, kept, tie_break=tie_break, reference_sorted=True)
    reachable = per_block.gather(-1, picks) > -torch.inf
    keep = torch.zeros_like(per_block, dtype=torch.bool).scatter_(-1, picks, reachable)
    return keep.repeat_interleave(block_size, dim=-1)[..., :n]


def pool_ids(pool: torch.Tensor, size: int) -> torch.Tensor:
    """The entry ids of a candidate mask, ascending per row, padded with -1: [B, T, size] int64.

    O(N) per row (one `topk` on distinct keys: candidates first, then lower id).

    Args:
        pool: [B, T, N] bool, at most `size` True per row (a `candidate_blocks` mask holds at most
            topk_blocks * block_size).
        size: slots per row, >= 1.

    Raises:
        ValueError: a row holding more than `size` candidates, or size < 1.
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    n = pool.size(-1)
    counts = pool.sum(dim=-1)
    if counts.numel() and int(counts.max()) > size:
        raise ValueError(f"a row holds {int(counts.max())} candidates, more than size={size}")
    take = min(size, n)
    reversed_ids = torch.arange(n - 1, -1, -1, device=pool.device, dtype=torch.int64) + (2**32 - n)
    picks = ((pool.long() << 32) | reversed_ids).topk(take, dim=-1, sorted=False).indices
    # non-candidates picked to fill a short row sort behind the candidates, then become -1
    picks = torch.where(pool.gather(-1, picks), picks, n).sort(dim=-1).values
    picks = torch.where(picks == n, -1, picks)
    if take < size:
        picks = F.pad(picks, (0, size - take), value=-1)
    return picks


def candidate_ids(
    scores: torch.Tensor,
    visible: int | torch.Tensor,
    block_size: int,
    topk_blocks: int,
    *,
    compiled: bool = True,
) -> torch.Tensor:
    """The deterministic candidate pool as entry ids: `pool_ids(candidate_blocks(..., tie_break=
    "deterministic"), topk_blocks * block_size)` bit for bit (tested), without building the [B, T, N] mask.

    Args:
        scores, visible, block_size, topk_blocks: as `candidate_blocks`.
        compiled: pick the blocks with the compiled selection (kernels/topk/cpu.py: the deterministic
            rule, blocks not above -inf dropped) where it applies (bf16 CPU scores, at most 2^16 blocks) and
            builds; False: the torch ops (its slow twin). The same ids either way.

    Returns:
        [B, T, topk_blocks * block_size] int64: the kept blocks' entry ids ascending, then -1.

    Raises:
        ValueError: as `candidate_blocks`.
    """
    if scores.dim() != 3:
        raise ValueError(f"scores must be [B, T, N], got shape {tuple(scores.shape)}")
    if block_size < 1 or topk_blocks < 1:
        raise ValueError(f"block_size and topk_blocks must be >= 1, got {block_size}, {topk_blocks}")
    n = scores.size(-1)
    per_block = block_scores(scores, visible, block_size)  # [B, T, nblocks]
    nblocks = per_block.size(-1)
    kept = min(topk_blocks, nblocks)
    blocks = None
    if compiled and _cpu.covers(per_block) and _cpu.usable():
        # the best blocks, those not above -inf (-inf or NaN) as -1 after the kept ones ascending
        picked = _cpu.select_topk_cpu(per_block, kept, nblocks, True, drop_nan=True)
        if picked is not None:
            blocks = picked.long()
            blocks = torch.where(blocks >= 0, blocks, nblocks)  # as the torch ops leave them, below
    if blocks is None:
        picks = top_indices(per_block, kept, tie_break="deterministic", reference_sorted=True)
        reachable = per_block.gather(-1, picks) > -torch.inf
        # kept blocks ascending, unreachable ones (-inf) after them
        blocks = torch.where(reachable, picks, nblocks).sort(dim=-1).values  # [B, T, kept]
    entries = blocks.unsqueeze(-1) * block_size + torch.arange(block_size, device=scores.device)
    entries = entries.flatten(-2)  # [B, T, kept * P]
    # only the last block can run past N, and it sorts last among the kept: the -1s stay at the end
    entries = torch.where(entries >= n, -1, entries)
    size = topk_blocks * block_size
    if entries.size(-1) < size:
        entries = F.pad(entries, (0, size - entries.size(-1)), value=-1)
    return entries

"""Top-k selection of indexer scores into sorted entry ids, with the reference's or a deterministic tie rule.

Knows nothing of offsets into a concatenated KV buffer or of how scores were made. The reference
selection is the official V4.1 `Indexer.forward` tail (tenstorrent/tt-metal `deepseek_v41/model.py`):
torch `topk(sorted=False)`, then the picked ids sorted ascending, then ids the row cannot see -> -1.
"""

from __future__ import annotations

import torch

from kernels.topk import cpu as _cpu

TIE_BREAKS = ("reference", "deterministic")
# +inf's bits in fp32 and bf16 (positive, so already monotone as signed integers)
_F32_INF_BITS = 0x7F800000
_BF16_INF_BITS = 0x7F80


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
    return rank_keys(scores).topk(k, dim=-1, sorted=False).indices


def top_indices_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Slow twin of the deterministic rule (O(N log N) per row): a stable descending sort keeps equal
    scores in id order. Same set of ids as `top_indices(..., tie_break="deterministic")`."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def rank_keys(scores: torch.Tensor) -> torch.Tensor:
    """Distinct integer keys [..., N] ordered as the deterministic rule ranks entries: higher score
    first, then lower id. `topk` on them is O(N) per row and, the keys being distinct, picks exactly the
    ids a stable descending sort puts first.

    The high bits are the score's bits made monotone as signed integers (a negative float's magnitude
    bits flipped), the low bits (2^b - 1 - id). bf16 rows of at most 2^16 entries get int32 keys (16 + 16
    bits), anything else int64 keys from the fp32 value (32 + 32 bits). Scores the sort treats as equal
    are made bit-equal first: -0.0 becomes +0.0, and every NaN gets the largest key (torch's sort puts
    NaN above +inf).

    Args:
        scores: [..., N] bf16 or fp32 (any float dtype that converts to fp32 exactly).

    Returns:
        [..., N] int32 or int64.
    """
    n = scores.size(-1)
    if n > 2**32:
        raise ValueError(f"rank_keys supports rows of at most 2^32 entries, got {n}")
    narrow = scores.dtype == torch.bfloat16 and n <= 2**16
    f = scores if narrow else scores.float()
    shift, sign_mask, inf_bits = (16, 0x7FFF, _BF16_INF_BITS) if narrow else (32, 0x7FFFFFFF, _F32_INF_BITS)
    key_dtype = torch.int32 if narrow else torch.int64
    nan = torch.isnan(f)
    # -0.0 + 0.0 is +0.0 under round-to-nearest; every other value keeps its bits
    bits = (f + 0.0).view(torch.int16 if narrow else torch.int32).to(key_dtype)
    # in place on the one fresh key tensor: a resume's rows x 64K entries made each temporary cost
    flip = bits >> (shift - 1)
    flip &= sign_mask
    bits ^= flip  # monotone: signed-integer order = score order
    # +inf's bits plus one: above every score, as the sort ranks NaN
    bits.masked_fill_(nan, inf_bits + 1)
    bits <<= shift
    bits |= torch.arange(n - 1, -1, -1, device=scores.device, dtype=key_dtype) + (2**shift - n)
    return bits


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
    compiled: bool | None = None,
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
        compiled: the deterministic rule's compiled CPU path (kernels/topk/cpu.py: integer work, the same
            ids) for bf16 CPU scores of at most 2^16 entries; None: wherever it applies and builds; False:
            the torch ops (its slow twin); True: that path or a ValueError.

    Returns:
        [B, T, k] int32: valid ids ascending, then the -1s. No offset is added.

    Raises:
        ValueError: scores not 3-D, k out of range, bad visible shape/dtype, unknown tie_break, or
            compiled=True where the compiled path does not apply.
    """
    check_tie_break(tie_break)
    if scores.dim() != 3:
        raise ValueError(f"scores must be [B, T, N], got shape {tuple(scores.shape)}")
    n = scores.size(-1)
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, N={n}], got {k}")
    counts = as_row_counts(visible, scores)
    applies = tie_break == "deterministic" and _cpu.covers(scores) and _cpu.usable()
    if compiled and not applies:
        raise ValueError(
            "select_topk(compiled=True) needs the deterministic rule, bf16 CPU scores of at most 2^16 "
            f"entries and the compiled library, got {tie_break!r}, {scores.dtype}, {scores.device}, N={n}"
        )
    if applies and compiled is not False:
        picked = _cpu.select_topk_cpu(scores, k, counts, drop_neg_inf)
        if picked is not None:
            return picked
    idxs = top_indices(scores, k, tie_break=tie_break, reference_sorted=False).sort(dim=-1).values
    unusable = idxs >= counts
    if drop_neg_inf:
        unusable = unusable | (scores.gather(-1, idxs) == -torch.inf)
        # the dropped ids may sit between kept ones: push them to the end, keeping kept ids ascending
        idxs = torch.where(unusable, n, idxs).sort(dim=-1).values
        unusable = idxs == n
    return torch.where(unusable, -1, idxs).int()

"""Lightning indexer of an index-source layer: MXFP4 index queries scored against shared index keys, then
top-k (optionally inside the candidate pool of the hierarchical indexer).

Knows nothing of the main attention: it returns selected entry ids; the caller adds its window offset.
Follows the official V4.1 `Indexer` (V41_SPEC §4): index K = k_norm(wk(pre-RoPE latent)), RoPE at the
entry position, MXFP4 QDQ; index Q = wq_b(qr), RoPE, MXFP4 QDQ; score = sum_h w_h relu(q_h . k) in
bf16 with w = weights_proj(x) * D_I^-0.5 * H_I^-0.5; top-k width min(index_topk, entries at the end of the
rows), the same for every row.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import (
    candidate_blocks,
    candidate_ids,
    index_score,
    index_score_at,
    pool_ids,
    qdq_mxfp4,
    quantize_mxfp4,
    select_topk,
)
from model.linear import Linear
from model.norm import RMSNorm
from model.rope import apply_rope


class Indexer(nn.Module):
    """Args: dims from the config; owns_k (this layer is a kv source and makes the index keys)."""

    def __init__(
        self,
        *,
        dim: int,
        q_lora_rank: int,
        head_dim: int,
        n_heads: int,
        index_head_dim: int,
        rope_dim: int,
        topk: int,
        owns_k: bool,
        dense_dtype: str,
        norm_eps: float,
    ):
        super().__init__()
        self.n_heads = n_heads
        self.index_head_dim = index_head_dim
        self.rope_dim = rope_dim
        self.topk = topk
        self.owns_k = owns_k
        self.wq_b = Linear(q_lora_rank, n_heads * index_head_dim, dense_dtype)
        self.weights_proj = Linear(dim, n_heads, "bf16")
        if owns_k:
            self.wk = Linear(head_dim, index_head_dim, "bf16")
            self.k_norm = RMSNorm(index_head_dim, norm_eps)

    def keys(
        self, latent: torch.Tensor, freqs: torch.Tensor, *, backend: str = "torch", quantize: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Index keys of new entries.

        Args:
            latent: [B, G, D] bf16 pre-RoPE compressed latents.
            freqs: [G, rope_dim/2] complex64 rotations at the entries' positions j*m.
            backend: kernels backend of the MXFP4 quantization ("torch" or "triton").
            quantize: False returns the unquantized keys as the first output (quality harness's
                unquantized-cache baseline); the stored form is MXFP4 either way.

        Returns:
            keys [B, G, D_I] bf16 (RoPE'd, MXFP4-QDQ'd), and their stored form: E2M1 codes uint8
            [B, G, D_I/2] and E8M0 scale bytes uint8 [B, G, D_I/32].
        """
        k = self.k_norm(self.wk(latent))
        k = apply_rope(k, freqs, self.rope_dim)
        with torch.no_grad():
            packed, scales = quantize_mxfp4(k.detach(), backend=backend)
        return (qdq_mxfp4(k, backend=backend) if quantize else k), packed, scales

    def select(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        freqs: torch.Tensor,
        index_k: torch.Tensor,
        visible: torch.Tensor,
        *,
        candidate_source: bool,
        candidates: torch.Tensor | None,
        block_size: int,
        topk_blocks: int,
        tie_break: str,
        backend: str = "torch",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Select entries for each query row.

        Args:
            x: [B, T, dim] bf16 attention inputs; qr: [B, T, q_lora_rank] bf16 query latents.
            freqs: [T, rope_dim/2] complex64 rotations at the rows' positions.
            index_k: [B, N, D_I] bf16 keys of every entry visible at the end of the rows.
            visible: [T] int64 entries each row may see ((pos + 1) // m).
            candidate_source: publish the candidate pool (level 1) from these scores.
            candidates: the pool to restrict to (Reindex layers), or None: what a candidate source
                published, a [B, T, N] bool mask (`kernels.candidate_blocks`) or, under the deterministic
                rule, [B, T, topk_blocks * block_size] int64 ids (`kernels.candidate_ids`).
            tie_break: "reference" or "deterministic" (kernels.select_topk).
            backend: kernels backend of the MXFP4 QDQ and the scores ("torch" or "triton"); top-k selection
                has only a torch implementation.

        Returns:
            ids [B, T, K] int32 ascending entry ids, -1 unused; the candidate pool when published: int64
            ids [B, T, topk_blocks * block_size] (ascending, -1 padded) under tie_break="deterministic",
            else the [B, T, N] bool mask.
        """
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.index_head_dim))  # [B, T, H_I, D_I]
        q = apply_rope(q, freqs, self.rope_dim)
        q = qdq_mxfp4(q, backend=backend)
        weights = self.weights_proj(x) * (self.index_head_dim**-0.5 * self.n_heads**-0.5)  # [B, T, H_I]
        k = min(self.topk, index_k.size(1))
        deterministic = tie_break == "deterministic"
        if candidates is not None and not candidate_source and deterministic:
            return self._select_in_pool(q, index_k, weights, visible, candidates, k, block_size * topk_blocks)
        scores = index_score(q, index_k, weights, visible=visible, backend=backend)  # [B, T, N] bf16
        pool = None
        if candidate_source and deterministic:
            # the pool as ids: what the Reindex layers score (no [B, T, N] mask to build and scan)
            pool = candidate_ids(scores, visible, block_size, topk_blocks)
        elif candidate_source:
            pool = candidate_blocks(scores, visible, block_size, topk_blocks, tie_break=tie_break)
        elif candidates is not None:
            scores = scores.masked_fill(~candidates, -torch.inf)
        # the reference keeps -inf picks as valid ids; the deterministic mode drops them (V41_SPEC §4.2)
        ids = select_topk(scores, k, visible, tie_break=tie_break, drop_neg_inf=tie_break != "reference")
        return ids, pool

    @staticmethod
    def _select_in_pool(
        q: torch.Tensor,
        index_k: torch.Tensor,
        weights: torch.Tensor,
        visible: torch.Tensor,
        candidates: torch.Tensor,
        k: int,
        pool_size: int,
    ) -> tuple[torch.Tensor, None]:
        """A Reindex layer's deterministic top-k, scoring only its candidate pool (O(pool) per row).

        Equal bit for bit to the full scan with non-candidates at -inf (tested): the pool's scores are
        the full scan's at those ids, the pool is ascending in id so ranking by (score, pool slot) is
        ranking by (score, id), and -inf picks become -1 in both.

        q [B, T, H_I, D_I], index_k [B, N, D_I], weights [B, T, H_I] bf16; visible [T] int64; candidates
        [B, T, P] int64 ids or [B, T, N] bool -> ids [B, T, k] int32 (ascending, then -1).
        """
        # ids from the candidate source, or a mask (a caller that built one with candidate_blocks)
        ids = candidates if candidates.dtype == torch.int64 else pool_ids(candidates, pool_size)
        scores = index_score_at(q, index_k, weights, ids, visible=visible)  # [B, T, pool_size] bf16
        slots = select_topk(scores, min(k, pool_size), pool_size, tie_break="deterministic")
        picked = torch.where(slots >= 0, ids.gather(-1, slots.long().clamp_min(0)), -1)
        if picked.size(-1) < k:
            picked = torch.nn.functional.pad(picked, (0, k - picked.size(-1)), value=-1)
        return picked.int(), None

"""Indexer.select: a Reindex layer's pool-only scoring against the full scan it replaces (its slow twin)."""

from __future__ import annotations

import pytest
import torch

from kernels import candidate_blocks, index_score, qdq_mxfp4, select_topk
from model import Transformer, apply_rope, init_random, rope_table
from model.train.family import sibling_config


def select_full_scan(indexer, x, qr, freqs, index_k, visible, candidates, tie_break):
    """The slow twin: score every visible key, set non-candidates to -inf, top-k over all N."""
    q = indexer.wq_b(qr).unflatten(-1, (indexer.n_heads, indexer.index_head_dim))
    q = qdq_mxfp4(apply_rope(q, freqs, indexer.rope_dim))
    weights = indexer.weights_proj(x) * (indexer.index_head_dim**-0.5 * indexer.n_heads**-0.5)
    scores = index_score(q, index_k, weights, visible=visible).masked_fill(~candidates, -torch.inf)
    k = min(indexer.topk, index_k.size(1))
    return select_topk(scores, k, visible, tie_break=tie_break, drop_neg_inf=True)


@pytest.mark.parametrize(
    "t_n", [(1, 37), (1, 2000), (63, 150), (7, 9)], ids=["decode", "decode-N2000", "T63", "N9"]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_select_reindex_pool_equals_full_scan(t_n: tuple[int, int], seed: int) -> None:
    cfg = sibling_config("v41-sib-l")
    model = init_random(Transformer(cfg), seed=seed).eval()
    layer = next(i for i in cfg.index_source_layers if cfg.uses_candidates(i))
    indexer = model.layers[layer].attn.indexer
    t, n = t_n
    g = torch.Generator().manual_seed(seed + 10)
    x = torch.randn(1, t, cfg.dim, generator=g).bfloat16()
    qr = torch.randn(1, t, cfg.q_lora_rank, generator=g).bfloat16()
    index_k = qdq_mxfp4(torch.randn(1, n, cfg.index_head_dim, generator=g).bfloat16())
    # the last t rows of a history of n entries (ratio 1): row r sees n - t + r + 1 entries
    visible = torch.arange(n - t + 1, n + 1)
    freqs = rope_table(cfg.rope_head_dim, n + 1, base=cfg.compress_rope_theta)[visible - 1]
    # a candidate pool from coarse scores, so that blocks tie and some rows have few candidates
    coarse = torch.randint(0, 3, (1, t, n), generator=g).bfloat16()
    coarse = coarse.masked_fill(torch.arange(n) >= visible.unsqueeze(-1), -torch.inf)
    bs, tb = cfg.candidate_block_size, cfg.candidate_topk_blocks
    pool = candidate_blocks(coarse, visible, bs, tb, tie_break="deterministic")
    with torch.inference_mode():
        got, published = indexer.select(
            x, qr, freqs, index_k, visible, candidate_source=False, candidates=pool,
            block_size=bs, topk_blocks=tb, tie_break="deterministic",
        )  # fmt: skip
        want = select_full_scan(indexer, x, qr, freqs, index_k, visible, pool, "deterministic")
    assert published is None
    assert got.dtype == torch.int32 and torch.equal(got, want), f"{(got != want).sum().item()} ids differ"


def test_select_candidate_source_publishes_ids_and_reindex_reads_them() -> None:
    cfg = sibling_config("v41-sib-l")
    model = init_random(Transformer(cfg), seed=3).eval()
    src = cfg.candidate_source_layer
    reindex = next(i for i in cfg.index_source_layers if cfg.uses_candidates(i))
    t, n = 5, 300
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, t, cfg.dim, generator=g).bfloat16()
    qr = torch.randn(1, t, cfg.q_lora_rank, generator=g).bfloat16()
    index_k = qdq_mxfp4(torch.randn(1, n, cfg.index_head_dim, generator=g).bfloat16())
    visible = torch.arange(n - t + 1, n + 1)
    freqs = rope_table(cfg.rope_head_dim, n + 1, base=cfg.compress_rope_theta)[visible - 1]
    bs, tb = cfg.candidate_block_size, cfg.candidate_topk_blocks
    kw = dict(block_size=bs, topk_blocks=tb, tie_break="deterministic")
    with torch.inference_mode():
        _, ids = model.layers[src].attn.indexer.select(
            x, qr, freqs, index_k, visible, candidate_source=True, candidates=None, **kw
        )
        got, _ = model.layers[reindex].attn.indexer.select(
            x, qr, freqs, index_k, visible, candidate_source=False, candidates=ids, **kw
        )
        mask = candidate_blocks(
            _scores(model.layers[src].attn.indexer, x, qr, freqs, index_k, visible), visible, bs, tb,
            tie_break="deterministic",
        )  # fmt: skip
        want = select_full_scan(model.layers[reindex].attn.indexer, x, qr, freqs, index_k, visible, mask,
                                "deterministic")  # fmt: skip
    assert ids.dtype == torch.int64 and ids.shape == (1, t, bs * tb)
    assert torch.equal(got, want)


def _scores(indexer, x, qr, freqs, index_k, visible):
    q = indexer.wq_b(qr).unflatten(-1, (indexer.n_heads, indexer.index_head_dim))
    q = qdq_mxfp4(apply_rope(q, freqs, indexer.rope_dim))
    weights = indexer.weights_proj(x) * (indexer.index_head_dim**-0.5 * indexer.n_heads**-0.5)
    return index_score(q, index_k, weights, visible=visible)

"""The attention stage of a batched decode: one new row for each of N sequences, with every part that a lone
`Attention.attend` runs per sequence (window ids and ring, compressor and FP4/MXFP4 writes, indexer scores
and top-k, sparse attention) done in calls over all of them, and each sequence's result bit for bit its
lone pass's.

Knows nothing of the residual stream or of scheduling: `model/batched.py` calls `attend_rows` per layer for
the sequences `batchable` accepts and runs `Attention.attend` one sequence at a time (the slow twin) for
the rest. Why each part is exact (tests/model/test_batched.py checks all of it on fresh random states, at
1 and 2 threads):
- integer work (window ids, slots, visible counts, top-k ranking) is exact whatever the batch;
- the format kernels work per block, RMSNorm and RoPE per row, the bf16 and block-scaled linears are
  row-invariant, and the compressor's fp32 products go through `invariant.rowwise_linear`;
- the indexer's full scan runs over keys padded to the longest history: each score is one row's dot
  product, relu and head sum, and the padded columns are masked to -inf by the visibility rule before
  anything reads them (the top-k ranks by score, then id, so extra -inf columns after every real one are
  never chosen over a real one; the candidate pool's extra blocks are -inf and dropped as the lone pass
  drops unreachable blocks; ids at or past a row's visible count become -1 as past its width alone);
- the sparse attention runs per group of sequences with the same number of indices (its block structure
  and sums depend on that width), over a buffer [ring ; new row ; selected global rows] per sequence whose
  row 0 is the lone buffer's row 0 (an unused -1 slot reads row 0), with `rowwise=True`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import (
    candidate_ids,
    index_score_at,
    index_score_rows,
    qdq_mxfp4,
    select_topk,
    sparse_attn,
)
from model.append_buffer import append_rows_many
from model.attention import Attention, ProjectedRows
from model.invariant import rowwise_linear
from model.owned_rows import write_ring_rows
from model.rope import apply_rope
from model.state import ModelState, SourceCache

__all__ = ["Selection", "attend_rows", "batchable"]


@dataclass
class Selection:
    """What the index sources of one layer half publish to its later layers, for the sequences of a
    batched stage (the lone pass's `shared["topk"]` / `shared["candidates"]`).

    Attributes:
        ids: [N, K_max] int64 selected entry ids per sequence (ascending, then -1), or None before the
            first index source.
        widths: each sequence's K, min(index_topk, visible entries) as its lone pass has.
        candidates: [N, 1, P] int64 candidate pool of the candidate source, or None.
        picked, picked_source: the rows `ids` name in source layer `picked_source`'s KV, per sequence
            ([1, k, D] each)
            (`attend_rows` gathers them once per source and selections; only the layer that writes that
            source, or one that publishes new selections, gathers them again).
    """

    ids: torch.Tensor | None = None
    widths: list[int] | None = None
    candidates: torch.Tensor | None = None
    # the global rows the selections name in one source (kv_source_of), gathered per sequence: a later
    # layer of the half that reads the same source with the same selections reads the same rows
    picked: list[torch.Tensor] | None = None
    picked_source: int | None = None


def batchable(model, state: ModelState) -> bool:
    """Whether a decode step of `state` may take the batched stage (else its layers run `attend` alone).

    True when every layer's ring is in use (its lone pass attends [ring ; new row]), every compressed
    layer sees at least one entry, and every kv source holds exactly the entries of the history (what a
    state made by prefill, decode and the cache imports always holds). The batched code relies on these;
    other states (an empty one, windows dropped and not replayed) are rare and take the slow twin.
    """
    cfg = model.cfg
    start = state.n_tokens
    if any(f >= start for f in state.window_from):
        return False
    ratios = [r for r in cfg.compress_ratios[: cfg.n_layers] if r]
    if ratios and start + 1 < max(ratios):
        return False
    for layer, src in state.sources.items():
        n = start // src.ratio
        if src.kv.size(1) != n or (layer in cfg.index_source_layers and src.index_k.size(1) != n):
            return False
    return True


def _write_ring(layer: int, rows: ProjectedRows, states: Sequence[ModelState], slots: list[int],
                in_place: bool) -> None:  # fmt: skip
    """Each state's ring of `layer` with its new row at slot start % W (as `Attention.attend`): written into
    the ring tensors a state alone holds when `in_place`, else (and for the states that hold none) fresh
    tensors, which become theirs (model/owned_rows.py)."""
    rings = [[s.windows[layer] for s in states], [s.window_codes[layer] for s in states],
             [s.window_scales[layer] for s in states]]  # fmt: skip
    new = [rows.kv[:, 0], rows.codes[:, 0], rows.scales[:, 0]]
    renewed, (ring, codes, scales) = write_ring_rows(rings, new, slots, [s.owner for s in states],
                                                     in_place=in_place)  # fmt: skip
    for i, r, c, sc in zip(renewed, ring, codes, scales, strict=True):
        s = states[i]
        s.windows[layer], s.window_codes[layer], s.window_scales[layer] = r, c, sc


def _write_carries(srcs: Sequence[SourceCache], states: Sequence[ModelState], kv: torch.Tensor,
                   score: torch.Tensor, slots: list[int], in_place: bool) -> None:
    """Each source's open-group carries with this row's compressor outputs (kv, score [N, 1, D] fp32) at
    slot start % m: in place into the carries a state alone holds when `in_place`, else fresh ones."""
    rings = [[src.carry_kv for src in srcs], [src.carry_score for src in srcs]]
    renewed, (carry_kv, carry_score) = write_ring_rows(
        rings, [kv[:, 0], score[:, 0]], slots, [s.owner for s in states], in_place=in_place  # type: ignore[arg-type]
    )
    for i, ck, cs in zip(renewed, carry_kv, carry_score, strict=True):
        srcs[i].carry_kv, srcs[i].carry_score = ck, cs


def _write_global(attn: Attention, layer: int, x: torch.Tensor, states: Sequence[ModelState],
                  starts: torch.Tensor, table: torch.Tensor, backend: str,
                  in_place: bool) -> None:  # fmt: skip
    """`Attention._write_global` for one row per sequence: compress, and for the sequences whose group
    closes at this row, rotate, quantize and append the new entry (and its index key) to their source."""
    comp = attn.compressor
    assert comp is not None
    m = comp.ratio
    srcs = [s.sources[layer] for s in states]
    n = len(states)
    if m == 1:
        latent = comp.norm(comp.wkv(x))  # [N, 1, D] bf16: every row closes its group
        closing = list(range(n))
    else:
        xf = x.float()
        kv = rowwise_linear(xf, comp.wkv.weight)  # [N, 1, D] fp32, each row as a one-row product
        score = rowwise_linear(xf, comp.wgate.weight)
        positions = starts.tolist()
        _write_carries(srcs, states, kv, score, [p % m for p in positions], in_place)
        closing = [i for i, p in enumerate(positions) if (p + 1) % m == 0]
        if closing:
            ck = torch.cat([srcs[i].carry_kv for i in closing])  # [G, m, D] # type: ignore[misc]
            cs = torch.cat([srcs[i].carry_score for i in closing])  # type: ignore[misc]
            pooled = (ck * cs.softmax(dim=1)).sum(dim=1, keepdim=True)  # [G, 1, D]
            latent = comp.norm(pooled.to(x.dtype))
    extra: dict[str, torch.Tensor] = {}
    if closing:
        pick = torch.tensor(closing, device=x.device)
        # batchable states hold entries [0, start // m): the closing entry is start // m, never stored yet
        freqs = table[starts[pick] // m * m].unsqueeze(1)  # [G, 1, rope/2] at each entry's position j*m
        extra = attn.entry_fields(latent, freqs, backend=backend)
    # each closing source's new entry appended as append_rows would, every field of all of them in one call.
    # The fields are replaced on each state's own SourceCache (ModelState.clone copies those objects, so
    # no snapshot shares one; no tensor is written): a new SourceCache per state and source, as the lone
    # pass makes, cost about 2% of a 44-sequence decode step.
    for name, t in extra.items():
        grown = append_rows_many([getattr(srcs[i], name) for i in closing], t)  # t [G, 1, ...]
        for i, g in zip(closing, grown, strict=True):
            setattr(srcs[i], name, g)
    if "index_k" in extra:
        for i in closing:
            states[i].extra["index_k_slot"] = layer


def _by_width(widths: Sequence[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, k in enumerate(widths):
        groups.setdefault(k, []).append(i)
    return groups


def _select(attn: Attention, x: torch.Tensor, rows: ProjectedRows, freqs: torch.Tensor,
            states: Sequence[ModelState], src_layer: int, starts: list[int], sel: Selection,
            backend: str) -> None:  # fmt: skip
    """`Indexer.select` (deterministic rule) of an index-source layer for one row per sequence; publishes
    the top-k (and, for the candidate source, the pool) into `sel`."""
    indexer = attn.indexer
    assert indexer is not None
    n, dev = len(states), x.device
    visible = [(p + 1) // attn.ratio for p in starts]  # == each source's entries (batchable)
    vis = torch.tensor(visible, device=dev).view(n, 1)  # [N, T=1]
    widths = [min(indexer.topk, v) for v in visible]
    q = indexer.wq_b(rows.qr).unflatten(-1, (indexer.n_heads, indexer.index_head_dim))  # [N, 1, H_I, D_I]
    q = qdq_mxfp4(apply_rope(q, freqs, indexer.rope_dim), backend=backend)
    weights = indexer.weights_proj(x) * (indexer.index_head_dim**-0.5 * indexer.n_heads**-0.5)  # [N, 1, H_I]
    ids = torch.full((n, max(widths)), -1, dtype=torch.int64, device=dev)
    pool = sel.candidates if attn.uses_candidates and not attn.is_candidate_source else None
    if pool is not None:
        # a Reindex layer scores only its pool (`Indexer._select_in_pool`): the pool's keys gathered per
        # sequence, each pool slot scored at its own id (slots past the visible count or empty: -inf).
        # Each sequence's keys [1, n_i, D_I] gathered along their token axis (index_select copies whole
        # rows, the values advanced indexing gives), the ids clamped once for all: one dispatched op a
        # sequence instead of four.
        size = pool.size(-1)
        at = pool[:, 0].clamp_min(0)  # [N, P]
        gathered = torch.cat([s.sources[src_layer].index_k.index_select(1, a)
                              for s, a in zip(states, at, strict=True)])  # [N, P, D_I]  # fmt: skip
        usable = (pool >= 0) & (pool < vis.unsqueeze(-1))
        slot_ids = torch.where(usable, torch.arange(size, device=dev), -1)  # [N, 1, P]
        scores = index_score_at(q, gathered, weights, slot_ids)  # [N, 1, P] bf16
        for k, members in _by_width(widths).items():
            g = torch.tensor(members, device=dev)
            slots = select_topk(scores[g], min(k, size), size, tie_break="deterministic")
            picked = torch.where(slots >= 0, pool[g].gather(-1, slots.long().clamp_min(0)), -1)
            ids[g, : picked.size(-1)] = picked[:, 0]
    else:
        keys = [s.sources[src_layer].index_k[0] for s in states]  # [n_i, D_I] each, n_i == visible[i]
        # as `index_score` of the keys padded to the longest history, each sequence's read where they lie
        scores = index_score_rows(q, keys, weights, vis, backend=backend)  # [N, 1, N_max], -inf past
        if attn.is_candidate_source:
            cand = candidate_ids(scores, vis, attn.candidate_block_size, attn.candidate_topk_blocks)
            # ids a sequence alone would not have (past its own width) are -1 there
            sel.candidates = torch.where(cand >= vis.unsqueeze(-1), -1, cand)
        for k, members in _by_width(widths).items():
            g = torch.tensor(members, device=dev)
            picked = select_topk(scores[g], k, vis[g], tie_break="deterministic", drop_neg_inf=True)
            ids[g, :k] = picked[:, 0].long()
    sel.ids, sel.widths = ids, widths


def attend_rows(model, layer: int, x: torch.Tensor, rows: ProjectedRows, freqs: torch.Tensor,
                states: Sequence[ModelState], starts: list[int], sel: Selection, *,
                in_place: bool = False) -> torch.Tensor:  # fmt: skip
    """Layer `layer`'s `Attention.attend` for one new row of each of N batchable sequences, and its state
    writes (`Transformer.keep_layer_io`): ring, global KV, published index-key slot.

    Args:
        model: the Transformer.
        x: [N, 1, dim] bf16 normed attention inputs; rows: their `Attention.project` output.
        freqs: [N, 1, rope/2] complex64 rotations at each sequence's position.
        states: batch-1 states at positions `starts` (all `batchable`), updated in place.
        sel: the half's published selections (read by every compressed layer, written by index sources).
        in_place: write the new rows into the rings and carries each state alone holds
            (model/owned_rows.py); False: fresh tensors for every state (the slow twin).

    Returns:
        o [N, 1, H, D] bf16 attention values before `project_out`.
    """
    attn = model.layers[layer].attn
    backend = model.kernel_backend
    n, w, dev = len(states), attn.window_size, x.device
    pos = torch.tensor(starts, device=dev)  # [N]
    lowest = torch.tensor([s.window_from[layer] for s in states], device=dev)
    # `window_ids(canonical=True)` for one row per sequence, into [ring (W rows) ; new row (row W)]
    col = pos.view(n, 1)
    keys = torch.maximum(col - w + 1, lowest.view(n, 1)) + torch.arange(w, device=dev)  # [N, W] positions
    win_ids = torch.where(keys > col, -1, torch.where(keys == col, w, keys % w))
    old = torch.cat([s.windows[layer] for s in states])  # [N, W, D] the rings before this row
    _write_ring(layer, rows, states, [p % w for p in starts], in_place)
    widths, entries, picked = [0] * n, None, None
    if attn.ratio:
        src_layer = model.cfg.kv_source_of(layer)
        if attn.is_kv_source:
            _write_global(attn, layer, x, states, pos, model.rope_for(layer, max(starts) + 1, dev), backend,
                          in_place)
        if attn.is_index_source:
            _select(attn, x, rows, freqs, states, src_layer, starts, sel, backend)
        assert sel.ids is not None and sel.widths is not None
        widths, entries = sel.widths, sel.ids
        if attn.is_kv_source or attn.is_index_source or sel.picked is None or sel.picked_source != src_layer:
            # the global rows each sequence's selections name, gathered from its own source (as
            # gather_selected); the source changes only at its own layer, the selections only here.
            # index_select copies whole rows (advanced indexing went element by element): the same values.
            # Each [1, k, D] along the source's token axis, with no `kv[0]` select and, at the widest width
            # (most sequences), no `e[:k]` slice: two dispatched ops fewer a sequence and gathering layer.
            clamped = entries.clamp_min(0)
            widest = clamped.size(1)
            sel.picked = [
                s.sources[src_layer].kv.index_select(1, e if k == widest else e[:k])
                for s, e, k in zip(states, clamped, widths, strict=True)
            ]
            sel.picked_source = src_layer
        picked = sel.picked
    o = None
    for k, members in _by_width(widths).items():
        whole = len(members) == n
        g = None if whole else torch.tensor(members, device=dev)
        parts = [old, rows.kv] if whole else [old[g], rows.kv[g]]
        ids = win_ids if whole else win_ids[g]
        if k:
            assert entries is not None and picked is not None
            parts.append(torch.cat([picked[i] for i in members]))  # [G, k, D]
            sel_ids = entries[:, :k] if whole else entries[g, :k]
            # slot j of a sequence's selection reads buffer row W + 1 + j
            slots = torch.arange(w + 1, w + 1 + k, device=dev)
            ids = torch.cat([ids, torch.where(sel_ids >= 0, slots, -1)], dim=1)
        kv_all = torch.cat(parts, dim=1)  # [G, W + 1 + k, D]
        q = rows.q if whole else rows.q[g]
        out = sparse_attn(q, kv_all, attn.attn_sink, ids.int().unsqueeze(1), attn.softmax_scale,
                          backend=backend, rowwise=True)  # fmt: skip
        if whole:
            return out
        if o is None:
            o = out.new_empty(n, *out.shape[1:])
        o[g] = out
    assert o is not None
    return o

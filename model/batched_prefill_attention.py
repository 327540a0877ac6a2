"""The attention stage of a batched prefill: the chunks of N sequences (T_i rows each, at their own
positions, stacked along one axis) through one layer's window ring, global KV writes, top-k selection and
sparse attention in calls over all of them, each sequence's result bit for bit its lone pass's
(`Attention.attend` under tie_break "deterministic").

Knows nothing of the residual stream or of scheduling: `model/batched_prefill.py` calls `attend_chunks`
per layer for the sequences `chunk_batchable` accepts and runs `Attention.attend` one sequence at a time
(the slow twin) for the rest. Why each part is exact (tests/model/test_batched_prefill.py checks it all
on fresh random ragged chunks, at 1 and 2 threads):
- integer work (window ids, ring slots, visible counts, candidate pools, top-k ranking) is exact whatever
  the batch; the ring writes are index copies;
- the format kernels work per block, RMSNorm and RoPE per row, the bf16 linears are row-invariant, and
  the compressor's fp32 products (whose sums depend on the number of rows M) give each sequence its own
  product's sums (`invariant.stacked_fp32_linear`); its
  pooling softmax runs
  over the m slots of a group, vectorized across the channels only, so the groups of all sequences go in
  one call;
- the indexer's full scan runs over keys padded to the longest history and rows padded to the longest
  chunk, the padding masked to -inf by the visibility rule (padded rows see nothing and are dropped): each
  score is one row's dot products, relu and head sum; the top-k ranks by score, then id, so -inf columns
  after every real one are never chosen over a real one, and the candidate pool's entries at or past a
  sequence's entry count become -1 as past its own width alone; a Reindex layer scores its pool on the
  keys of all sequences laid end to end, each pool id shifted to its sequence's keys;
- the sparse attention runs per group of sequences with the same chunk length and the same selection
  width (its exponentials run over each batch row's [T, H, block] values as one contiguous run, whose SIMD
  body and scalar tail depend on T, and its 64-wide blocks and sums on the width), with `rowwise=True`,
  over a buffer [ring ; new rows ; selected global rows] per sequence in which every index reads the
  vector its lone pass reads, in the same column.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from kernels import (
    candidate_ids,
    index_score,
    index_score_at,
    qdq_mxfp4,
    select_topk,
    sparse_attn,
)
from model.append_buffer import append_rows_ragged
from model.attention import Attention, ProjectedRows
from model.invariant import stacked_fp32_linear
from model.owned_rows import mark_owned
from model.ragged_attention import ragged_sparse_attn
from model.rope import apply_rope
from model.state import ModelState, SourceCache

__all__ = ["ChunkRows", "ChunkSelection", "attend_chunks", "chunk_batchable"]


@dataclass
class ChunkRows:
    """One sequence's rows in a layer half: positions [start, start + t) at stack rows [at, at + t).

    Attributes:
        floor: lowest window position the rows may read (the half's floor of the plan).
        compress_x: [1, T_c, dim] inputs of the rows the split layer compresses (from compress_start),
            or None: the rows themselves.
        shared: the lone pass's per-half dict (`AttnIO.shared`) when this sequence runs the slow twin.
    """

    state: ModelState
    start: int
    t: int
    floor: int
    at: int = 0
    compress_x: torch.Tensor | None = None
    compress_start: int = 0
    shared: dict = field(default_factory=dict)

    @property
    def span(self) -> slice:
        return slice(self.at, self.at + self.t)

    @property
    def end(self) -> int:
        return self.start + self.t


@dataclass
class ChunkSelection:
    """What the index sources of one layer half publish to its later layers, for the sequences of the
    batched stage (the lone pass's `shared["topk"]` / `shared["candidates"]`), in their order.

    Attributes:
        entries: [N, T_max, K_max] int64 selected entry ids per row (ascending, then -1; no window offset),
            or None before the first index source.
        widths: each sequence's K, min(index_topk, entries visible at the chunk's end), as its lone pass.
        candidates: [N, T_max, P] int64 candidate pools, or None; has_pool: which sequences published one.
    """

    entries: torch.Tensor | None = None
    widths: list[int] | None = None
    candidates: torch.Tensor | None = None
    has_pool: list[bool] = field(default_factory=list)
    # Integer index tensors that depend on the half's rows and windows, not on the layer: each sequence's
    # stack rows, its window ids, where its last rows go in its ring, and the ragged attention's window
    # ids into its buffer; made at the half's first layer and read by the others (`_layout`). Keyed by
    # what each depends on: the sequences (their ChunkRows, the same objects at every layer of a half) and
    # their windows' effective floors. Measured (session 34): the same tensors remade at every layer were
    # about 100 of a 1-chunk batched prefill's 3,571 dispatched ops a layer.
    layout: dict[tuple, object] = field(default_factory=dict)


def _layout(sel: ChunkSelection, key: tuple, make):  # type: ignore[no-untyped-def]
    """`sel.layout[key]`, made by `make()` the first time (integer index tensors, never written after)."""
    got = sel.layout.get(key)
    if got is None:
        got = sel.layout[key] = make()
    return got


def _uses_ring(state: ModelState, layer: int, r: ChunkRows) -> bool:
    return max(r.floor, state.window_from[layer]) < r.start


def chunk_batchable(model, r: ChunkRows, layers: range) -> bool:
    """Whether a sequence's rows may take the batched stage in the half of `layers`.

    The lone pass adds the window offset of the index source's buffer to its selections and a later layer
    reads them at its own offset; the batched stage reads the selected entries themselves, which is the
    same only when every compressed layer of the half has the same offset, i.e. all use the ring or none
    does (always so for states of prefill, decode and the cache imports, whose layers keep one
    window_from). Other states take the slow twin.
    """
    ratios = model.cfg.compress_ratios
    return len({_uses_ring(r.state, layer, r) for layer in layers if ratios[layer]}) <= 1


def _apart(t: torch.Tensor) -> list[torch.Tensor]:
    """Rows of a stacked [N, ...] result as N tensors [1, ...] with storage of their own (`split_copy`: one
    call, not a clone per row)."""
    return list(torch.split_copy(t, 1))


def _window_ids(seqs: Sequence[ChunkRows], eff: Sequence[int], w: int, t_max: int,
                dev: torch.device) -> torch.Tensor:  # fmt: skip
    """Canonical window ids [N, T_max, W] into each sequence's [ring (W rows) ; new rows], for windows
    valid from `eff` (`window_ids(canonical=True)`: the ring from the effective floor, or only this
    pass's rows)."""
    n = len(seqs)
    starts = torch.tensor([r.start for r in seqs], device=dev).view(n, 1, 1)
    lowest = torch.tensor([max(f, 0) if f < r.start else r.start for f, r in zip(eff, seqs, strict=True)],
                          device=dev).view(n, 1, 1)  # fmt: skip
    pos = starts + torch.arange(t_max, device=dev).view(1, t_max, 1)  # [N, T, 1]
    keys = torch.maximum(pos - w + 1, lowest) + torch.arange(w, device=dev)  # [N, T, W] positions
    ids = torch.where(keys >= starts, keys - starts + w, keys % w)
    return torch.where(keys > pos, -1, ids)


def _ring_rows(seqs: Sequence[ChunkRows], w: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """Where each sequence's last min(t, W) rows go into its ring, at slot position % W (distinct slots):
    (sequence, slot, stack row) of each, flat."""
    n = len(seqs)
    starts = torch.tensor([r.start for r in seqs], device=dev).view(n, 1)
    ts = torch.tensor([r.t for r in seqs], device=dev).view(n, 1)
    keep = ts.clamp_max(w)
    rank = torch.arange(w, device=dev).view(1, w)
    kept = rank < keep  # [N, W]
    first = ts - keep + rank  # [N, W] each kept row's place in its chunk
    si = torch.arange(n, device=dev).view(n, 1).expand(n, w)[kept]
    sl = ((starts + first) % w)[kept]
    ri = (torch.tensor([r.at for r in seqs], device=dev).view(n, 1) + first)[kept]
    return si, sl, ri


def _window(layer: int, w: int, rows: ProjectedRows, seqs: Sequence[ChunkRows], t_max: int,
            dev: torch.device, sel: ChunkSelection, key: tuple,
            eff: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Canonical window ids [N, T_max, W] into each sequence's [ring (W rows) ; new rows], the rings
    before this pass [N, W, D]; and each state's ring, codes, scales and valid-from after it. `key`: the
    sequences' layout key; `eff`: each window's effective floor at this layer."""
    states = [r.state for r in seqs]
    ids = _layout(sel, ("window_ids", key, eff), lambda: _window_ids(seqs, eff, w, t_max, dev))
    si, sl, ri = _layout(sel, ("ring_rows", key), lambda: _ring_rows(seqs, w, dev))
    old = torch.cat([s.windows[layer] for s in states])  # [N, W, D]
    ring = old.clone()
    ring[si, sl] = rows.kv[0, ri]
    codes = torch.cat([s.window_codes[layer] for s in states])
    codes[si, sl] = rows.codes[0, ri]
    scales = torch.cat([s.window_scales[layer] for s in states])
    scales[si, sl] = rows.scales[0, ri]
    after = zip(states, eff, seqs, _apart(ring), _apart(codes), _apart(scales), strict=True)
    # fresh rings each state alone holds: a later batched decode step writes its row into them (in
    # inference mode, where that step writes in place: model/owned_rows.py)
    own = torch.is_inference_mode_enabled()
    for s, f, r, rg, c, sc in after:
        s.windows[layer], s.window_codes[layer], s.window_scales[layer] = rg, c, sc
        s.window_from[layer] = min(f, r.start)
        if own:
            mark_owned(s.owner, (rg, c, sc))
    return ids, old


def _write_global(attn: Attention, layer: int, x: torch.Tensor, seqs: Sequence[ChunkRows],
                  table: torch.Tensor, backend: str) -> None:  # fmt: skip
    """`Attention._write_global` of every sequence: compress its rows (or its compress_x), and rotate,
    quantize and append the entries not yet stored (and their index keys) to its source."""
    comp = attn.compressor
    assert comp is not None
    m = comp.ratio
    xs = [r.compress_x if r.compress_x is not None else x[:, r.span] for r in seqs]
    cstarts = [r.compress_start if r.compress_x is not None else r.start for r in seqs]
    srcs = [r.state.sources[layer] for r in seqs]
    firsts, counts, carries = [], [], []
    if m == 1:
        latent = comp.norm(comp.wkv(torch.cat(xs, dim=1)))  # [1, sum T_c, D] bf16: every row an entry
        firsts, counts = cstarts, [cx.size(1) for cx in xs]
        carries = [(None, None)] * len(seqs)
    else:
        # fp32 products of T_c rows each, as the lone pass makes them (the sums depend on the row count,
        # and a batched product of equal-length blocks equals them only under some MKL modes and threads):
        # one product over the rows of all sequences where that gives every row its lone sums
        runs = [cx.size(1) for cx in xs]
        stack = torch.cat(xs, dim=1)[0].float()  # [sum T_c, dim]
        kvs = stacked_fp32_linear(stack, comp.wkv.weight, runs).unsqueeze(0).split(runs, dim=1)
        scores = stacked_fp32_linear(stack, comp.wgate.weight, runs).unsqueeze(0).split(runs, dim=1)
        group_kv, group_score = [], []
        for kv, score, cstart, src in zip(kvs, scores, cstarts, srcs, strict=True):
            t = kv.size(1)
            end, lead = cstart + t, cstart % m
            # `Compressor.forward`: the open group's slots come from the carry, the trailing open group
            # goes back into it
            if t == 1:
                new_kv, new_score = src.carry_kv.clone(), src.carry_score.clone()
                new_kv[:, lead] = kv[:, 0]
                new_score[:, lead] = score[:, 0]
                closes = (cstart + 1) % m == 0
                firsts.append(cstart // m if closes else end // m)
                counts.append(int(closes))
                if closes:
                    group_kv.append(new_kv.unsqueeze(1))  # [1, 1, m, D]
                    group_score.append(new_score.unsqueeze(1))
                carries.append((new_kv, new_score))
                continue
            if lead:
                kv = torch.cat([src.carry_kv[:, :lead], kv], dim=1)
                score = torch.cat([src.carry_score[:, :lead], score], dim=1)
            rem = end % m
            cutoff = kv.size(1) - rem
            new_kv, new_score = src.carry_kv, src.carry_score
            if rem:
                new_kv, new_score = src.carry_kv.clone(), src.carry_score.clone()
                new_kv[:, :rem] = kv[:, cutoff:]
                new_score[:, :rem] = score[:, cutoff:]
            carries.append((new_kv, new_score))
            firsts.append((cstart - lead) // m)
            counts.append(cutoff // m)
            if cutoff:
                group_kv.append(kv[:, :cutoff].unflatten(1, (-1, m)))  # [1, G_i, m, D]
                group_score.append(score[:, :cutoff].unflatten(1, (-1, m)))
        latent = None
        if group_kv:
            gk, gs = torch.cat(group_kv, dim=1), torch.cat(group_score, dim=1)  # [1, sum G, m, D]
            latent = comp.norm((gk * gs.softmax(dim=2)).sum(dim=2).to(x.dtype))  # [1, sum G, D]
    # the entries not stored yet (a replay recomputes stored ones without writing them)
    rows, positions, spans = [], [], []
    at = 0
    for first, g, src in zip(firsts, counts, srcs, strict=True):
        n_old = src.n_entries
        assert first <= n_old or g == 0, f"layer {layer}: entry gap {n_old} .. {first}"
        if g and first + g > n_old:
            skip = n_old - first
            rows += range(at + skip, at + g)
            positions += range(first + skip, first + g)
            spans.append(g - skip)
        else:
            spans.append(0)
        at += g
    extra: dict[str, torch.Tensor] = {}
    if rows:
        assert latent is not None
        dev = x.device
        new = latent[:, torch.tensor(rows, device=dev)]  # [1, E, D]
        freqs = table[torch.tensor(positions, device=dev) * attn.ratio]  # [E, rope/2] at each entry's j*m
        extra = attn.entry_fields(new, freqs, backend=backend)  # name -> [1, E, ...], sequence after sequence
    # each source's new rows appended as append_rows would, every sequence's in one call per field (the
    # rows lie sequence after sequence); the fields replaced on each state's own SourceCache
    # (ModelState.clone copies those objects, so no snapshot shares one; no tensor is written), as the
    # batched decode does (model/batched_attention.py)
    members = [i for i, g in enumerate(spans) if g]
    counts = [spans[i] for i in members]
    for name, t in extra.items():
        grown = append_rows_ragged([getattr(srcs[i], name) for i in members], t, counts)
        for i, grew in zip(members, grown, strict=True):
            setattr(srcs[i], name, grew)
    own = torch.is_inference_mode_enabled()
    for r, src, (carry_kv, carry_score), span in zip(seqs, srcs, carries, spans, strict=True):
        if own and carry_kv is not src.carry_kv and carry_kv is not None and carry_score is not None:
            mark_owned(r.state.owner, (carry_kv, carry_score))  # clones made above for this state alone
        src.carry_kv, src.carry_score = carry_kv, carry_score
        if span and "index_k" in extra:
            r.state.extra["index_k_slot"] = layer


def _by_key(keys: Sequence) -> dict:
    groups: dict = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    return groups


def _row_index(seqs: Sequence[ChunkRows], t_max: int, dev: torch.device) -> torch.Tensor:
    """[N, T_max] stack row of each sequence's row r (rows past a chunk repeat its first row: padding)."""
    r = torch.arange(t_max, device=dev).view(1, t_max)
    at = torch.tensor([s.at for s in seqs], device=dev).view(-1, 1)
    t = torch.tensor([s.t for s in seqs], device=dev).view(-1, 1)
    return at + torch.where(r < t, r, 0)


def _select(attn: Attention, x: torch.Tensor, rows: ProjectedRows, freqs: torch.Tensor,
            seqs: Sequence[ChunkRows], src_layer: int, index: torch.Tensor, sel: ChunkSelection,
            backend: str) -> None:  # fmt: skip
    """`Indexer.select` (deterministic rule) of an index-source layer for every sequence's rows; publishes
    the selections (and, for the candidate source, the pools) into `sel`."""
    indexer = attn.indexer
    assert indexer is not None
    n, t_max, dev = len(seqs), index.size(1), x.device
    m = attn.ratio
    keys = [r.state.sources[src_layer].index_k[0, : r.end // m] for r in seqs]  # [n_i, D_I] each
    n_vis = [k.size(0) for k in keys]
    widths = [min(indexer.topk, v) for v in n_vis]
    r_ = torch.arange(t_max, device=dev).view(1, t_max)
    starts = torch.tensor([r.start for r in seqs], device=dev).view(n, 1)
    lens = torch.tensor([r.t for r in seqs], device=dev).view(n, 1)
    # entries each row sees ((pos + 1) // m); padded rows see none
    vis = torch.where(r_ < lens, (starts + r_ + 1) // m, 0)  # [N, T_max]
    q = indexer.wq_b(rows.qr).unflatten(-1, (indexer.n_heads, indexer.index_head_dim))  # [1, S, H_I, D_I]
    q = qdq_mxfp4(apply_rope(q, freqs, indexer.rope_dim), backend=backend)
    weights = indexer.weights_proj(x) * (indexer.index_head_dim**-0.5 * indexer.n_heads**-0.5)  # [1, S, H_I]
    entries = torch.full((n, t_max, max(widths)), -1, dtype=torch.int64, device=dev)
    in_pool = attn.uses_candidates and not attn.is_candidate_source and sel.candidates is not None
    pooled = [i for i in range(n) if in_pool and sel.has_pool[i] and n_vis[i]]
    scanned = [i for i in range(n) if n_vis[i] and i not in pooled]
    if pooled:
        # a Reindex layer scores only its pool (`Indexer._select_in_pool`): the keys of its sequences end
        # to end, each pool id shifted to its sequence's keys, each row's rows of q and weights
        assert sel.candidates is not None
        g = torch.tensor(pooled, device=dev)
        offsets = torch.tensor([0] + n_vis, device=dev).cumsum(0)[g].view(-1, 1, 1)
        pool = sel.candidates[g]  # [G, T_max, P]
        size = pool.size(-1)
        flat = torch.cat([keys[i] for i in pooled]).unsqueeze(0)  # [1, sum n_i, D_I]
        rows_g = index[g].view(1, -1)  # [1, G * T_max]
        shifted = torch.where(pool >= 0, pool + offsets, -1).view(1, -1, size)
        scores = index_score_at(q[:, rows_g[0]], flat, weights[:, rows_g[0]], shifted)  # [1, G*T_max, P]
        scores = scores.view(len(pooled), t_max, size)
        scores = scores.masked_fill_(pool >= vis[g].unsqueeze(-1), -torch.inf)
        for k, members in _by_key([widths[i] for i in pooled]).items():
            sub = g[torch.tensor(members, device=dev)]
            local = torch.tensor(members, device=dev)
            slots = select_topk(scores[local], min(k, size), size, tie_break="deterministic")
            picked = torch.where(slots >= 0, pool[local].gather(-1, slots.long().clamp_min(0)), -1)
            entries[sub, :, : picked.size(-1)] = picked
    if scanned:
        g = torch.tensor(scanned, device=dev)
        padded = pad_sequence([keys[i] for i in scanned], batch_first=True)  # [G, N_max, D_I], zeros past
        idx = index[g]  # [G, T_max]
        vis_g = vis[g]
        scores = index_score(q[0, idx], padded, weights[0, idx], visible=vis_g, backend=backend)
        if attn.is_candidate_source:
            cand = candidate_ids(scores, vis_g, attn.candidate_block_size, attn.candidate_topk_blocks)
            # ids at or past a sequence's entries are -1 in its lone pool (it scans only its own)
            limit = torch.tensor([n_vis[i] for i in scanned], device=dev).view(-1, 1, 1)
            cand = torch.where(cand >= limit, -1, cand)
            full = torch.full((n, t_max, cand.size(-1)), -1, dtype=torch.int64, device=dev)
            full[g] = cand
            sel.candidates = full
            sel.has_pool = [i in scanned for i in range(n)]
        for k, members in _by_key([widths[i] for i in scanned]).items():
            local = torch.tensor(members, device=dev)
            picked = select_topk(scores[local], k, vis_g[local], tie_break="deterministic", drop_neg_inf=True)
            entries[g[local], :, :k] = picked.long()
    sel.entries, sel.widths = entries, widths


def attend_chunks(model, layer: int, x: torch.Tensor, rows: ProjectedRows, freqs: torch.Tensor,
                  seqs: Sequence[ChunkRows], table: torch.Tensor, sel: ChunkSelection,
                  out: torch.Tensor) -> None:  # fmt: skip
    """Layer `layer`'s `Attention.attend` for the rows of N sequences (all `chunk_batchable`) and its
    state writes (`Transformer.keep_layer_io`): ring, global KV, published index-key slot.

    Args:
        model: the Transformer.
        x: [1, S, dim] bf16 normed attention inputs of the stack (each sequence's rows at its span);
            rows: their `Attention.project` output; freqs: [S, rope/2] complex64 at each row's position.
        seqs: the sequences' rows (batch-1 states, updated in place).
        table: [>= every end, rope/2] this layer's rotations.
        sel: the half's published selections (read by every compressed layer, written by index sources).
        out: [1, S, H, D] bf16, filled at each sequence's span with its attention values.
    """
    attn = model.layers[layer].attn
    backend = model.kernel_backend
    n, w, dev = len(seqs), attn.window_size, x.device
    t_max = max(r.t for r in seqs)
    key = tuple(id(r) for r in seqs)  # the half's ChunkRows: the same objects at each of its layers
    eff = tuple(max(r.floor, r.state.window_from[layer]) for r in seqs)
    win_ids, old = _window(layer, w, rows, seqs, t_max, dev, sel, key, eff)
    index = _layout(sel, ("row_index", key), lambda: _row_index(seqs, t_max, dev))
    widths = [0] * n
    srcs: list[SourceCache] = []
    if attn.ratio:
        src_layer = model.cfg.kv_source_of(layer)
        assert src_layer is not None
        if attn.is_kv_source:
            _write_global(attn, layer, x, seqs, table, backend)
        if attn.is_index_source:
            _select(attn, x, rows, freqs, seqs, src_layer, index, sel, backend)
        assert sel.entries is not None and sel.widths is not None
        widths = sel.widths
        srcs = [r.state.sources[src_layer] for r in seqs]
    if backend == "torch":
        for k, members in _by_key(widths).items():
            window = _layout(
                sel, ("ragged_window", key, eff, tuple(members)),
                lambda m=members: _ragged_window(w, win_ids[m], index[m], [seqs[i].t for i in m]),
            )  # fmt: skip
            _attend_ragged(attn, rows, [seqs[i] for i in members], window, old[members],
                           sel.entries[members] if k else None, k, [srcs[i] for i in members] if k else [],
                           out)  # fmt: skip
        return
    # the Triton kernel is row-wise by construction; the groups keep the reference's shapes all the same
    for (t, k), members in _by_key([(r.t, k) for r, k in zip(seqs, widths, strict=True)]).items():
        g = torch.tensor(members, device=dev)
        idx = index[g, :t]  # [G, t] stack rows
        parts = [old[g], rows.kv[0, idx]]  # [G, W, D], [G, t, D]
        ids = win_ids[g, :t]  # [G, t, W]
        if k:
            assert sel.entries is not None
            ent = sel.entries[g, :t, :k]  # [G, t, k]
            n_vis = [seqs[i].end // attn.ratio for i in members]
            if t * k < max(n_vis):
                # few selections against a long history: only the rows they name, once per (row, slot)
                parts.append(torch.stack([srcs[i].kv[0, e.reshape(-1).clamp_min(0)]
                                          for i, e in zip(members, ent, strict=True)]))  # fmt: skip
                slots = torch.arange(t * k, device=dev).view(1, t, k)
                sel_ids = torch.where(ent >= 0, w + t + slots, -1)
            else:
                parts.append(pad_sequence([srcs[i].kv[0, :v] for i, v in zip(members, n_vis, strict=True)],
                                          batch_first=True))  # fmt: skip
                sel_ids = torch.where(ent >= 0, w + t + ent, -1)
            ids = torch.cat([ids, sel_ids], dim=-1)  # [G, t, W + k]
        kv_all = torch.cat(parts, dim=1)
        o = sparse_attn(rows.q[0, idx], kv_all, attn.attn_sink, ids.int(), attn.softmax_scale,
                        backend=backend, rowwise=True)  # fmt: skip
        out[0, idx] = o


@dataclass(frozen=True)
class _RaggedWindow:
    """The window half of a ragged attention call's ids, for the rows of G sequences (`_ragged_window`)."""

    ts: list[int]  # each sequence's rows
    live: torch.Tensor  # [G, T_max] each sequence's own rows, in stack order once flattened
    seq: torch.Tensor  # [S_g] the sequence of each row
    row: torch.Tensor  # [S_g] each row's place in its chunk
    idx: torch.Tensor  # [S_g] each row's stack row
    ids: torch.Tensor  # [S_g, W] window ids into the call's buffer (-1 none)


def _ragged_window(w: int, win_ids: torch.Tensor, index: torch.Tensor, ts: list[int]) -> _RaggedWindow:
    """The rows of G sequences (win_ids [G, T_max, W] into each one's [ring ; rows], index [G, T_max]
    their stack rows) laid out as one ragged call reads them: ring slot s of sequence j is buffer row
    j * W + s, its new row W + r is the whole stack's row at_j + r."""
    g, t_max = win_ids.size(0), win_ids.size(1)
    dev = win_ids.device
    rank = torch.arange(t_max, device=dev).view(1, t_max)
    live = rank < torch.tensor(ts, device=dev).view(g, 1)
    seq = torch.arange(g, device=dev).view(g, 1).expand(g, t_max)[live]
    row = rank.expand(g, t_max)[live]
    idx = index[live]
    wi = win_ids[live]  # [S_g, W] into each sequence's [ring ; rows]
    into_ring = seq.view(-1, 1) * w + wi
    into_rows = g * w + (idx - row).view(-1, 1) + (wi - w)
    ids = torch.where(wi < 0, -1, torch.where(wi < w, into_ring, into_rows))
    return _RaggedWindow(ts=ts, live=live, seq=seq, row=row, idx=idx, ids=ids)


def _attend_ragged(attn: Attention, rows: ProjectedRows, seqs: Sequence[ChunkRows], window: _RaggedWindow,
                   old: torch.Tensor, entries: torch.Tensor | None, k: int, srcs: Sequence[SourceCache],
                   out: torch.Tensor) -> None:  # fmt: skip
    """The sparse attention of sequences of one selection width k in one `ragged_sparse_attn` call, every
    index row pointing at the vector its lone pass reads, in the same column.

    The call reads its buffer only through the ids (it gathers the rows they name), so the buffer's layout
    is free: [every ring (G x W rows) ; the whole stack of new rows ; each sequence's selected global rows],
    and the ids are computed for all rows at once (integer work, exact). Only the selected rows are cut per
    sequence, from each state's own source: the rows the selections name, once per (row, slot), when they
    are fewer than the entries visible, else the visible entries as they lie (a view).
    """
    w, dev = attn.window_size, rows.kv.device
    g, t_max = len(seqs), window.live.size(1)
    live, seq, row, idx, ids = window.live, window.seq, window.row, window.idx, window.ids
    # every part [1, rows, D], laid end to end along the token axis (the sources' own [1, n, D] layout:
    # no select a sequence)
    parts = [old.reshape(1, g * w, -1), rows.kv]
    if k:
        assert entries is not None
        ent = entries[:, :t_max, :k]  # [G, T_max, k] entry ids (-1 none)
        clamped = ent.clamp_min(0)
        # each sequence's (row, slot) ids flat: its rows' first r.t * k (one view for all, one row each)
        flat = clamped.reshape(g, -1).unbind(0)
        base, offsets, picked = g * w + rows.kv.size(1), [], []
        for i, (r, src) in enumerate(zip(seqs, srcs, strict=True)):
            n_vis = r.end // attn.ratio
            offsets.append(base)
            if r.t * k < n_vis:
                # few selections against a long history: only the rows they name, once per (row, slot)
                parts.append(src.kv.index_select(1, flat[i][: r.t * k]))
                picked.append(True)
                base += r.t * k
            else:
                parts.append(src.kv.narrow(1, 0, n_vis))  # one view op (`[:, :n]` makes two)
                picked.append(False)
                base += n_vis
        at_sel = torch.tensor(offsets, device=dev)[seq].view(-1, 1)
        e = ent[live]  # [S_g, k]
        slots = row.view(-1, 1) * k + torch.arange(k, device=dev)  # the row's own gathered rows
        by_slot = torch.tensor(picked, device=dev)[seq].view(-1, 1)
        ids = torch.cat([ids, torch.where(e >= 0, at_sel + torch.where(by_slot, slots, e), -1)], dim=-1)
    kv_all = torch.cat(parts, dim=1)  # [1, buffer rows, D]
    o = ragged_sparse_attn(rows.q[0, idx].unsqueeze(0), kv_all, attn.attn_sink, ids.unsqueeze(0).int(),
                           attn.softmax_scale, window.ts)  # fmt: skip
    out[0, idx] = o[0]

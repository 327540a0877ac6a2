"""Prefill chunks of many independent sequences in one pass: the batched twin of `inference.prefill` that a
serving scheduler runs over every prefill or replay chunk of a step.

Knows nothing of sessions or scheduling. Each sequence brings its own chunk (T_i >= 1 tokens) at its own
position, and `inference.plan_prefill` decides its rows exactly as a lone prefill would (encoder bounded
replay, the decoder's tail [dec_from, end), the split layer's compression of every new row). The rows of
all sequences are stacked along one axis (ragged: [1, S, ...], S = sum of the rows each runs) and:
- run once over the stack: the attention projections, norms, the mHC collapse / expand and the experts,
  whose results per row do not depend on the other rows in the call (bf16 and block-scaled linears,
  elementwise ops without transcendental functions);
- the mHC mixes in one pass too (`model.ragged_mixes`: each sequence's fp32 products its own, their
  sigmoid / exp as each sequence's lone run has them);
- the attention stage batched across sequences (`model.batched_prefill_attention`), a sequence it cannot
  take, or every sequence with `batched_attention=False`, by `Attention.attend` alone (the slow twin);
- the MoE gate once, but each sequence's fp32 score product its own and its softplus as its lone run has it;
- per sequence: the head's one-row product.
So each sequence's logits, state and exported bytes are bit-identical to its lone prefill under
tie_break "deterministic" (tests/model/test_batched_prefill.py compares them on fresh random chunks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from model.append_buffer import append_rows
from model.attention import AttnIO, ProjectedRows
from model.batched_prefill_attention import (
    ChunkRows,
    ChunkSelection,
    attend_chunks,
    chunk_batchable,
)
from model.inference import PREFILL_MODES, PrefillPlan, plan_prefill
from model.invariant import rowwise_linear, stacked_fp32_linear
from model.mhc import collapse, expand, identity_pre
from model.ragged_mixes import lone_runs, ragged_mixes
from model.state import ModelState
from model.transformer import PassOutput, PassStats, Transformer

__all__ = ["prefill_many"]


def _place(seqs: list[ChunkRows]) -> None:
    at = 0
    for s in seqs:
        s.at, at = at, at + s.t


def _rows(rows: ProjectedRows, span: slice) -> ProjectedRows:
    return ProjectedRows(qr=rows.qr[:, span], q=rows.q[:, span], kv=rows.kv[:, span],
                         codes=rows.codes[:, span], scales=rows.scales[:, span])  # fmt: skip


def _mixes(block, h: torch.Tensor, seqs: list[ChunkRows], which: str) -> tuple[torch.Tensor, ...]:
    """The mHC mixes of each sequence's rows as its lone pass computes them, over the whole stack
    (`model.ragged_mixes`: each sequence's fp32 products its own, the transcendental ops as each sequence's
    lone run has them)."""
    return ragged_mixes(block, h, [s.t for s in seqs], which)


def _moe(moe, x: torch.Tensor, seqs: list[ChunkRows]) -> torch.Tensor:
    """MoE over the stack x [1, S, dim]: each sequence's rows routed as alone, the experts once."""
    flat = x.view(-1, moe.dim)
    weights, indices = _route(moe.gate, flat, [s.t for s in seqs])
    return moe.experts_out(flat, weights, indices).view(x.shape)


def _route(gate, flat: torch.Tensor, runs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`Gate.forward` op for op over the stack flat [S, dim] (sequence i: runs[i] rows) -> weights
    [S, topk] fp32, ids [S, topk] int64, each sequence's rows as its lone gate routes them: the fp32 score
    product each sequence's own (`invariant.stacked_fp32_linear`), its transcendental op as each sequence's
    lone run has it (`ragged_mixes.lone_runs`), the rest (row-wise) once."""
    # each sequence's rows as its own T_i-row product (one product over the stack where that is exact)
    scores = stacked_fp32_linear(flat.float(), gate.weight.float(), runs) / gate.gate_temp  # [S, E]
    if gate.score_func == "softmax":
        scores = scores.softmax(dim=-1)  # one row's values at a time
    elif gate.score_func == "sigmoid":
        scores = lone_runs(torch.sigmoid, scores, runs)
    else:
        scores = lone_runs(F.softplus, scores, runs).sqrt()
    indices = (scores + gate.bias).topk(gate.topk, dim=-1)[1]
    weights = scores.gather(1, indices)
    if gate.norm_topk_prob and gate.topk > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * gate.route_scale, indices


def _layer(model: Transformer, layer: int, h: torch.Tensor, pre: torch.Tensor, seqs: list[ChunkRows],
           table: torch.Tensor, batched: list[int], sel: ChunkSelection,
           positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`Block.forward` over the stacked rows h [1, S, hc, d], pre [1, S, hc]; the fp32 mixes each
    sequence's own, the attention stage batched for the sequences in `batched` (`attend_chunks`) and alone
    for the others (`Attention.attend`, the slow twin). Updates each sequence's state as
    `Transformer._run_layer` does. positions: [S] int64, each stacked row's position (`_positions`)."""
    block = model.layers[layer]
    attn = block.attn
    attn_pre, attn_post, attn_comb = _mixes(block, h, seqs, "attn")
    x = block.attn_input(h, pre)  # [1, S, dim]
    freqs = table.index_select(0, positions)  # [S, rope/2] at each row's position
    rows = attn.project(x, freqs, backend=model.kernel_backend)
    src_layer = model.cfg.kv_source_of(layer)
    o = x.new_empty(1, x.size(1), attn.n_heads, attn.head_dim)
    if batched:
        attend_chunks(model, layer, x, rows, freqs, [seqs[i] for i in batched], table, sel, o)
    for i in sorted(set(range(len(seqs))) - set(batched)):
        s = seqs[i]
        st = s.state
        io = AttnIO(
            start=s.start,
            floor=s.floor,
            window=st.windows[layer],
            window_codes=st.window_codes[layer],
            window_scales=st.window_scales[layer],
            window_from=st.window_from[layer],
            source=st.sources[src_layer] if src_layer is not None else None,
            compress_x=s.compress_x,
            compress_start=s.compress_start,
            shared=s.shared,
            tie_break="deterministic",
            backend=model.kernel_backend,
        )
        o[:, s.span] = attn.attend(x[:, s.span], _rows(rows, s.span), io, table)
        model.keep_layer_io(layer, io, st)
    y = attn.project_out(o, freqs)
    h = expand(y, h, attn_post, attn_comb)
    ffn_pre, ffn_post, ffn_comb = _mixes(block, h, seqs, "ffn")
    y = _moe(block.ffn, block.ffn_norm(collapse(h, attn_pre)), seqs)
    return expand(y, h, ffn_post, ffn_comb), ffn_pre


def _positions(seqs: list[ChunkRows], device: torch.device) -> torch.Tensor:
    """[S] int64 position of each stacked row (sequence after sequence): a layer's rotations are
    `table[positions]`, gathered in one op instead of a slice a sequence."""
    return torch.cat([torch.arange(s.start, s.start + s.t) for s in seqs]).to(device)


def _half(model: Transformer, seqs: list[ChunkRows], layers: range, batched_attention: bool) -> list[int]:
    """The sequences that take the batched attention stage in the half of `layers`: decided before any
    layer of it runs (a layer changes only its own ring's valid-from)."""
    if not batched_attention:
        return []
    return [i for i, s in enumerate(seqs) if chunk_batchable(model, s, layers)]


def _check(model: Transformer, plan: PrefillPlan, state: ModelState) -> None:
    """What `Transformer.run` refuses, checked before any state changes."""
    w, lo, hi = model.cfg.window_size, plan.start, plan.end
    if not lo - w <= plan.dec_from <= hi or (plan.dec_from < lo and model.split is None):
        raise ValueError(f"dec_from {plan.dec_from} must be in [start - W, end] = [{lo - w}, {hi}]")
    if plan.dec_from < plan.start and state.enc_from > plan.dec_from:
        raise ValueError(
            f"encoder outputs from position {plan.dec_from} are not in the state "
            f"(valid from {state.enc_from}); replay the encoder instead"
        )


def prefill_many(
    model: Transformer,
    chunks: Sequence[torch.Tensor],
    states: Sequence[ModelState | None],
    *,
    prompt_ends: Sequence[int | None] | None = None,
    mode: str = "ced",
    batched_attention: bool = True,
) -> list[PassOutput]:
    """Prefill (or extend) N sequences in one pass: chunk `chunks[i]` ([1, T_i] int64, T_i >= 1) onto
    `states[i]` (None: a fresh state).

    Equals `[prefill(model, chunks[i], states[i], mode=mode, prompt_end=prompt_ends[i]) for i]` bit for
    bit (tie_break "deterministic", the serving rule): logits, states, stats.

    batched_attention: False runs every sequence's attention stage alone (`Attention.attend`, the slow
    twin of the batched stage; the row-wise ops and the mixes stay as they are).

    Raises:
        ValueError: no sequences, length mismatches, a chunk not [1, T >= 1], a state of batch != 1, one
            state given twice, token ids out of range, or what `prefill` refuses; all before any state
            changes.
    """
    n = len(chunks)
    ends = [None] * n if prompt_ends is None else list(prompt_ends)
    if n == 0 or len(states) != n or len(ends) != n:
        raise ValueError(
            f"prefill_many needs one chunk, state and prompt_end per sequence, got {n} chunks, "
            f"{len(states)} states, {len(ends)} prompt_ends"
        )
    if mode not in PREFILL_MODES:
        raise ValueError(f"mode must be one of {PREFILL_MODES}, got {mode!r}")
    real = [s for s in states if s is not None]
    if len({id(s) for s in real}) != len(real):
        raise ValueError("prefill_many got the same state twice; each sequence needs its own")
    cfg = model.cfg
    device = model.head.weight.device
    model._check_backend_device(device)
    for c in chunks:
        if c.dim() != 2 or c.size(0) != 1 or c.size(1) == 0:
            raise ValueError(f"each chunk must be [1, T] with T >= 1, got {tuple(c.shape)}")
    # the ids' range over all chunks at once (four dispatched ops, not four a chunk); the first chunk out
    # of range is named
    every = torch.cat(list(chunks), dim=1)
    if int(every.min()) < 0 or int(every.max()) >= cfg.vocab_size:
        bad = next(c for c in chunks if int(c.min()) < 0 or int(c.max()) >= cfg.vocab_size)
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size}), got {bad.tolist()}")
    bad = [s.batch for s in real if s.batch != 1]
    if bad:
        raise ValueError(f"prefill_many takes batch-1 states, got batch {bad[0]}")
    states = [s if s is not None else model.new_state(1, device=device) for s in states]
    plans = [plan_prefill(model, c, s, mode=mode, prompt_end=e)
             for c, s, e in zip(chunks, states, ends, strict=True)]  # fmt: skip
    for plan, s in zip(plans, states, strict=True):
        _check(model, plan, s)

    for plan, s in zip(plans, states, strict=True):
        plan.mark(s)
    split = model.split if model.split is not None else cfg.n_layers
    enc = [ChunkRows(state=s, start=p.start, t=p.tokens.size(1), floor=p.enc_floor)
           for p, s in zip(plans, states, strict=True)]  # fmt: skip
    _place(enc)
    ids = torch.cat([p.tokens for p in plans], dim=1)  # [1, S]
    h = model.embed(ids).unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)  # [1, S, hc, d]
    pre = identity_pre(1, ids.size(1), cfg.hc_mult, device)
    last = max(p.end for p in plans)
    batched, sel = _half(model, enc, range(split), batched_attention), ChunkSelection()
    positions = _positions(enc, device)
    for layer in range(split):
        h, pre = _layer(model, layer, h, pre, enc, model.rope_for(layer, last, device), batched, sel,
                        positions)  # fmt: skip

    dec_of: dict[int, ChunkRows] = {}
    if model.split is None:
        dec_of = dict(enumerate(enc))
    else:
        w = cfg.window_size
        hs, pres, dec = [], [], []
        # the split layer's inputs of every encoder row at once (collapse and RMSNorm are row-wise: each
        # row's value is its lone pass's), cut per sequence below
        compress_in = None
        if any(p.dec_from != p.start for p in plans):
            compress_in = model.layers[split].attn_input(h, pre)  # [1, S, dim]
        for i, (p, s, e) in enumerate(zip(plans, states, enc, strict=True)):
            h_new, pre_new = h[:, e.span], pre[:, e.span]
            if p.dec_from < p.start:
                # read the ring before this pass's rows overwrite its slots
                slots = torch.arange(p.dec_from, p.start, device=device) % w
                hd = torch.cat([s.enc_lanes[:, slots], h_new], dim=1)
                pd = torch.cat([s.enc_pre[:, slots], pre_new], dim=1)
            else:
                hd, pd = h_new[:, p.dec_from - p.start :], pre_new[:, p.dec_from - p.start :]
            model._save_encoder_rows(s, h_new, pre_new, p.start)
            cx = None if compress_in is None or p.dec_from == p.start else compress_in[:, e.span]
            if p.dec_from == p.end:
                model._compress_only(split, cx, p.start, s)
                continue
            hs.append(hd)
            pres.append(pd)
            r = ChunkRows(state=s, start=p.dec_from, t=p.end - p.dec_from, floor=p.dec_floor, compress_x=cx,
                      compress_start=p.start)  # fmt: skip
            dec.append(r)
            dec_of[i] = r
        if dec:
            _place(dec)
            h, pre = torch.cat(hs, dim=1), torch.cat(pres, dim=1)
            batched, sel = _half(model, dec, range(split, cfg.n_layers), batched_attention), ChunkSelection()
            positions = _positions(dec, device)
            for layer in range(split, cfg.n_layers):
                h, pre = _layer(model, layer, h, pre, dec, model.rope_for(layer, last, device), batched, sel,
                                positions)  # fmt: skip
                for r in dec:
                    r.compress_x = None  # only the split layer compresses the new rows' inputs

    logits: dict[int, torch.Tensor] = {}
    if dec_of:
        order = sorted(dec_of)
        tails = torch.tensor([dec_of[i].at + dec_of[i].t - 1 for i in order], device=device)
        x = model.norm(collapse(h[0, tails].unsqueeze(1), pre[0, tails].unsqueeze(1)))  # [M, 1, d]
        # each sequence's head product as its lone pass makes it (`fp32_linear` of one row), all in one
        # call as decode_many makes them: `rowwise_linear` stacks the rows where MKL's mode makes a stacked
        # row's sums a lone row's (strict), else runs one-row products (session 21: one product per
        # sequence had cost about 0.14 ms a sequence under strict, the head's weight read each time)
        rows = rowwise_linear(x[:, -1].float(), model.head.weight)  # [M, vocab]
        logits = {i: rows[k : k + 1] for k, i in enumerate(order)}

    outs = []
    for i, (p, s) in enumerate(zip(plans, states, strict=True)):
        kept = s.tokens if p.start == s.tokens.size(1) else s.tokens[:, : p.start]
        s.tokens = append_rows(kept, p.tokens)
        t = p.tokens.size(1)
        rows_per_layer = [t] * split + [p.end - p.dec_from] * (cfg.n_layers - split)
        compressed = {layer: t for layer in cfg.kv_source_layers if layer < split}
        if model.split is not None:
            compressed[split] = t
        stats = PassStats(
            start=p.start,
            end=p.end,
            decoder_from=p.dec_from if model.split is not None else p.end,
            rows_per_layer=tuple(rows_per_layer),
            compressed_rows=compressed,
        )
        outs.append(PassOutput(logits=logits.get(i), state=s, stats=stats))
    return outs

"""One decode step for many independent sequences at once, each at its own position: the batched twin of
`inference.decode` that a serving scheduler runs over every session decoding in a step.

Knows nothing of sessions or scheduling. Every row-wise op (embedding, mHC mixes, norms, the attention
projections, MoE, the head) runs once over the stacked rows of all sequences, and so does the attention
stage (window ring, global KV writes, top-k selection, sparse attention: `model/batched_attention.py`) for
every sequence it can take; the rest (an empty state, windows dropped and not replayed) and, on request,
every sequence run that stage alone (`Attention.attend` on its own state: the slow twin). The result is
batch-invariant: each sequence's logits and state are bit-identical to a lone `decode` of it
(`tests/model/test_batched.py` compares them on fresh random states of unequal lengths), because the
kernels used are row-invariant (`model/invariant.py`, `model/batched_attention.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from model.append_buffer import append_rows_many
from model.attention import AttnIO, ProjectedRows
from model.batched_attention import Selection, attend_rows, batchable
from model.invariant import rowwise_linear
from model.mhc import collapse, expand, identity_pre
from model.owned_rows import write_ring_rows
from model.state import ModelState
from model.transformer import PassOutput, PassStats, Transformer

__all__ = ["decode_many"]


def _rows(rows: ProjectedRows, idx: torch.Tensor | slice) -> ProjectedRows:
    return ProjectedRows(qr=rows.qr[idx], q=rows.q[idx], kv=rows.kv[idx], codes=rows.codes[idx],
                         scales=rows.scales[idx])  # fmt: skip


def _attend_alone(
    model: Transformer,
    layer: int,
    x: torch.Tensor,
    rows: ProjectedRows,
    state: ModelState,
    shared: dict,
    start: int,
    table: torch.Tensor,
) -> torch.Tensor:
    """The slow twin for one sequence: `Attention.attend` on its own state (x [1, 1, dim]) -> [1, 1, H, D]."""
    cfg = model.cfg
    src_layer = cfg.kv_source_of(layer)
    io = AttnIO(
        start=start,
        floor=0,
        window=state.windows[layer],
        window_codes=state.window_codes[layer],
        window_scales=state.window_scales[layer],
        window_from=state.window_from[layer],
        source=state.sources[src_layer] if src_layer is not None else None,
        shared=shared,
        tie_break="deterministic",
        backend=model.kernel_backend,
    )
    out = model.layers[layer].attn.attend(x, rows, io, table)
    model.keep_layer_io(layer, io, state)
    return out


@dataclass
class _Step:
    """What every layer of a step shares: each sequence's position, and its rotation from each rope table
    (one lookup per table per step, not per layer)."""

    starts: list[int]
    positions: torch.Tensor  # [N] int64
    # write new rows into the rings each state alone holds (model/owned_rows.py)
    in_place: bool = False
    freqs: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def rotations(self, model: Transformer, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s rope table and the rotations at each sequence's position, [N, 1, rope/2]."""
        table = model.rope_for(layer, max(self.starts) + 1, self.positions.device)
        cached = self.freqs.get(id(table))
        if cached is None or cached[0] is not table:
            cached = (table, table[self.positions].unsqueeze(1))
            self.freqs[id(table)] = cached
        return cached


@dataclass
class _Half:
    """What the layers of one half (encoder or decoder) share in a step: the batched sequences'
    published selections, and the lone pass's `shared` dict of each sequence run alone."""

    selection: Selection = field(default_factory=Selection)
    shared: dict[int, dict] = field(default_factory=dict)


def _attend_layer(
    model: Transformer,
    layer: int,
    x: torch.Tensor,
    states: Sequence[ModelState],
    half: _Half,
    step: _Step,
    batched: list[int],
) -> torch.Tensor:
    """Layer `layer`'s attention over one new row per sequence: x [N, 1, dim] normed inputs -> [N, 1, dim].

    The sequences in `batched` take the batched stage together, the others `Attention.attend` alone; both
    update each state's window ring and (for kv sources) its global KV, as `Transformer._run_layer`.
    """
    attn = model.layers[layer].attn
    n, starts = len(states), step.starts
    table, freqs = step.rotations(model, layer)  # freqs [N, 1, rope/2]: each sequence at its own position
    rows = attn.project(x, freqs, backend=model.kernel_backend)
    if len(batched) == n:
        o = attend_rows(model, layer, x, rows, freqs, states, starts, half.selection, in_place=step.in_place)
        return attn.project_out(o, freqs)
    o = x.new_empty(n, 1, attn.n_heads, attn.head_dim)
    if batched:
        g = torch.tensor(batched, device=x.device)
        o[g] = attend_rows(model, layer, x[g], _rows(rows, g), freqs[g], [states[i] for i in batched],
                           [starts[i] for i in batched], half.selection, in_place=step.in_place)  # fmt: skip
    for i in sorted(set(range(n)) - set(batched)):
        one = slice(i, i + 1)
        shared = half.shared.setdefault(i, {})
        o[one] = _attend_alone(model, layer, x[one], _rows(rows, one), states[i], shared, starts[i], table)
    return attn.project_out(o, freqs)


def _layer(
    model: Transformer,
    layer: int,
    h: torch.Tensor,
    pre: torch.Tensor,
    states: Sequence[ModelState],
    half: _Half,
    step: _Step,
    batched: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`Block.forward` over the stacked rows, with the attention's per-sequence stage in the middle."""
    block = model.layers[layer]
    attn_pre, attn_post, attn_comb = block._mixes(
        h, block.hc_attn_fn, block.hc_attn_scale, block.hc_attn_base, linear=rowwise_linear, rowwise=True
    )
    y = _attend_layer(model, layer, block.attn_input(h, pre), states, half, step, batched)
    h = expand(y, h, attn_post, attn_comb)
    ffn_pre, ffn_post, ffn_comb = block._mixes(
        h, block.hc_ffn_fn, block.hc_ffn_scale, block.hc_ffn_base, linear=rowwise_linear, rowwise=True
    )
    y = block.ffn(block.ffn_norm(collapse(h, attn_pre)), rowwise=True)
    return expand(y, h, ffn_post, ffn_comb), ffn_pre


def _save_encoder_rows(model: Transformer, states: Sequence[ModelState], h: torch.Tensor, pre: torch.Tensor,
                       step: _Step) -> None:  # fmt: skip
    """`Transformer._save_encoder_rows` for one new row per sequence (h [N, 1, hc, d] bf16, pre [N, 1, hc]
    fp32): each state's encoder-output rings with its row at slot start % W. Written into the rings a state
    alone holds when the step writes in place (model/owned_rows.py); for the others in one stacked call, then
    cut apart so that each state holds rings of its own (never a view pinning the whole step's)."""
    w = model.cfg.window_size
    rings = [[s.enc_lanes for s in states], [s.enc_pre for s in states]]
    renewed, (lanes, pres) = write_ring_rows(
        rings, [h[:, 0].detach(), pre[:, 0].detach()], [p % w for p in step.starts],  # type: ignore[arg-type]
        [s.owner for s in states], in_place=step.in_place,
    )  # fmt: skip
    for i, lane, p in zip(renewed, lanes, pres, strict=True):
        states[i].enc_lanes, states[i].enc_pre = lane, p
    for s, start in zip(states, step.starts, strict=True):
        s.enc_from = min(s.enc_from, start)


def decode_many(
    model: Transformer,
    tokens: Sequence[int],
    states: Sequence[ModelState],
    *,
    batched_attention: bool = True,
    in_place: bool = True,
) -> list[PassOutput]:
    """One decode step of N sequences: `tokens[i]` at position `states[i].n_tokens` of each.

    Equals `[decode(model, tensor([tokens[i]]), states[i]) for i]` bit for bit (tie_break
    "deterministic", the serving rule), in one pass over the stacked rows.

    Args:
        tokens: one token id per sequence.
        states: batch-1 states, distinct objects (each is updated in place and returned in its output).
        batched_attention: False runs every sequence's attention stage alone (the slow twin of the
            batched stage; the row-wise ops stay batched).
        in_place: write each new row into the ring tensors (window rings, encoder-output rings, carries)
            that a state alone holds, as an earlier step made them for it (model/owned_rows.py); False:
            fresh tensors for every state each step (the slow twin). The same values either way.

    Returns:
        One PassOutput per sequence, logits [1, vocab] fp32.

    Raises:
        ValueError: no sequences, a length mismatch, a state of batch != 1, or one state given twice.
    """
    if not states or len(tokens) != len(states):
        raise ValueError(
            f"decode_many needs one token per state, got {len(tokens)} tokens and {len(states)} states"
        )
    if len({id(s) for s in states}) != len(states):
        raise ValueError("decode_many got the same state twice; each sequence needs its own")
    bad = [s.batch for s in states if s.batch != 1]
    if bad:
        raise ValueError(f"decode_many takes batch-1 states, got batch {bad[0]}")
    cfg = model.cfg
    device = model.head.weight.device
    model._check_backend_device(device)
    starts = [s.n_tokens for s in states]
    ids = torch.tensor(list(tokens), dtype=torch.int64, device=device).view(-1, 1)
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size}), got {list(tokens)}")
    for s in states:
        s.extra.pop("decoder_floor", None)
    n = len(states)
    h = model.embed(ids).unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)  # [N, 1, hc, d]
    pre = identity_pre(n, 1, cfg.hc_mult, device)
    split = model.split if model.split is not None else cfg.n_layers
    # decided before any state changes: a state's layout is what it was when the step began
    batched = [i for i, s in enumerate(states) if batched_attention and batchable(model, s)]
    # in place only in inference mode (the serving passes'): nothing there records autograd history, and
    # the tensors it marks are inference tensors, written only in that mode again
    write = in_place and torch.is_inference_mode_enabled()
    step = _Step(starts=starts, positions=torch.tensor(starts, device=device), in_place=write)
    half = _Half()
    for layer in range(split):
        h, pre = _layer(model, layer, h, pre, states, half, step, batched)
    if model.split is not None:
        _save_encoder_rows(model, states, h, pre, step)
        half = _Half()
        for layer in range(split, cfg.n_layers):
            h, pre = _layer(model, layer, h, pre, states, half, step, batched)
    x = model.norm(collapse(h, pre))  # [N, 1, d]
    logits = rowwise_linear(x[:, -1].float(), model.head.weight)  # [N, vocab]
    # as Transformer.run reports them: the encoder's kv sources, and the split layer's (CED)
    compressed = {layer: 1 for layer in cfg.kv_source_layers if layer < split}
    if model.split is not None:
        compressed[split] = 1
    outs = []
    # starts[i] is each state's n_tokens, so every history is kept whole
    histories = append_rows_many([s.tokens for s in states], ids)
    for i, (s, tokens, row) in enumerate(zip(states, histories, logits.split(1), strict=True)):
        s.tokens = tokens
        stats = PassStats(
            start=starts[i],
            end=starts[i] + 1,
            decoder_from=starts[i] if model.split is not None else starts[i] + 1,
            rows_per_layer=(1,) * cfg.n_layers,
            compressed_rows=compressed,
        )
        outs.append(PassOutput(logits=row, state=s, stats=stats))
    return outs

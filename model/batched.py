"""One decode step for many independent sequences at once, each at its own position: the batched twin of
`inference.decode` that a serving scheduler runs over every session decoding in a step.

Knows nothing of sessions or scheduling. Every row-wise op (embedding, mHC mixes, norms, the attention
projections, MoE, the head) runs once over the stacked rows of all sequences; the per-sequence parts (the
window ring, global KV writes, top-k selection, sparse attention) run per sequence on that sequence's
own state. The result is batch-invariant: each sequence's logits and state are bit-identical to a lone
`decode` of it (`tests/model/test_batched.py` compares them on fresh random states of unequal lengths),
because the row-wise kernels used are row-invariant (`model/invariant.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model.append_buffer import append_rows
from model.attention import AttnIO, ProjectedRows
from model.invariant import rowwise_linear
from model.mhc import collapse, expand, identity_pre
from model.state import ModelState
from model.transformer import PassOutput, PassStats, Transformer

__all__ = ["decode_many"]


def _row(rows: ProjectedRows, i: int) -> ProjectedRows:
    return ProjectedRows(
        qr=rows.qr[i : i + 1],
        q=rows.q[i : i + 1],
        kv=rows.kv[i : i + 1],
        codes=rows.codes[i : i + 1],
        scales=rows.scales[i : i + 1],
    )


def _attend_layer(
    model: Transformer,
    layer: int,
    x: torch.Tensor,
    states: Sequence[ModelState],
    shared: list[dict],
    starts: Sequence[int],
) -> torch.Tensor:
    """Layer `layer`'s attention over one new row per sequence: x [N, 1, dim] normed inputs -> [N, 1, dim].

    Updates each state's window ring and (for kv sources) its global KV, as `Transformer._run_layer`.
    """
    cfg = model.cfg
    attn = model.layers[layer].attn
    table = model.rope_for(layer, max(starts) + 1, x.device)
    positions = torch.tensor(list(starts), device=x.device)
    freqs = table[positions].unsqueeze(1)  # [N, 1, rope/2]: each sequence at its own position
    rows = attn.project(x, freqs, backend=model.kernel_backend)
    src_layer = cfg.kv_source_of(layer)
    outs = []
    for i, state in enumerate(states):
        io = AttnIO(
            start=starts[i],
            floor=0,
            window=state.windows[layer],
            window_codes=state.window_codes[layer],
            window_scales=state.window_scales[layer],
            window_from=state.window_from[layer],
            source=state.sources[src_layer] if src_layer is not None else None,
            shared=shared[i],
            tie_break="deterministic",
            backend=model.kernel_backend,
        )
        outs.append(attn.attend(x[i : i + 1], _row(rows, i), io, table))
        model.keep_layer_io(layer, io, state)
    return attn.project_out(torch.cat(outs, dim=0), freqs)


def _layer(
    model: Transformer,
    layer: int,
    h: torch.Tensor,
    pre: torch.Tensor,
    states: Sequence[ModelState],
    shared: list[dict],
    starts: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`Block.forward` over the stacked rows, with the attention's per-sequence stage in the middle."""
    block = model.layers[layer]
    attn_pre, attn_post, attn_comb = block._mixes(
        h, block.hc_attn_fn, block.hc_attn_scale, block.hc_attn_base, linear=rowwise_linear, rowwise=True
    )
    y = _attend_layer(model, layer, block.attn_input(h, pre), states, shared, starts)
    h = expand(y, h, attn_post, attn_comb)
    ffn_pre, ffn_post, ffn_comb = block._mixes(
        h, block.hc_ffn_fn, block.hc_ffn_scale, block.hc_ffn_base, linear=rowwise_linear, rowwise=True
    )
    y = block.ffn(block.ffn_norm(collapse(h, attn_pre)), rowwise=True)
    return expand(y, h, ffn_post, ffn_comb), ffn_pre


def decode_many(model: Transformer, tokens: Sequence[int], states: Sequence[ModelState]) -> list[PassOutput]:
    """One decode step of N sequences: `tokens[i]` at position `states[i].n_tokens` of each.

    Equals `[decode(model, tensor([tokens[i]]), states[i]) for i]` bit for bit (tie_break
    "deterministic", the serving rule), in one pass over the stacked rows.

    Args:
        tokens: one token id per sequence.
        states: batch-1 states, distinct objects (each is updated in place and returned in its output).

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
    shared: list[dict] = [{} for _ in states]
    for layer in range(split):
        h, pre = _layer(model, layer, h, pre, states, shared, starts)
    if model.split is not None:
        for i, s in enumerate(states):
            model._save_encoder_rows(s, h[i : i + 1], pre[i : i + 1], starts[i])
        shared = [{} for _ in states]
        for layer in range(split, cfg.n_layers):
            h, pre = _layer(model, layer, h, pre, states, shared, starts)
    x = model.norm(collapse(h, pre))  # [N, 1, d]
    logits = rowwise_linear(x[:, -1].float(), model.head.weight)  # [N, vocab]
    # as Transformer.run reports them: the encoder's kv sources, and the split layer's (CED)
    compressed = {layer: 1 for layer in cfg.kv_source_layers if layer < split}
    if model.split is not None:
        compressed[split] = 1
    outs = []
    for i, s in enumerate(states):
        kept = s.tokens if starts[i] == s.tokens.size(1) else s.tokens[:, : starts[i]]
        s.tokens = append_rows(kept, ids[i : i + 1])
        stats = PassStats(
            start=starts[i],
            end=starts[i] + 1,
            decoder_from=starts[i] if model.split is not None else starts[i] + 1,
            rows_per_layer=(1,) * cfg.n_layers,
            compressed_rows=compressed,
        )
        outs.append(PassOutput(logits=logits[i : i + 1], state=s, stats=stats))
    return outs

"""The training forward pass: the whole-sequence function of `Transformer.run` in `reference` prefill mode
(every layer over every row from position 0), written with dense masked attention so that autograd runs it
fast on CPU, plus the indexer's distillation loss.

Knows nothing of optimizers or data. It reuses the model's own modules (mHC mixers, norms, compressors,
MoE, projections) and replaces only the attention core: `kernels.sparse_attn` over gathered ids becomes a
softmax over [window keys ; compressed entries ; sink] with boolean masks, which is the same function
(the sparse kernel's per-block bf16 rounding aside). The selection follows the model: the window covers
positions p-W+1..p, compressed entry j of ratio m is visible to row p when j < (p + 1) // m, an index
source picks its top-k (inside the candidate pool for Reindex layers above the candidate source) and the
layers that borrow from it reuse the pick. Differences from the serving numerics are switches
(`PassMode`): `sparse=False` lets every visible compressed entry through (the dense warm-up of the
lightning indexer), `qdq=False` skips the FP4 / MXFP4 / FP8 quantize-dequantize of the caches (the kernels'
QDQ has a straight-through gradient, so `qdq=True` trains through it).

Indexer distillation (DeepSeek-V3.2 DSA recipe): the target of an index source is its own main attention's
probability mass over compressed entries, summed over heads and renormalized, detached; the prediction is
the softmax of the index scores over the visible entries, computed from detached inputs, so the KL term
trains only the indexer (its query projection, head weights and, at kv sources, key projection).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import candidate_blocks, qdq_fp4_e4m3, qdq_fp8_ue8m0, qdq_mxfp4, select_topk
from model.attention import Attention
from model.mhc import collapse, expand, identity_pre
from model.rope import apply_rope
from model.transformer import Transformer

__all__ = ["PassMode", "TrainPassOutput", "head_logits", "train_pass"]

# tie rule of the model's service mode: higher score first, then lower position
_TIE_BREAK = "deterministic"


@dataclass(frozen=True, kw_only=True)
class PassMode:
    """How faithful to serving the training pass is.

    sparse: select each row's compressed entries with the indexer's top-k (False: all visible entries).
    qdq: quantize-dequantize main KV (FP4), index keys and queries (MXFP4) and window KV (FP8).
    distill: compute the indexer KL term (it costs one extra score tensor per index source).
    """

    sparse: bool = False
    qdq: bool = False
    distill: bool = True


@dataclass(frozen=True, kw_only=True)
class TrainPassOutput:
    """hidden: [B, T, dim] final-normed hidden states (the head's input; `head_logits` turns chosen rows into
    logits, so a loss over few positions does not pay for the whole [B, T, vocab] product); distill: scalar
    fp32 mean KL over the index sources (0 when off); index_agreement: per index source, the share of the
    dense main attention's compressed-entry mass that an index_topk pick of the index scores keeps (only
    when `sparse` is off and there are more entries than index_topk): a cheap probe of the indexer.
    evidence: scalar fp32 evidence-attention loss (0 when no hints are given), see `train_pass`."""

    hidden: torch.Tensor
    distill: torch.Tensor
    index_agreement: dict[int, float]
    evidence: torch.Tensor


def _maybe(fn, x: torch.Tensor, on: bool) -> torch.Tensor:
    return fn(x) if on else x


def _indexer_scores(
    attn: Attention, x: torch.Tensor, qr: torch.Tensor, freqs: torch.Tensor, keys: torch.Tensor,
    vis: torch.Tensor, qdq: bool,
) -> torch.Tensor:
    """Index scores [B, T, G] fp32 (-inf where invisible) from detached inputs, as `Indexer.select` scores."""
    ix = attn.indexer
    assert ix is not None
    q = ix.wq_b(qr.detach()).unflatten(-1, (ix.n_heads, ix.index_head_dim))  # [B, T, H_I, D_I]
    q = _maybe(qdq_mxfp4, apply_rope(q, freqs, ix.rope_dim), qdq)
    weights = ix.weights_proj(x.detach()) * (ix.index_head_dim**-0.5 * ix.n_heads**-0.5)  # [B, T, H_I]
    scores = torch.einsum("bthd,bgd->bthg", q, keys).relu()
    scores = (scores * weights.unsqueeze(-1)).sum(dim=2)  # [B, T, G]
    return scores.masked_fill(~vis, -torch.inf)


def _evidence_loss(p_comp: torch.Tensor, sel: torch.Tensor, hints: torch.Tensor) -> torch.Tensor | None:
    """-log of the head-mean attention probability on each hinted entry, averaged over the hints whose entry
    the row may attend (a top-k pick that dropped it has no gradient to give). p_comp [B, H, T, G]; sel
    [B, T, G]; hints [N, 3] (batch row, query position, entry)."""
    b, q, e = hints.unbind(-1)
    ok = sel[b, q, e]
    if not ok.any():
        return None
    p = p_comp[b[ok], :, q[ok], e[ok]].float().mean(-1)  # [N'] mean over heads
    # -log(mean_h p) <= log(H) - log(max_h p): one head that finds the evidence already pays off
    return -torch.log(p + 1e-6).mean()


def _attention(
    model: Transformer, i: int, x: torch.Tensor, shared: dict, mode: PassMode, losses: list,
    agreement: dict[int, float], hints: torch.Tensor | None = None, evidence: list | None = None,
    mass: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Layer i's attention over the whole sequence: x [B, T, dim] -> [B, T, dim]."""
    cfg = model.cfg
    attn: Attention = model.layers[i].attn
    b, t, _ = x.shape
    table = model.rope_for(i, t, x.device)
    freqs = table[:t]
    rd, w, m = attn.rope_dim, attn.window_size, attn.ratio

    qr = attn.q_norm(attn.wq_a(x))
    q = apply_rope(attn.wq_b(qr).unflatten(-1, (attn.n_heads, attn.head_dim)), freqs, rd)  # [B, T, H, D]
    kv = _maybe(qdq_fp8_ue8m0, apply_rope(attn.kv_norm(attn.wkv(x)), freqs, rd), mode.qdq)  # [B, T, D]
    pos = torch.arange(t, device=x.device)
    band = (pos.view(1, t) <= pos.view(t, 1)) & (pos.view(1, t) > pos.view(t, 1) - w)  # [T(query), T(key)]
    s_win = torch.einsum("bthd,bsd->bhts", q, kv) * attn.softmax_scale
    s_win = s_win.masked_fill(~band, -torch.inf)
    parts, values = [s_win], [kv]

    comp = None
    if m:
        if attn.is_kv_source:
            assert attn.compressor is not None
            c = attn.compressor
            carry_kv = carry_score = None
            if m > 1:
                carry_kv = x.new_zeros(b, m, c.head_dim, dtype=torch.float32)
                carry_score = torch.full_like(carry_kv, -torch.inf)
            latent = c(x, 0, carry_kv, carry_score).latent  # [B, G, D] pre-RoPE
            f = table[torch.arange(latent.size(1), device=x.device) * m]
            keys = None
            if attn.indexer is not None and attn.indexer.owns_k:
                ix = attn.indexer
                keys = apply_rope(ix.k_norm(ix.wk(latent.detach())), f, rd)
                keys = _maybe(qdq_mxfp4, keys, mode.qdq)
            comp_kv = _maybe(qdq_fp4_e4m3, apply_rope(latent, f, rd), mode.qdq)
            shared["sources"][i] = (comp_kv, keys)
        comp, keys = shared["sources"][cfg.kv_source_of(i)]
        g = comp.size(1)
        visible = (pos + 1) // m  # [T]
        vis = torch.arange(g, device=x.device).view(1, g) < visible.view(t, 1)  # [T, G]
        vis = vis.unsqueeze(0).expand(b, t, g)
        scores = None
        if attn.is_index_source:
            scores = _indexer_scores(attn, x, qr, freqs, keys, vis, mode.qdq) if g else None
            sel = vis
            if mode.sparse and g:
                pick = scores.detach()
                if attn.is_candidate_source:
                    shared["candidates"] = candidate_blocks(
                        pick, visible, attn.candidate_block_size, attn.candidate_topk_blocks,
                        tie_break=_TIE_BREAK,
                    )
                elif attn.uses_candidates:
                    pick = pick.masked_fill(~shared["candidates"], -torch.inf)
                ids = select_topk(pick, min(cfg.index_topk, g), visible, tie_break=_TIE_BREAK).long()
                sel = torch.zeros_like(vis)
                sel.scatter_(-1, ids.clamp_min(0), ids >= 0)
                # scatter of the -1 slots wrote False at id 0; a valid pick of id 0 must survive it
                sel[..., 0] |= (ids == 0).any(-1)
            shared["selected"] = sel
        sel = shared["selected"]
        s_comp = torch.einsum("bthd,bgd->bhtg", q, comp) * attn.softmax_scale
        s_comp = s_comp.masked_fill(~sel.unsqueeze(1), -torch.inf)
        parts.append(s_comp)
        values.append(comp)

    sink = attn.attn_sink.float().view(1, -1, 1, 1).expand(b, -1, t, 1)
    logits = torch.cat([*parts, sink.to(parts[0].dtype)], dim=-1)
    probs = torch.softmax(logits.float(), dim=-1).to(x.dtype)  # [B, H, T, T + G + 1]
    o = torch.einsum("bhts,bsd->bthd", probs[..., :t], kv)
    if comp is not None:
        p_comp = probs[..., t : t + comp.size(1)]  # [B, H, T, G]
        o = o + torch.einsum("bhtg,bgd->bthd", p_comp, comp)
        if mass is not None:
            src = cfg.kv_source_of(i)
            read = p_comp.detach().float().sum((1, 2))  # [B, G]: what this layer's queries read per entry
            mass[src] = mass[src] + read if src in mass else read
        if hints is not None and evidence is not None and hints.numel():
            ev = _evidence_loss(p_comp, sel, hints)
            if ev is not None:
                evidence.append(ev)
        if attn.is_index_source and scores is not None:
            mass = p_comp.detach().float().sum(1)  # [B, T, G]
            rows = mass.sum(-1) > 0
            if mode.distill and rows.any():
                target = mass[rows] / mass[rows].sum(-1, keepdim=True)
                logp = torch.log_softmax(scores.float()[rows], dim=-1)
                kl = (target * (torch.log(target.clamp_min(1e-30)) - logp.clamp_min(-1e4))).sum(-1)
                losses.append(kl.mean())
            if not mode.sparse and scores.size(-1) > cfg.index_topk and rows.any():
                # how much of the dense attention mass an index_topk pick would keep (indexer quality)
                top = scores.detach().topk(cfg.index_topk, dim=-1).indices
                kept = mass.gather(-1, top).sum(-1)[rows] / mass.sum(-1)[rows]
                agreement[i] = float(kept.mean())
    o = apply_rope(o, freqs, rd, inverse=True).reshape(b, t, attn.n_groups, -1)  # [B, T, G_o, H*D/G_o]
    wo_a = attn.wo_a.weight.view(attn.n_groups, attn.o_lora_rank, -1)
    o = torch.einsum("btgd,grd->btgr", o, wo_a)
    return attn.wo_b(o.flatten(2))


def train_pass(
    model: Transformer,
    tokens: torch.Tensor,
    mode: PassMode,
    evidence_hints: torch.Tensor | None = None,
    attention_mass: dict[int, torch.Tensor] | None = None,
) -> TrainPassOutput:
    """Run every layer over `tokens` from position 0 (the reference prefill function), differentiably.

    Args:
        model: the transformer (any parameter dtype; fp32 for training).
        tokens: [B, T] int64 ids of positions 0 .. T-1.
        mode: selection, quantization and distillation switches.
        evidence_hints: optional [N, 3] int64 (batch row, query position, compressed entry): where the
            decoder's candidate-source layer (ratio 1, so entry = token position) should look to answer.
            The pass then returns the evidence-attention loss (`_evidence_loss`) of that layer: an
            auxiliary target for the retrieval the recall task needs, used only in training.
        attention_mass: when given, filled with kv-source layer -> [B, G] fp32: the attention
            probability every query of every layer reading that source puts on each compressed entry,
            summed over heads, queries and layers (detached; mapper calibration weights).

    Returns:
        TrainPassOutput with hidden [B, T, dim].

    Raises:
        ValueError: tokens not [B, T] with T >= 1, or hints without a ratio-1 candidate-source layer.
    """
    if tokens.dim() != 2 or tokens.size(1) == 0:
        raise ValueError(f"tokens must be [B, T] with T >= 1, got {tuple(tokens.shape)}")
    cfg = model.cfg
    hint_layer = cfg.candidate_source_layer
    if evidence_hints is not None and (hint_layer < 0 or cfg.compress_ratios[hint_layer] != 1):
        raise ValueError(
            f"evidence hints need a ratio-1 candidate-source layer; candidate_source_layer={hint_layer}"
        )
    evidence: list[torch.Tensor] = []
    b, t = tokens.shape
    h = model.embed(tokens).unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)  # [B, T, hc, d]
    pre = identity_pre(b, t, cfg.hc_mult, tokens.device)
    shared: dict = {"sources": {}}
    losses: list[torch.Tensor] = []
    agreement: dict[int, float] = {}
    for i, blk in enumerate(model.layers):
        attn_pre, attn_post, attn_comb = blk._mixes(h, blk.hc_attn_fn, blk.hc_attn_scale, blk.hc_attn_base)
        y = _attention(
            model, i, blk.attn_input(h, pre), shared, mode, losses, agreement,
            evidence_hints if i == hint_layer else None, evidence, attention_mass,
        )
        h = expand(y, h, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = blk._mixes(h, blk.hc_ffn_fn, blk.hc_ffn_scale, blk.hc_ffn_base)
        y = blk.ffn(blk.ffn_norm(collapse(h, attn_pre)))
        h, pre = expand(y, h, ffn_post, ffn_comb), ffn_pre
    x = model.norm(collapse(h, pre))  # [B, T, dim]
    distill = torch.stack(losses).mean() if losses else x.new_zeros((), dtype=torch.float32)
    ev = torch.stack(evidence).mean() if evidence else x.new_zeros((), dtype=torch.float32)
    return TrainPassOutput(hidden=x, distill=distill, index_agreement=agreement, evidence=ev)


@torch.no_grad()
def attention_mass(model: Transformer, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    """kv-source layer -> [B, T // ratio] fp32: how much attention every query puts on each compressed
    entry (summed over heads, queries and the layers reading the source), in one pass with the served
    selection and cache quantization (sparse top-k, QDQ). Task-free: it weighs the rows a model reads."""
    mass: dict[int, torch.Tensor] = {}
    train_pass(model, tokens, PassMode(sparse=True, qdq=True, distill=False), attention_mass=mass)
    return mass


def head_logits(model: Transformer, hidden: torch.Tensor) -> torch.Tensor:
    """Next-token logits of hidden rows: [..., dim] -> [..., vocab] fp32 (the model's head, in fp32)."""
    return F.linear(hidden.float(), model.head.weight.float())

"""Applying a mapper: the sender's stored global KV becomes the receiver's, in the receiver's packed format
(FP4 E2M1 + E4M3/16 main KV, MXFP4 index K), as `model.import_global` chunks carrying the receiver's
fingerprint. Knows nothing of storage or turn policy: windows and open compression groups are rebuilt
by the receiver's bounded replay after `model.state_from_global`.

Per receiver source r of ratio m and part (main KV, index K), for entries j in [0, P // m):
    X = concat_s strip_rope_sender(dequant(sender_s[j]), j*m)      [n, k*D_in] fp32
    Y = X @ coefᵀ + intercept                                        [n, D_out] fp32
    receiver_r[j] = quantize(add_rope_receiver(Y, j*m))
An identity part under equal RoPE tables is the exact composition strip∘id∘add = id, and FP4 re-quantization
is not idempotent on codes (a dequantized group whose largest code is below 6 re-quantizes to another scale
and other codes), so those parts copy the stored codes and scales instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import dequantize_fp4_e4m3, dequantize_mxfp4, quantize_fp4_e4m3, quantize_mxfp4
from mappers.artifact import KVMapper, PartMap
from mappers.errors import MapperMismatch
from mappers.geometry import add_rope, entry_rotations, rope_spec, strip_rope
from mappers.mlp import build_features, mlp_predict
from model import (
    CacheFormatError,
    ModelConfig,
    ModelState,
    SourceCache,
    Transformer,
    export_global,
    import_global_chunks,
)


@dataclass(frozen=True, kw_only=True)
class Applicability:
    """Whether a mapper may serve a swap from one checkpoint to another, and why not."""

    ok: bool
    reason: str


@dataclass(frozen=True, kw_only=True)
class MappedGlobal:
    """The receiver's global KV of positions [0, n_tokens).

    Attributes:
        blobs: consecutive `model.import_global` chunks with the receiver's fingerprint.
        bounds: (start, end) positions of each blob.
        copied_parts: (receiver layer, part) pairs whose codes were copied (exact identity).
    """

    blobs: tuple[bytes, ...]
    bounds: tuple[tuple[int, int], ...]
    n_tokens: int
    copied_parts: tuple[tuple[int, str], ...]


def applicability(
    mapper: KVMapper, *, sender_fingerprint: bytes, receiver_fingerprint: bytes, require_gate: bool = True
) -> Applicability:
    """Whether `mapper` maps caches of `sender_fingerprint` into `receiver_fingerprint` (an expected miss
    is a value, not an exception): fingerprints must match where the mapper records them, and the mapper
    must have passed its gate unless `require_gate` is False."""
    for side, fp in (("sender", sender_fingerprint), ("receiver", receiver_fingerprint)):
        want = getattr(mapper, side).fingerprint
        if want is not None and want != fp.hex():
            return Applicability(ok=False, reason=f"{side}_fingerprint_mismatch")
    if require_gate and not mapper.passed_gate:
        return Applicability(ok=False, reason="gate_not_passed")
    return Applicability(ok=True, reason="ok")


_PART_FIELDS = {"kv": ("kv", "kv_packed", "kv_scales"), "index": ("index_k", "index_packed", "index_scales")}


def _part_fields(src: SourceCache, part: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dequantized view, codes, scales) of one part."""
    if part == "kv":
        return src.kv, src.kv_packed, src.kv_scales
    return src.index_k, src.index_packed, src.index_scales


def _quantize(part: str, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 [B, n, D] -> (bf16 dequantized view, packed codes uint8, scale bytes uint8)."""
    if part == "kv":
        packed, scales = quantize_fp4_e4m3(y)
        return dequantize_fp4_e4m3(packed, scales, torch.bfloat16), packed, scales.view(torch.uint8)
    packed, scales = quantize_mxfp4(y)
    return dequantize_mxfp4(packed, scales, torch.bfloat16), packed, scales


def map_part_content(
    mapper: KVMapper, receiver_layer: int, part: str, content: list[torch.Tensor]
) -> torch.Tensor:
    """The linear step in content space (identity or linear parts).

    Args:
        content: per sender layer of the part's `sender_layers`, fp32 [..., D_in] RoPE-stripped entries.

    Returns:
        fp32 [..., D_out] predicted receiver content.
    """
    pm = mapper.layer(receiver_layer).part(part)
    x = torch.cat(content, dim=-1)  # [..., k*D_in]
    if pm.kind == "identity":
        return x
    assert pm.kind == "linear", f"{part} part of kind {pm.kind} has no content map"
    coef, intercept = mapper.weights(receiver_layer, part)
    return x @ coef.to(x.device).T + intercept.to(x.device)  # [..., D_out]


def recompute_index(
    receiver_model: Transformer, layer: int, latent: torch.Tensor, rotations: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index keys from a pre-RoPE latent with the receiver's own indexer (k_norm(wk(latent)), RoPE, MXFP4).

    Args:
        latent: fp32 [B, n, D] mapped main-KV content; rotations: [n, rope_dim/2] complex64 of its entries.

    Returns:
        (bf16 dequantized view [B, n, D_I], codes uint8 [B, n, D_I/2], E8M0 bytes uint8 [B, n, D_I/32]).
    """
    indexer = receiver_model.layers[layer].attn.indexer
    assert indexer is not None and indexer.owns_k, f"receiver layer {layer} makes no index keys"
    weight = next(indexer.parameters())
    return indexer.keys(latent.to(weight.device, torch.bfloat16), rotations.to(weight.device))


def map_sources(
    mapper: KVMapper,
    sender_sources: dict[int, SourceCache],
    n_tokens: int,
    *,
    receiver_model: Transformer | None = None,
    tokens: torch.Tensor | None = None,
) -> tuple[dict[int, SourceCache], list[tuple[int, str]]]:
    """Map the global KV of positions [0, n_tokens) for every receiver kv source (any batch size B).

    Args:
        sender_sources: sender layer -> SourceCache holding at least n_tokens // ratio entries.
        receiver_model: the receiver, needed by index parts of kind "recompute" and mlp parts that read
            token embeddings (`KVMapper.needs_receiver_weights`).
        tokens: [B, >= n_tokens] int64 history tokens, needed by mlp parts reading token embeddings.

    Returns:
        receiver layer -> SourceCache ([B, n_tokens // ratio, ...], no carries), and the parts copied.

    Raises:
        ValueError: a "recompute" part without `receiver_model`.
    """
    if mapper.needs_receiver_weights and receiver_model is None:
        raise ValueError("this mapper reads the receiver's weights (recompute, mlp): pass receiver_model")
    if mapper.needs_tokens and tokens is None:
        raise ValueError("this mapper's mlp parts read the history's token embeddings: pass tokens")
    s_rope, r_rope = rope_spec(mapper.sender.config), rope_spec(mapper.receiver.config)
    embed_rows = None
    if mapper.needs_tokens:
        assert receiver_model is not None and tokens is not None
        weight = receiver_model.embed.weight
        embed_rows = weight[tokens[:, :n_tokens].to(weight.device)].float()
    out: dict[int, SourceCache] = {}
    copied: list[tuple[int, str]] = []
    for lm in mapper.layers:
        m = lm.ratio
        n = n_tokens // m
        device = sender_sources[lm.kv.sender_layers[0]].kv.device
        s_rot = entry_rotations(s_rope, m, n, device)
        r_rot = entry_rotations(r_rope, m, n, device)
        fields: dict[str, torch.Tensor] = {}
        kv_content = None
        for part in ("kv", "index"):
            pm: PartMap = lm.part(part)
            names = _PART_FIELDS[part]
            if pm.kind == "recompute":
                assert receiver_model is not None and kv_content is not None
                keys = recompute_index(receiver_model, lm.receiver_layer, kv_content, r_rot)
                fields.update(zip(names, (t.to(device) for t in keys), strict=True))
                continue
            if pm.kind == "identity" and s_rope == r_rope:
                view, codes, scales = _part_fields(sender_sources[pm.sender_layers[0]], part)
                fields.update(zip(names, (view[:, :n], codes[:, :n], scales[:, :n]), strict=True))
                copied.append((lm.receiver_layer, part))
                if part == "kv":
                    kv_content = strip_rope(view[:, :n], s_rot, s_rope.rope_dim)
                continue
            content = [
                strip_rope(_part_fields(sender_sources[s], part)[0][:, :n], s_rot, s_rope.rope_dim)
                for s in pm.sender_layers
            ]
            if pm.kind == "mlp":
                y = _mlp_part(mapper, lm.receiver_layer, part, content, sender_sources, n_tokens, embed_rows)
            else:
                y = map_part_content(mapper, lm.receiver_layer, part, content)
            if part == "kv":
                kv_content = y
            fields.update(zip(names, _quantize(part, add_rope(y, r_rot, r_rope.rope_dim)), strict=True))
        out[lm.receiver_layer] = SourceCache(ratio=m, **fields)
    return out, copied


def sender_other_content(
    sender_sources: dict[int, SourceCache], layers: Sequence[int], n_tokens: int, s_rope
) -> dict[int, tuple[int, torch.Tensor]]:
    """Sender layer -> (ratio, content-space main KV of [0, n_tokens)) for an mlp part's other layers."""
    out = {}
    for s in layers:
        src = sender_sources[s]
        n_s = n_tokens // src.ratio
        rot = entry_rotations(s_rope, src.ratio, n_s, src.kv.device)
        out[s] = (src.ratio, strip_rope(src.kv[:, :n_s], rot, s_rope.rope_dim))
    return out


def _mlp_part(
    mapper: KVMapper,
    receiver_layer: int,
    part: str,
    content: list[torch.Tensor],
    sender_sources: dict[int, SourceCache],
    n_tokens: int,
    embed_rows: torch.Tensor | None,
) -> torch.Tensor:
    lm = mapper.layer(receiver_layer)
    pm = lm.part(part)
    assert pm.features is not None
    n = n_tokens // lm.ratio
    s_rope = rope_spec(mapper.sender.config)
    others = sender_other_content(sender_sources, pm.features.other_layers, n_tokens, s_rope)
    f = build_features(content, others, pm.features, lm.ratio, n, embed_rows=embed_rows)
    arrays = {k: v.to(f.device) for k, v in mapper.mlp_arrays(receiver_layer, part).items()}
    return mlp_predict(arrays, torch.cat(content, -1), f)


def _empty_sources(cfg: ModelConfig, device: torch.device | str) -> dict[int, SourceCache]:
    """Batch-1 empty global KV of every kv source of `cfg` (what `import_global` appends to)."""
    d, di = cfg.head_dim, cfg.index_head_dim

    def empty(width: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(1, 0, width, dtype=dtype, device=device)

    return {
        s: SourceCache(
            ratio=cfg.compress_ratios[s],
            kv=empty(d, torch.bfloat16),
            index_k=empty(di, torch.bfloat16),
            kv_packed=empty(d // 2, torch.uint8),
            kv_scales=empty(d // 16, torch.uint8),
            index_packed=empty(di // 2, torch.uint8),
            index_scales=empty(di // 32, torch.uint8),
        )
        for s in cfg.kv_source_layers
    }


def _globals_only_state(
    sources: dict[int, SourceCache], n_tokens: int, device: torch.device | str
) -> ModelState:
    # export_global / import_global read only `sources` and the history length
    return ModelState(
        tokens=torch.zeros(1, n_tokens, dtype=torch.int64, device=device),
        sources=sources,
        windows=[],
        window_codes=[],
        window_scales=[],
        window_from=[],
    )


def _read_blobs(
    cfg: ModelConfig, blobs: Sequence[bytes], fingerprint: bytes, device: torch.device | str
) -> tuple[ModelState, list[tuple[int, int]]]:
    """The sender's chunks as one globals-only state (imported in one linear-time call) and their bounds.

    Raises:
        CacheFormatError: the first chunk `import_global` would refuse (none is mapped then).
    """
    state = _globals_only_state(_empty_sources(cfg, device), 0, device)
    done = import_global_chunks(state, list(blobs), fingerprint=fingerprint)
    if done.failure is not None:
        raise CacheFormatError(f"sender chunk {done.imported}: {done.failure}")
    starts = (0, *done.ends[:-1]) if done.ends else ()
    state.tokens = torch.zeros(1, done.end or 0, dtype=torch.int64, device=device)
    return state, list(zip(starts, done.ends, strict=True))


def _chunk_bounds(n_tokens: int, chunk_tokens: int | None) -> list[tuple[int, int]]:
    if chunk_tokens is None:
        return [(0, n_tokens)]
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    return [(a, min(a + chunk_tokens, n_tokens)) for a in range(0, max(n_tokens, 1), chunk_tokens)]


@torch.no_grad()
def apply_mapper(
    mapper: KVMapper,
    sender: ModelState | Sequence[bytes],
    *,
    sender_fingerprint: bytes,
    receiver_fingerprint: bytes,
    chunk_tokens: int | None = None,
    row: int = 0,
    device: torch.device | str = "cpu",
    receiver_model: Transformer | None = None,
    tokens: torch.Tensor | None = None,
) -> MappedGlobal:
    """Map the sender's global KV of its whole history into receiver chunks.

    Args:
        sender: a sender `ModelState` (batch row `row` is mapped) or its consecutive `export_global`
            chunks from position 0.
        sender_fingerprint: the fingerprint the sender chunks were written with.
        receiver_fingerprint: the fingerprint the receiver chunks get.
        chunk_tokens: chunk size of the output for a state input (one chunk when None); chunk blobs keep
            the input chunk bounds. Chunk starts must be multiples of every ratio.
        device: where the sender blobs are decoded and the maps run.
        receiver_model: the receiver, needed when `mapper.needs_receiver_weights` (index "recompute", mlp
            parts reading token embeddings).
        tokens: [1, >= n] int64 history tokens for mlp parts reading token embeddings (a state input
            supplies its own).

    Returns:
        MappedGlobal; `model.state_from_global(receiver, tokens, list(m.blobs), fingerprint=...)` then
        a receiver `prefill` continues from it (with encoder bounded replay).

    Raises:
        MapperMismatch: a fingerprint differs from the one the mapper records (see `applicability`).
        model.CacheFormatError: a corrupt, foreign or non-contiguous sender chunk.
        ValueError: a bad chunk size or chunk start, a row outside the state's batch, or a mapper that
            needs the receiver's weights without `receiver_model`.
    """
    for side, fp in (("sender", sender_fingerprint), ("receiver", receiver_fingerprint)):
        want = getattr(mapper, side).fingerprint
        if want is not None and want != fp.hex():
            raise MapperMismatch(f"{side} fingerprint {fp.hex()[:16]}.. is not the mapper's {want[:16]}..")
    if isinstance(sender, ModelState):
        if not 0 <= row < sender.batch:
            raise ValueError(f"row {row} is outside the state's batch of {sender.batch}")
        n_tokens = sender.n_tokens
        sources = {
            layer: SourceCache(
                ratio=src.ratio,
                **{
                    f: getattr(src, f)[row : row + 1].to(device)
                    for f in ("kv", "index_k", "kv_packed", "kv_scales", "index_packed", "index_scales")
                },
            )
            for layer, src in sender.sources.items()
        }
        bounds = _chunk_bounds(n_tokens, chunk_tokens)
        if tokens is None:
            tokens = sender.tokens[row : row + 1]
    else:
        state, bounds = _read_blobs(mapper.sender.config, sender, sender_fingerprint, device)
        n_tokens, sources = state.n_tokens, state.sources
    mapped, copied = map_sources(mapper, sources, n_tokens, receiver_model=receiver_model, tokens=tokens)
    out = _globals_only_state(mapped, n_tokens, device)
    blobs = tuple(export_global(out, a, b, fingerprint=receiver_fingerprint) for a, b in bounds)
    return MappedGlobal(blobs=blobs, bounds=tuple(bounds), n_tokens=n_tokens, copied_parts=tuple(copied))

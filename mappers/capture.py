"""Capturing a model's global KV in content space: prefill tokens, dequantize every kv source's stored
entries and strip their RoPE. Knows nothing of fitting; rows come out as (batch, entry) pairs flattened.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mappers.geometry import entry_rotations, rope_spec, strip_rope
from model import ModelState, SourceCache, Transformer, prefill


@dataclass(frozen=True, kw_only=True)
class ContentKV:
    """Content-space global KV of B sequences of T tokens.

    Attributes:
        kv: kv-source layer -> fp32 [B, T // m, D] dequantized main KV with RoPE stripped.
        index: kv-source layer -> fp32 [B, T // m, D_I] dequantized index keys with RoPE stripped.
        ratios: kv-source layer -> m.
    """

    kv: dict[int, torch.Tensor]
    index: dict[int, torch.Tensor]
    ratios: dict[int, int]

    def part(self, name: str) -> dict[int, torch.Tensor]:
        return self.kv if name == "kv" else self.index


def content_of(cfg, sources: dict[int, SourceCache], n_tokens: int) -> ContentKV:
    """Strip RoPE from the dequantized entries of [0, n_tokens) of every source (cfg: model.ModelConfig)."""
    spec = rope_spec(cfg)
    kv, index, ratios = {}, {}, {}
    for layer in sorted(sources):
        src = sources[layer]
        m = src.ratio
        n = n_tokens // m
        rot = entry_rotations(spec, m, n, src.kv.device)
        kv[layer] = strip_rope(src.kv[:, :n], rot, spec.rope_dim)
        index[layer] = strip_rope(src.index_k[:, :n], rot, spec.rope_dim)
        ratios[layer] = m
    return ContentKV(kv=kv, index=index, ratios=ratios)


@torch.no_grad()
def capture_content(model: Transformer, tokens: torch.Tensor) -> tuple[ContentKV, ModelState]:
    """Prefill `tokens` [B, T] int64 (`ced` mode); return the content-space global KV and the state."""
    state = prefill(model, tokens).state
    return content_of(model.cfg, state.sources, state.n_tokens), state

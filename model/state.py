"""The explicit cache state of one batch of sequences: everything an exact continuation needs.

Knows nothing of bytes or storage (serialisation lives beside it); the forward pass reads and replaces
its tensors, never mutating a tensor another state or a snapshot (`clone`) shows, so a snapshot stays
valid. The one exception keeps that promise: a batched decode step writes its new row into ring tensors
that this state alone holds (model/owned_rows.py: marked with its `owner` token when made; `clone` gives
both states new tokens, so neither writes into the tensors they share).
Positions are absolute token positions; rings are indexed by slot = position % W.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass(kw_only=True)
class SourceCache:
    """Global KV of one kv-source layer (compressed main KV and its index keys).

    Attributes:
        ratio: compression ratio m; entry j pools positions [j*m, (j+1)*m) and is rotated at j*m.
        kv: [B, n, D] bf16, main KV after RoPE and FP4 (E2M1, E4M3 scale per 16) quantize-dequantize;
            exactly the dequantized stored codes.
        index_k: [B, n, D_I] bf16 index keys after RoPE and MXFP4 quantize-dequantize.
        kv_packed, kv_scales: the stored form of kv: E2M1 codes uint8 [B, n, D/2] (even channel in the low
            nibble) and E4M3 scales as uint8 bytes [B, n, D/16]. kv is exactly their dequantization.
        index_packed, index_scales: the stored form of index_k: E2M1 codes uint8 [B, n, D_I/2] and E8M0
            scale bytes uint8 [B, n, D_I/32].
        carry_kv, carry_score: [B, m, D] fp32 open-group buffers of a ratio > 1 compressor
            (slot = position % m; score -inf where never written); None for ratio 1.
    """

    ratio: int
    kv: torch.Tensor
    index_k: torch.Tensor
    kv_packed: torch.Tensor
    kv_scales: torch.Tensor
    index_packed: torch.Tensor
    index_scales: torch.Tensor
    carry_kv: torch.Tensor | None = None
    carry_score: torch.Tensor | None = None

    @property
    def n_entries(self) -> int:
        return self.kv.size(1)


@dataclass(kw_only=True)
class ModelState:
    """Cache state after `n_tokens` positions of B sequences that share positions.

    Attributes:
        tokens: [B, n_tokens] int64 token history (needed by bounded replay).
        sources: kv-source layer -> SourceCache (global KV; what `export_global` persists).
        windows: per backbone layer, [B, W, D] bf16 sliding-window ring of FP8-QDQ'd, RoPE'd KV.
        window_codes, window_scales: per layer, the ring's stored form: E4M3 values float8_e4m3fn [B, W, D]
            and UE8M0 scale bytes uint8 [B, W, D/32]; windows is exactly their dequantization.
        window_from: per layer, the lowest position whose ring entry is valid; positions below are absent
            (never written, dropped, or truncated by a bounded replay).
        enc_lanes: [B, W, hc, dim] bf16 ring of the mHC lanes entering the first decoder layer (the encoder
            output), slot = position % W; lets `ced` mode rerun the decoder over the last W positions.
        enc_pre: [B, W, hc] fp32 ring of the pending pre-mix entering the first decoder layer.
        enc_from: lowest position whose enc_lanes/enc_pre entry is valid.
        owner: this state's token for the ring tensors it alone holds (model/owned_rows.py); replaced
            by `clone`, on both sides.
    """

    tokens: torch.Tensor
    sources: dict[int, SourceCache]
    windows: list[torch.Tensor]
    window_codes: list[torch.Tensor]
    window_scales: list[torch.Tensor]
    window_from: list[int]
    enc_lanes: torch.Tensor | None = None
    enc_pre: torch.Tensor | None = None
    enc_from: int = 0
    extra: dict[str, int] = field(default_factory=dict)
    owner: object = field(default_factory=object, repr=False, compare=False)

    @property
    def batch(self) -> int:
        return self.tokens.size(0)

    @property
    def n_tokens(self) -> int:
        return self.tokens.size(1)

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def windows_complete(self, layers: range) -> bool:
        """Whether every layer in `layers` holds its ring for the last min(W, n_tokens) positions."""
        w = self.windows[0].size(1) if self.windows else 0
        need = max(0, self.n_tokens - w)
        return all(self.window_from[i] <= need for i in layers)

    def drop_windows(self, layers: range) -> None:
        """Forget the rings of `layers` (e.g. the encoder pool entry expired): they become absent."""
        for i in layers:
            self.window_from[i] = self.n_tokens
            self.windows[i] = torch.zeros_like(self.windows[i])
            self.window_codes[i] = torch.zeros_like(self.window_codes[i])
            self.window_scales[i] = torch.zeros_like(self.window_scales[i])

    def drop_encoder_rows(self) -> None:
        """Forget the encoder-output ring (it travels with the encoder windows in the pool)."""
        self.enc_from = self.n_tokens
        if self.enc_lanes is not None and self.enc_pre is not None:
            self.enc_lanes = torch.zeros_like(self.enc_lanes)
            self.enc_pre = torch.zeros_like(self.enc_pre)

    def clone(self) -> ModelState:
        """A snapshot that later forwards cannot affect: the two share every tensor, and both get new
        owner tokens, so that no later step of either writes into a ring the other shows."""
        self.owner = object()
        return dataclasses.replace(
            self,
            owner=object(),
            sources={k: dataclasses.replace(v) for k, v in self.sources.items()},
            windows=list(self.windows),
            window_codes=list(self.window_codes),
            window_scales=list(self.window_scales),
            window_from=list(self.window_from),
            extra=dict(self.extra),
        )

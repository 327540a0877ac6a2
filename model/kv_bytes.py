"""KV-cache byte accounting from the config's KV geometry alone: the one place the formulas live.

The cache export (model/) must produce exactly these sizes. Formulas: V41_SPEC.md §6.2-6.4 (entry layouts),
§6.6 and §10.2 (bytes per token and per sequence). Knows nothing of tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from model.config import ModelConfig

__all__ = [
    "INDEX_K_SCALE_GROUP",
    "MAIN_KV_SCALE_GROUP",
    "WINDOW_KV_SCALE_GROUP",
    "KVBytes",
    "SourceBytes",
    "index_k_entry_bytes",
    "kv_bytes",
    "main_kv_entry_bytes",
    "window_kv_entry_bytes",
]

# Main (compressed) KV: FP4 E2M1 payload, one E4M3 scale byte per 16 channels (§6.2).
MAIN_KV_SCALE_GROUP = 16
# Indexer K: MXFP4, FP4 E2M1 payload, one E8M0 scale byte per 32 channels (§6.3).
INDEX_K_SCALE_GROUP = 32
# Sliding-window KV: FP8 E4M3 payload, one UE8M0 scale byte per 32 channels (§6.4).
WINDOW_KV_SCALE_GROUP = 32
# Two FP4 codes share a byte.
_FP4_PER_BYTE = 2


def main_kv_entry_bytes(head_dim: int) -> int:
    """Bytes of one compressed main-KV entry of width head_dim: FP4 codes 2 per byte, 1 E4M3 byte per 16."""
    _check_width("head_dim", head_dim, MAIN_KV_SCALE_GROUP)
    return head_dim // _FP4_PER_BYTE + head_dim // MAIN_KV_SCALE_GROUP


def index_k_entry_bytes(index_head_dim: int) -> int:
    """Bytes of one indexer-K entry of width index_head_dim: FP4 codes two per byte, one E8M0 byte per 32."""
    _check_width("index_head_dim", index_head_dim, INDEX_K_SCALE_GROUP)
    return index_head_dim // _FP4_PER_BYTE + index_head_dim // INDEX_K_SCALE_GROUP


def window_kv_entry_bytes(head_dim: int) -> int:
    """Bytes of one sliding-window KV row of width head_dim: one FP8 byte per value, one UE8M0 byte per 32."""
    _check_width("head_dim", head_dim, WINDOW_KV_SCALE_GROUP)
    return head_dim + head_dim // WINDOW_KV_SCALE_GROUP


def _check_width(name: str, width: int, group: int) -> None:
    if width <= 0 or width % group:
        raise ValueError(f"{name} must be a positive multiple of {group}, got {width}")


@dataclass(frozen=True, kw_only=True)
class SourceBytes:
    """Global KV of one kv-source layer: one main entry and one index-K entry per `ratio` tokens."""

    layer: int
    ratio: int
    half: str  # "enc" or "dec", as in ModelConfig.layer_table()
    entry_bytes: int  # main + index-K bytes of one compressed position

    @property
    def bytes_per_token(self) -> Fraction:
        return Fraction(self.entry_bytes, self.ratio)

    def bytes_for(self, n_tokens: int) -> int:
        """Exact bytes this source stores for a prefix of n_tokens: only complete groups make entries."""
        return (n_tokens // self.ratio) * self.entry_bytes


@dataclass(frozen=True, kw_only=True)
class KVBytes:
    """Byte breakdown of a config's KV cache.

    Global KV (persisted per token) comes from the kv sources only; window KV (a fixed ring per sequence)
    from every backbone layer, the encoder half being what the window pool keeps. DSpark/MTP draft layers
    also hold a window each; they are listed apart and are not part of the backbone figures.
    """

    main_entry_bytes: int
    index_entry_bytes: int
    window_entry_bytes: int
    window_size: int
    sources: tuple[SourceBytes, ...]
    encoder_layer_count: int
    decoder_layer_count: int
    draft_layer_count: int

    @property
    def global_bytes_per_token(self) -> Fraction:
        """Σ over kv sources of (main + index-K entry) / ratio: 890 for v41-flash, 212 for v41-tiny."""
        return sum((s.bytes_per_token for s in self.sources), Fraction(0))

    @property
    def encoder_global_bytes_per_token(self) -> Fraction:
        return sum((s.bytes_per_token for s in self.sources if s.half == "enc"), Fraction(0))

    @property
    def decoder_global_bytes_per_token(self) -> Fraction:
        return sum((s.bytes_per_token for s in self.sources if s.half == "dec"), Fraction(0))

    def global_bytes(self, n_tokens: int) -> int:
        """Exact global-KV bytes for a prefix of n_tokens (whole groups only, per source)."""
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        return sum(s.bytes_for(n_tokens) for s in self.sources)

    @property
    def _layer_window_bytes(self) -> int:
        return self.window_size * self.window_entry_bytes

    @property
    def window_bytes_per_sequence(self) -> int:
        """n_layers × window_size × window entry: 2,703,360 for v41-flash, 50,688 for v41-tiny."""
        return (self.encoder_layer_count + self.decoder_layer_count) * self._layer_window_bytes

    @property
    def encoder_window_bytes_per_sequence(self) -> int:
        return self.encoder_layer_count * self._layer_window_bytes

    @property
    def decoder_window_bytes_per_sequence(self) -> int:
        return self.decoder_layer_count * self._layer_window_bytes

    @property
    def draft_window_bytes_per_sequence(self) -> int:
        return self.draft_layer_count * self._layer_window_bytes

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: exact fractions become ints when whole, floats otherwise."""
        return {
            "global_bytes_per_token": _number(self.global_bytes_per_token),
            "encoder_global_bytes_per_token": _number(self.encoder_global_bytes_per_token),
            "decoder_global_bytes_per_token": _number(self.decoder_global_bytes_per_token),
            "main_entry_bytes": self.main_entry_bytes,
            "index_entry_bytes": self.index_entry_bytes,
            "window_entry_bytes": self.window_entry_bytes,
            "window_size": self.window_size,
            "window_bytes_per_sequence": self.window_bytes_per_sequence,
            "encoder_window_bytes_per_sequence": self.encoder_window_bytes_per_sequence,
            "decoder_window_bytes_per_sequence": self.decoder_window_bytes_per_sequence,
            "draft_window_bytes_per_sequence": self.draft_window_bytes_per_sequence,
            "layers": {
                "encoder": self.encoder_layer_count,
                "decoder": self.decoder_layer_count,
                "draft": self.draft_layer_count,
            },
            "sources": [
                {
                    "layer": s.layer,
                    "ratio": s.ratio,
                    "half": s.half,
                    "entry_bytes": s.entry_bytes,
                    "bytes_per_token": _number(s.bytes_per_token),
                }
                for s in self.sources
            ],
        }


def _number(value: Fraction) -> int | float:
    return value.numerator if value.denominator == 1 else float(value)


def kv_bytes(config: ModelConfig) -> KVBytes:
    """The byte breakdown of `config`'s KV cache (any valid config, unsupported features included)."""
    main = main_kv_entry_bytes(config.head_dim)
    index = index_k_entry_bytes(config.index_head_dim)
    encoder = config.encoder_layers
    sources = tuple(
        SourceBytes(
            layer=layer,
            ratio=config.ratio(layer),
            half="enc" if layer in encoder else "dec",
            entry_bytes=main + index,
        )
        for layer in config.kv_source_layers
    )
    return KVBytes(
        main_entry_bytes=main,
        index_entry_bytes=index,
        window_entry_bytes=window_kv_entry_bytes(config.head_dim),
        window_size=config.window_size,
        sources=sources,
        encoder_layer_count=len(config.encoder_layers),
        decoder_layer_count=len(config.decoder_layers),
        draft_layer_count=len(config.draft_layers),
    )

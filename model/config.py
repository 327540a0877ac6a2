"""The model's configuration: the official `inference/config.json` keys as one frozen dataclass, plus the
per-layer schedule (roles, borrowed sources, CED split) derived from it. Knows nothing of weights or caches.

Field names and defaults are those of the reference `ModelArgs` (DeepSeek-V4.1-Flash `inference/model.py`,
revision dba1be0a40aa45a94ad051997016db3960a90277); list-valued keys become tuples. The layer-role rules
follow V41_SPEC.md §2.1 and §11.1; layer numbers are 0-based.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["LayerRole", "LayerRow", "ModelConfig"]

# FP8 activations and FP4 expert weights are quantized in groups of this many channels along K, and the
# SWA window KV carries one UE8M0 scale per this many channels (V41_SPEC §6.3-6.4).
_GROUP_32 = 32
# Main (compressed) KV carries one E4M3 scale per 16 channels (V41_SPEC §6.2).
_GROUP_16 = 16
# candidate_source_layer below zero turns the hierarchical indexer off (reference convention).
_CANDIDATES_OFF = -1


class LayerRole(enum.Enum):
    """What a layer's attention owns (V41_SPEC §2.1)."""

    SWA_ONLY = "swa_only"  # compress ratio 0: sliding window only, no global branch
    FULL = "full"  # kv source: own compressor, own index K, own indexer
    REINDEX = "reindex"  # index source but not kv source: own indexer over a borrowed index K
    REUSE = "reuse"  # ratio > 0, borrows compressed KV and top-k indices from below


@dataclass(frozen=True, kw_only=True)
class LayerRow:
    """One row of `ModelConfig.layer_table()`.

    `half` is "enc", "dec" (backbone layers either side of the CED split) or "draft" (DSpark/MTP draft
    layers appended after the backbone). Sources are None where the layer has no global branch.
    """

    layer: int
    half: str
    ratio: int
    role: LayerRole
    kv_source: int | None
    index_source: int | None
    is_candidate_source: bool
    uses_candidates: bool


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The official inference config. Every field is a key of `inference/config.json`.

    Construct with keywords or with `from_json` / `from_dict`; `__post_init__` normalizes lists to tuples
    and ints to floats where the reference types say float, then validates (ValueError naming the key).
    Extra entries of `compress_ratios` beyond `n_layers` belong to the `n_mtp_layers` DSpark draft layers.
    """

    # runtime limits rather than model shape: they size the reference's caches and RoPE table
    max_batch_size: int = 4
    max_seq_len: int = 4096
    temperature: float = 1.0
    dtype: Literal["bf16", "fp8"] = "fp8"
    expert_dtype: Literal["fp4"] | None = "fp4"
    vocab_size: int = 129280
    dim: int = 1024
    moe_inter_dim: int = 1024
    n_layers: int = 5
    n_mtp_layers: int = 1
    n_heads: int = 16
    # MoE
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    n_activated_experts: int = 2
    score_func: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    route_scale: float = 1.0
    swiglu_limit: float = 0.0
    # attention: low-rank query, one shared latent (K = V), grouped low-rank output projection
    q_lora_rank: int = 256
    head_dim: int = 128
    rope_head_dim: int = 32
    norm_eps: float = 1e-20
    o_groups: int = 8
    o_lora_rank: int = 256
    # sliding window and the CSA2 schedule
    window_size: int = 128
    compress_ratios: tuple[int, ...] = (0, 2, 2, 1, 1, 0)
    kv_source_layers: tuple[int, ...] = (1, 3)
    index_source_layers: tuple[int, ...] = (1, 3)
    # rotary embedding; YaRN applies in ratio > 0 layers when original_seq_len > 0
    compress_rope_theta: float = 40000.0
    original_seq_len: int = 0
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    beta_fast: int = 32
    beta_slow: int = 1
    # lightning indexer and the hierarchical candidate pool (candidate_source_layer < 0: off)
    index_n_heads: int = 16
    index_head_dim: int = 64
    index_topk: int = 64
    candidate_source_layer: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    # mHC: the residual stream is hc_mult parallel lanes
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Engram (not run by this project in v1; see unsupported_features)
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 1
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 0
    # vision tower (vision_n_layers == 0 disables it)
    vision_n_layers: int = 0
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024
    vision_min_pixels: int = 544 * 544
    vision_max_wh_ratio: int | None = None
    image_token_id: int = 129264
    # DSpark draft head (dspark_block_size == 0 disables it)
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 0
    dspark_n_activated_experts: int = 0

    # ---- construction ------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a config.json mapping. Missing keys take the reference defaults.

        Raises:
            ValueError: unknown keys (all named), or a value of the wrong type or out of range.
        """
        if not isinstance(data, dict):
            raise ValueError(f"model config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model config keys: {unknown}")
        return cls(**data)

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """Read a config.json file.

        Raises:
            OSError: the file cannot be read.
            ValueError: the file is not valid JSON, or `from_dict` rejects it (the message names the path).
        """
        text = Path(path).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from exc
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        """Every key with its value, lists for tuples: `from_dict(c.to_dict()) == c`."""
        return {
            f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
            for f in dataclasses.fields(self)
        }

    def __post_init__(self) -> None:
        hints = _field_hints(type(self))
        for f in dataclasses.fields(self):
            value = _normalize(f.name, getattr(self, f.name), hints[f.name])
            # frozen dataclass: normalization is the one write allowed, done before anyone sees the object
            object.__setattr__(self, f.name, value)
        self._validate_sizes()
        self._validate_schedule()
        self._validate_optional_features()

    # ---- validation --------------------------------------------------------------------------------

    def _validate_sizes(self) -> None:
        for key in (
            "max_batch_size", "max_seq_len", "vocab_size", "dim", "moe_inter_dim", "n_layers", "n_heads",
            "n_routed_experts", "n_activated_experts", "q_lora_rank", "head_dim", "rope_head_dim",
            "o_groups", "o_lora_rank", "window_size", "index_n_heads", "index_head_dim", "index_topk",
            "hc_mult", "hc_sinkhorn_iters",
        ):  # fmt: skip
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")
        for key in (
            "n_mtp_layers", "original_seq_len", "candidate_topk_blocks", "candidate_block_size",
            "engram_vocab_size", "engram_n_heads", "engram_head_dim", "engram_compressed_vocab_size",
            "vision_n_layers", "dspark_block_size", "dspark_n_routed_experts", "dspark_n_activated_experts",
            "temperature", "swiglu_limit",
        ):  # fmt: skip
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)}")
        for key in ("rope_theta", "compress_rope_theta", "rope_factor", "norm_eps", "hc_eps", "gate_temp",
                    "route_scale"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")
        # the reference MoE asserts exactly one shared expert
        if self.n_shared_experts != 1:
            raise ValueError(f"n_shared_experts must be 1 (reference MoE), got {self.n_shared_experts}")
        if self.n_activated_experts > self.n_routed_experts:
            raise ValueError(
                f"n_activated_experts={self.n_activated_experts} exceeds "
                f"n_routed_experts={self.n_routed_experts}"
            )
        # head_dim % 32: the FP8 window KV has one scale per 32 channels (which also covers FP4's 16)
        if self.head_dim % _GROUP_32:
            raise ValueError(f"head_dim must be a multiple of {_GROUP_32}, got {self.head_dim}")
        if self.index_head_dim % _GROUP_32:
            raise ValueError(f"index_head_dim must be a multiple of {_GROUP_32}, got {self.index_head_dim}")
        rd = self.rope_head_dim
        if rd % 2 or rd >= self.head_dim or rd >= self.index_head_dim:
            raise ValueError(
                f"rope_head_dim must be even and below head_dim={self.head_dim} and "
                f"index_head_dim={self.index_head_dim}, got {rd}"
            )
        if self.n_heads % self.o_groups:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by o_groups={self.o_groups}")
        # FP8/FP4 linears quantize their input in groups of 32 along K: every GEMM input width
        for key, width in (
            ("dim", self.dim),
            ("q_lora_rank", self.q_lora_rank),
            ("moe_inter_dim", self.moe_inter_dim),
            ("o_groups * o_lora_rank", self.o_groups * self.o_lora_rank),
        ):
            if width % _GROUP_32:
                raise ValueError(f"{key} must be a multiple of {_GROUP_32}, got {width}")

    def _validate_schedule(self) -> None:
        n, ratios = self.n_layers, self.compress_ratios
        if len(ratios) != n + self.n_mtp_layers:
            raise ValueError(
                f"compress_ratios has {len(ratios)} entries, expected n_layers + n_mtp_layers = "
                f"{n} + {self.n_mtp_layers}: {list(ratios)}"
            )
        if any(r < 0 for r in ratios):
            raise ValueError(f"compress_ratios must be >= 0: {list(ratios)}")
        # DSpark draft attention asserts ratio 0 (sliding window only)
        if any(ratios[n:]):
            raise ValueError(f"compress_ratios of the draft layers {n}.. must be 0: {list(ratios[n:])}")
        for key in ("kv_source_layers", "index_source_layers"):
            layers = getattr(self, key)
            if list(layers) != sorted(set(layers)):
                raise ValueError(f"{key} must be strictly increasing: {list(layers)}")
            bad = [layer for layer in layers if not 0 <= layer < n or ratios[layer] == 0]
            if bad:
                raise ValueError(f"{key} {bad} are not backbone layers with compress ratio > 0")
        missing = sorted(set(self.kv_source_layers) - set(self.index_source_layers))
        if missing:
            raise ValueError(f"kv sources {missing} are not in index_source_layers")
        for layer in range(n):
            if ratios[layer] == 0:
                continue
            kv, idx = self.kv_source_of(layer), self.index_source_of(layer)
            if kv is None or ratios[kv] != ratios[layer]:
                raise ValueError(
                    f"layer {layer} (ratio {ratios[layer]}) has no kv source of the same ratio at or below "
                    f"it (kv_source_layers={list(self.kv_source_layers)})"
                )
            # Every kv source is an index source, so idx >= kv; idx lies in [kv, layer] and was itself
            # checked against the same kv source, so its ratio equals this layer's (V41_SPEC §11.1).
            assert idx is not None and idx >= kv and ratios[idx] == ratios[layer]
        cand = self.candidate_source_layer
        if cand < 0:
            if cand != _CANDIDATES_OFF:
                raise ValueError(f"candidate_source_layer must be -1 (off) or a kv source, got {cand}")
            return
        if cand not in self.kv_source_layers:
            raise ValueError(
                f"candidate_source_layer {cand} is not a kv source ({list(self.kv_source_layers)})"
            )
        if self.candidate_topk_blocks <= 0 or self.candidate_block_size <= 0:
            raise ValueError(
                "candidate_topk_blocks and candidate_block_size must be > 0 with a candidate source, got "
                f"{self.candidate_topk_blocks} and {self.candidate_block_size}"
            )
        # the candidate mask is a mask over the candidate source's compressed positions, so every layer
        # that applies it must score that same cache
        foreign = [i for i in self.index_source_layers if i > cand and self.kv_source_of(i) != cand]
        if foreign:
            raise ValueError(
                f"index sources {foreign} use the candidates of layer {cand} but read another kv source"
            )

    def _validate_optional_features(self) -> None:
        n = self.n_layers
        bad = [layer for layer in self.engram_layer_ids if not 0 <= layer < n]
        if bad:
            raise ValueError(f"engram_layer_ids {bad} are not backbone layers")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ValueError(
                f"engram_num_embeddings {list(self.engram_num_embeddings)} needs one entry per engram layer "
                f"{list(self.engram_layer_ids)}"
            )
        bad = [layer for layer in self.dspark_target_layer_ids if not 0 <= layer < n]
        if bad:
            raise ValueError(f"dspark_target_layer_ids {bad} are not backbone layers")

    # ---- derived schedule --------------------------------------------------------------------------

    @property
    def n_total_layers(self) -> int:
        """Backbone plus draft layers: `len(compress_ratios)`."""
        return len(self.compress_ratios)

    @property
    def draft_layers(self) -> range:
        """The DSpark/MTP draft layers, indices n_layers .. n_layers + n_mtp_layers - 1."""
        return range(self.n_layers, self.n_total_layers)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.n_total_layers:
            raise ValueError(f"layer {layer} is out of range 0..{self.n_total_layers - 1}")

    def ratio(self, layer: int) -> int:
        """Compression ratio of `layer` (0: sliding window only)."""
        self._check_layer(layer)
        return self.compress_ratios[layer]

    def _nearest_at_or_below(self, layer: int, sources: tuple[int, ...]) -> int | None:
        self._check_layer(layer)
        if layer >= self.n_layers or self.compress_ratios[layer] == 0:
            return None
        below = [s for s in sources if s <= layer]
        return below[-1] if below else None

    def kv_source_of(self, layer: int) -> int | None:
        """The kv source whose compressed KV and index K `layer` reads: the nearest one at or below it.

        None for layers with ratio 0 (and draft layers).
        """
        return self._nearest_at_or_below(layer, self.kv_source_layers)

    def index_source_of(self, layer: int) -> int | None:
        """The index source whose top-k indices `layer` uses: the nearest one at or below it, or None."""
        return self._nearest_at_or_below(layer, self.index_source_layers)

    def layer_role(self, layer: int) -> LayerRole:
        """SWA_ONLY, FULL, REINDEX or REUSE (V41_SPEC §2.1). Draft layers are SWA_ONLY."""
        self._check_layer(layer)
        if layer >= self.n_layers or self.compress_ratios[layer] == 0:
            return LayerRole.SWA_ONLY
        if layer in self.kv_source_layers:
            return LayerRole.FULL
        if layer in self.index_source_layers:
            return LayerRole.REINDEX
        return LayerRole.REUSE

    def is_candidate_source(self, layer: int) -> bool:
        """True for the layer that publishes the candidate-block mask (level 1 of the two-level indexer)."""
        self._check_layer(layer)
        return layer == self.candidate_source_layer

    def uses_candidates(self, layer: int) -> bool:
        """True for index sources above the candidate source: their top-k is masked to the candidates."""
        self._check_layer(layer)
        return layer in self.index_source_layers and 0 <= self.candidate_source_layer < layer

    @property
    def candidates_enabled(self) -> bool:
        """Whether the hierarchical (two-level) indexer is on."""
        return self.candidate_source_layer >= 0

    @property
    def candidate_pool_covers_topk(self) -> bool:
        """(candidate_topk_blocks - 1) * candidate_block_size >= index_topk (V41_SPEC §10.1).

        The pinned newest block may be partly filled, so only topk_blocks - 1 full blocks are certain.
        When this is False a Reindex top-k can run out of candidates and pick masked (-inf) positions,
        which the reference returns as valid ids. The reference allows such configs, so this is reported,
        not rejected; the released config and v41-tiny satisfy it. True when candidates are off.
        """
        if not self.candidates_enabled:
            return True
        return (self.candidate_topk_blocks - 1) * self.candidate_block_size >= self.index_topk

    @property
    def ced_split(self) -> int | None:
        """First layer of the decoder half: the first kv source with ratio 1 (V41_SPEC §2.3, §11.1).

        None when no kv source has ratio 1 (the config has no CED split; only the `reference` prefill
        mode can run it).
        """
        firsts = [s for s in self.kv_source_layers if self.compress_ratios[s] == 1]
        return firsts[0] if firsts else None

    @property
    def supports_ced(self) -> bool:
        """Whether the `ced` prefill mode can run: a CED split exists and no kv source lies above it.

        A kv source above the split would compress decoder hidden states, which the decoder bounded replay
        computes only for the last window of tokens.
        """
        split = self.ced_split
        return split is not None and self.kv_source_layers[-1] == split

    @property
    def encoder_layers(self) -> range:
        """Backbone layers before the CED split (all backbone layers when there is no split)."""
        split = self.ced_split
        return range(0, self.n_layers if split is None else split)

    @property
    def decoder_layers(self) -> range:
        """Backbone layers from the CED split on (empty when there is no split)."""
        split = self.ced_split
        return range(self.n_layers if split is None else split, self.n_layers)

    def layer_table(self) -> list[LayerRow]:
        """One row per layer, backbone then draft layers, for printing and tests."""
        encoder = self.encoder_layers
        rows = []
        for layer in range(self.n_total_layers):
            half = "draft" if layer >= self.n_layers else ("enc" if layer in encoder else "dec")
            rows.append(
                LayerRow(
                    layer=layer,
                    half=half,
                    ratio=self.compress_ratios[layer],
                    role=self.layer_role(layer),
                    kv_source=self.kv_source_of(layer),
                    index_source=self.index_source_of(layer),
                    is_candidate_source=self.is_candidate_source(layer),
                    uses_candidates=self.uses_candidates(layer),
                )
            )
        return rows

    def unsupported_features(self) -> list[str]:
        """Features this config enables that the project's model does not implement (v1).

        Empty for a config the model can build. Byte accounting works on any valid config regardless.
        """
        found = []
        if self.engram_layer_ids:
            found.append(f"engram (engram_layer_ids={list(self.engram_layer_ids)})")
        if self.n_mtp_layers > 0:
            found.append(f"mtp draft layers (n_mtp_layers={self.n_mtp_layers})")
        if self.vision_n_layers > 0:
            found.append(f"vision (vision_n_layers={self.vision_n_layers})")
        if self.dspark_block_size > 0:
            found.append(f"dspark (dspark_block_size={self.dspark_block_size})")
        return found


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    # resolved once per class: the annotations are strings under `from __future__ import annotations`
    return typing.get_type_hints(cls)


def _normalize(key: str, value: Any, hint: Any) -> Any:
    """Check `value` against the field's type hint; return it as a tuple / float where the hint says so."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return _normalize(key, value, inner)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed or isinstance(value, bool):
            raise ValueError(f"{key} must be one of {list(allowed)}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple) or not all(_is_int(v) for v in value):
            raise ValueError(f"{key} must be a list of integers, got {value!r}")
        return tuple(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if not _is_int(value):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if not (_is_int(value) or isinstance(value, float)):
            raise ValueError(f"{key} must be a number, got {value!r}")
        return float(value)
    raise AssertionError(f"no rule for the type {hint} of {key}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

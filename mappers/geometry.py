"""The KV geometry of a model config as a mapper sees it: kv-source layers, their ratios and widths, and
the rotary tables of compressed entries. Knows nothing of weights or caches.

A compressed entry j of a ratio-m source pools positions [j*m, (j+1)*m) and carries the RoPE rotation of
position j*m in its last `rope_head_dim` channels (main KV and index K alike), with the compressed-layer
table (compress_rope_theta, YaRN when original_seq_len > 0): `model.Transformer.rope_for`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model import ModelConfig, apply_rope, rope_table


@dataclass(frozen=True, kw_only=True)
class SourceGeometry:
    """One kv-source layer: its ratio and the widths of its main KV (D) and index keys (D_I)."""

    layer: int
    ratio: int
    head_dim: int
    index_head_dim: int


@dataclass(frozen=True, kw_only=True)
class RopeSpec:
    """The parameters that fix the compressed-layer rotary table (equal specs mean equal tables)."""

    rope_dim: int
    base: float
    original_seq_len: int
    factor: float
    beta_fast: int
    beta_slow: int

    def table(self, n_positions: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[n_positions, rope_dim/2] complex64 rotations (row p rotates position p)."""
        return rope_table(
            self.rope_dim,
            max(n_positions, 1),
            base=self.base,
            original_seq_len=self.original_seq_len,
            factor=self.factor,
            beta_fast=self.beta_fast,
            beta_slow=self.beta_slow,
        ).to(device)


def sources_of(cfg: ModelConfig) -> tuple[SourceGeometry, ...]:
    """The kv-source layers of `cfg` in layer order."""
    return tuple(
        SourceGeometry(
            layer=s, ratio=cfg.compress_ratios[s], head_dim=cfg.head_dim, index_head_dim=cfg.index_head_dim
        )
        for s in cfg.kv_source_layers
    )


def source_of(cfg: ModelConfig, layer: int) -> SourceGeometry:
    """The geometry of kv-source `layer`.

    Raises:
        ValueError: `layer` is not a kv source of `cfg`.
    """
    for src in sources_of(cfg):
        if src.layer == layer:
            return src
    raise ValueError(f"layer {layer} is not a kv source (kv_source_layers={list(cfg.kv_source_layers)})")


def rope_spec(cfg: ModelConfig) -> RopeSpec:
    """The rotary parameters of compressed entries (kv sources always have ratio > 0)."""
    return RopeSpec(
        rope_dim=cfg.rope_head_dim,
        base=cfg.compress_rope_theta,
        original_seq_len=cfg.original_seq_len,
        factor=cfg.rope_factor,
        beta_fast=cfg.beta_fast,
        beta_slow=cfg.beta_slow,
    )


def entry_rotations(spec: RopeSpec, ratio: int, n_entries: int, device: torch.device | str) -> torch.Tensor:
    """Rotations of entries 0..n_entries-1 of a ratio-`ratio` source: [n, rope_dim/2] complex64."""
    table = spec.table(n_entries * ratio, device)
    return table[torch.arange(n_entries, device=table.device) * ratio]


def strip_rope(x: torch.Tensor, rotations: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Content space: undo the entry rotations. x [B, n, D] -> fp32 [B, n, D] (rotation in fp32)."""
    return apply_rope(x.float(), rotations, rope_dim, inverse=True)


def add_rope(x: torch.Tensor, rotations: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Inverse of `strip_rope`: x fp32 [B, n, D] -> fp32 [B, n, D] rotated at the entry positions."""
    return apply_rope(x.float(), rotations, rope_dim)

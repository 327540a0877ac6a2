"""Configuration of one node's global KV store, as data."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

CONFIG_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Where and how a node keeps global KV chunks.

    Args:
        path: root directory; the database lives in `path/db`, checkpoints in `path/checkpoints`.
        region: this node's region label, matched against tenants' allowed_regions.
        chunk_tokens: tokens per full chunk; a multiple of every compression ratio.
        compression_ratios: the model family's compression ratios, checked against chunk_tokens.
        capacity_bytes: byte budget of stored values (header + payload + checksum).
        maintenance_interval_s: period of the expiry/physical-deletion pass when the background
            thread runs; a chunk past its ceiling is gone from disk within this plus one pass.
        max_payload_bytes: largest payload accepted per chunk.
    """

    path: str
    region: str = "local"
    chunk_tokens: int = 256
    compression_ratios: tuple[int, ...] = (4, 128)
    capacity_bytes: int = 100 * 2**30
    maintenance_interval_s: float = 60.0
    max_payload_bytes: int = 64 * 2**20

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("store path must be non-empty")
        if not self.region:
            raise ValueError("store region must be non-empty")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        object.__setattr__(self, "compression_ratios", tuple(self.compression_ratios))
        bad = [r for r in self.compression_ratios if r < 1 or self.chunk_tokens % r]
        if bad:
            raise ValueError(f"chunk_tokens {self.chunk_tokens} not a multiple of compression ratios {bad}")
        if self.capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {self.capacity_bytes}")
        if not (math.isfinite(self.maintenance_interval_s) and self.maintenance_interval_s > 0):
            raise ValueError(f"maintenance_interval_s must be > 0, got {self.maintenance_interval_s}")
        if self.max_payload_bytes < 1:
            raise ValueError(f"max_payload_bytes must be >= 1, got {self.max_payload_bytes}")

    @property
    def db_path(self) -> Path:
        return Path(self.path) / "db"

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.path) / "checkpoints"

    @classmethod
    def from_json(cls, data: bytes | str) -> StoreConfig:
        """Load a versioned JSON object; unknown keys are a ValueError."""
        obj = json.loads(data)
        if not isinstance(obj, dict) or obj.pop("version", None) != CONFIG_VERSION:
            raise ValueError(f"store config must be a version-{CONFIG_VERSION} JSON object")
        unknown = set(obj) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown store config keys {sorted(unknown)}")
        return cls(**obj)

    def to_json(self) -> str:
        return json.dumps({"version": CONFIG_VERSION, **asdict(self)}, sort_keys=True)

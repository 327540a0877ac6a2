"""Per-tenant retention and residency policy: what a tenant's stored KV may do, as data.

Knows nothing of how chunks are stored; the store applies it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

DEFAULT_FLOOR_S = 72 * 3600.0
DEFAULT_CEILING_S = 30 * 24 * 3600.0
POLICY_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """Retention and residency for one tenant.

    Args:
        floor_s: seconds after a store during which the chunk is never evicted for capacity.
        ceiling_s: seconds after a store after which the chunk is never served again and is scheduled
            for physical deletion. When floor_s > ceiling_s the ceiling wins (see `effective_floor_s`).
        allowed_regions: region labels where this tenant's KV may be persisted; None means anywhere,
            an empty tuple means nowhere.
    """

    floor_s: float = DEFAULT_FLOOR_S
    ceiling_s: float = DEFAULT_CEILING_S
    allowed_regions: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.floor_s) and self.floor_s >= 0):
            raise ValueError(f"floor_s must be finite and >= 0, got {self.floor_s}")
        if not (math.isfinite(self.ceiling_s) and self.ceiling_s > 0):
            raise ValueError(f"ceiling_s must be finite and > 0, got {self.ceiling_s}")
        if self.allowed_regions is not None:
            regions = tuple(self.allowed_regions)
            if any(not isinstance(r, str) or not r for r in regions):
                raise ValueError(f"allowed_regions must be non-empty strings, got {regions!r}")
            object.__setattr__(self, "allowed_regions", regions)

    @property
    def effective_floor_s(self) -> float:
        """The floor actually guaranteed: never beyond the ceiling (the ceiling wins a conflict)."""
        return min(self.floor_s, self.ceiling_s)

    def allows_region(self, region: str) -> bool:
        return self.allowed_regions is None or region in self.allowed_regions

    def to_json(self) -> bytes:
        obj = asdict(self)
        obj["version"] = POLICY_VERSION
        obj["allowed_regions"] = None if self.allowed_regions is None else list(self.allowed_regions)
        return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> RetentionPolicy:
        """Inverse of to_json; unknown keys or another version are a ValueError."""
        obj = json.loads(data)
        if not isinstance(obj, dict) or obj.pop("version", None) != POLICY_VERSION:
            raise ValueError(f"retention policy must be a version-{POLICY_VERSION} JSON object: {data!r}")
        unknown = set(obj) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown retention policy keys {sorted(unknown)}")
        if obj.get("allowed_regions") is not None:
            obj["allowed_regions"] = tuple(obj["allowed_regions"])
        return cls(**obj)

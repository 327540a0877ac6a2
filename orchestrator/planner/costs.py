"""The cost model: measured per-token seconds of each kind of work, per model, stored as a JSON artifact.

Knows nothing of how the figures were measured (`calibration.py` does that) or of paths (`planner.py`).
Artifact format (version 1): `{"format": "kvresume.costs", "version": 1, "models": {name: {field: v}},
"default": {field: v}}` with the fields of `Costs`; unknown keys are an error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.planner.plan import ResumePath, TokenCounts

__all__ = ["BUILTIN_COSTS", "Costs", "CostTable", "estimate_seconds", "COSTS_FORMAT", "COSTS_VERSION"]

COSTS_FORMAT = "kvresume.costs"
COSTS_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Per-token seconds of each kind of work for one model on one device class.

    Attributes:
        load_s: read, verify and dequantize one token of stored global KV.
        encode_s: run one token through the encoder (prefill or encoder replay).
        decode_replay_s: run one token through the decoder half during the decoder bounded replay.
        map_s: map one token of sender global KV into the receiver's format.
        pool_restore_s: fixed cost of restoring a pool entry (windows and encoder output rows).
        source: where the figures come from (an artifact path, or "builtin").
    """

    load_s: float
    encode_s: float
    decode_replay_s: float
    map_s: float
    pool_restore_s: float = 0.0
    source: str = "builtin"

    def __post_init__(self) -> None:
        for f in ("load_s", "encode_s", "decode_replay_s", "map_s", "pool_restore_s"):
            value = getattr(self, f)
            if not value >= 0.0 or value == float("inf"):
                raise ValueError(f"cost {f}={value} must be a finite number >= 0")

    def to_json(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "source"}

    @classmethod
    def from_json(cls, raw: Mapping[str, object], *, source: str) -> Costs:
        names = {f.name for f in dataclasses.fields(cls)} - {"source"}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ValueError(f"unknown cost keys {unknown} in {source}")
        return cls(**{k: float(v) for k, v in raw.items()}, source=source)  # type: ignore[arg-type]


# Rough CPU figures for a small model, used until a calibration artifact exists: loading stored KV is
# far cheaper per token than encoding it, which is the premise of the service.
BUILTIN_COSTS = Costs(load_s=2e-6, encode_s=2e-4, decode_replay_s=2e-4, map_s=2e-5, pool_restore_s=1e-3)


@dataclass(frozen=True, kw_only=True)
class CostTable:
    """Costs per model with a default for models never calibrated."""

    default: Costs = BUILTIN_COSTS
    models: Mapping[str, Costs] = field(default_factory=dict)

    def for_model(self, model: str) -> Costs:
        return self.models.get(model, self.default)

    def with_model(self, model: str, costs: Costs) -> CostTable:
        return CostTable(default=self.default, models={**self.models, model: costs})

    def save(self, path: Path | str) -> None:
        """Write the artifact atomically (temp file + rename)."""
        path = Path(path)
        doc = {
            "format": COSTS_FORMAT,
            "version": COSTS_VERSION,
            "default": self.default.to_json(),
            "models": {name: c.to_json() for name, c in sorted(self.models.items())},
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh, indent=2, sort_keys=True)
            fh.write("\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path | str) -> CostTable:
        """Read an artifact written by `save`.

        Raises:
            ValueError: wrong format name or version, unknown keys, or invalid figures.
        """
        source = str(path)
        with open(path) as fh:
            doc = json.load(fh)
        if doc.get("format") != COSTS_FORMAT or doc.get("version") != COSTS_VERSION:
            raise ValueError(
                f"{source}: format {doc.get('format')!r} version {doc.get('version')!r} is not "
                f"{COSTS_FORMAT!r} version {COSTS_VERSION}"
            )
        unknown = sorted(set(doc) - {"format", "version", "default", "models"})
        if unknown:
            raise ValueError(f"{source}: unknown keys {unknown}")
        default = Costs.from_json(doc["default"], source=source) if "default" in doc else BUILTIN_COSTS
        models = {name: Costs.from_json(raw, source=source) for name, raw in doc.get("models", {}).items()}
        return cls(default=default, models=models)


def estimate_seconds(path: ResumePath, counts: TokenCounts, costs: Costs) -> float:
    """Estimated seconds of a path's prompt work (decode of new tokens is the same on every path)."""
    seconds = (
        costs.load_s * (counts.cached + counts.mapped)
        + costs.map_s * counts.mapped
        + costs.encode_s * (counts.replayed_encoder + counts.prefilled)
        + costs.decode_replay_s * counts.replayed_decoder
    )
    if path == ResumePath.FULL_HIT:
        seconds += costs.pool_restore_s
    return seconds

"""Registered cross-model KV mappers: artifact, sender/receiver pair, quality figures and gate verdict."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from orchestrator.db.models import MapperRow

__all__ = ["MapperRepository", "MapperRegistration"]


@dataclass(frozen=True, kw_only=True)
class MapperRegistration:
    """What registering a mapper records; `passed_gate` is the fitting job's verdict, stored as given."""

    mapper_id: str
    sender_model: str
    receiver_model: str
    artifact_uri: str
    artifact_sha256: str = ""
    kind: str = "ridge"
    metrics: Mapping[str, float] = field(default_factory=dict)
    gate_metric: str = ""
    gate_threshold: float | None = None
    passed_gate: bool = False

    def __post_init__(self) -> None:
        for name in ("mapper_id", "sender_model", "receiver_model", "artifact_uri"):
            if not getattr(self, name):
                raise ValueError(f"mapper {name} must be non-empty")
        if self.sender_model == self.receiver_model:
            raise ValueError(f"mapper {self.mapper_id!r} maps {self.sender_model!r} onto itself")
        if self.passed_gate and (not self.gate_metric or self.gate_threshold is None):
            raise ValueError(
                f"mapper {self.mapper_id!r} claims to pass a gate without naming its metric/threshold"
            )
        if self.passed_gate and self.metrics.get(self.gate_metric) is None:
            raise ValueError(
                f"mapper {self.mapper_id!r} passed gate {self.gate_metric!r} without that figure"
            )
        figure = self.metrics.get(self.gate_metric)
        if self.passed_gate and figure < self.gate_threshold:  # type: ignore[operator]
            raise ValueError(
                f"mapper {self.mapper_id!r}: {self.gate_metric}={figure} is below its "
                f"gate {self.gate_threshold}, so it cannot have passed"
            )
        object.__setattr__(self, "metrics", {str(k): float(v) for k, v in self.metrics.items()})


# Every mapper to one receiver in `list`'s order, as Core rows (`TurnReads` runs it through the driver).
_MAPPERS = MapperRow.__table__
_OF_RECEIVER = (
    select(_MAPPERS)
    .where(_MAPPERS.c.receiver_model == bindparam("rm"))
    .order_by(_MAPPERS.c.sender_model, _MAPPERS.c.receiver_model, _MAPPERS.c.id)
)


class MapperRepository:
    def __init__(self, session: Session) -> None:
        self._s = session

    def register(self, reg: MapperRegistration) -> MapperRow:
        """Insert or replace the mapper with this id."""
        row = self._s.get(MapperRow, reg.mapper_id)
        if row is None:
            row = MapperRow(id=reg.mapper_id)
            self._s.add(row)
        row.sender_model = reg.sender_model
        row.receiver_model = reg.receiver_model
        row.artifact_uri = reg.artifact_uri
        row.artifact_sha256 = reg.artifact_sha256
        row.kind = reg.kind
        row.metrics = dict(reg.metrics)
        row.gate_metric = reg.gate_metric
        row.gate_threshold = reg.gate_threshold
        row.passed_gate = reg.passed_gate
        self._s.flush()
        return row

    def get(self, mapper_id: str) -> MapperRow | None:
        return self._s.get(MapperRow, mapper_id)

    def list(self, *, sender_model: str | None = None, receiver_model: str | None = None) -> list[MapperRow]:
        stmt = select(MapperRow)
        if sender_model is not None:
            stmt = stmt.where(MapperRow.sender_model == sender_model)
        if receiver_model is not None:
            stmt = stmt.where(MapperRow.receiver_model == receiver_model)
        return list(
            self._s.scalars(stmt.order_by(MapperRow.sender_model, MapperRow.receiver_model, MapperRow.id))
        )

    def delete(self, mapper_id: str) -> bool:
        row = self.get(mapper_id)
        if row is None:
            return False
        self._s.delete(row)
        self._s.flush()
        return True

"""A turn's registry reads in one read transaction on SQLite through the driver: the session's facts, its
history, the tenant's effective policy, the session's segment spans and, for a switch or a new session,
the mappers to the turn's model, as `SessionRepository.facts` / `history`, `PolicyRepository.effective`,
`SegmentRepository.spans_of` and `MapperRepository.list` give them in a Session (their tested twins),
with the same statements (`DriverSelect`: same SQL text and type processing).

Why: every turn reads these before it plans; through a Session they cost a Session, a pool checkout with
a BEGIN statement, four Core executions and a ROLLBACK, several times the driver calls. The reads run
between one BEGIN and its ROLLBACK on one pooled connection, so they see one snapshot, as in the Session.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.db.models import blob_to_tokens
from orchestrator.db.repositories import mappers, policies, segments, sessions
from orchestrator.db.repositories.driver_select import DriverSelect
from orchestrator.db.repositories.policies import EffectivePolicy, effective_policy

__all__ = ["TurnReads", "TurnSnapshot", "reads_mappers"]


@dataclass(frozen=True, kw_only=True)
class TurnSnapshot:
    """What a turn read of the registry in one snapshot (`row` None: no such session of the tenant;
    the rest is then empty).

    `history_ids` are the history's ids as the turn rows store them (u32 little-endian, what
    `storage.token_bytes(history)` gives): the store and the digests take the ids in that form, and a
    64K-token history costs about 0.4 ms to encode again.

    `mappers` holds every mapper row to the turn's model (`MapperRepository.list(receiver_model=...)`
    as Core rows), read only when the turn reads mapper rows: a switch of the session to another model
    or a session without history (`reads_mappers`); None otherwise.
    """

    row: Any | None
    history: list[int] = field(default_factory=list)
    history_ids: bytes = b""
    policy: EffectivePolicy | None = None
    spans: list[Any] = field(default_factory=list)
    mappers: list[Any] | None = None


def reads_mappers(row: Any, history: list[int], model: str) -> bool:
    """Whether a turn of `model` on this session reads mapper rows: a switch from the model of its last
    turn, or no history yet (its prompt may be stored under another model)."""
    last = row.model if row.turn_count else None
    return (last is not None and last != model) or not history


class TurnReads:
    """The per-turn reads on SQLite in one driver transaction; `read` returns None on other databases
    (the caller reads through a Session).

    Args:
        sessions: the registry's read sessions (their engine is used when it is SQLite).
        driver: read through the driver on SQLite (default True; False: `read` always returns None).
    """

    def __init__(self, sessions_: sessionmaker[Session], *, driver: bool = True) -> None:
        bind = getattr(sessions_, "kw", {}).get("bind")
        self._engine: Engine | None = (
            bind if driver and isinstance(bind, Engine) and bind.dialect.name == "sqlite" else None
        )
        if self._engine is not None:
            dialect = self._engine.dialect
            self._facts = DriverSelect(sessions._FACTS, dialect)
            self._history = DriverSelect(sessions._HISTORY, dialect)
            self._policy = DriverSelect(policies._EFFECTIVE, dialect)
            self._spans = DriverSelect(segments._SPANS, dialect)
            self._mappers = DriverSelect(mappers._OF_RECEIVER, dialect)

    def read(
        self,
        session_id: str,
        *,
        tenant_id: str,
        default_floor_s: float,
        default_ceiling_s: float,
        model: str | None = None,
    ) -> TurnSnapshot | None:
        """The snapshot of a turn of `model` (None: the session's model) on the session."""
        if self._engine is None:
            return None
        raw = self._engine.raw_connection()
        try:
            cursor = raw.cursor()
            try:
                # A deferred read transaction (autocommit connections, `engine.py`): one snapshot for all
                # four reads, and no write lock taken.
                cursor.execute("BEGIN")
                try:
                    return self._read(
                        cursor, session_id, tenant_id, default_floor_s, default_ceiling_s, model
                    )
                finally:
                    cursor.execute("ROLLBACK")
            finally:
                cursor.close()
        finally:
            raw.close()

    def _read(
        self,
        cursor: Any,
        session_id: str,
        tenant_id: str,
        default_floor_s: float,
        default_ceiling_s: float,
        model: str | None,
    ) -> TurnSnapshot:
        found = self._facts.rows(cursor, {"sid": session_id})
        row = found[0] if found else None
        # as SessionRepository.facts: another tenant's session reads as absent
        if row is None or row.tenant_id != tenant_id:
            return TurnSnapshot(row=None)
        blob = b"".join(b for r in self._history.rows(cursor, {"sid": session_id}) for b in r)
        held = self._policy.rows(cursor, {"tid": row.tenant_id})
        policy = effective_policy(
            row.tenant_id,
            held[0] if held else None,
            default_floor_s=default_floor_s,
            default_ceiling_s=default_ceiling_s,
        )
        spans = self._spans.rows(cursor, {"sid": session_id})
        history = blob_to_tokens(blob)
        name = model or row.model
        found = self._mappers.rows(cursor, {"rm": name}) if reads_mappers(row, history, name) else None
        return TurnSnapshot(
            row=row, history=history, history_ids=blob, policy=policy, spans=spans, mappers=found
        )

"""A turn's registry reads in one read transaction on SQLite through the driver: the session's facts, its
history, the tenant's effective policy and the session's segment spans, as `SessionRepository.facts` /
`history`, `PolicyRepository.effective` and `SegmentRepository.spans_of` give them in a Session (their
tested twins), with the same statements (`DriverSelect`: same SQL text and type processing).

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
from orchestrator.db.repositories import policies, segments, sessions
from orchestrator.db.repositories.driver_select import DriverSelect
from orchestrator.db.repositories.policies import EffectivePolicy, effective_policy

__all__ = ["TurnReads", "TurnSnapshot"]


@dataclass(frozen=True, kw_only=True)
class TurnSnapshot:
    """What a turn read of the registry in one snapshot (`row` None: no such session of the tenant;
    the rest is then empty)."""

    row: Any | None
    history: list[int] = field(default_factory=list)
    policy: EffectivePolicy | None = None
    spans: list[Any] = field(default_factory=list)


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

    def read(
        self, session_id: str, *, tenant_id: str, default_floor_s: float, default_ceiling_s: float
    ) -> TurnSnapshot | None:
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
                    return self._read(cursor, session_id, tenant_id, default_floor_s, default_ceiling_s)
                finally:
                    cursor.execute("ROLLBACK")
            finally:
                cursor.close()
        finally:
            raw.close()

    def _read(
        self, cursor: Any, session_id: str, tenant_id: str, default_floor_s: float, default_ceiling_s: float
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
        return TurnSnapshot(row=row, history=blob_to_tokens(blob), policy=policy, spans=spans)

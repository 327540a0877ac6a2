"""The read path's retention check of a turn's stored chunks (`SegmentRepository.within_retention` with a
tenant and fingerprint), in a read of its own: on SQLite the Core statement's SQL text on a pooled driver
connection, elsewhere a Session as before.

Why: every turn runs it once, after its store reads (a purge commits in SQL first, so the registry must be
read after the store). Through a Session it costs a Session, a pool checkout with a BEGIN statement, the
Core execution and a ROLLBACK; the driver call alone reads the same rows. SQLite's connections here are in
autocommit (`engine.py`), where one SELECT reads one snapshot, which is all a one-statement transaction
gives. The bound stamp goes through the column's own bind processor, as the Core path's does.

The rows come back as one JSON array in one row (`json_group_array`; keys as hex): Python 3.11's sqlite3
lets go of the GIL at each step and each column of each row, and at 64 sessions each of those hands the
GIL to another thread (turn_reads.py says more).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.db.models import CacheSegment
from orchestrator.db.repositories.segments import SegmentRepository

__all__ = ["RetainedKeys"]

_CS = CacheSegment.__table__
# `segments._RETAINED` as the SQLite dialect renders it, the expanding IN written out per call, its rows
# aggregated into one JSON array of [hex(store_key), expires_at > ?].
_HEAD = (
    "SELECT json_group_array(json_array(hex(cache_segments.store_key), cache_segments.expires_at > ?)) "
    "FROM cache_segments WHERE "
)
_TAIL = " AND cache_segments.tenant_id = ? AND cache_segments.fingerprint = ?"


class RetainedKeys:
    """key -> whether its row is inside the latest retention granted by the sessions holding it, for the
    rows of one tenant and fingerprint (`SegmentRepository.within_retention`, its tested twin).

    Args:
        sessions: the registry's read sessions (PostgreSQL, or `driver=False`: the Session path).
        driver: on SQLite, read through the driver (default True).
    """

    def __init__(self, sessions: sessionmaker[Session], *, driver: bool = True) -> None:
        self._sessions = sessions
        bind = getattr(sessions, "kw", {}).get("bind")
        self._engine: Engine | None = (
            bind if driver and isinstance(bind, Engine) and bind.dialect.name == "sqlite" else None
        )
        self._stamp = None
        if self._engine is not None:
            dialect = self._engine.dialect
            self._stamp = _CS.c.expires_at.type.dialect_impl(dialect).bind_processor(dialect)

    def __call__(
        self, keys: Sequence[bytes], *, now: float, tenant_id: str, fingerprint: str
    ) -> dict[bytes, bool]:
        if not keys:
            return {}
        if self._engine is None:
            with self._sessions() as session:
                return SegmentRepository(session).within_retention(
                    keys, now=now, tenant_id=tenant_id, fingerprint=fingerprint
                )
        live_at = dt.datetime.fromtimestamp(now, dt.UTC)
        stamp = self._stamp(live_at) if self._stamp is not None else live_at
        sql = _HEAD + "cache_segments.store_key IN (" + ", ".join("?" * len(keys)) + ")" + _TAIL
        raw = self._engine.raw_connection()
        try:
            cursor = raw.cursor()
            try:
                ((rows,),) = cursor.execute(sql, [stamp, *keys, tenant_id, fingerprint]).fetchall()
            finally:
                cursor.close()
        finally:
            # back to the pool (whose reset on return rolls back: nothing is open)
            raw.close()
        return {bytes.fromhex(key): bool(live) for key, live in json.loads(rows)}

"""`SegmentRepository.link_current` on SQLite in driver statements: the Core upsert path's four statements
(`link_current_core`, its tested twin: same rows, same returned keys) written as SQL text and run on the
transaction's own sqlite3 connection.

Why: they run inside every turn's write transaction, which every other turn waits for, and SQLAlchemy's
execution of a Core statement (compiled-cache lookup, parameter processing, result setup; an upsert's
multi-row rendering) costs 50-600 us where the driver call costs a few. Values go through the columns' own
bind processors (the UTC datetimes as SQLAlchemy stores them), so the stored bytes are the Core path's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy.engine import Connection

from orchestrator.db.models import CacheSegment, utcnow

__all__ = ["link_current_sqlite"]

_CS = CacheSegment.__table__
_COLUMNS = (
    "store_key", "tenant_id", "model", "fingerprint", "numerics", "start_pos", "end_pos", "nbytes", "node",
    "region", "stored_at", "expires_at",
)  # fmt: skip
_ROW = "(" + ", ".join("?" * len(_COLUMNS)) + ")"
_UPSERT_HEAD = f"INSERT INTO cache_segments ({', '.join(_COLUMNS)}) VALUES "
# Same as `_FastLinkStatements.upsert`: a known key of the same tenant only has its expiry extended; one
# of another tenant is left alone and returns no row.
_UPSERT_TAIL = (
    " ON CONFLICT (store_key) DO UPDATE SET expires_at = CASE WHEN cache_segments.expires_at < "
    "excluded.expires_at THEN excluded.expires_at ELSE cache_segments.expires_at END "
    "WHERE cache_segments.tenant_id = excluded.tenant_id RETURNING id, store_key"
)
_LINK = "INSERT INTO session_segments (session_id, segment_id) VALUES (?, ?) ON CONFLICT DO NOTHING"
_UNLINK_HEAD = (
    "DELETE FROM session_segments WHERE session_id = ? AND segment_id IN "
    "(SELECT id FROM cache_segments WHERE fingerprint = ?)"
)
_DROP_TAIL = (
    ") AND NOT EXISTS (SELECT 1 FROM session_segments"
    " WHERE session_segments.segment_id = cache_segments.id) RETURNING store_key"
)

_processors: dict[int, Callable[[Any], Any]] = {}


def _datetime_processor(conn: Connection) -> Callable[[Any], Any]:
    """The bind processor of the UTC datetime columns on this dialect (what the Core path applies)."""
    key = id(conn.dialect)
    proc = _processors.get(key)
    if proc is None:
        typ = _CS.c.expires_at.type
        proc = typ.dialect_impl(conn.dialect).bind_processor(conn.dialect) or (lambda v: v)
        _processors[key] = proc
    return proc


def _marks(n: int) -> str:
    return ", ".join("?" * n)


def link_current_sqlite(
    conn: Connection, session_id: str, fingerprint: str, values: Sequence[dict[str, Any]]
) -> tuple[dict[bytes, int], list[bytes] | None]:
    """Upsert `values` (distinct store keys, as `_segment_values` gives them), link them to the session,
    unlink its stale links of `fingerprint` and delete the rows nobody links.

    Returns:
        (store key -> row id of every key upserted; the keys of the deleted rows). A key missing from
        the ids is another tenant's: the caller refuses it (nothing past the upsert has run then, and
        the deleted keys are None).
    """
    raw = conn.connection.driver_connection
    assert raw is not None
    stamp = _datetime_processor(conn)
    ids: dict[bytes, int] = {}
    if values:
        params: list[Any] = []
        for v in values:
            params += [v[c] for c in _COLUMNS[:10]]
            # stored_at: the column's default, as the Core insert fills it
            params += [stamp(utcnow()), stamp(v["expires_at"])]
        sql = _UPSERT_HEAD + ", ".join([_ROW] * len(values)) + _UPSERT_TAIL
        ids = {key: seg_id for seg_id, key in raw.execute(sql, params).fetchall()}
        if len(ids) != len(values):
            return ids, None
        raw.executemany(_LINK, [(session_id, i) for i in ids.values()])
    keep = sorted(ids.values())
    sql = _UNLINK_HEAD + (f" AND segment_id NOT IN ({_marks(len(keep))})" if keep else "")
    stale = [r[0] for r in raw.execute(sql + " RETURNING segment_id", [session_id, fingerprint, *keep])]
    if not stale:
        return ids, []
    sql = "DELETE FROM cache_segments WHERE id IN (" + _marks(len(stale)) + _DROP_TAIL
    return ids, [r[0] for r in raw.execute(sql, stale)]

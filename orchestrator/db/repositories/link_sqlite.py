"""`SegmentRepository.link_current` on SQLite in driver statements: the Core upsert path's four statements
(`link_current_core`, its tested twin: same rows, same returned keys) written as SQL text and run on the
transaction's own sqlite3 connection.

Why: they run inside every turn's write transaction, which every other turn waits for, and SQLAlchemy's
execution of a Core statement (compiled-cache lookup, parameter processing, result setup; an upsert's
multi-row rendering) costs 50-600 us where the driver call costs a few. Values go through the columns' own
bind processors (the UTC datetimes as SQLAlchemy stores them), so the stored bytes are the Core path's.

A long session re-links every chunk of its history each turn (all of them get the turn's expiry). From
`INCREMENTAL_FROM` segments on, the statements read the session's links first and upsert only the keys it
does not link yet; the chunks it links keep their rows, and their expiry moves up in one UPDATE per
expiry (`_link_incremental`). The rows and returned keys are the same (tests/orchestrator/db/
test_link_current_twin.py runs both against the reference); at 250 chunks (a 64K-token history) the
upsert had bound 3,000 values a turn, inside the write transaction every other turn waits for.
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

_LINKED = (
    "SELECT cache_segments.store_key, cache_segments.id, cache_segments.tenant_id"
    " FROM session_segments JOIN cache_segments"
    " ON cache_segments.id = session_segments.segment_id"
    " WHERE session_segments.session_id = ? AND cache_segments.fingerprint = ?"
)

# Segments from which `link_current_sqlite` (and PostgreSQL's `SegmentRepository.link_current_core`)
# upserts only the keys the session does not link yet. Below it the one upsert of every key costs less than
# the read of the links it would save (about one statement).
INCREMENTAL_FROM = 8

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
    if len(values) >= INCREMENTAL_FROM:
        return _link_incremental(raw, stamp, session_id, fingerprint, values)
    ids = _upsert_and_link(raw, stamp, session_id, values)
    if len(ids) != len(values):
        return ids, None
    keep = sorted(ids.values())
    sql = _UNLINK_HEAD + (f" AND segment_id NOT IN ({_marks(len(keep))})" if keep else "")
    stale = [r[0] for r in raw.execute(sql + " RETURNING segment_id", [session_id, fingerprint, *keep])]
    return ids, _drop_unlinked(raw, stale)


def _upsert_and_link(
    raw: Any, stamp: Callable[[Any], Any], session_id: str, values: Sequence[dict[str, Any]]
) -> dict[bytes, int]:
    """Insert the rows of `values` or extend the expiry of the known ones, and link the session to them;
    store key -> row id of each row of the caller's tenant. Another tenant's key returns no row, and then
    nothing is linked (the caller refuses the call)."""
    if not values:
        return {}
    params: list[Any] = []
    for v in values:
        params += [v[c] for c in _COLUMNS[:10]]
        # stored_at: the column's default, as the Core insert fills it
        params += [stamp(utcnow()), stamp(v["expires_at"])]
    sql = _UPSERT_HEAD + ", ".join([_ROW] * len(values)) + _UPSERT_TAIL
    ids = {key: seg_id for seg_id, key in raw.execute(sql, params).fetchall()}
    if len(ids) == len(values):
        raw.executemany(_LINK, [(session_id, i) for i in ids.values()])
    return ids


def _drop_unlinked(raw: Any, stale: list[int]) -> list[bytes]:
    """Delete the rows among `stale` (ids just unlinked) that no session links; their store keys."""
    if not stale:
        return []
    sql = "DELETE FROM cache_segments WHERE id IN (" + _marks(len(stale)) + _DROP_TAIL
    return [r[0] for r in raw.execute(sql, stale)]


def _link_incremental(
    raw: Any, stamp: Callable[[Any], Any], session_id: str, fingerprint: str, values: Sequence[dict[str, Any]]
) -> tuple[dict[bytes, int], list[bytes] | None]:
    """`link_current_sqlite` from the session's links: the keys it links already keep their rows (their
    expiry extended as the upsert extends it: only upward, only for the row's own tenant), the others are
    upserted and linked, and the links to keys not in `values` are deleted. The tenant is compared from
    the links' read, as PostgreSQL's twin does it (`SegmentRepository._link_incremental_core`)."""
    rows = raw.execute(_LINKED, (session_id, fingerprint)).fetchall()
    linked = {bytes(key): (seg_id, owner) for key, seg_id, owner in rows}
    new = [v for v in values if v["store_key"] not in linked]
    ids = _upsert_and_link(raw, stamp, session_id, new)
    if len(ids) != len(new):
        return ids, None
    extend: dict[Any, list[int]] = {}
    stamps: dict[Any, Any] = {}  # a turn's segments share one expiry: its bind value made once, not per row
    for v in values:
        held = linked.get(v["store_key"])
        if held is None:
            continue
        seg_id, owner = held
        ids[v["store_key"]] = seg_id
        if owner != v["tenant_id"]:
            continue  # as the upsert: another tenant's row keeps its expiry
        at = v["expires_at"]
        bound = stamps.get(at)
        if bound is None:
            bound = stamps[at] = stamp(at)
        extend.setdefault(bound, []).append(seg_id)
    for at, seg_ids in extend.items():
        sql = "UPDATE cache_segments SET expires_at = ? WHERE expires_at < ? AND id IN ("
        raw.execute(sql + _marks(len(seg_ids)) + ")", [at, at, *seg_ids])
    stale = [seg_id for key, (seg_id, _) in linked.items() if key not in ids]
    if stale:
        raw.execute(
            "DELETE FROM session_segments WHERE session_id = ? AND segment_id IN ("
            + _marks(len(stale))
            + ")",
            [session_id, *stale],
        )
    return ids, _drop_unlinked(raw, stale)

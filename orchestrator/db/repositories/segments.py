"""Cache segments: which durably stored chunk holds which positions of which model, for which tenant.

A segment row is added only after the store has reported the write durable, so SQL never points at a
chunk that is not stored; purges return the store keys that no session needs any more, for the caller
to delete from the store after the SQL transaction commits.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import Integer, any_, bindparam, case, delete, exists, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Row
from sqlalchemy.orm import Session

from orchestrator.db.models import CacheSegment, SessionSegment
from orchestrator.db.repositories import link_sqlite
from orchestrator.db.repositories.link_sqlite import link_current_sqlite
from orchestrator.db.repositories.read_connection import read_connection
from orchestrator.db.transactions import connection_of

__all__ = ["SegmentRepository", "DurableSegment", "SegmentTotals"]

_CS, _SS = CacheSegment.__table__, SessionSegment.__table__


class _LinkStatements:
    """`link_current`'s statements, built once: building a statement costs several times what running a
    cached one does, and these run on every turn."""

    known = select(_CS.c.id, _CS.c.store_key, _CS.c.tenant_id, _CS.c.expires_at).where(
        _CS.c.store_key.in_(bindparam("keys", expanding=True))
    )
    add = insert(_CS).returning(_CS.c.id, _CS.c.store_key)
    extend = (
        update(_CS)
        .where(_CS.c.id.in_(bindparam("ids", expanding=True)), _CS.c.expires_at < bindparam("until"))
        .values(expires_at=bindparam("until"))
    )
    linked = (
        select(_SS.c.segment_id, _CS.c.fingerprint)
        .join(_CS, _SS.c.segment_id == _CS.c.id)
        .where(_SS.c.session_id == bindparam("sid"))
    )
    link = insert(_SS)
    unlink = delete(_SS).where(
        _SS.c.session_id == bindparam("sid"), _SS.c.segment_id.in_(bindparam("ids", expanding=True))
    )
    # RETURNING the keys: the turn's transaction then skips them in `forget_gone_chunks` (the store's
    # records of the superseded tail name the chunks this very statement deleted).
    drop_unlinked = (
        delete(_CS)
        .where(_CS.c.id.in_(bindparam("ids", expanding=True)), ~exists().where(_SS.c.segment_id == _CS.c.id))
        .returning(_CS.c.store_key)
    )


def _upsert(dialect: object) -> object:
    """INSERT of a chunk's row that, on a store key already recorded for the same tenant, only extends its
    expiry (never shortens it), returning (id, store_key) of every row it inserted or touched;
    a key of another tenant is left alone and returns nothing."""
    stmt = dialect.insert(_CS)  # type: ignore[attr-defined]
    new = stmt.excluded
    return stmt.on_conflict_do_update(
        index_elements=[_CS.c.store_key],
        set_={
            "expires_at": case((_CS.c.expires_at < new.expires_at, new.expires_at), else_=_CS.c.expires_at)
        },
        where=_CS.c.tenant_id == new.tenant_id,
    ).returning(_CS.c.id, _CS.c.store_key)


class _FastLinkStatements:
    """`link_current`'s statements: three or four per turn instead of the reference's seven
    (`link_current_reference`), each of them inside the turn's write transaction, where every statement
    is a release and re-take of the GIL while other turns wait for the write lock."""

    upsert = {"sqlite": _upsert(sqlite), "postgresql": _upsert(postgresql)}
    link = {
        "sqlite": sqlite.insert(_SS).on_conflict_do_nothing(),
        "postgresql": postgresql.insert(_SS).on_conflict_do_nothing(),
    }
    # The session's links to chunks of this fingerprint that are not current any more (a superseded tail).
    unlink_stale = (
        delete(_SS)
        .where(
            _SS.c.session_id == bindparam("sid"),
            _SS.c.segment_id.in_(select(_CS.c.id).where(_CS.c.fingerprint == bindparam("fp"))),
            _SS.c.segment_id.not_in(bindparam("keep", expanding=True)),
        )
        .returning(_SS.c.segment_id)
    )
    owner = select(_CS.c.tenant_id).where(_CS.c.store_key == bindparam("key"))
    # A long session's incremental path (`_link_incremental_core`): its links of the fingerprint, the
    # expiry of the linked rows moved up (only upward, only the row's own tenant: what the upsert does;
    # the tenant is compared here, from the links' read, so that the UPDATE names rows by primary key
    # only: with `tenant_id` in its WHERE, PostgreSQL planned a scan of the tenant's index with the id
    # list tested per row, 118 ms at 500 segments under a generic plan, against 2-5 ms by key), and its
    # stale links deleted by id.
    linked = (
        select(_CS.c.store_key, _CS.c.id, _CS.c.tenant_id)
        .join(_SS, _SS.c.segment_id == _CS.c.id)
        .where(_SS.c.session_id == bindparam("sid"), _CS.c.fingerprint == bindparam("fp"))
    )
    # PostgreSQL takes the ids as one array parameter: an IN list of 250 parameters took 3.5 ms of the
    # statement's planning and binding alone (SQLite, the twin's only other dialect, has no arrays).
    extend = {
        name: update(_CS)
        .where(ids, _CS.c.expires_at < bindparam("until"))
        .values(expires_at=bindparam("until"))
        for name, ids in (
            ("sqlite", _CS.c.id.in_(bindparam("ids", expanding=True))),
            ("postgresql", _CS.c.id == any_(bindparam("ids", type_=postgresql.ARRAY(Integer)))),
        )
    }


_LINK = _LinkStatements()
_FAST = _FastLinkStatements()

_SPANS = (
    select(_CS.c.fingerprint, _CS.c.model, _CS.c.numerics, _CS.c.start_pos, _CS.c.end_pos)
    .join(_SS, _SS.c.segment_id == _CS.c.id)
    .where(_SS.c.session_id == bindparam("sid"))
    .order_by(_CS.c.start_pos)
)
# `within_retention`: each key's row and whether it is inside its retention at `live_at`.
_RETAINED_ANY = select(_CS.c.store_key, _CS.c.expires_at > bindparam("live_at")).where(
    _CS.c.store_key.in_(bindparam("keys", expanding=True))
)
_RETAINED = _RETAINED_ANY.where(_CS.c.tenant_id == bindparam("tenant"), _CS.c.fingerprint == bindparam("fp"))


@dataclass(frozen=True, kw_only=True)
class DurableSegment:
    """A chunk the store has written durably: key, positions [start_pos, end_pos), size and expiry."""

    store_key: bytes
    tenant_id: str
    model: str
    fingerprint: str
    start_pos: int
    end_pos: int
    nbytes: int
    expires_at: dt.datetime
    node: str = ""
    region: str = ""
    numerics: str = ""

    def __post_init__(self) -> None:
        if not self.store_key:
            raise ValueError("store_key must be non-empty")
        if not 0 <= self.start_pos < self.end_pos:
            raise ValueError(f"segment positions [{self.start_pos}, {self.end_pos}) are empty or negative")
        if self.nbytes < 0:
            raise ValueError(f"nbytes={self.nbytes} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class SegmentTotals:
    segments: int
    bytes: int
    tokens: int


def _segment_values(seg: DurableSegment) -> dict[str, object]:
    return dict(
        store_key=seg.store_key,
        tenant_id=seg.tenant_id,
        model=seg.model,
        fingerprint=seg.fingerprint,
        numerics=seg.numerics,
        start_pos=seg.start_pos,
        end_pos=seg.end_pos,
        nbytes=seg.nbytes,
        node=seg.node,
        region=seg.region,
        expires_at=seg.expires_at,
    )


def _upsert_and_link_core(
    conn: Connection, session_id: str, segments: Sequence[DurableSegment]
) -> dict[bytes, int]:
    """Insert the rows of `segments` or extend the expiry of the known ones, and link the session to
    them; store key -> row id. A key of another tenant is refused (ValueError) before anything is linked."""
    if not segments:
        return {}
    dialect = conn.dialect.name
    rows = conn.execute(_FAST.upsert[dialect], [_segment_values(seg) for seg in segments])
    ids = {r.store_key: r.id for r in rows}
    if len(ids) != len(segments):
        _refuse_foreign(conn, [seg for seg in segments if seg.store_key not in ids])
    conn.execute(_FAST.link[dialect], [{"session_id": session_id, "segment_id": i} for i in ids.values()])
    return ids


def _refuse_foreign(conn: Connection, untouched: Sequence[DurableSegment]) -> None:
    """Raise for the first segment the upsert left alone: its key is recorded for another tenant."""
    seg = untouched[0]
    owner = conn.execute(_FAST.owner, {"key": seg.store_key}).scalar_one()
    # Keys embed the tenant salt, so a collision across tenants means a broken key scheme.
    raise ValueError(f"store key already owned by tenant {owner!r}, not {seg.tenant_id!r}")


class SegmentRepository:
    """Segment rows and links inside the caller's unit of work. A Core Connection (a turn's
    `run_serializable_connection`) serves the `link_current*` methods, which run Core and driver
    statements only; the others need the ORM Session."""

    def __init__(self, session: Session | Connection) -> None:
        self._s = session

    def link(self, session_id: str, segment: DurableSegment) -> CacheSegment:
        """Record a durable chunk (once per store key) and link it to the session that needs it."""
        row = self._s.scalars(
            select(CacheSegment).where(CacheSegment.store_key == segment.store_key)
        ).one_or_none()
        if row is None:
            row = CacheSegment(
                store_key=segment.store_key,
                tenant_id=segment.tenant_id,
                model=segment.model,
                fingerprint=segment.fingerprint,
                numerics=segment.numerics,
                start_pos=segment.start_pos,
                end_pos=segment.end_pos,
                nbytes=segment.nbytes,
                node=segment.node,
                region=segment.region,
                expires_at=segment.expires_at,
            )
            self._s.add(row)
            self._s.flush()
        else:
            if row.tenant_id != segment.tenant_id:
                # Keys embed the tenant salt, so a collision across tenants means a broken key scheme.
                raise ValueError(
                    f"store key already owned by tenant {row.tenant_id!r}, not {segment.tenant_id!r}"
                )
            row.expires_at = max(row.expires_at, segment.expires_at)
        linked = self._s.get(SessionSegment, (session_id, row.id))
        if linked is None:
            self._s.add(SessionSegment(session_id=session_id, segment_id=row.id))
            self._s.flush()
        return row

    def link_current(
        self, session_id: str, fingerprint: str, segments: Sequence[DurableSegment]
    ) -> list[bytes]:
        """Make `segments` the session's chunks of `fingerprint`: record new ones (once per store key),
        extend the expiry of known ones, link them, unlink the session's other chunks of that
        fingerprint (a superseded shorter tail) and delete rows no session links any more. Returns the
        store keys of the rows it deleted.

        The rows left are those `link_current_reference` leaves (tests compare them on random chains;
        row ids may differ on PostgreSQL, whose sequence an upsert's conflict consumes): an upsert per
        chunk in one statement, links added with ON CONFLICT DO NOTHING, the stale links deleted in one
        statement that returns them, then the rows no session links; on SQLite as driver statements
        (`link_sqlite.py`, twin `link_current_core`). A store key given twice takes the reference's path.

        Raises:
            ValueError: a store key already recorded for another tenant (raised after the upsert of the
                others: the caller's transaction must not commit, as run_serializable ensures).
        """
        conn = connection_of(self._s)
        keys = [seg.store_key for seg in segments]
        if len(set(keys)) != len(keys) or conn.dialect.name not in _FAST.upsert:
            return self.link_current_reference(session_id, fingerprint, segments)
        if conn.dialect.name != "sqlite":
            return self.link_current_core(session_id, fingerprint, segments)
        # SQLite: the same statements as driver SQL (`link_sqlite.py`; twin: `link_current_core`)
        ids, dropped = link_current_sqlite(
            conn, session_id, fingerprint, [_segment_values(g) for g in segments]
        )
        if dropped is None:
            _refuse_foreign(conn, [seg for seg in segments if seg.store_key not in ids])
        assert dropped is not None
        return dropped

    def link_current_core(
        self, session_id: str, fingerprint: str, segments: Sequence[DurableSegment]
    ) -> list[bytes]:
        """`link_current` in SQLAlchemy Core statements (PostgreSQL's path; SQLite's twin); distinct
        store keys."""
        conn = connection_of(self._s)
        if len(segments) >= link_sqlite.INCREMENTAL_FROM:
            return self._link_incremental_core(conn, session_id, fingerprint, segments)
        ids = _upsert_and_link_core(conn, session_id, segments)
        params = {"sid": session_id, "fp": fingerprint, "keep": sorted(ids.values())}
        stale = [r.segment_id for r in conn.execute(_FAST.unlink_stale, params)]
        if not stale:
            return []
        return [r.store_key for r in conn.execute(_LINK.drop_unlinked, {"ids": stale})]

    @staticmethod
    def _link_incremental_core(
        conn: Connection, session_id: str, fingerprint: str, segments: Sequence[DurableSegment]
    ) -> list[bytes]:
        """`link_current_core` from the session's links, as SQLite's `_link_incremental` does it: the keys
        it links already keep their rows (their expiry extended), the others are upserted and linked, the
        links to keys not in `segments` are deleted, then the rows nobody links. Why: the upsert of every
        chunk re-sent a 64K-token history's 250 rows each turn (20 ms a turn on PostgreSQL, against 2.3
        ms at 4 chunks)."""
        rows = conn.execute(_FAST.linked, {"sid": session_id, "fp": fingerprint})
        linked = {r.store_key: (r.id, r.tenant_id) for r in rows}
        ids = _upsert_and_link_core(
            conn, session_id, [seg for seg in segments if seg.store_key not in linked]
        )
        extend: dict[dt.datetime, list[int]] = {}
        for seg in segments:
            held = linked.get(seg.store_key)
            if held is not None:
                seg_id, owner = held
                ids[seg.store_key] = seg_id
                if owner == seg.tenant_id:  # as the upsert: another tenant's row keeps its expiry
                    extend.setdefault(seg.expires_at, []).append(seg_id)
        for until, held_ids in extend.items():
            conn.execute(_FAST.extend[conn.dialect.name], {"ids": held_ids, "until": until})
        stale = [seg_id for key, (seg_id, _) in linked.items() if key not in ids]
        if not stale:
            return []
        conn.execute(_LINK.unlink, {"sid": session_id, "ids": stale})
        return [r.store_key for r in conn.execute(_LINK.drop_unlinked, {"ids": stale})]

    def link_current_reference(
        self, session_id: str, fingerprint: str, segments: Sequence[DurableSegment]
    ) -> list[bytes]:
        """`link_current`'s reference twin: reads the known rows and the session's links, then inserts,
        extends, links, unlinks and deletes what differs (seven Core statements built once, `_LINK`,
        whatever the number of segments).

        Raises:
            ValueError: a store key already recorded for another tenant (before anything is written).
        """
        conn = connection_of(self._s)
        keys = [seg.store_key for seg in segments]
        known: dict[bytes, tuple[int, str, dt.datetime]] = {}
        if keys:
            rows = conn.execute(_LINK.known, {"keys": keys})
            known = {r.store_key: (r.id, r.tenant_id, r.expires_at) for r in rows}
        ids: dict[bytes, int] = {}
        fresh: list[dict[str, object]] = []
        extend: dict[dt.datetime, list[int]] = {}
        seen: set[bytes] = set()
        for seg in segments:
            hit = known.get(seg.store_key)
            if hit is None:
                if seg.store_key in seen:
                    continue
                seen.add(seg.store_key)
                fresh.append(_segment_values(seg))
                continue
            seg_id, owner, expires = hit
            if owner != seg.tenant_id:
                # Keys embed the tenant salt, so a collision across tenants means a broken key scheme.
                raise ValueError(f"store key already owned by tenant {owner!r}, not {seg.tenant_id!r}")
            ids[seg.store_key] = seg_id
            if expires < seg.expires_at:
                extend.setdefault(seg.expires_at, []).append(seg_id)
        if fresh:
            inserted = conn.execute(_LINK.add, fresh)
            ids.update({r.store_key: r.id for r in inserted})
        for expires, seg_ids in extend.items():
            conn.execute(_LINK.extend, {"ids": seg_ids, "until": expires})
        keep = set(ids.values())
        linked = conn.execute(_LINK.linked, {"sid": session_id}).all()
        have = {r.segment_id for r in linked}
        missing = [{"session_id": session_id, "segment_id": i} for i in sorted(keep - have)]
        if missing:
            conn.execute(_LINK.link, missing)
        stale = [r.segment_id for r in linked if r.fingerprint == fingerprint and r.segment_id not in keep]
        if not stale:
            return []
        conn.execute(_LINK.unlink, {"sid": session_id, "ids": stale})
        return [r.store_key for r in conn.execute(_LINK.drop_unlinked, {"ids": stale})]

    def spans_of(self, session_id: str) -> list[Row]:
        """The session's linked segments as Core rows (fingerprint, model, numerics, start_pos, end_pos)
        ordered by start_pos: what a turn's preparation reads, without loading ORM objects."""
        return read_connection(self._s).execute(_SPANS, {"sid": session_id}).all()

    def for_session(self, session_id: str, *, model: str | None = None) -> list[CacheSegment]:
        stmt = (
            select(CacheSegment)
            .join(SessionSegment, SessionSegment.segment_id == CacheSegment.id)
            .where(SessionSegment.session_id == session_id)
        )
        if model is not None:
            stmt = stmt.where(CacheSegment.model == model)
        return list(self._s.scalars(stmt.order_by(CacheSegment.start_pos)))

    def _drop_unlinked(self, candidate_ids: Iterable[int] | None = None) -> list[bytes]:
        linked = exists().where(SessionSegment.segment_id == CacheSegment.id)
        stmt = select(CacheSegment).where(~linked)
        if candidate_ids is not None:
            ids = list(candidate_ids)
            if not ids:
                return []
            stmt = stmt.where(CacheSegment.id.in_(ids))
        keys: list[bytes] = []
        for row in self._s.scalars(stmt):
            keys.append(row.store_key)
            self._s.delete(row)
        self._s.flush()
        return keys

    def unlink_session(self, session_id: str) -> list[bytes]:
        """Drop the session's links; delete and return the keys of segments no other session needs."""
        ids = list(
            self._s.scalars(select(SessionSegment.segment_id).where(SessionSegment.session_id == session_id))
        )
        self._s.execute(delete(SessionSegment).where(SessionSegment.session_id == session_id))
        return self._drop_unlinked(ids)

    def purge_tenant(self, tenant_id: str) -> list[bytes]:
        """Delete every segment row of the tenant and return their store keys."""
        rows = list(self._s.scalars(select(CacheSegment).where(CacheSegment.tenant_id == tenant_id)))
        return self._delete_rows(rows)

    def purge_model(self, model: str, *, tenant_id: str | None = None) -> list[bytes]:
        """Delete every segment row written by `model` (optionally of one tenant) and return the keys."""
        stmt = select(CacheSegment).where(CacheSegment.model == model)
        if tenant_id is not None:
            stmt = stmt.where(CacheSegment.tenant_id == tenant_id)
        return self._delete_rows(list(self._s.scalars(stmt)))

    def expired(self, now: dt.datetime) -> list[bytes]:
        """Delete segments past their expiry (the retention ceiling is hard) and return their keys."""
        rows = list(self._s.scalars(select(CacheSegment).where(CacheSegment.expires_at <= now)))
        return self._delete_rows(rows)

    def delete_keys(self, keys: Iterable[bytes]) -> int:
        """Delete the rows of these store keys (used by reconciliation); returns how many existed."""
        wanted = list(keys)
        if not wanted:
            return 0
        rows = list(self._s.scalars(select(CacheSegment).where(CacheSegment.store_key.in_(wanted))))
        self._delete_rows(rows)
        return len(rows)

    def within_retention(
        self,
        keys: Sequence[bytes],
        *,
        now: float,
        tenant_id: str | None = None,
        fingerprint: str | None = None,
        node: str | None = None,
    ) -> dict[bytes, bool]:
        """Each of these keys that has a row (under the filters given) -> whether that row is still inside
        the latest retention granted by the sessions holding it. The comparison runs in SQL, where the
        stored stamps and this one are converted alike on both dialects."""
        if not keys:
            return {}
        live_at = dt.datetime.fromtimestamp(now, dt.UTC)
        params: dict[str, object] = {"keys": list(keys), "live_at": live_at}
        if tenant_id is not None and fingerprint is not None and node is None:
            # the read path's filters on every turn: the statement built once
            params.update(tenant=tenant_id, fp=fingerprint)
            return {key: bool(live) for key, live in self._s.connection().execute(_RETAINED, params)}
        stmt = _RETAINED_ANY
        if tenant_id is not None:
            stmt = stmt.where(_CS.c.tenant_id == bindparam("tenant"))
            params["tenant"] = tenant_id
        if fingerprint is not None:
            stmt = stmt.where(_CS.c.fingerprint == bindparam("fp"))
            params["fp"] = fingerprint
        if node is not None:
            stmt = stmt.where(_CS.c.node == bindparam("node"))
            params["node"] = node
        return {key: bool(live) for key, live in self._s.connection().execute(stmt, params)}

    def keys_on_node(self, node: str) -> set[bytes]:
        return set(self._s.scalars(select(CacheSegment.store_key).where(CacheSegment.node == node)))

    def _delete_rows(self, rows: list[CacheSegment]) -> list[bytes]:
        keys = [r.store_key for r in rows]
        for row in rows:
            self._s.delete(row)
        self._s.flush()
        return keys

    def totals(self, *, tenant_id: str | None = None) -> SegmentTotals:
        stmt = select(
            func.count(CacheSegment.id),
            func.coalesce(func.sum(CacheSegment.nbytes), 0),
            func.coalesce(func.sum(CacheSegment.end_pos - CacheSegment.start_pos), 0),
        )
        if tenant_id is not None:
            stmt = stmt.where(CacheSegment.tenant_id == tenant_id)
        count, nbytes, tokens = self._s.execute(stmt).one()
        return SegmentTotals(segments=int(count), bytes=int(nbytes), tokens=int(tokens))

"""Reconciliation of the registry with this node's store: at start-up after a crash, as the store's
records arrive, and in a periodic sweep.

Knows nothing of the store's layout: the caller passes which keys the store holds durably. Rows that
point at a chunk the store does not hold are deleted (SQL never points at garbage): at start-up, and
whenever a store record says a chunk was expired, evicted, found corrupt or purged (`forget_gone_chunks`,
so GetStoreStats, read from SQL, stays right). Chunks the store holds without a row, past a grace
period, are orphans of turns that never committed: `collect_orphans` deletes them from the store, one
audit record each.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog
from sqlalchemy import Connection, bindparam, delete, select
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.db.audit_sink import SqlAuditSink
from orchestrator.db.models import CacheSegment, SessionSegment
from orchestrator.db.repositories import SegmentRepository, SessionRepository
from orchestrator.db.transactions import connection_of, run_serializable
from storage import AuditAction, AuditRecord

__all__ = [
    "ORPHAN_REASON",
    "RETENTION_REASON",
    "OrphanStore",
    "OrphanSweeper",
    "ReconcileReport",
    "collect_orphans",
    "forget_gone_chunks",
    "mirror_and_forget",
    "reconcile_segments",
    "reconcile_with_prefixes",
]

ORPHAN_REASON = "orphan_no_registry_row"
"""The reason of the PURGE record of each orphan chunk deleted."""

RETENTION_REASON = "retention_expired"
"""The reason of the PURGE record of each chunk whose registry row is past the granted retention of every
session that held it (the row's expires_at is the latest of theirs)."""

# Store records after which the named chunk is gone from the store.
_GONE = frozenset({AuditAction.EXPIRE, AuditAction.EVICT, AuditAction.READ_CORRUPT, AuditAction.PURGE})
_FORGET = delete(CacheSegment.__table__).where(
    CacheSegment.store_key.in_(bindparam("keys", expanding=True)), CacheSegment.node == bindparam("node")
)

log = structlog.get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class ReconcileReport:
    rows_checked: int
    dangling_rows_deleted: int
    unreferenced_chunks: frozenset[bytes]


def reconcile_segments(
    factory: sessionmaker[Session],
    *,
    node: str,
    store_has: Callable[[Iterable[bytes]], set[bytes]],
    store_keys: Iterable[bytes] = (),
) -> ReconcileReport:
    """Delete this node's segment rows whose chunks are not durably stored; list unreferenced chunks.

    Args:
        factory: serialisable session factory.
        node: this node's name (rows of other nodes describe other stores and are left alone).
        store_has: returns the subset of the given keys the store holds durably (and readable).
        store_keys: every chunk key in the store, to find chunks no row references (may be empty).
    """

    def work(s: Session) -> tuple[int, int, set[bytes]]:
        repo = SegmentRepository(s)
        known = repo.keys_on_node(node)
        present = store_has(known)
        dangling = known - present
        deleted = repo.delete_keys(dangling)
        return len(known), deleted, known

    checked, deleted, known = run_serializable(factory, work)
    unreferenced = frozenset(set(store_keys) - known)
    log.info(
        "registry_reconciled",
        node=node,
        rows_checked=checked,
        dangling_rows_deleted=deleted,
        unreferenced_chunks=len(unreferenced),
    )
    return ReconcileReport(
        rows_checked=checked, dangling_rows_deleted=deleted, unreferenced_chunks=unreferenced
    )


def reconcile_with_prefixes(
    factory: sessionmaker[Session],
    *,
    node: str,
    stored_prefix: Callable[[str, str, list[int]], int],
) -> ReconcileReport:
    """Delete this node's segment rows that lie beyond what the store holds for their session's history.

    For a store addressed by (tenant, model fingerprint, tokens), such as storage's GlobalKVStore:
    `stored_prefix(tenant, fingerprint, history)` returns how many leading tokens it holds durably
    (`store.lookup(...).n_tokens`). A row whose chunk ends past that is dropped for every session.
    """

    def work(s: Session) -> tuple[int, int]:
        stmt = (
            select(SessionSegment.session_id, CacheSegment)
            .join(CacheSegment, SessionSegment.segment_id == CacheSegment.id)
            .where(CacheSegment.node == node)
        )
        by_session: dict[str, list[CacheSegment]] = {}
        for session_id, seg in s.execute(stmt):
            by_session.setdefault(session_id, []).append(seg)
        sessions = SessionRepository(s)
        dangling: dict[int, CacheSegment] = {}
        checked: set[int] = set()
        for session_id, segs in by_session.items():
            history = sessions.history(session_id)
            prefixes: dict[tuple[str, str], int] = {}
            for seg in segs:
                checked.add(seg.id)
                key = (seg.tenant_id, seg.fingerprint)
                if key not in prefixes:
                    prefixes[key] = stored_prefix(seg.tenant_id, seg.fingerprint, history)
                if seg.end_pos > prefixes[key]:
                    dangling[seg.id] = seg
        deleted = SegmentRepository(s).delete_keys(seg.store_key for seg in dangling.values())
        return len(checked), deleted

    checked, deleted = run_serializable(factory, work)
    log.info("registry_reconciled", node=node, rows_checked=checked, dangling_rows_deleted=deleted)
    return ReconcileReport(
        rows_checked=checked, dangling_rows_deleted=deleted, unreferenced_chunks=frozenset()
    )


def _gone_keys(records: Iterable[AuditRecord]) -> list[bytes]:
    keys: list[bytes] = []
    for rec in records:
        if rec.action in _GONE and rec.subject.startswith("chunk:"):
            try:
                keys.append(bytes.fromhex(rec.subject[len("chunk:") :]))
            except ValueError:
                continue
    return keys


def forget_gone_chunks(
    session: Session | Connection,
    *,
    node: str,
    records: Iterable[AuditRecord],
    deleted: Collection[bytes] = (),
) -> int:
    """Inside `session`'s transaction: delete this node's segment rows of the chunks that `records`
    (store records) say were expired, evicted, found corrupt or purged; returns rows deleted. Rows of
    other nodes name other stores' copies and stay.

    Args:
        deleted: store keys whose rows this transaction already deleted (store keys are unique, so
            no row of them is left): skipped, and no statement runs when nothing else is gone.
    """
    keys = [k for k in _gone_keys(records) if k not in deleted]
    if not keys:
        return 0
    # Core, built once (`_FORGET`): this runs in the transaction of every turn whose write replaced a
    # tail chunk. The links go with the rows (ON DELETE CASCADE).
    return connection_of(session).execute(_FORGET, {"keys": keys, "node": node}).rowcount


def mirror_and_forget(
    factory: sessionmaker[Session], sink: SqlAuditSink, *, node: str
) -> Callable[[list[AuditRecord]], list[AuditRecord]]:
    """The store's `on_audit`: mirror its records into the SQL log and, in the same transaction, drop
    the rows of the chunks they say are gone (so the registry never outlives an expiry until restart)."""

    def on_audit(records: list[AuditRecord]) -> list[AuditRecord]:
        batch = list(records)
        if not batch:
            return []

        def work(s: Session) -> list[AuditRecord]:
            mirrored = sink.mirror_in(s, batch, skip_known=True)
            forget_gone_chunks(s, node=node, records=batch)
            return mirrored

        return run_serializable(factory, work)

    return on_audit


class OrphanStore(Protocol):
    """What `collect_orphans` needs of a store (storage.GlobalKVStore has it)."""

    def chunks_stored_before(self, cutoff: float) -> list[bytes]: ...

    def delete_orphans(
        self, addrs: list[bytes], *, older_than: float, actor: str, reason: str
    ) -> tuple[int, int]: ...


def collect_orphans(
    factory: sessionmaker[Session], store: OrphanStore, *, node: str, grace_s: float, now: float
) -> tuple[int, int]:
    """Delete from the store every chunk stored more than `grace_s` before `now` that no segment row of
    this node names (the chunks of turns that never committed), and every one whose row is past its
    retention (no session that held it may keep it longer; the PURGE record's mirror then removes the
    row). Returns (chunks, bytes) deleted.

    The SQL read comes before the store's deletion and not under its lock (no SQL under the store
    lock); a turn that links one of these old chunks in between loses it to a miss at its next
    resume (a cold prefill, never wrong data), and the start-up reconciliation drops its row.
    """
    cutoff = now - grace_s
    candidates = store.chunks_stored_before(cutoff)
    if not candidates:
        return 0, 0
    with factory() as s:
        named = SegmentRepository(s).within_retention(candidates, now=now, node=node)
    orphans = [a for a in candidates if a not in named]
    expired = sorted(key for key, live in named.items() if not live)
    chunks = freed = 0
    if orphans:
        chunks, freed = store.delete_orphans(
            orphans, older_than=cutoff, actor="reconcile", reason=ORPHAN_REASON
        )
        log.info("orphan_chunks_deleted", node=node, chunks=chunks, bytes=freed, grace_s=grace_s)
    if expired:
        gone, gone_bytes = store.delete_orphans(
            expired, older_than=cutoff, actor="reconcile", reason=RETENTION_REASON
        )
        log.info("expired_chunks_deleted", node=node, chunks=gone, bytes=gone_bytes)
        chunks, freed = chunks + gone, freed + gone_bytes
    return chunks, freed


class OrphanSweeper:
    """Runs `collect_orphans` every `interval_s` on a daemon thread until `stop`."""

    def __init__(
        self,
        factory: sessionmaker[Session],
        store: OrphanStore,
        *,
        node: str,
        grace_s: float,
        interval_s: float,
        clock: Callable[[], float],
    ) -> None:
        self._sweep = lambda: collect_orphans(factory, store, node=node, grace_s=grace_s, now=clock())
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.deleted: Sequence[int] = (0, 0)

    def sweep(self) -> tuple[int, int]:
        chunks, freed = self._sweep()
        self.deleted = (self.deleted[0] + chunks, self.deleted[1] + freed)
        return chunks, freed

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(self._interval):
                try:
                    self.sweep()
                except Exception as exc:  # noqa: BLE001 - a closed store or a busy database: next pass
                    log.error("orphan_sweep_failed", error=str(exc))

        self._thread = threading.Thread(target=loop, name="orphan-sweep", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join()

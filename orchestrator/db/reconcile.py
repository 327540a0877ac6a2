"""Start-up reconciliation of the registry with this node's store after a crash.

Knows nothing of the store's layout: the caller passes which keys the store holds durably. Rows that
point at a chunk the store does not hold are deleted (SQL never points at garbage); chunks the store
holds without a row are returned for the caller to delete or keep under the store's own retention.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.db.models import CacheSegment, SessionSegment
from orchestrator.db.repositories import SegmentRepository, SessionRepository
from orchestrator.db.transactions import run_serializable

__all__ = ["ReconcileReport", "reconcile_segments", "reconcile_with_prefixes"]

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

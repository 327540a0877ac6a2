"""Purges of a session, a tenant or a model: SQL rows and their audit record in one serialisable
transaction, then the stored bytes through the store (so SQL never points at a deleted chunk).

Knows nothing of the store's internals: it calls a `StorePurger` (storage's GlobalKVStore fits).
A crash between the SQL commit and the store purge leaves unreferenced chunks, which the start-up
reconciliation (`reconcile.py`) and the store's own retention remove.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.db.audit_sink import SqlAuditSink
from orchestrator.db.models import CacheSegment, SessionRow
from orchestrator.db.repositories import SegmentRepository, SessionRepository, TenantRepository
from orchestrator.db.transactions import run_serializable
from storage import AuditAction, AuditEvent

__all__ = ["StorePurger", "PurgeOutcome", "Purger"]


class _PurgeResult(Protocol):
    chunks_deleted: int
    bytes_deleted: int


class StorePurger(Protocol):
    """What a purge needs from the global-KV store (the signatures of storage's GlobalKVStore)."""

    def purge_session(self, tenant: str, session: str, *, actor: str, reason: str = ...) -> _PurgeResult: ...

    def purge_tenant(self, tenant: str, *, actor: str, reason: str = ...) -> _PurgeResult: ...

    def purge_model(
        self, model_fingerprint: str, *, tenant: str | None = ..., actor: str, reason: str = ...
    ) -> _PurgeResult: ...


@dataclass(frozen=True, kw_only=True)
class PurgeOutcome:
    sessions_deleted: int
    segments_deleted: int
    bytes_deleted: int


class Purger:
    """Runs purges; `factory` must make serialisable sessions (`serializable_factory`)."""

    def __init__(
        self, factory: sessionmaker[Session], sink: SqlAuditSink, store: StorePurger | None = None
    ) -> None:
        self._factory = factory
        self._sink = sink
        self._store = store

    def purge_session(
        self, session_id: str, *, tenant_id: str | None, actor: str, reason: str
    ) -> PurgeOutcome | None:
        """Delete a session, its turns, and the segments only it used. None when it is not the caller's.

        Args:
            tenant_id: the caller's tenant; None for the admin (any tenant).
        """

        def work(s: Session) -> tuple[str, int, int] | None:
            row = SessionRepository(s).get(session_id, tenant_id=tenant_id)
            if row is None:
                return None
            owner = row.tenant_id
            segs = SegmentRepository(s)
            sizes = {seg.store_key: seg.nbytes for seg in segs.for_session(session_id)}
            orphaned = segs.unlink_session(session_id)
            SessionRepository(s).delete(row)
            freed = sum(sizes[k] for k in orphaned)
            self._sink.append_in(
                s,
                [
                    AuditEvent(
                        actor=actor,
                        action=AuditAction.PURGE,
                        tenant=owner,
                        subject=f"session:{session_id}",
                        reason=reason,
                        nbytes=freed,
                    )
                ],
            )
            return owner, len(orphaned), freed

        done = run_serializable(self._factory, work)
        if done is None:
            return None
        owner, segments, freed = done
        if self._store is not None:
            result = self._store.purge_session(owner, session_id, actor=actor, reason=reason)
            freed = max(freed, result.bytes_deleted)
        return PurgeOutcome(sessions_deleted=1, segments_deleted=segments, bytes_deleted=freed)

    def purge_tenant(self, tenant_id: str, *, actor: str, reason: str) -> PurgeOutcome:
        """Delete every session and segment row of the tenant and rotate its salt; the policy stays."""

        def work(s: Session) -> tuple[int, int, int]:
            sessions = list(s.scalars(select(SessionRow).where(SessionRow.tenant_id == tenant_id)))
            freed = sum(s.scalars(select(CacheSegment.nbytes).where(CacheSegment.tenant_id == tenant_id)))
            keys = SegmentRepository(s).purge_tenant(tenant_id)
            repo = SessionRepository(s)
            for row in sessions:
                repo.delete(row)
            TenantRepository(s).rotate_salt(tenant_id)
            self._sink.append_in(
                s,
                [
                    AuditEvent(
                        actor=actor,
                        action=AuditAction.PURGE,
                        tenant=tenant_id,
                        subject=f"tenant:{tenant_id}",
                        reason=reason,
                        nbytes=freed,
                    )
                ],
            )
            return len(sessions), len(keys), freed

        sessions, segments, freed = run_serializable(self._factory, work)
        if self._store is not None:
            result = self._store.purge_tenant(tenant_id, actor=actor, reason=reason)
            freed = max(freed, result.bytes_deleted)
        return PurgeOutcome(sessions_deleted=sessions, segments_deleted=segments, bytes_deleted=freed)

    def purge_model(
        self,
        model: str,
        *,
        tenant_id: str | None,
        actor: str,
        reason: str,
        fingerprints: tuple[str, ...] = (),
    ) -> PurgeOutcome:
        """Delete every segment written by `model` (one tenant's, or all); sessions stay and resume cold.

        The store then removes the bytes of those fingerprints, restricted to `tenant_id` when given.

        Args:
            tenant_id: purge only this tenant's segments and stored chunks; None for every tenant.
            fingerprints: model fingerprints to purge from the store beyond those the rows name.
        """

        def work(s: Session) -> tuple[int, int, set[str]]:
            stmt = select(CacheSegment).where(CacheSegment.model == model)
            if tenant_id is not None:
                stmt = stmt.where(CacheSegment.tenant_id == tenant_id)
            rows = list(s.scalars(stmt))
            fps = {r.fingerprint for r in rows}
            freed = sum(r.nbytes for r in rows)
            keys = SegmentRepository(s).purge_model(model, tenant_id=tenant_id)
            self._sink.append_in(
                s,
                [
                    AuditEvent(
                        actor=actor,
                        action=AuditAction.PURGE,
                        tenant=tenant_id or "",
                        subject=f"model:{model}",
                        reason=reason,
                        nbytes=freed,
                    )
                ],
            )
            return len(keys), freed, fps

        segments, freed, fps = run_serializable(self._factory, work)
        if self._store is not None:
            store_freed = 0
            for fp in sorted(fps | set(fingerprints)):
                result = self._store.purge_model(fp, tenant=tenant_id, actor=actor, reason=reason)
                store_freed += result.bytes_deleted
            freed = max(freed, store_freed)
        return PurgeOutcome(sessions_deleted=0, segments_deleted=segments, bytes_deleted=freed)

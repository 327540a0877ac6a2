"""The SQL audit sink: storage's audit record and hash-chain format, kept in the registry database.

One chain per database, authoritative while the service runs. Each append locks the head row, seals the
next record with `storage.seal`, inserts it and moves the head, all in one serialisable transaction,
so several replicas appending at once still produce one gap-free chain. Knows nothing of what the
events describe.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session

from orchestrator.db.models import AuditHead, AuditRow
from orchestrator.db.transactions import run_serializable, serializable_factory
from storage import AuditAction, AuditEvent, AuditRecord, AuditSink, seal

__all__ = ["SqlAuditSink", "record_from_row", "row_from_record"]

_HEAD_ID = 1


def record_from_row(row: AuditRow) -> AuditRecord:
    return AuditRecord(
        seq=row.seq,
        ts_us=row.ts_us,
        actor=row.actor,
        action=AuditAction(row.action),
        tenant=row.tenant,
        subject=row.subject,
        reason=row.reason,
        nbytes=row.nbytes,
        prev_hash=row.prev_hash,
        hash=row.hash,
    )


def row_from_record(rec: AuditRecord) -> AuditRow:
    return AuditRow(
        seq=rec.seq,
        ts_us=rec.ts_us,
        actor=rec.actor,
        action=str(rec.action),
        tenant=rec.tenant,
        subject=rec.subject,
        reason=rec.reason,
        nbytes=rec.nbytes,
        prev_hash=rec.prev_hash,
        hash=rec.hash,
    )


class SqlAuditSink(AuditSink):
    """Append-only, hash-chained audit log in the `audit_log` table (head in `audit_head`).

    `append` runs its own serialisable transaction with retries; `append_in` adds records to the
    caller's transaction so that a change and its audit record commit together (the caller must run
    that transaction through `run_serializable`).
    """

    def __init__(self, engine: Engine, *, clock: Callable[[], float] = time.time, attempts: int = 50) -> None:
        self._engine = engine
        self._factory = serializable_factory(engine)
        self._clock = clock
        self._attempts = attempts

    def append(self, event: AuditEvent) -> AuditRecord:
        return run_serializable(
            self._factory, lambda s: self.append_in(s, [event])[0], attempts=self._attempts
        )

    def append_many(self, events: Sequence[AuditEvent]) -> list[AuditRecord]:
        return run_serializable(self._factory, lambda s: self.append_in(s, events), attempts=self._attempts)

    def mirror(self, record: AuditRecord) -> AuditRecord:
        """Append a record sealed in another chain (the store's, via its `on_audit`) as the next record
        of this one: same fields and timestamp, this chain's seq and hashes."""
        event = AuditEvent(
            actor=record.actor,
            action=record.action,
            tenant=record.tenant,
            subject=record.subject,
            reason=record.reason,
            nbytes=record.nbytes,
        )
        return run_serializable(
            self._factory,
            lambda s: self.append_in(s, [event], ts_us=record.ts_us)[0],
            attempts=self._attempts,
        )

    def append_in(
        self, session: Session, events: Sequence[AuditEvent], *, ts_us: int | None = None
    ) -> list[AuditRecord]:
        """Seal and insert `events` after the current head inside `session`'s transaction."""
        if not events:
            return []
        # FOR UPDATE serialises appenders on PostgreSQL; under SERIALIZABLE a concurrent head move also
        # fails one of the two transactions, which run_serializable reruns.
        head = session.scalars(select(AuditHead).where(AuditHead.id == _HEAD_ID).with_for_update()).one()
        seq, prev = head.seq, head.hash
        if ts_us is None:
            ts_us = int(round(self._clock() * 1_000_000))
        records: list[AuditRecord] = []
        for event in events:
            seq += 1
            rec = seal(event, seq=seq, ts_us=ts_us, prev_hash=prev)
            session.add(row_from_record(rec))
            records.append(rec)
            prev = rec.hash
        session.flush()
        moved = session.execute(
            update(AuditHead)
            .where(AuditHead.id == _HEAD_ID, AuditHead.seq == head.seq)
            .values(seq=seq, hash=prev)
            .execution_options(synchronize_session=False)
        )
        # The guarded update can only miss if another writer moved the head under us, which the lock
        # and the isolation level exclude.
        assert moved.rowcount == 1, "audit head moved during append"
        session.expire(head)
        return records

    def iter_records(self, *, batch: int = 1000) -> Iterator[AuditRecord]:
        """Every record in seq order, read in pages so that long chains stream."""
        after = 0
        while True:
            with Session(self._engine) as session:
                rows = list(
                    session.scalars(
                        select(AuditRow).where(AuditRow.seq > after).order_by(AuditRow.seq).limit(batch)
                    )
                )
            if not rows:
                return
            for row in rows:
                yield record_from_row(row)
            after = rows[-1].seq

    def head(self) -> tuple[int, str]:
        with Session(self._engine) as session:
            head = session.get(AuditHead, _HEAD_ID)
            assert head is not None, "audit_head row missing: run the migrations"
            return head.seq, head.hash

    def query(
        self,
        *,
        tenant: str | None = None,
        action: AuditAction | str | None = None,
        since_us: int | None = None,
        until_us: int | None = None,
        after_seq: int = 0,
        limit: int = 100,
    ) -> list[AuditRecord]:
        """Records matching every given filter, in seq order, after `after_seq`, at most `limit`."""
        if limit <= 0:
            raise ValueError(f"limit={limit} must be positive")
        stmt = select(AuditRow).where(AuditRow.seq > after_seq)
        if tenant is not None:
            stmt = stmt.where(AuditRow.tenant == tenant)
        if action is not None:
            stmt = stmt.where(AuditRow.action == str(AuditAction(action)))
        if since_us is not None:
            stmt = stmt.where(AuditRow.ts_us >= since_us)
        if until_us is not None:
            stmt = stmt.where(AuditRow.ts_us < until_us)
        with Session(self._engine) as session:
            return [record_from_row(r) for r in session.scalars(stmt.order_by(AuditRow.seq).limit(limit))]

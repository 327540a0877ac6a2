"""Delivery of the store's audit records to its consumer (the service's SQL log): after the batch holding
them is durable and outside the store lock, with acknowledgements, and again when the store opens for
records never acknowledged. A mixin of GlobalKVStore (kv_store.py), split out by concept; it uses the
store's lock, audit sink, group commit and `on_audit`.

Each thread collects what its writes under the lock left to do (a WAL ticket to sync, records to
deliver) and settles it when it releases the lock (`_after_release`); records a caller claims during
`put_chunks` are the caller's to acknowledge (`ack_audit`) or hand back (`release_audit`).
"""

from __future__ import annotations

import struct
import threading
from typing import TYPE_CHECKING

import structlog

from storage.audit_record import AuditRecord

if TYPE_CHECKING:
    from storage.kv_store import GlobalKVStore

log = structlog.get_logger(__name__)

AUDIT_ACK = b"O"
"""Key of the seq up to which the consumer acknowledged every record (8 bytes big-endian); absent in a
store written before consumers acknowledged, whose records were all mirrored synchronously."""
SEQ = struct.Struct(">Q")


class AuditDelivery:
    """Audit delivery half of GlobalKVStore (see the module docstring)."""

    def _pending_state(self: GlobalKVStore) -> threading.local:
        """This thread's unsynced ticket and undelivered records, settled when it releases the lock."""
        state = self._pending
        if not hasattr(state, "ticket"):
            state.ticket = 0
            state.records = []
        return state

    def _take_pending(self: GlobalKVStore) -> tuple[int, list[AuditRecord]]:
        state = self._pending_state()
        ticket, records = state.ticket, state.records
        state.ticket, state.records = 0, []
        return ticket, records

    def _after_release(self: GlobalKVStore) -> None:
        """Run by the lock after this thread's outermost release: sync the WAL through this thread's
        writes (shared with concurrent writers), then deliver its audit records."""
        ticket, records = self._take_pending()
        self._settle_ticket(ticket)
        if records:
            self._deliver(records)

    def _deliver(self: GlobalKVStore, records: list[AuditRecord]) -> None:
        """Hand durable records to the consumer (no lock held); acknowledge them when it returns."""
        with self._ack_lock:
            batch = self._undelivered + list(records)
            self._undelivered = []
        if not batch:
            return
        if self._on_audit is None:
            # An offline store (hold_audit) leaves them for the consumer of the next open.
            if not self._hold_audit:
                self.ack_audit(batch)
            return
        try:
            self._on_audit(batch)
        except Exception as exc:  # noqa: BLE001 - the records stay durable here and are re-delivered
            with self._ack_lock:
                self._undelivered = batch + self._undelivered
            log.error("audit_delivery_failed", records=len(batch), error=str(exc))
            return
        self.ack_audit(batch)

    def ack_audit(self: GlobalKVStore, records: list[AuditRecord]) -> None:
        """The consumer holds these records durably: advance the acknowledged mark over them (it is
        written with the next batch; a lost mark only means records are delivered again)."""
        with self._ack_lock:
            self._acked.update(r.seq for r in records if r.seq > self._ack_mark)
            while self._ack_mark + 1 in self._acked:
                self._ack_mark += 1
                self._acked.discard(self._ack_mark)

    def release_audit(self: GlobalKVStore, records: list[AuditRecord]) -> None:
        """Hand claimed records back (their caller could not record them): deliver them to the
        consumer now. Call without the store lock."""
        assert not self._lock.held()
        if records:
            self._deliver(list(records))

    def _redeliver(self: GlobalKVStore) -> None:
        """At open: deliver the durable records the consumer never acknowledged (a crash came
        between the store's write and the consumer's commit)."""
        raw = self._db.get(AUDIT_ACK)
        head = self._audit.head()[0]
        if raw is None:
            # Written before acknowledgements existed: the consumer mirrored every record synchronously.
            mark = head
        else:
            (mark,) = SEQ.unpack(raw)
        with self._ack_lock:
            self._ack_mark = min(mark, head)
        if self._ack_mark < head:
            missing = list(self._audit.iter_records(after=self._ack_mark))
            log.info("audit_redelivery", after_seq=self._ack_mark, records=len(missing))
            self._deliver(missing)

    @property
    def audit_acked_seq(self: GlobalKVStore) -> int:
        """The store audit seq up to which the consumer acknowledged every record."""
        with self._ack_lock:
            return self._ack_mark

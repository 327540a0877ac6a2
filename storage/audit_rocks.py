"""RocksDB-backed audit sink: records live in the store's own database so that a chunk, its index
entries and its audit record commit in one write batch (made durable by the store before its
operation returns). Knows nothing of chunks.

Keys: `A` + seq (8 bytes big-endian) -> AuditRecord.to_json(); `H` -> head (seq 8 BE + 32-byte hash);
`N` + n (8 bytes big-endian) -> Anchor.to_json() (the store's copy of this node's audit anchors,
audit_anchor.py).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rocksdict import AccessType, Options, Rdict, WriteBatch, WriteOptions

from storage.audit_anchor import Anchor
from storage.audit_delivery import AUDIT_ACK
from storage.audit_record import (
    GENESIS_HASH,
    AuditEvent,
    AuditRecord,
    AuditSink,
    VerifyResult,
    seal,
    verify_chain,
)
from storage.errors import AuditRecordError

AUDIT_PREFIX = b"A"
HEAD_KEY = b"H"
ANCHOR_PREFIX = b"N"
_SEQ = struct.Struct(">Q")


def audit_key(seq: int) -> bytes:
    return AUDIT_PREFIX + _SEQ.pack(seq)


def unsynced_write_options() -> WriteOptions:
    """WAL on, not synced: the write reaches the log file, and a later WAL sync makes it durable."""
    opts = WriteOptions()
    opts.sync = False
    opts.disable_wal = False
    return opts


def synced_write_options() -> WriteOptions:
    """WAL on and synced: a write returns only after the log reached the disk."""
    opts = WriteOptions()
    opts.sync = True
    opts.disable_wal = False
    return opts


class RocksAuditSink(AuditSink):
    """Hash-chained audit log in a raw-mode Rdict.

    Standalone use: `append(event)` (a synced write). Inside the store: hold `lock`, call
    `stage(batch, events)` to add records to a write batch, write the batch, then `advance(records)`;
    the head moves only after the write returned, so a failed write leaves the chain as it was (the
    store makes the batch durable before its operation returns). Pass the store's lock as `lock` so
    that standalone appends and staged ones never interleave.
    """

    def __init__(
        self,
        db: Rdict,
        *,
        clock: Callable[[], float] = time.time,
        lock: threading.RLock | None = None,
    ) -> None:
        self._db = db
        self._clock = clock
        self._write_opts = synced_write_options()
        self.lock = lock if lock is not None else threading.RLock()
        raw = db.get(HEAD_KEY)
        if raw is None:
            self._head: tuple[int, str] = (0, GENESIS_HASH)
        else:
            (seq,) = _SEQ.unpack_from(raw)
            self._head = (seq, raw[_SEQ.size :].hex())

    def head(self) -> tuple[int, str]:
        return self._head

    def stage(
        self, batch: WriteBatch, events: Sequence[AuditEvent], *, ts: float | None = None
    ) -> list[AuditRecord]:
        """Add the next records and the new head to `batch`; call with `lock` held, then `advance`."""
        seq, prev = self._head
        stamp = self._clock() if ts is None else ts
        ts_us = int(round(stamp * 1_000_000))
        records: list[AuditRecord] = []
        for event in events:
            seq += 1
            record = seal(event, seq=seq, ts_us=ts_us, prev_hash=prev)
            batch.put(audit_key(seq), record.to_json())
            records.append(record)
            prev = record.hash
        if records:
            batch.put(HEAD_KEY, _SEQ.pack(seq) + bytes.fromhex(prev))
        return records

    def advance(self, records: Sequence[AuditRecord]) -> None:
        """Move the in-memory head after the batch holding `records` was written."""
        if not records:
            return
        assert records[0].seq == self._head[0] + 1 and records[0].prev_hash == self._head[1]
        self._head = (records[-1].seq, records[-1].hash)

    def append(self, event: AuditEvent) -> AuditRecord:
        with self.lock:
            batch = WriteBatch(raw_mode=True)
            records = self.stage(batch, [event])
            self._db.write(batch, self._write_opts)
            self.advance(records)
            return records[0]

    def put_anchors(self, anchors: Sequence[Anchor]) -> None:
        """Store anchors (keyed by their n) in one synced write; one already stored under its n is
        overwritten with the same bytes."""
        if not anchors:
            return
        with self.lock:
            batch = WriteBatch(raw_mode=True)
            for anchor in anchors:
                batch.put(ANCHOR_PREFIX + _SEQ.pack(anchor.n), anchor.to_json())
            self._db.write(batch, self._write_opts)

    def anchors(self) -> tuple[list[Anchor], list[str]]:
        """(the stored anchors in n order, problems: entries that do not decode)."""
        out: list[Anchor] = []
        problems: list[str] = []
        it = self._db.iter()
        it.seek(ANCHOR_PREFIX)
        while it.valid() and it.key().startswith(ANCHOR_PREFIX):
            (n,) = _SEQ.unpack_from(it.key(), len(ANCHOR_PREFIX))
            try:
                out.append(Anchor.from_json(it.value()))
            except ValueError as exc:
                problems.append(f"store anchor n={n}: {exc}")
            it.next()
        return out, problems

    def first_hash(self) -> str | None:
        """The hash of record seq 1 (the chain's identity: a store started afresh has another), None
        while the chain is empty or its first record does not decode."""
        raw = self._db.get(audit_key(1))
        if raw is None:
            return None
        try:
            return AuditRecord.from_json(raw).hash
        except AuditRecordError:
            return None

    def iter_records(self, *, after: int = 0) -> Iterator[AuditRecord]:
        """Every record with seq > `after`, in seq order."""
        # Stored order is key order, which is seq order; a record whose key and seq disagree (a moved
        # record) shows up as a seq break in verify_chain.
        it = self._db.iter()
        it.seek(audit_key(after + 1) if after > 0 else AUDIT_PREFIX)
        while it.valid():
            key = it.key()
            if not key.startswith(AUDIT_PREFIX):
                break
            yield AuditRecord.from_json(it.value())
            it.next()

    def iter_decodable(self) -> Iterator[AuditRecord]:
        """Every record that decodes, in seq order (`verify` reports the others as a break)."""
        it = self._db.iter()
        it.seek(AUDIT_PREFIX)
        while it.valid() and it.key().startswith(AUDIT_PREFIX):
            try:
                yield AuditRecord.from_json(it.value())
            except AuditRecordError:
                pass
            it.next()

    def verify(self, *, head: tuple[int, str] | None = None) -> VerifyResult:
        """Walk the chain against the head; an undecodable record is a break at its key's seq.

        Args:
            head: a head read before the walk (`head()`) of a store that is being written: records past
                its seq were appended during the walk and are left out. Default: the head after the
                walk, and every record counts (a record past the head is a break).
        """
        upto = head[0] if head is not None else None
        records: list[AuditRecord] = []
        it = self._db.iter()
        it.seek(AUDIT_PREFIX)
        while it.valid() and it.key().startswith(AUDIT_PREFIX):
            if upto is not None and _SEQ.unpack_from(it.key(), len(AUDIT_PREFIX))[0] > upto:
                break
            try:
                records.append(AuditRecord.from_json(it.value()))
            except AuditRecordError as exc:
                (seq,) = _SEQ.unpack_from(it.key(), len(AUDIT_PREFIX))
                prefix = verify_chain(records)
                if not prefix.ok:
                    return prefix
                return VerifyResult(ok=False, records=len(records) + 1, first_break_seq=seq, reason=str(exc))
            it.next()
        return verify_chain(records, head=self._head if head is None else head)


@contextmanager
def read_only_audit(db_path: Path | str) -> Iterator[tuple[RocksAuditSink, int] | None]:
    """The audit chain of a store's database opened read-only (no lock taken, so also while a node
    runs it; the view is the state at open), with the seq up to which its consumer acknowledged every
    record. None when there is no database at `db_path`."""
    if not (Path(db_path) / "CURRENT").is_file():
        yield None
        return
    db = Rdict(str(db_path), Options(raw_mode=True), access_type=AccessType.read_only())
    try:
        sink = RocksAuditSink(db)
        raw = db.get(AUDIT_ACK)
        acked = sink.head()[0] if raw is None else _SEQ.unpack(raw)[0]
        yield sink, acked
    finally:
        db.close()

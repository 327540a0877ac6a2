"""Global KV store: FP4 global-KV chunks of session histories in RocksDB (raw mode), addressed by a
salted hash chain, verified on every read. Knows nothing of tensors: payloads are opaque bytes from
model/. The write path is in chunk_writer.py; retention (purge, expiry, eviction, checkpoints) in
retention.py.

Invariants:
- A chunk, its index entries, its references and its audit record commit in one write batch, and
  nothing is visible (in the index or to readers) before the WAL holding it is synced.
- Batches are written unsynced while the store lock is held (so the audit chain's order is the lock's
  order); the WAL sync that makes them durable runs after the lock is released, shared by every
  writer waiting at that moment (group commit, `wal_sync.py`). Every public operation returns only
  after its batches are durable. No callback runs, and no fsync happens, while the lock is held.
- Audit records reach the `on_audit` consumer (the service's SQL log) after they are durable and
  outside the lock; records a caller claims (`put_chunks(audit_claim=...)`) are its to deliver, and
  it acknowledges them (`ack_audit`) or hands them back (`release_audit`). The store persists the seq
  up to which every record was acknowledged and re-delivers the rest when it opens, so a crash
  between a store write and the consumer's commit loses no record.
- A read serves a payload only after the header and checksum verify against the address, tenant and
  model fingerprint asked for, and the chunk is before its ceiling; anything else is a typed miss.
- Time is `max(clock(), high-water mark persisted on disk)`, so a clock stepping back cannot revive
  an expired chunk.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import structlog
from rocksdict import DBCompressionType, Options, Rdict, ReadOptions, WriteBatch

from storage.audit_delivery import AUDIT_ACK, SEQ, AuditDelivery
from storage.audit_record import AuditAction, AuditEvent, AuditRecord
from storage.audit_rocks import RocksAuditSink, synced_write_options, unsynced_write_options
from storage.chunk_format import CHECKSUM_BYTES, decode_chunk
from storage.chunk_index import (
    CHECKPOINT_CEILING,
    CHUNK,
    CLOCK_HWM,
    F64,
    FORMAT,
    SALT,
    SESSION_IDX,
    STORE_FORMAT_VERSION,
    ChunkIndex,
    ChunkMeta,
)
from storage.chunk_key import (
    ChainAddresses,
    chain_root,
    check_id,
    session_tag,
    tenant_tag,
    token_bytes,
)
from storage.chunk_writer import ACTOR, ChunkWriter
from storage.errors import (
    AuditRecordError,
    StoreClosedError,
    StoreDamagedError,
    StoreFormatError,
    StoreLockedError,
)
from storage.policy import RetentionPolicy
from storage.quarantine import QUARANTINE_DIR, QuarantineArea, QuarantinedStore
from storage.retention import RetentionOps
from storage.store_config import StoreConfig
from storage.store_health import HealthReason, StoreHealth, WriteHealth
from storage.store_results import (
    ChunkSpan,
    IndexedPrefix,
    LookupResult,
    Miss,
    MissReason,
    PrefixResult,
    RecoveryReport,
    StoreStats,
    TenantStats,
)
from storage.store_scan import iter_prefix, scan_store
from storage.wal_sync import GroupSync, ReleaseHookLock

log = structlog.get_logger(__name__)


def _read_options() -> ReadOptions:
    opts = ReadOptions()
    # Values are 100s of KB read once per resume; caching them in RocksDB's block cache would only
    # copy them again and evict index blocks (the OS page cache still holds them).
    opts.fill_cache(False)
    # Every chunk value carries its own sha256 over header and payload, verified on each read, so
    # RocksDB's per-block crc32c would check the same bytes a second time.
    opts.set_verify_checksums(False)
    return opts


def _db_options() -> Options:
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    # Payloads are FP4 codes and scales: incompressible, so compression would only cost CPU.
    opts.set_compression_type(DBCompressionType.none())
    opts.set_max_background_jobs(2)
    # A torn WAL tail after a crash is dropped up to the last whole record; synced writes precede it.
    return opts


class GlobalKVStore(ChunkWriter, RetentionOps, AuditDelivery):
    """One node's store of global-KV chunks. Thread-safe; one instance per database directory.

    Args:
        config: paths, region, chunk size, capacity.
        clock: seconds since the epoch; injected everywhere time matters.
        on_audit: called with a list of audit records once their batches are durable, outside the
            store lock (e.g. to mirror them into the service's authoritative SQL log). Returning
            acknowledges them; raising keeps them for the next delivery and for re-delivery when the
            store opens again (so the consumer must skip records it already holds).
        hold_audit: without `on_audit`, keep every record unacknowledged (an offline tool's store:
            the node's consumer receives them when it next opens the store) instead of acknowledging
            them as delivered.

    Raises:
        StoreVersionError: the directory holds a store of a newer format (no entry was written).
        StoreFormatError: the directory holds data without a store format mark.
        StoreDamagedError: the database cannot be read whole or an entry of ours does not decode;
            no entry was written (`store_open.open_store` quarantines it and opens an empty store).
        StoreLockedError: another process or store object has the database open.
    """

    def __init__(
        self,
        config: StoreConfig,
        *,
        clock: Callable[[], float] = time.time,
        on_audit: Callable[[list[AuditRecord]], None] | None = None,
        hold_audit: bool = False,
    ) -> None:
        self.config = config
        # the database path as errors name it (every prefix scan passes it; building it is not free)
        self._where = str(config.db_path)
        self._clock = clock
        self._on_audit = on_audit
        self._hold_audit = hold_audit and on_audit is None
        self._lock = ReleaseHookLock()
        self._lock.on_release = self._after_release
        self._pending = threading.local()
        self._closed = False
        self._write_opts = synced_write_options()
        self._nosync_opts = unsynced_write_options()
        # Records a caller claims during put_chunks: (tenant, list to fill); set under the lock.
        self._claim: tuple[str, list[AuditRecord]] | None = None
        self._ack_lock = threading.Lock()
        self._ack_mark = 0
        self._acked: set[int] = set()
        self._undelivered: list[AuditRecord] = []
        self._inflight: dict[bytes, ChunkMeta] = {}
        # In-flight chunks a purge reached before they were visible; their put deletes them.
        self._doomed: set[bytes] = set()
        self.batches_written = 0
        self._stats = StoreStats(capacity_bytes=config.capacity_bytes)
        self._index = ChunkIndex()
        # the chunk chain's addresses already computed (pure functions of their content: never stale)
        self._addresses = ChainAddresses()
        self._salts: dict[str, bytes] = {}
        self._tenant_of_tag: dict[bytes, str] = {}
        self._policies: dict[str, RetentionPolicy] = {}
        self._hwm = 0.0
        self._maintenance_thread: threading.Thread | None = None
        self._maintenance_stop = threading.Event()
        self._sync_guard = threading.Lock()
        self._db_closed = False
        # Bumped by each reopen after write errors; a sync of an older generation's batches fails.
        self._generation = 0
        # Why the database is closed between a failed reopen and the next try (else None).
        self._suspended: str | None = None
        self._wal = GroupSync(self._sync_wal)
        self._writes = WriteHealth()
        self._read_error: str | None = None
        self.quarantine = QuarantineArea(config.path)
        # Set by store_open.open_store when it moved a damaged database aside before this open.
        self.quarantined_at_open: QuarantinedStore | None = None
        self._open_db()
        # Quarantined copies count against capacity (retention.py); cached, refreshed when they change.
        self._quarantined_bytes = sum(e.nbytes for e in self.quarantine.list())
        log.info("store_opened", path=config.path, **self.recovery.__dict__)

    def _open_db(self, *, redeliver: bool = True) -> None:
        """Open the database and recover the index from it, or raise without writing any entry
        (RocksDB's own open may still rotate its MANIFEST and LOG; `store_open.refuse_newer_format`
        checks the format read-only first).

        Raises:
            StoreVersionError: a newer store format (never opened, never quarantined).
            StoreFormatError: data without a store format mark.
            StoreDamagedError: anything that keeps the database from being read whole, or a read
                error recorded while it last served.
        """
        config = self.config
        config.db_path.mkdir(parents=True, exist_ok=True)
        config.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._db = Rdict(str(config.db_path), _db_options())
        except Exception as exc:  # noqa: BLE001 - rocksdict raises a plain Exception for every RocksDB status
            # A live store held by another process (a second `serve`, an offline repair) is not damage.
            if "LOCK" in str(exc) and ("lock hold" in str(exc) or "While lock file" in str(exc)):
                raise StoreLockedError(f"{config.db_path} is open elsewhere: {exc}") from exc
            raise StoreDamagedError(f"{config.db_path}: the database does not open: {exc}") from exc
        # Checked once this process holds the database's lock, so a live store is never reported damaged.
        mark = self.quarantine.damage_mark()
        if mark is not None:
            self._db.close()
            raise StoreDamagedError(f"{config.db_path}: a read error was recorded while serving: {mark}")
        try:
            self._db.set_read_options(_read_options())
            self._audit = RocksAuditSink(self._db, clock=self._now, lock=self._lock)  # type: ignore[arg-type]
            self.recovery = self._recover()
            if redeliver:
                self._redeliver()
        except StoreFormatError:
            self._db.close()
            raise
        except StoreDamagedError:
            self._db.close()
            raise
        except Exception as exc:
            self._db.close()
            # rocksdict raises a plain Exception carrying RocksDB's status, and an entry of ours that
            # does not decode raises struct.error or AuditRecordError; anything else is a bug
            # of ours and must not be mistaken for damage (that would move a healthy store aside).
            if type(exc) is not Exception and not isinstance(exc, AuditRecordError | struct.error):
                raise
            raise StoreDamagedError(f"{config.db_path}: {exc}") from exc

    @property
    def audit(self) -> RocksAuditSink:
        """The store's own hash-chained audit log (`verify()`, `iter_records()`)."""
        return self._audit

    @property
    def write_options_synced(self) -> bool:
        """True when every batch goes through the WAL and every operation syncs it before returning
        (the durability contract; the sync is shared by concurrent writers)."""
        return (
            bool(self._write_opts.sync)
            and not self._write_opts.disable_wal
            and not self._nosync_opts.disable_wal
        )

    @property
    def wal_syncs(self) -> int:
        """WAL syncs run by the group commit so far (one may cover the batches of many writers)."""
        return self._wal.syncs

    def close(self) -> None:
        """Stop maintenance, flush and close the database. Idempotent."""
        self.stop_maintenance()
        with self._lock:
            if self._closed:
                return
            self._persist_clock()
            self._closed = True
            with self._sync_guard:
                self._db_closed = True
                try:
                    # Closing holds the lock across this one sync: nothing else may run on a closing store.
                    self._db.flush_wal(True)
                except Exception as exc:  # noqa: BLE001 - after an I/O error (disk full) the sync fails;
                    # everything acknowledged was synced before its call returned.
                    log.error("store_close_sync_failed", error=str(exc))
                try:
                    self._db.close()
                except Exception as exc:  # noqa: BLE001 - after an I/O error (disk full) the final flush
                    # fails; everything acknowledged is already in the synced WAL, so closing must not raise.
                    log.error("store_close_flush_failed", error=str(exc))

    def __enter__(self) -> GlobalKVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _now(self) -> float:
        stamp = self._clock()
        if stamp > self._hwm:
            self._hwm = stamp
        return self._hwm

    def _persist_clock(self) -> None:
        """Write the clock high-water mark (also written by every batch) after reads moved it; the
        sync follows when the lock is released."""
        try:
            batch = WriteBatch(raw_mode=True)
            batch.put(CLOCK_HWM, F64.pack(self._hwm))
            with self._ack_lock:
                batch.put(AUDIT_ACK, SEQ.pack(self._ack_mark))
            self._db.write(batch, self._nosync_opts)
            self._pending_state().ticket = self._note_write()
        except Exception as exc:  # noqa: BLE001 - a full disk must not stop a close or a read
            log.error("clock_mark_write_failed", error=str(exc))

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store at {self.config.path} is closed")
        if self._suspended is not None:
            raise StoreClosedError(f"store at {self.config.path} is reopening: {self._suspended}")

    def _note_write(self) -> tuple[GroupSync, int]:
        """The ticket of a batch just written: the group commit it belongs to and its number there.
        Kept together so that a batch written before a reopen is settled by that database's group,
        whose sync then fails (`_reopen_after_write_errors`), never by the next one's."""
        return self._wal, self._wal.note_write()

    def _settle_ticket(self, ticket: tuple[GroupSync, int] | int) -> None:
        """Wait until the batch of `ticket` (0: none) is durable; raises what the sync raised."""
        if ticket:
            assert isinstance(ticket, tuple)
            wal, n = ticket
            wal.wait(n)

    def _sync_wal(self, generation: int = 0) -> None:
        # A sync racing close() finds the database closed; close() synced every write before that.
        with self._sync_guard:
            if generation != self._generation:
                raise StoreClosedError(
                    f"{self.config.db_path} was reopened after write errors; a batch written before "
                    "could not be made durable"
                )
            if self._db_closed:
                return
            try:
                self._db.flush_wal(True)
            except Exception as exc:
                self._writes.failed(str(exc))
                raise
            self._writes.ok()

    def _commit(self, batch: WriteBatch, events: list[AuditEvent]) -> list[AuditRecord]:
        """Write `batch` plus the audit records of `events`, the clock mark and the audit ack mark,
        unsynced, in lock order. Lock held; the WAL sync and the delivery of the records follow when
        this thread releases the lock (`_after_release`), or in put_chunks' own settle step."""
        assert self._lock.held()
        self._check_open()
        now = self._now()
        records = self._audit.stage(batch, events, ts=now)
        batch.put(CLOCK_HWM, F64.pack(now))
        with self._ack_lock:
            batch.put(AUDIT_ACK, SEQ.pack(self._ack_mark))
        try:
            self._db.write(batch, self._nosync_opts)
        except Exception as exc:
            self._writes.failed(str(exc))
            raise
        state = self._pending_state()
        state.ticket = self._note_write()
        self._stats.synced_writes += 1
        self.batches_written += 1
        self._audit.advance(records)
        claim = self._claim
        for record in records:
            if claim is not None and record.tenant == claim[0]:
                claim[1].append(record)
            else:
                state.records.append(record)
        return records

    def _delete_chunks(
        self, addrs: list[bytes], *, action: AuditAction, actor: str, reason: str
    ) -> tuple[int, int]:
        """RetentionOps' deletion, which sees only indexed chunks; a chunk still being written (its sync
        under way, not yet indexed) is marked for its put to delete once the sync returns."""
        for addr in addrs:
            if addr in self._inflight and addr not in self._index.meta:
                self._doomed.add(addr)
        return super()._delete_chunks(addrs, action=action, actor=actor, reason=reason)

    def _recover(self) -> RecoveryReport:
        """Rebuild the index from disk and remove leftovers of interrupted operations. Deletes only
        after the scan read every entry without an error (store_scan.py); raises before any write
        otherwise."""
        db = self._db
        where = str(self.config.db_path)
        found = scan_store(db, where)
        if not found.formatted:
            db.put(FORMAT, STORE_FORMAT_VERSION, self._write_opts)
        self._hwm = found.clock_high_water
        self._salts.update(found.salts)
        self._tenant_of_tag.update({tenant_tag(salt): t for t, salt in found.salts.items()})
        self._policies.update(found.policies)
        for addr, meta in found.chunks:
            self._index.add(addr, meta)
        leftovers = found.leftovers
        if leftovers:
            batch = WriteBatch(raw_mode=True)
            for key in leftovers:
                batch.delete(key)
            self._db.write(batch, self._write_opts)
            log.warning("store_leftovers_removed", count=len(leftovers))
        stale = 0
        for entry in self.config.checkpoint_dir.iterdir():
            # RocksDB builds a checkpoint in `<name>.tmp` and renames it when complete.
            if entry.name.endswith(".tmp"):
                shutil.rmtree(entry, ignore_errors=True)
                stale += 1
        existing = {p.name.encode() for p in self.config.checkpoint_dir.iterdir()}
        gone = [CHECKPOINT_CEILING + name for name in found.checkpoint_ceilings if name not in existing]
        if gone:
            batch = WriteBatch(raw_mode=True)
            for key in gone:
                batch.delete(key)
            self._db.write(batch, self._write_opts)
        self._stats.recovered_chunks = len(self._index)
        return RecoveryReport(
            chunks=len(self._index),
            bytes_stored=self._index.bytes_stored,
            tenants=len(self._salts),
            orphans_removed=len(leftovers),
            stale_checkpoints_removed=stale,
            audit_head_seq=self._audit.head()[0],
            clock_high_water=self._hwm,
        )

    def _iter_prefix(self, prefix: bytes, *, values: bool = False):
        """Yield (key, value or None) for keys starting with `prefix`, in key order.

        Raises:
            StoreDamagedError: RocksDB stopped the iteration with an error; while serving, the store
                is marked damaged first (`health()`, and quarantine at the next open).
        """
        try:
            yield from iter_prefix(self._db, prefix, values=values, where=self._where)
        except StoreDamagedError as exc:
            if hasattr(self, "recovery"):
                self._on_read_error(str(exc))
            raise

    def _on_read_error(self, detail: str) -> None:
        """A read failed while serving: report it in `health()` and leave the mark that makes the
        next open quarantine this database (its own entries may not be writable any more)."""
        if self._read_error is None:
            self._read_error = detail
            self.quarantine.mark_damaged(detail, now=self._clock())
            log.error("store_read_error", detail=detail)

    def _salt(self, tenant: str, *, create: bool) -> bytes | None:
        salt = self._salts.get(tenant)
        if salt is None and create:
            salt = secrets.token_bytes(32)
            batch = WriteBatch(raw_mode=True)
            batch.put(SALT + tenant.encode(), salt)
            self._commit(batch, [])
            self._salts[tenant] = salt
            self._tenant_of_tag[tenant_tag(salt)] = tenant
        return salt

    def get_policy(self, tenant: str) -> RetentionPolicy:
        """The tenant's policy (the default one until set)."""
        check_id("tenant", tenant)
        with self._lock:
            return self._policies.get(tenant, RetentionPolicy())

    def lookup(self, tenant: str, model_fingerprint: str, token_ids: list[int] | bytes) -> LookupResult:
        """Index-only: the leading chunks of `token_ids` this tenant has stored for this model.

        No payload is read; `longest_valid_prefix` reads and verifies. A tenant without data, another
        tenant's prefix and another fingerprint's prefix all look the same: a miss at token 0.
        """
        check_id("tenant", tenant)
        check_id("model_fingerprint", model_fingerprint)
        toks = token_bytes(token_ids)
        n = len(toks) // 4
        size = self.config.chunk_tokens
        with self._lock:
            self._check_open()
            now = self._now()
            salt = self._salts.get(tenant)
            spans: list[ChunkSpan] = []
            if salt is None:
                return LookupResult(n_tokens=0, spans=spans, miss=Miss(reason=MissReason.ABSENT, at_token=0))
            root = parent = chain_root(model_fingerprint, salt)
            pos = 0
            index = self._index.meta
            # the full chunks' addresses a kept walk of the same leading tokens holds; the rest computed
            known = self._addresses.leading(root, toks, size, n // size)
            while pos + size <= n:
                k = pos // size
                addr = (
                    known[k]
                    if k < len(known)
                    else self._addresses.address(parent, toks[pos * 4 : (pos + size) * 4])
                )
                meta = index.get(addr)
                if meta is None:
                    break
                if now >= meta.ceiling_at:
                    self._persist_clock()
                    return LookupResult(
                        n_tokens=pos, spans=spans, miss=Miss(reason=MissReason.EXPIRED, at_token=pos)
                    )
                spans.append(ChunkSpan(address=addr, start=pos, end=pos + size))
                parent = addr
                pos += size
            if len(spans) > len(known):
                self._addresses.remember_walk(root, toks, size, [span.address for span in spans])
            for length in sorted(self._index.tail_lengths(parent), reverse=True):
                if pos + length > n:
                    continue
                addr = self._addresses.address(parent, toks[pos * 4 : (pos + length) * 4])
                meta = index.get(addr)
                if meta is None:
                    continue
                if now >= meta.ceiling_at:
                    self._persist_clock()
                    return LookupResult(
                        n_tokens=pos, spans=spans, miss=Miss(reason=MissReason.EXPIRED, at_token=pos)
                    )
                spans.append(ChunkSpan(address=addr, start=pos, end=pos + length))
                pos += length
                break
            miss = None if pos == n else Miss(reason=MissReason.ABSENT, at_token=pos)
            return LookupResult(n_tokens=pos, spans=spans, miss=miss)

    def longest_valid_prefix(
        self,
        tenant: str,
        model_fingerprint: str,
        token_ids: list[int] | bytes,
        *,
        count_unstored: bool = True,
    ) -> PrefixResult:
        """Read and verify the stored chunks covering the longest prefix of `token_ids`.

        Args:
            count_unstored: count a history of which no chunk is stored (nothing read) in the miss
                counters. False for a caller that used to `lookup` first and read only when it found a
                chunk (`read_prefix`): its counters keep meaning what they meant, one index walk fewer.

        Returns:
            PrefixResult: payloads in order and where/why the prefix ends. A value that fails its
            header or checksum checks ends the prefix with a CORRUPT miss, is removed from the store
            and recorded in the audit log; its bytes are never returned.
        """
        found = self.lookup(tenant, model_fingerprint, token_ids)
        ranges: list[tuple[int, int]] = []
        payloads: list[bytes] = []
        checksums: list[bytes] = []
        miss = found.miss
        with self._lock:
            salt = self._salts.get(tenant)
            # the entries the reads below run under: a checksum is kept only for a value read while its
            # entry stayed (a removal, or a removal and a new write, in between is another value)
            entries = [self._index.meta.get(span.address) for span in found.spans]
        ttag = tenant_tag(salt) if salt is not None else b""
        for span in found.spans:
            generation = self._generation
            try:
                value = self._db.get(CHUNK + span.address)
            except Exception as exc:  # noqa: BLE001 - rocksdict raises a plain Exception for RocksDB errors
                if generation != self._generation or self._suspended is not None:
                    # The database was being reopened under this read (after write errors): a miss.
                    miss = Miss(reason=MissReason.ABSENT, at_token=span.start)
                    break
                self._on_read_error(f"{self.config.db_path}: reading a chunk value failed: {exc}")
                miss = Miss(reason=MissReason.CORRUPT, at_token=span.start, detail="read_error")
                break
            if value is None:
                with self._lock:
                    indexed = span.address in self._index.meta
                # Deleted since the lookup (purge, eviction, expiry): an ordinary miss. Indexed but
                # without a value: the database lost it, which is corruption.
                if indexed:
                    miss = self._on_bad_value(tenant, span, "value_missing", 0)
                else:
                    miss = Miss(reason=MissReason.ABSENT, at_token=span.start)
                break
            decoded = decode_chunk(
                value, address=span.address, tenant_tag=ttag, model_fingerprint=model_fingerprint
            )
            if not isinstance(decoded, tuple):
                miss = self._on_bad_value(tenant, span, decoded.value, len(value))
                break
            header, payload = decoded
            if self._now() >= header.ceiling_at:
                miss = Miss(reason=MissReason.EXPIRED, at_token=span.start)
                break
            ranges.append((span.start, span.end))
            payloads.append(bytes(payload))
            # the value's last bytes are the checksum decode_chunk just verified
            checksums.append(bytes(value[-CHECKSUM_BYTES:]))
        with self._lock:
            for span, entry, checksum in zip(found.spans, entries, checksums, strict=False):
                if entry is not None and self._index.meta.get(span.address) is entry:
                    self._index.checksums[span.address] = checksum
            self._count_served(found.spans[: len(ranges)], miss, count_unstored=count_unstored)
        n_tokens = ranges[-1][1] if ranges else 0
        return PrefixResult(
            n_tokens=n_tokens,
            ranges=ranges,
            payloads=payloads,
            miss=miss,
            checksums=checksums,
            spans=found.spans,
        )

    def _count_served(self, spans: list[ChunkSpan], miss: Miss | None, *, count_unstored: bool) -> None:
        """Count a prefix served from `spans` (their LRU recency too). Lock held."""
        for span in spans:
            self._index.touch(span.address)
        self._stats.chunk_hits += len(spans)
        if miss is not None and (count_unstored or spans):
            self._stats.misses[miss.reason.value] += 1

    def indexed_prefix(
        self, tenant: str, model_fingerprint: str, token_ids: list[int] | bytes
    ) -> IndexedPrefix:
        """`lookup` with, per span, the checksum of the chunk's value as this process wrote it or last
        verified it by reading it (None where it knows none: after a restart, before a read). Reads no
        value, verifies nothing and counts nothing: for a caller that holds what the values decode to
        (checked against these checksums) and so needs no payload; it reports what it served with
        `record_served`, and reads with `longest_valid_prefix` whenever a checksum is unknown.

        A known checksum says what was written or verified at that address while its index entry stood,
        not that the bytes on disk are still intact: damage is found by the next read of the value.
        """
        found = self.lookup(tenant, model_fingerprint, token_ids)
        with self._lock:
            checksums = [self._index.checksums.get(span.address) for span in found.spans]
        return IndexedPrefix(n_tokens=found.n_tokens, spans=found.spans, miss=found.miss, checksums=checksums)

    def record_served(self, spans: list[ChunkSpan], miss: Miss | None) -> None:
        """Count a prefix served from `indexed_prefix` spans as `longest_valid_prefix` counts its reads
        (hits, LRU recency, the miss where the prefix ended; an unstored history is not a miss)."""
        with self._lock:
            held = [span for span in spans if span.address in self._index.meta]
            self._count_served(held, miss, count_unstored=False)
            self._stats.unread_chunk_hits += len(held)

    def _on_bad_value(self, tenant: str, span: ChunkSpan, defect: str, nbytes: int) -> Miss:
        """Quarantine a chunk whose stored bytes failed verification: remove it, audit, count."""
        with self._lock:
            self._stats.corrupt_by_defect[defect] = self._stats.corrupt_by_defect.get(defect, 0) + 1
            meta = self._index.meta.get(span.address)
            if meta is not None:
                batch = WriteBatch(raw_mode=True)
                self._stage_delete(batch, span.address, meta)
                event = AuditEvent(
                    actor=ACTOR,
                    action=AuditAction.READ_CORRUPT,
                    tenant=tenant,
                    subject=f"chunk:{span.address.hex()}",
                    reason=defect,
                    nbytes=nbytes,
                )
                try:
                    self._commit(batch, [event])
                    self._index.remove(span.address)
                except Exception as exc:  # noqa: BLE001 - the miss stands even if the cleanup cannot be written
                    log.error("corrupt_chunk_cleanup_failed", error=str(exc))
            log.warning("chunk_corrupt", tenant=tenant, start=span.start, defect=defect)
        return Miss(reason=MissReason.CORRUPT, at_token=span.start, detail=defect)

    def stats(self) -> StoreStats:
        """Node-wide counters (admin/metrics only: they aggregate every tenant)."""
        with self._lock:
            snap = StoreStats(**{**self._stats.__dict__})
            snap.misses = dict(self._stats.misses)
            snap.refusals = dict(self._stats.refusals)
            snap.corrupt_by_defect = dict(self._stats.corrupt_by_defect)
            snap.chunks = len(self._index)
            snap.bytes_stored = self._index.bytes_stored
            snap.tenants = len(self._salts)
            return snap

    def _reopen_after_write_errors(self) -> bool:
        """Reopen the database once the disk takes writes again; True when it is open and usable.

        RocksDB keeps a WAL write error sticky ("Writer has previous error") and rocksdict offers no
        resume, so after a full disk the only way back is to close and open the database again. The
        index is rebuilt from disk like at start (batches that did not reach the WAL are simply not
        there), and batches of the old database still waiting for their sync are refused (their
        tickets' group syncs against a generation that is gone). Nothing is reopened while a 1 MiB
        file cannot be written beside the database: a reopen on a full disk would only fail.
        """
        probe = Path(self.config.path) / ".space_probe"
        try:
            with probe.open("wb") as f:
                f.write(b"\0" * (1 << 20))
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            return False
        finally:
            probe.unlink(missing_ok=True)
        with self._lock:
            if self._closed:
                return False
            if self._suspended is None and not self._writes.failing:
                # Another caller reopened it while this one waited for the lock.
                return True
            if self._suspended is None:
                with self._sync_guard:
                    self._generation += 1
                    self._db_closed = True
                    try:
                        self._db.close()
                    except Exception as exc:  # noqa: BLE001 - a closing database with a sticky write error
                        log.error("store_reopen_close_failed", error=str(exc))
                self._suspended = "write errors"
            self._index = ChunkIndex()
            self._salts.clear()
            self._tenant_of_tag.clear()
            self._policies.clear()
            self._inflight.clear()
            self._doomed.clear()
            with self._ack_lock:
                self._acked.clear()
            self._wal = GroupSync(functools.partial(self._sync_wal, self._generation))
            hwm = self._hwm
            try:
                self._open_db(redeliver=False)
            except Exception as exc:  # noqa: BLE001 - stay closed; the next probe tries again
                self._suspended = f"reopen failed: {exc}"
                log.error("store_reopen_failed", error=str(exc))
                return False
            # The clock mark on disk may lag the one in memory (its last write may have failed).
            self._hwm = max(hwm, self._hwm)
            self._db_closed = False
            self._suspended = None
            self._writes.ok()
        log.warning("store_reopened_after_write_errors", chunks=len(self._index))
        self._redeliver()
        return True

    def health(self) -> StoreHealth:
        """Whether the store serves as a cache now, and why not (store_health.py)."""
        entries = self.quarantine.list()
        reasons: list[HealthReason] = []
        details: list[str] = []
        if entries:
            reasons.append(HealthReason.QUARANTINED)
            latest = entries[-1]
            details.append(f"{len(entries)} quarantined store(s), latest {latest.name}: {latest.detail}")
        if self._read_error is not None:
            reasons.append(HealthReason.READ_ERROR)
            details.append(self._read_error)
        if self._writes.failing:
            reasons.append(HealthReason.WRITE_FAILING)
            failures, error = self._writes.failures, self._writes.last_error
            details.append(f"{failures} write attempts failed in a row: {error}")
        return StoreHealth(
            reasons=tuple(reasons),
            detail="; ".join(details),
            quarantined_stores=len(entries),
            quarantined_bytes=sum(e.nbytes for e in entries),
            consecutive_write_failures=self._writes.failures,
        )

    def probe_write(self) -> bool:
        """Write and sync the clock and ack marks once: whether the disk takes writes now. A health
        poller calls this while writes fail, so that health recovers when space returns even if no
        turn writes in the meantime."""
        if self._writes.failing and not self._reopen_after_write_errors():
            return False
        with self._lock:
            if self._closed or self._suspended is not None:
                return False
            try:
                self._commit(WriteBatch(raw_mode=True), [])
            except Exception:  # noqa: BLE001 - the failure is what the probe measures (counted by _commit)
                return False
            ticket, records = self._take_pending()
        try:
            self._settle_ticket(ticket)
        except Exception:  # noqa: BLE001 - the failure is what the probe measures (counted by _sync_wal)
            return False
        if records:
            self._deliver(records)
        return True

    def record_quarantine(self, entry: QuarantinedStore, *, actor: str = ACTOR) -> None:
        """Write the audit record of a database moved aside (into this, the fresh store's, chain)."""
        event = AuditEvent(
            actor=actor,
            action=AuditAction.QUARANTINE,
            tenant="",
            subject=f"store:{QUARANTINE_DIR}/{entry.name}",
            reason=entry.reason,
            nbytes=entry.nbytes,
        )
        with self._lock:
            self._check_open()
            self._commit(WriteBatch(raw_mode=True), [event])
        self._quarantined_bytes = sum(e.nbytes for e in self.quarantine.list())

    def tenant_stats(self, tenant: str) -> TenantStats:
        """What this tenant has stored on this node; says nothing about any other tenant."""
        check_id("tenant", tenant)
        with self._lock:
            salt = self._salts.get(tenant)
            if salt is None:
                return TenantStats(chunks=0, bytes_stored=0)
            tag = tenant_tag(salt)
            return TenantStats(
                chunks=self._index.tenant_chunks.get(tag, 0),
                bytes_stored=self._index.tenant_bytes.get(tag, 0),
            )

    def session_chunks(self, tenant: str, session: str) -> int:
        """How many stored chunks this tenant's session refers to."""
        check_id("tenant", tenant)
        check_id("session", session)
        with self._lock:
            salt = self._salts.get(tenant)
            if salt is None:
                return 0
            return sum(1 for _ in self._iter_prefix(SESSION_IDX + session_tag(salt, session)))

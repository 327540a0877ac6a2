"""Write path of the global KV store: validate chunk ranges, apply residency and capacity, and commit
a put's chunks with their index entries, references and audit records in one batch, made durable by
the store's group commit after the lock is released and visible only after that.

A mixin of GlobalKVStore (kv_store.py), split out by concept; it uses the store's lock, database,
index and audit sink.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
from rocksdict import WriteBatch

from storage.audit_record import AuditAction, AuditEvent, AuditRecord
from storage.chunk_format import CHECKSUM_BYTES, ChunkHeader, encode_chunk
from storage.chunk_index import REF, ChunkMeta, index_keys, ref_key, session_key
from storage.chunk_key import (
    ADDRESS_BYTES,
    TAG_BYTES,
    chain_root,
    check_id,
    model_tag,
    session_tag,
    tenant_tag,
    token_bytes,
)
from storage.policy import RetentionPolicy
from storage.store_results import PutResult, Refusal, RefusalKind

if TYPE_CHECKING:
    from storage.kv_store import GlobalKVStore

log = structlog.get_logger(__name__)

ACTOR = "storage"


@dataclass(frozen=True, kw_only=True)
class _StagedChunk:
    """One chunk of a written, not yet synced put: `meta` when this put wrote its value, None when it
    only added a reference (`pending`: the meta of another put's in-flight write of it)."""

    addr: bytes
    parent: bytes
    start: int
    end: int
    meta: ChunkMeta | None
    pending: ChunkMeta | None
    checksum: bytes | None = None


@dataclass(frozen=True, kw_only=True)
class _StagedPut:
    items: list[_StagedChunk]
    tenant: str
    stag: bytes
    evicted: int


class ChunkWriter:
    """Write half of GlobalKVStore (see the module docstring)."""

    def put_chunks(
        self: GlobalKVStore,
        tenant: str,
        session: str,
        model_fingerprint: str,
        token_ids: list[int] | bytes,
        payloads: Mapping[tuple[int, int], bytes],
        *,
        actor: str = ACTOR,
        audit_claim: list[AuditRecord] | None = None,
    ) -> PutResult:
        """Persist chunk payloads of a session's history, durably, under the tenant's policy.

        All chunks of one call go in one write batch; the WAL sync runs after the store lock is
        released (shared with concurrent writers), and the chunks become visible only after it.

        Args:
            tenant, session: owner ids; the session holds a reference on every chunk it stores.
            model_fingerprint: opaque id of the model (config, weights, cache format, numerics).
            token_ids: the history (ints, or u32 little-endian bytes) covering every range.
            payloads: (start, end) -> opaque payload bytes (model/'s export_global(start, end)).
                Full chunks are [k*chunk_tokens, (k+1)*chunk_tokens); at most one partial tail chunk
                [k*chunk_tokens, e) with e < (k+1)*chunk_tokens, the last range. A tail supersedes the
                session's shorter tail at the same position, and a full chunk supersedes them all.
            audit_claim: when given, this tenant's audit records of the call (durable when the call
                returns) are appended to it instead of going to the store's consumer: the caller
                records them (in its own SQL transaction) and then calls `ack_audit`, or hands them
                back with `release_audit`.

        Returns:
            PutResult; `refusal` says why nothing was persisted (residency, capacity in floor, I/O).

        Raises:
            ValueError: misaligned, overlapping or out-of-range ranges, empty or oversized payloads.
        """
        check_id("tenant", tenant)
        check_id("session", session)
        check_id("model_fingerprint", model_fingerprint)
        toks = token_bytes(token_ids)
        ranges = self._validate_ranges(len(toks) // 4, payloads)
        with self._lock:
            self._check_open()
            self._claim = (tenant, audit_claim) if audit_claim is not None else None
            try:
                policy = self._policies.get(tenant, RetentionPolicy())
                if not policy.allows_region(self.config.region):
                    return self._refuse(
                        tenant,
                        session,
                        RefusalKind.RESIDENCY,
                        f"region {self.config.region!r} not in allowed_regions "
                        f"{list(policy.allowed_regions or ())}",
                        sum(len(payloads[r]) for r in ranges),
                    )
                salt = self._salt(tenant, create=True)
                assert salt is not None
                staged = self._put_locked(
                    tenant, session, model_fingerprint, toks, ranges, payloads, policy, salt, actor
                )
            finally:
                self._claim = None
            if isinstance(staged, PutResult):
                return staged
            # This call settles its own sync (the release hook finds nothing left to do).
            ticket, records = self._take_pending()
        try:
            self._settle_ticket(ticket)
        except Exception as exc:  # noqa: BLE001 - a failed sync (disk error) becomes a refusal
            with self._lock:
                for item in staged.items:
                    if item.meta is not None and self._inflight.get(item.addr) is item.meta:
                        del self._inflight[item.addr]
                        self._doomed.discard(item.addr)
                self._stats.refusals[RefusalKind.IO_ERROR.value] += 1
            log.error("store_sync_failed", tenant=tenant, error=str(exc))
            return PutResult(
                stored=[],
                new_bytes=0,
                shared_chunks=0,
                evicted_chunks=staged.evicted,
                refusal=Refusal(kind=RefusalKind.IO_ERROR, message=f"WAL sync failed: {exc}"),
            )
        if records:
            self._deliver(records)
        with self._lock:
            return self._apply_put(staged)

    def _validate_ranges(
        self: GlobalKVStore, n_tokens: int, payloads: Mapping[tuple[int, int], bytes]
    ) -> list[tuple[int, int]]:
        size = self.config.chunk_tokens
        ranges = sorted(payloads)
        prev_end = 0
        for i, (start, end) in enumerate(ranges):
            if start % size or not (0 <= start < end <= n_tokens) or end - start > size:
                raise ValueError(
                    f"range ({start}, {end}) must start at a multiple of chunk_tokens={size}, "
                    f"span at most {size} tokens and lie within the {n_tokens}-token history"
                )
            if end - start < size and i != len(ranges) - 1:
                raise ValueError(f"partial range ({start}, {end}) must be the last one")
            if start < prev_end:
                raise ValueError(f"range ({start}, {end}) overlaps the previous one")
            prev_end = end
            payload = payloads[(start, end)]
            if not isinstance(payload, bytes | bytearray | memoryview) or not 0 < len(payload):
                raise ValueError(f"payload of range ({start}, {end}) must be non-empty bytes")
            if len(payload) > self.config.max_payload_bytes:
                raise ValueError(
                    f"payload of range ({start}, {end}) is {len(payload)} B "
                    f"> max_payload_bytes={self.config.max_payload_bytes}"
                )
        return ranges

    def _refuse(
        self: GlobalKVStore, tenant: str, session: str, kind: RefusalKind, message: str, nbytes: int
    ) -> PutResult:
        self._stats.refusals[kind.value] += 1
        event = AuditEvent(
            actor=ACTOR,
            action=AuditAction.REFUSE,
            tenant=tenant,
            subject=f"session:{session}",
            reason=kind.value,
            nbytes=nbytes,
        )
        try:
            self._commit(WriteBatch(raw_mode=True), [event])
        except Exception as exc:  # noqa: BLE001 - a full disk refuses the audit write too; say so, don't crash
            log.error("refusal_audit_failed", tenant=tenant, kind=kind.value, error=str(exc))
        log.warning("store_refused", tenant=tenant, kind=kind.value, message=message)
        return PutResult(
            stored=[],
            new_bytes=0,
            shared_chunks=0,
            evicted_chunks=0,
            refusal=Refusal(kind=kind, message=message),
        )

    def _put_locked(
        self: GlobalKVStore,
        tenant: str,
        session: str,
        fp: str,
        toks: bytes,
        ranges: list[tuple[int, int]],
        payloads: Mapping[tuple[int, int], bytes],
        policy: RetentionPolicy,
        salt: bytes,
        actor: str,
    ) -> _StagedPut | PutResult:
        """Plan, evict if needed, and write the one batch of this put (unsynced); a PutResult when
        refused. Lock held."""
        size = self.config.chunk_tokens
        now = self._now()
        ttag, stag, mtag = tenant_tag(salt), session_tag(salt, session), model_tag(fp)
        root = chain_root(fp, salt)
        needed = max(s for s, _ in ranges) // size
        # the full chunks below the last range (each the parent of the next): from a kept walk of the same
        # tokens where one holds them, the rest computed
        chain = self._addresses.leading(root, toks, size, needed)
        for k in range(len(chain), needed):
            chain.append(
                self._addresses.address(chain[-1] if chain else root, toks[k * size * 4 : (k + 1) * size * 4])
            )
        parents = {0: root} | {(k + 1) * size: addr for k, addr in enumerate(chain)}
        plan: list[tuple[int, int, bytes, bytes, bool, ChunkMeta | None]] = []
        new_bytes = 0
        replaced_bytes = 0
        for start, end in ranges:
            addr = self._addresses.address(parents[start], toks[start * 4 : end * 4])
            old = self._index.meta.get(addr)
            # A chunk another put wrote but has not made visible yet (its sync is under way) is shared:
            # this put's own sync comes later in the log, so it covers that batch too.
            pending = self._inflight.get(addr) if old is None else None
            shared = (old is not None and now < old.ceiling_at) or pending is not None
            if not shared:
                new_bytes += self._value_len(fp, len(payloads[(start, end)]))
                replaced_bytes += old.value_len if old is not None else 0
            plan.append((start, end, addr, parents[start], shared, pending))
        inflight_bytes = sum(m.value_len for m in self._inflight.values())
        need = (
            self._index.bytes_stored
            + self._quarantined_bytes
            + inflight_bytes
            - replaced_bytes
            + new_bytes
            - self.config.capacity_bytes
        )
        evicted = 0
        if need > 0 and self._quarantined_bytes:
            # Quarantined copies go first: nothing can be served from them.
            before, drop, covered = self._quarantined_bytes, [], 0
            for entry in self.quarantine.list():
                if covered >= need:
                    break
                drop.append(entry)
                covered += entry.nbytes
            self._drop_quarantined(drop, actor=ACTOR, reason="capacity")
            need -= before - self._quarantined_bytes
        if need > 0:
            protect = {addr for _, _, addr, _, _, _ in plan}
            victims = self._pick_victims(need, protect, now)
            if victims is None:
                return self._refuse(
                    tenant,
                    session,
                    RefusalKind.CAPACITY,
                    f"needs {new_bytes} B, capacity {self.config.capacity_bytes} B is held by chunks inside "
                    "their retention floor",
                    new_bytes,
                )
            try:
                evicted = self._evict(victims)
            except Exception as exc:  # noqa: BLE001 - I/O failure (disk full) becomes a refusal
                return self._refuse(tenant, session, RefusalKind.IO_ERROR, str(exc), new_bytes)
        floor_until = now + policy.effective_floor_s
        ceiling_at = now + policy.ceiling_s
        batch = WriteBatch(raw_mode=True)
        events: list[AuditEvent] = []
        items: list[_StagedChunk] = []
        for start, end, addr, parent, shared, pending in plan:
            batch.put(ref_key(addr, stag), b"")
            batch.put(session_key(stag, addr), b"")
            if shared:
                events.append(
                    AuditEvent(
                        actor=actor,
                        action=AuditAction.STORE,
                        tenant=tenant,
                        subject=f"chunk:{addr.hex()}",
                        reason=f"session:{session} tokens:{start}-{end} shared",
                        nbytes=0,
                    )
                )
                items.append(
                    _StagedChunk(addr=addr, parent=parent, start=start, end=end, meta=None, pending=pending)
                )
                continue
            old = self._index.meta.get(addr)
            if old is not None:
                # Same address past its ceiling: drop the old entry before writing anew.
                self._stage_delete(batch, addr, old)
            payload = bytes(payloads[(start, end)])
            header = ChunkHeader(
                address=addr,
                tenant_tag=ttag,
                model_fingerprint=fp,
                start=start,
                n_tokens=end - start,
                created_at=now,
                floor_until=floor_until,
                ceiling_at=ceiling_at,
                payload_len=len(payload),
            )
            value = encode_chunk(header, payload)
            meta = ChunkMeta(
                tenant_tag=ttag,
                model_tag=mtag,
                parent=parent,
                start=start,
                n_tokens=end - start,
                value_len=len(value),
                created_at=now,
                floor_until=floor_until,
                ceiling_at=ceiling_at,
                is_tail=end - start < size,
            )
            keys = index_keys(addr, meta)
            batch.put(keys[0], value)
            batch.put(keys[1], meta.encode())
            for key in keys[2:]:
                batch.put(key, b"")
            events.append(
                AuditEvent(
                    actor=actor,
                    action=AuditAction.STORE,
                    tenant=tenant,
                    subject=f"chunk:{addr.hex()}",
                    reason=f"session:{session} tokens:{start}-{end}",
                    nbytes=len(value),
                )
            )
            items.append(
                _StagedChunk(
                    addr=addr,
                    parent=parent,
                    start=start,
                    end=end,
                    meta=meta,
                    pending=None,
                    checksum=value[-CHECKSUM_BYTES:],
                )
            )
        superseded: list[bytes] = []
        for item in items:
            superseded += self._stage_superseded_tails(
                batch, events, stag, item.addr, item.parent, item.start, item.end - item.start
            )
        try:
            self._commit(batch, events)
        except Exception as exc:  # noqa: BLE001 - I/O failure (disk full) becomes a refusal
            return self._refuse(tenant, session, RefusalKind.IO_ERROR, str(exc), new_bytes)
        for old in superseded:
            self._index.remove(old)
        for item in items:
            if item.meta is not None:
                self._inflight[item.addr] = item.meta
        return _StagedPut(items=items, tenant=tenant, stag=stag, evicted=evicted)

    def _apply_put(self: GlobalKVStore, staged: _StagedPut) -> PutResult:
        """After the sync: make the put's chunks visible in the index. A chunk that a purge reached while
        the sync ran (the purge found it in the database's index keys, `_doomed`, or removed this
        session's reference) is deleted instead, with a PURGE record; its bytes leave with the next
        removal pass. Lock held."""
        stored: list[tuple[int, int]] = []
        checksums: dict[tuple[int, int], bytes] = {}
        written = shared_count = 0
        drop = WriteBatch(raw_mode=True)
        events: list[AuditEvent] = []
        for item in staged.items:
            mine = item.meta
            if mine is not None and self._inflight.get(item.addr) is mine:
                del self._inflight[item.addr]
            doomed = item.addr in self._doomed
            if mine is not None:
                self._doomed.discard(item.addr)
            meta = mine if mine is not None else self._index.meta.get(item.addr, item.pending)
            unref = self._db.get(ref_key(item.addr, staged.stag)) is None
            if doomed or unref:
                orphan = not any(True for _ in self._iter_prefix(REF + item.addr))
                if mine is not None and (doomed or orphan):
                    self._index.remove(item.addr)
                    self._stage_delete(drop, item.addr, mine)
                    events.append(
                        AuditEvent(
                            actor=ACTOR,
                            action=AuditAction.PURGE,
                            tenant=staged.tenant,
                            subject=f"chunk:{item.addr.hex()}",
                            reason="purged_during_write",
                            nbytes=mine.value_len,
                        )
                    )
                continue
            if mine is not None:
                self._index.remove(item.addr)
                self._index.add(item.addr, mine)
                assert item.checksum is not None
                self._index.checksums[item.addr] = item.checksum
                checksums[(item.start, item.end)] = item.checksum
                written += mine.value_len
                self._stats.chunks_written += 1
                self._stats.bytes_written += mine.value_len
            else:
                shared_count += 1
                if item.addr in self._index.meta:
                    self._index.touch(item.addr)
                elif meta is not None:
                    self._index.add(item.addr, meta)
            stored.append((item.start, item.end))
        if events:
            self._commit(drop, events)
        return PutResult(
            stored=stored,
            new_bytes=written,
            shared_chunks=shared_count,
            evicted_chunks=staged.evicted,
            written=checksums,
        )

    @staticmethod
    def _value_len(fp: str, payload_len: int) -> int:
        probe = ChunkHeader(
            address=bytes(ADDRESS_BYTES),
            tenant_tag=bytes(TAG_BYTES),
            model_fingerprint=fp,
            start=0,
            n_tokens=0,
            created_at=0.0,
            floor_until=0.0,
            ceiling_at=0.0,
            payload_len=payload_len,
        )
        return probe.header_len + payload_len + 32

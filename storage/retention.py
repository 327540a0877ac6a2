"""Retention operations of the global KV store: policy changes, expiry past the ceiling, capacity
eviction past the floor, purges, checkpoints, and the physical deletion that follows each of them.

A mixin of GlobalKVStore (kv_store.py), split out by concept; it uses the store's lock, database,
index and audit sink, and every method below runs with the store lock held unless it takes it.

Physical deletion: RocksDB's own TTL is database-wide and leaves expired values readable until a
compaction happens to reach them, so it is not used. Every deletion (expiry, purge, eviction,
superseded tail, corrupt value) commits, in one synced batch with its audit record, the tombstones
of the chunk and a `G` entry naming it as pending physical removal. A removal pass then (1) flushes
the memtable, so the WAL segments holding old values become obsolete and are deleted, (2) compacts
the pending keys through the bottommost level (forced), which rewrites the SST files without the
values and drops the tombstones, (3) clears the `G` entries, and (4) removes checkpoints that may
hold bytes past their ceiling (each checkpoint records the earliest ceiling of what it may hold) or,
after a purge, every checkpoint. Purges run the pass at once; expiry and evictions run it in the
maintenance pass. Hence a chunk's bytes leave every file under the store's root by
ceiling + maintenance_interval_s + one pass, and a purge's bytes before the purge call returns.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
from rocksdict import BottommostLevelCompaction, Checkpoint, CompactOptions, WriteBatch

from storage.audit_record import AuditAction, AuditEvent
from storage.chunk_index import (
    CHECKPOINT_CEILING,
    CHUNK,
    EXPIRY,
    F64,
    MODEL_IDX,
    PENDING,
    POLICY,
    REF,
    SALT,
    SESSION_IDX,
    TENANT_IDX,
    ChunkMeta,
    expiry_bound,
    expiry_key,
    index_keys,
    meta_key,
    prefix_end,
    ref_key,
    session_key,
)
from storage.chunk_key import ADDRESS_BYTES, TAG_BYTES, check_id, model_tag, session_tag, tenant_tag
from storage.policy import RetentionPolicy
from storage.quarantine import QUARANTINE_DIR, QuarantinedStore
from storage.store_results import MaintenanceReport, PurgeResult

if TYPE_CHECKING:
    from storage.kv_store import GlobalKVStore

log = structlog.get_logger(__name__)

# Above this many deleted chunks one compaction of the whole chunk range beats one per key.
_PER_KEY_COMPACTION_LIMIT = 64


class RetentionOps:
    """Retention half of GlobalKVStore (see the module docstring)."""

    def set_policy(
        self: GlobalKVStore, tenant: str, policy: RetentionPolicy, *, actor: str, reason: str = "admin"
    ) -> PurgeResult:
        """Set a tenant's retention and residency policy and apply it to what is stored.

        A shorter ceiling applies at once to stored chunks (served never after it and rescheduled for
        deletion); a longer floor or ceiling applies to later writes. A policy that excludes this
        node's region purges the tenant's chunks here.

        Returns:
            What the policy change deleted (nothing unless residency excluded this node).
        """
        check_id("tenant", tenant)
        check_id("actor", actor)
        with self._lock:
            self._check_open()
            batch = WriteBatch(raw_mode=True)
            batch.put(POLICY + tenant.encode(), policy.to_json())
            salt = self._salts.get(tenant)
            changed: list[tuple[bytes, ChunkMeta]] = []
            if salt is not None:
                ttag = tenant_tag(salt)
                for addr, meta in list(self._index.meta.items()):
                    if meta.tenant_tag != ttag:
                        continue
                    ceiling = min(meta.ceiling_at, meta.created_at + policy.ceiling_s)
                    if ceiling < meta.ceiling_at:
                        new = ChunkMeta(**{**meta.__dict__, "ceiling_at": ceiling})
                        new = ChunkMeta(**{**new.__dict__, "floor_until": min(new.floor_until, ceiling)})
                        batch.delete(expiry_key(meta.ceiling_at, addr))
                        batch.put(expiry_key(ceiling, addr), b"")
                        batch.put(meta_key(addr), new.encode())
                        changed.append((addr, new))
            regions = "*" if policy.allowed_regions is None else ",".join(policy.allowed_regions)
            event = AuditEvent(
                actor=actor,
                action=AuditAction.POLICY_CHANGE,
                tenant=tenant,
                subject="policy",
                reason=f"{reason}: floor_s={policy.floor_s} ceiling_s={policy.ceiling_s} regions={regions}",
            )
            self._commit(batch, [event])
            self._policies[tenant] = policy
            for addr, new in changed:
                self._index.replace(addr, new)
            if not policy.allows_region(self.config.region):
                return self._purge_tenant_locked(
                    tenant, actor=actor, reason="residency_policy", keep_salt=True
                )
            return PurgeResult(chunks_deleted=0, bytes_deleted=0, checkpoints_removed=0)

    def _stage_delete(self: GlobalKVStore, batch: WriteBatch, addr: bytes, meta: ChunkMeta) -> None:
        """Add the removal of a chunk, its index entries and all its references to `batch`, and mark
        its bytes pending physical removal."""
        for key in index_keys(addr, meta):
            batch.delete(key)
        batch.put(PENDING + addr, F64.pack(meta.ceiling_at))
        for key, _ in self._iter_prefix(REF + addr):
            batch.delete(key)
            batch.delete(session_key(key[1 + ADDRESS_BYTES :], addr))

    def _stage_removal(
        self: GlobalKVStore,
        batch: WriteBatch,
        events: list[AuditEvent],
        addr: bytes,
        meta: ChunkMeta,
        *,
        action: AuditAction,
        actor: str,
        reason: str,
    ) -> None:
        """`_stage_delete`, and the chunk's audit record (its tenant, its stored bytes) added to `events`."""
        self._stage_delete(batch, addr, meta)
        events.append(
            AuditEvent(
                actor=actor,
                action=action,
                tenant=self._tenant_of_tag.get(meta.tenant_tag, ""),
                subject=f"chunk:{addr.hex()}",
                reason=reason,
                nbytes=meta.value_len,
            )
        )

    def _delete_chunks(
        self: GlobalKVStore, addrs: list[bytes], *, action: AuditAction, actor: str, reason: str
    ) -> tuple[int, int]:
        """Delete chunks with one audit record each, in synced batches; returns (chunks, bytes)."""
        count = freed = 0
        for i in range(0, len(addrs), 256):
            batch = WriteBatch(raw_mode=True)
            events: list[AuditEvent] = []
            done: list[bytes] = []
            for addr in addrs[i : i + 256]:
                meta = self._index.meta.get(addr)
                if meta is None:
                    continue
                self._stage_removal(batch, events, addr, meta, action=action, actor=actor, reason=reason)
                done.append(addr)
            if not done:
                continue
            self._commit(batch, events)
            for addr in done:
                meta = self._index.remove(addr)
                assert meta is not None
                count += 1
                freed += meta.value_len
        return count, freed

    def _stage_superseded_tails(
        self: GlobalKVStore,
        batch: WriteBatch,
        events: list[AuditEvent],
        stag: bytes,
        addr: bytes,
        parent: bytes,
        start: int,
        n_tokens: int,
    ) -> list[bytes]:
        """Add to a put's `batch` (and its PURGE records to `events`) the drop of this session's references
        to its shorter tails at the same chain position: only the reference where another session holds
        the tail too, else the tail itself. Returns the chunks the batch deletes, for the caller to take
        out of the index once the batch is written.

        In the put's own batch rather than a batch of their own after it: a tail and the chunk that
        supersedes it change together in the log, and a turn pays one write, not two."""
        gone: list[bytes] = []
        for length, addrs in list(self._index.tail_lengths(parent).items()):
            if length >= n_tokens:
                continue
            for old in list(addrs):
                if old == addr or self._db.get(ref_key(old, stag)) is None:
                    continue
                meta = self._index.meta[old]
                assert meta.start == start
                if any(k[1 + ADDRESS_BYTES :] != stag for k, _ in self._iter_prefix(REF + old)):
                    batch.delete(ref_key(old, stag))
                    batch.delete(session_key(stag, old))
                    continue
                self._stage_removal(batch, events, old, meta, action=AuditAction.PURGE, actor="storage",
                                    reason="superseded_tail")  # fmt: skip
                gone.append(old)
        return gone

    def _pick_victims(self: GlobalKVStore, need: int, protect: set[bytes], now: float) -> list[bytes] | None:
        """Least recently used chunks past their floor freeing >= need bytes, or None if impossible."""
        victims: list[bytes] = []
        freed = 0
        for addr in self._index.lru:
            meta = self._index.meta[addr]
            if addr in protect or now < meta.floor_until:
                continue
            victims.append(addr)
            freed += meta.value_len
            if freed >= need:
                return victims
        return None

    def _evict(self: GlobalKVStore, victims: list[bytes]) -> int:
        count, freed = self._delete_chunks(
            victims, action=AuditAction.EVICT, actor="storage", reason="capacity_lru"
        )
        self._stats.evicted_chunks += count
        log.info("chunks_evicted", chunks=count, bytes=freed)
        return count

    def purge_session(
        self: GlobalKVStore, tenant: str, session: str, *, actor: str, reason: str = "request"
    ) -> PurgeResult:
        """Remove a session's references and every chunk only it used (shared chunks stay)."""
        with self._lock:
            self._check_open()
            self._purge_quarantined(actor)
            salt = self._salts.get(tenant)
            if salt is None:
                return PurgeResult(chunks_deleted=0, bytes_deleted=0, checkpoints_removed=0)
            stag = session_tag(salt, session)
            addrs = [k[1 + TAG_BYTES :] for k, _ in self._iter_prefix(SESSION_IDX + stag)]
            batch = WriteBatch(raw_mode=True)
            only_mine: list[bytes] = []
            for addr in addrs:
                others = [k for k, _ in self._iter_prefix(REF + addr) if k[1 + ADDRESS_BYTES :] != stag]
                if others:
                    batch.delete(ref_key(addr, stag))
                    batch.delete(session_key(stag, addr))
                else:
                    only_mine.append(addr)
            self._commit(batch, [])
            return self._purge(
                only_mine, tenant=tenant, subject=f"session:{session}", actor=actor, reason=reason
            )

    def purge_tenant(self: GlobalKVStore, tenant: str, *, actor: str, reason: str = "request") -> PurgeResult:
        """Remove every chunk of the tenant on this node and its salt (so any remnant is unreachable);
        the tenant's policy stays. Checkpoints taken before are removed."""
        with self._lock:
            self._check_open()
            return self._purge_tenant_locked(tenant, actor=actor, reason=reason, keep_salt=False)

    def _purge_tenant_locked(
        self: GlobalKVStore, tenant: str, *, actor: str, reason: str, keep_salt: bool
    ) -> PurgeResult:
        self._purge_quarantined(actor)
        salt = self._salts.get(tenant)
        if salt is None:
            return PurgeResult(chunks_deleted=0, bytes_deleted=0, checkpoints_removed=0)
        ttag = tenant_tag(salt)
        addrs = [k[1 + TAG_BYTES :] for k, _ in self._iter_prefix(TENANT_IDX + ttag)]
        result = self._purge(addrs, tenant=tenant, subject=f"tenant:{tenant}", actor=actor, reason=reason)
        if not keep_salt:
            batch = WriteBatch(raw_mode=True)
            batch.delete(SALT + tenant.encode())
            # Sessions' references die with the chunks; index entries of the tag die with them too.
            self._commit(batch, [])
            del self._salts[tenant]
            self._tenant_of_tag.pop(ttag, None)
        return result

    def purge_model(
        self: GlobalKVStore,
        model_fingerprint: str,
        *,
        tenant: str | None = None,
        actor: str,
        reason: str = "request",
    ) -> PurgeResult:
        """Remove every chunk written under this model fingerprint: every tenant's, or only `tenant`'s.

        Every session reference to a removed chunk goes with it (within a tenant, sessions sharing a
        prefix share its chunks). The bytes leave disk, checkpoints included, before the call returns.

        Args:
            tenant: restrict the purge to this tenant's chunks; None purges the fingerprint for all.
        """
        if tenant is not None:
            check_id("tenant", tenant)
        with self._lock:
            self._check_open()
            self._purge_quarantined(actor)
            mtag = model_tag(model_fingerprint)
            addrs = [k[1 + TAG_BYTES :] for k, _ in self._iter_prefix(MODEL_IDX + mtag)]
            if tenant is not None:
                salt = self._salts.get(tenant)
                if salt is None:
                    # A tenant without a salt here has no chain, so nothing of its is stored here.
                    return PurgeResult(chunks_deleted=0, bytes_deleted=0, checkpoints_removed=0)
                ttag = tenant_tag(salt)
                metas = self._index.meta
                addrs = [a for a in addrs if a in metas and metas[a].tenant_tag == ttag]
            return self._purge(
                addrs, tenant=tenant or "", subject=f"model:{model_fingerprint}", actor=actor, reason=reason
            )

    def _purge(
        self: GlobalKVStore, addrs: list[bytes], *, tenant: str, subject: str, actor: str, reason: str
    ) -> PurgeResult:
        count, freed = self._delete_chunks(
            addrs, action=AuditAction.PURGE, actor=actor, reason=f"{subject} {reason}"
        )
        self._stats.purged_chunks += count
        self._remove_pending_bytes()
        removed = self._drop_checkpoints(actor=actor, reason="purge", older_than=None)
        summary = AuditEvent(
            actor=actor, action=AuditAction.PURGE, tenant=tenant, subject=subject, reason=reason, nbytes=freed
        )
        self._commit(WriteBatch(raw_mode=True), [summary])
        log.info("store_purged", subject=subject, chunks=count, bytes=freed, checkpoints_removed=removed)
        return PurgeResult(chunks_deleted=count, bytes_deleted=freed, checkpoints_removed=removed)

    def run_maintenance(self: GlobalKVStore) -> MaintenanceReport:
        """Delete every chunk past its ceiling, then remove the bytes of every deletion so far from
        disk and drop checkpoints that could hold bytes past their ceiling (module docstring)."""
        with self._lock:
            self._check_open()
            now = self._now()
            bound = expiry_bound(now)
            due = [k[9:] for k, _ in self._iter_prefix(EXPIRY) if k < bound]
            count, freed = self._delete_chunks(
                due, action=AuditAction.EXPIRE, actor="maintenance", reason="past_ceiling"
            )
            self._stats.expired_chunks += count
            self._persist_clock()
            compacted = self._remove_pending_bytes()
            removed = self._drop_checkpoints(actor="maintenance", reason="past_ceiling", older_than=now)
            longest = max((p.ceiling_s for p in self._policies.values()), default=0.0)
            longest = max(longest, RetentionPolicy().ceiling_s)
            self._drop_quarantined(
                [q for q in self.quarantine.list() if q.quarantined_at + longest <= now],
                actor="maintenance",
                reason="past_ceiling",
            )
            if count or compacted or removed:
                log.info(
                    "maintenance_pass",
                    expired=count,
                    bytes=freed,
                    compacted=compacted,
                    checkpoints_removed=removed,
                )
            return MaintenanceReport(
                expired_chunks=count,
                expired_bytes=freed,
                compacted=compacted > 0,
                checkpoints_removed=removed,
            )

    def _remove_pending_bytes(self: GlobalKVStore) -> int:
        """Flush and compact every chunk key pending physical removal through the bottommost level,
        then clear the pending marks; returns how many keys were compacted."""
        pending = [k[1:] for k, _ in self._iter_prefix(PENDING)]
        if not pending:
            return 0
        self._db.flush(True)
        opts = CompactOptions()
        opts.set_bottommost_level_compaction(BottommostLevelCompaction.force())
        if len(pending) > _PER_KEY_COMPACTION_LIMIT:
            self._db.compact_range(CHUNK, prefix_end(CHUNK), opts)
        else:
            for addr in pending:
                self._db.compact_range(CHUNK + addr, CHUNK + addr, opts)
        batch = WriteBatch(raw_mode=True)
        for addr in pending:
            batch.delete(PENDING + addr)
        self._commit(batch, [])
        return len(pending)

    def _drop_checkpoints(self: GlobalKVStore, *, actor: str, reason: str, older_than: float | None) -> int:
        """Remove checkpoints whose earliest held ceiling is <= older_than (all when None)."""
        names = []
        for path in sorted(self.config.checkpoint_dir.iterdir()):
            raw = self._db.get(CHECKPOINT_CEILING + path.name.encode())
            # A checkpoint without a recorded ceiling (interrupted bookkeeping) is dropped early.
            ceiling = F64.unpack(raw)[0] if raw is not None else float("-inf")
            if older_than is None or ceiling <= older_than:
                names.append(path.name)
        if not names:
            return 0
        batch = WriteBatch(raw_mode=True)
        for name in names:
            shutil.rmtree(self.config.checkpoint_dir / name, ignore_errors=True)
            batch.delete(CHECKPOINT_CEILING + name.encode())
        event = AuditEvent(
            actor=actor,
            action=AuditAction.CHECKPOINT,
            tenant="",
            subject="checkpoints:" + ",".join(names),
            reason=f"removed_{reason}",
        )
        self._commit(batch, [event])
        return len(names)

    def _drop_quarantined(
        self: GlobalKVStore, entries: list[QuarantinedStore], *, actor: str, reason: str
    ) -> list[QuarantinedStore]:
        """Delete quarantined copies, one audit record each; lock held. Every chunk they hold was
        written before they were moved aside, so `quarantined_at` + the longest ceiling of any
        policy bounds every ceiling in them."""
        done: list[QuarantinedStore] = []
        for entry in entries:
            try:
                self.quarantine.remove(entry)
            except OSError as exc:
                log.error("quarantined_store_removal_failed", name=entry.name, error=str(exc))
                continue
            event = AuditEvent(
                actor=actor,
                action=AuditAction.QUARANTINE,
                tenant="",
                subject=f"store:{QUARANTINE_DIR}/{entry.name}",
                reason=f"removed_{reason}",
                nbytes=entry.nbytes,
            )
            self._commit(WriteBatch(raw_mode=True), [event])
            done.append(entry)
        if done:
            self._quarantined_bytes = sum(e.nbytes for e in self.quarantine.list())
        return done

    def _purge_quarantined(self: GlobalKVStore, actor: str) -> None:
        """A purge reaches quarantined copies too. Their databases do not read, so the purged
        tenant's, session's or model's entries cannot be picked out: each copy goes whole."""
        if self._quarantined_bytes or self.quarantine.dir.is_dir():
            self._drop_quarantined(self.quarantine.list(), actor=actor, reason="purge")

    def remove_quarantined(
        self: GlobalKVStore, *, actor: str, reason: str = "repaired"
    ) -> list[QuarantinedStore]:
        """Delete every quarantined copy of this store (an operator's repair); returns what went."""
        check_id("actor", actor)
        with self._lock:
            self._check_open()
            return self._drop_quarantined(self.quarantine.list(), actor=actor, reason=reason)

    def create_checkpoint(self: GlobalKVStore, name: str, *, actor: str = "admin") -> Path:
        """Take a consistent on-disk snapshot (backup) under `path/checkpoints/<name>`.

        It is removed by the first maintenance pass after the earliest ceiling of anything it holds,
        and by any purge, so no backup outlives a ceiling or a purge.
        """
        if not name or "/" in name or name.startswith(".") or name.endswith(".tmp"):
            raise ValueError(f"checkpoint name must be a plain directory name, got {name!r}")
        with self._lock:
            self._check_open()
            target = self.config.checkpoint_dir / name
            if target.exists():
                raise ValueError(f"checkpoint {name!r} already exists")
            held = [m.ceiling_at for m in self._index.meta.values()]
            held += [F64.unpack(v)[0] for _, v in self._iter_prefix(PENDING, values=True)]
            batch = WriteBatch(raw_mode=True)
            batch.put(CHECKPOINT_CEILING + name.encode(), F64.pack(min(held, default=float("inf"))))
            self._commit(batch, [])
            Checkpoint(self._db).create_checkpoint(str(target))
            event = AuditEvent(
                actor=actor,
                action=AuditAction.CHECKPOINT,
                tenant="",
                subject=f"checkpoint:{name}",
                reason="created",
            )
            self._commit(WriteBatch(raw_mode=True), [event])
            return target

    def list_checkpoints(self: GlobalKVStore) -> list[str]:
        return sorted(p.name for p in self.config.checkpoint_dir.iterdir() if not p.name.endswith(".tmp"))

    def start_maintenance(self: GlobalKVStore) -> None:
        """Run `run_maintenance` every config.maintenance_interval_s on a daemon thread until close()."""
        if self._maintenance_thread is not None:
            return
        self._maintenance_stop.clear()

        def loop() -> None:
            while not self._maintenance_stop.wait(self.config.maintenance_interval_s):
                try:
                    self.run_maintenance()
                except Exception as exc:  # noqa: BLE001 - keep the schedule alive; the next pass retries
                    log.error("maintenance_failed", error=str(exc))

        self._maintenance_thread = threading.Thread(
            target=loop, name="kvresume-storage-maintenance", daemon=True
        )
        self._maintenance_thread.start()

    def stop_maintenance(self: GlobalKVStore) -> None:
        thread = self._maintenance_thread
        if thread is None:
            return
        self._maintenance_stop.set()
        thread.join()
        self._maintenance_thread = None

    def chunks_stored_before(self: GlobalKVStore, cutoff: float) -> list[bytes]:
        """Addresses of the chunks stored (first written) before `cutoff`, seconds on the store's clock."""
        with self._lock:
            self._check_open()
            return [addr for addr, meta in self._index.meta.items() if meta.created_at < cutoff]

    def delete_orphans(
        self: GlobalKVStore, addrs: list[bytes], *, older_than: float, actor: str, reason: str
    ) -> tuple[int, int]:
        """Delete chunks the caller's registry names nowhere (a turn that never committed), one PURGE
        record each, if they were still stored before `older_than` (the grace period, checked again
        under the lock: a chunk written since is some running turn's). Their bytes go in the next
        maintenance pass. Returns (chunks, bytes)."""
        check_id("actor", actor)
        with self._lock:
            self._check_open()
            due = [
                a for a in addrs if (m := self._index.meta.get(a)) is not None and m.created_at < older_than
            ]
            return self._delete_chunks(due, action=AuditAction.PURGE, actor=actor, reason=reason)

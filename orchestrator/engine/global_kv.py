"""A served model's global KV in the store, for one session: read the longest usable prefix into a model
state, export and persist the history's chunks at turn end, and the registry rows that name them.

Knows nothing of plans or gRPC. A stored chunk counts only when the store verifies it (checksum, tenant,
fingerprint, retention), the registry still names it (purges commit in SQL first), and the model's
cache format accepts it; the first chunk failing any of these ends the prefix (a miss, never a hit).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from orchestrator.db import DurableSegment, RetainedKeys, SegmentRepository
from orchestrator.engine.decoded_states import DecodedSources
from orchestrator.engine.model_compute import ModelCompute, TorchCompute, import_chunks
from orchestrator.engine.payload_digests import PayloadDigests
from orchestrator.engine.pool_entry import chunks_digest_of
from orchestrator.engine.served_models import ServedModel
from orchestrator.planner import CacheInventory
from storage import AuditRecord, GlobalKVStore, MissReason, token_bytes

__all__ = ["StoredPrefix", "PersistOutcome", "read_prefix", "persist_chunks", "link_segments", "chunk_ranges"]


@dataclass(kw_only=True)
class StoredPrefix:
    """The usable stored prefix [0, n_tokens) of a history for one model.

    Attributes:
        state: a batch-1 state holding the prefix's global KV, windows absent (None when n_tokens is 0);
            a `ModelState` under `TorchCompute`.
        blobs: the verified chunk payloads in order (what a mapper reads on a model swap).
        miss_reason: why the prefix stops before the end of the history (None when it covers it all).
        decoded: whether the state was filled from kept decoded KV instead of importing the chunks.
    """

    model: str
    n_tokens: int
    state: Any | None
    blobs: list[bytes] = field(default_factory=list)
    ranges: list[tuple[int, int]] = field(default_factory=list)
    miss_reason: str | None = None
    lookup_result: str = "miss"
    decoded: bool = False
    _hashes: list[bytes] | None = field(default=None, repr=False)

    def payload_hashes(self) -> list[bytes]:
        """sha256 of each blob, in order (computed once: the full-hit check and the turn end's chunks
        digest both need them)."""
        if self._hashes is None:
            self._hashes = [hashlib.sha256(b).digest() for b in self.blobs]
        return self._hashes

    def inventory(self) -> CacheInventory:
        return CacheInventory(model=self.model, valid_prefix=self.n_tokens, miss_reason=self.miss_reason)


def _miss_text(reason: MissReason, at: int, detail: str) -> str:
    if reason == MissReason.CORRUPT:
        return f"stored chunk at token {at} failed verification ({detail})"
    if reason == MissReason.EXPIRED:
        return f"stored chunk at token {at} is past its retention"
    return f"nothing stored from token {at}"


def read_prefix(
    store: GlobalKVStore,
    registry: Callable[[], Session],
    *,
    tenant: str,
    served: ServedModel,
    history: Sequence[int],
    compute: ModelCompute | None = None,
    decoded: DecodedSources | None = None,
    now: float | None = None,
    digests: PayloadDigests | None = None,
    retained: RetainedKeys | None = None,
) -> StoredPrefix:
    """Read, verify and import the longest usable stored prefix of `history` for `served`.

    Args:
        registry: makes a read session of the registry (for the segment rows that name the chunks); it is
            opened only after the store calls return: a store call may deliver audit records to the SQL
            sink (outside the store lock, after its sync), so an SQL transaction held across it could
            wait on itself.
        compute: the model operations (default: the real model).
        decoded: the decoded global KV a window pool entry of this history was kept with
            (`decoded_states.py`): when the verified chunks read here are exactly the ones it decodes
            (same ranges, same payload digests), it fills the state instead of dequantizing them.
        now: wall seconds the registry's retention stamps are compared with (default: time.time()).
        digests: payload digests kept by verified checksum (`payload_digests.py`): the prefix's
            `payload_hashes()` are taken from it (hashing only chunks it has not seen) instead of
            hashing every payload.
        retained: the registry's retention check to use instead of one through a `registry` session
            (`RetainedKeys`: one driver read on SQLite); read after the store calls all the same.
    """
    compute = compute if compute is not None else TorchCompute()
    name, fp = served.name, served.fingerprint_hex
    if not history:
        return StoredPrefix(model=name, n_tokens=0, state=None, miss_reason=None, lookup_result="empty")
    # One index walk: the read reports the spans it started from (an unstored history is not counted
    # as a store miss, as when this looked the history up first and read only what it found).
    verified = store.longest_valid_prefix(tenant, fp, list(history), count_unstored=False)
    if not verified.spans:
        miss = verified.miss
        assert miss is not None
        why = _miss_text(miss.reason, miss.at_token, miss.detail)
        return StoredPrefix(model=name, n_tokens=0, state=None, miss_reason=why)
    keys = [s.address for s in verified.spans]
    # A chunk serves while any session of the tenant that stored or read it is inside its granted
    # retention (ARCHITECTURE §1: past its retention is a miss).
    at = time.time() if now is None else now
    if retained is not None:
        named = retained(keys, now=at, tenant_id=tenant, fingerprint=fp)
    else:
        with registry() as session:
            named = SegmentRepository(session).within_retention(
                keys, now=at, tenant_id=tenant, fingerprint=fp
            )
    miss_reason = None
    if verified.miss is not None:
        miss_reason = _miss_text(verified.miss.reason, verified.miss.at_token, verified.miss.detail)
    state = compute.new_state(served)
    blobs: list[bytes] = []
    ranges: list[tuple[int, int]] = []
    by_range = {(s.start, s.end): s.address for s in verified.spans}
    checksums = verified.checksums if len(verified.checksums) == len(verified.payloads) else None
    for (start, end), payload in zip(verified.ranges, verified.payloads, strict=True):
        key = by_range.get((start, end))
        if key not in named:
            miss_reason = f"stored chunk at token {start} is not in the registry (purged)"
            break
        if not named[key]:
            miss_reason = f"stored chunk at token {start} is past the retention of every session holding it"
            break
        blobs.append(payload)
        ranges.append((start, end))
    hashes: list[bytes] | None = None
    if digests is not None and checksums is not None:
        hashes = digests.of(blobs, checksums[: len(blobs)])
    elif decoded is not None:
        hashes = [hashlib.sha256(b).digest() for b in blobs]
    used_decoded = False
    if decoded is not None:
        assert hashes is not None
        used_decoded = decoded.matches(ranges, hashes)
    if used_decoded:
        assert decoded is not None
        decoded.fill(state)
        appended, error = len(blobs), None
    else:
        # one import of every named chunk: linear in the history (chunk by chunk would be quadratic)
        appended, error = import_chunks(compute, served, state, blobs)
    if error is not None:
        miss_reason = f"stored chunk at token {ranges[appended][0]} failed the cache format check ({error})"
        del blobs[appended:], ranges[appended:]
        if hashes is not None:
            del hashes[appended:]
    n = ranges[-1][1] if ranges else 0
    if n == 0:
        return StoredPrefix(model=name, n_tokens=0, state=None, miss_reason=miss_reason or "nothing stored")
    compute.seal_prefix(served, state, history[:n])
    if miss_reason is not None and "failed" in miss_reason:
        result = "corrupt"
    else:
        result = "hit" if n == len(history) else "partial"
    return StoredPrefix(
        model=name,
        n_tokens=n,
        state=state,
        blobs=blobs,
        ranges=ranges,
        miss_reason=miss_reason,
        lookup_result=result,
        decoded=used_decoded,
        _hashes=hashes if hashes is not None and len(hashes) == len(blobs) else None,
    )


def chunk_ranges(n_tokens: int, chunk_tokens: int, *, from_pos: int = 0) -> list[tuple[int, int]]:
    """Store ranges covering [first chunk holding from_pos, n_tokens): full chunks, then one partial tail
    (of any length: the cache format reads back a tail shorter than a compression group)."""
    start = from_pos - from_pos % chunk_tokens
    out = []
    while start < n_tokens:
        end = min(start + chunk_tokens, n_tokens)
        out.append((start, end))
        start += chunk_tokens
    return out


@dataclass(frozen=True, kw_only=True)
class PersistOutcome:
    """What a turn's persist left to record: the durable segments to link, and `audit`, the store's
    audit records of the write that the store left to the caller (claimed): the turn's registry
    transaction mirrors them and then acknowledges them (`GlobalKVStore.ack_audit`), or hands them
    back (`GlobalKVStore.release_audit`) when it cannot commit."""

    persisted: bool
    note: str
    segments: tuple[DurableSegment, ...]
    new_bytes: int = 0
    audit: tuple[AuditRecord, ...] = ()
    chunks: bytes = b""


def persist_chunks(
    store: GlobalKVStore,
    *,
    tenant: str,
    session_id: str,
    served: ServedModel,
    history: Sequence[int],
    state: Any,
    already_stored: int,
    retention_s: float,
    node: str,
    clock: Callable[[], float],
    compute: ModelCompute | None = None,
    known: Mapping[tuple[int, int], bytes] | None = None,
    known_hashes: Mapping[tuple[int, int], bytes] | None = None,
) -> PersistOutcome:
    """Export the chunks of `history` not yet stored for this session and write them durably.

    Args:
        history: the whole history after the turn ([1, n] tokens the state covers exactly).
        already_stored: this session's stored prefix before the turn (full chunks below it are kept).
        known: payloads by range that the state was loaded from (verified stored chunks, maybe another
            session's found by content): used as they are instead of exporting them again, and written
            (a reference of this session on a chunk another session stored) when not yet this session's.
        known_hashes: sha256 of those payloads, by range, where already computed.

    Returns:
        The durable segments of the whole history to link in the registry, or why nothing was persisted;
        `chunks`, the `chunks_digest` of the whole history's chunks as the state holds them (what a pool
        entry of this state continues).
    """
    compute = compute if compute is not None else TorchCompute()
    known = known if known is not None else {}
    known_hashes = known_hashes if known_hashes is not None else {}
    n = len(history)
    if state.n_tokens != n:
        raise ValueError(f"state covers {state.n_tokens} tokens but the history has {n}")
    size = store.config.chunk_tokens
    fp = served.fingerprint_hex
    every = chunk_ranges(n, size)
    ranges = chunk_ranges(n, size, from_pos=already_stored)

    def payload(r: tuple[int, int]) -> bytes:
        held = known.get(r)
        return held if held is not None else compute.export_global(served, state, r[0], r[1])

    payloads = {r: payload(r) for r in ranges}

    def payload_hash(r: tuple[int, int]) -> bytes:
        held = known_hashes.get(r) if r in known else None
        if held is not None:
            return held
        # the kept full chunks below already_stored count in the digest as the state holds them
        return hashlib.sha256(payloads[r] if r in payloads else payload(r)).digest()

    digest = chunks_digest_of(every, [payload_hash(r) for r in every])
    new_bytes = 0
    claimed: list[AuditRecord] = []
    # the ids as the store takes them (u32 little-endian), encoded once for the put and the lookup
    ids = token_bytes(list(history))
    if payloads:
        put = store.put_chunks(tenant, session_id, fp, ids, payloads, audit_claim=claimed)
        if put.refusal is not None:
            return PersistOutcome(
                persisted=False,
                note=f"not persisted: {put.refusal.message}",
                segments=(),
                audit=tuple(claimed),
            )
        new_bytes = put.new_bytes
    spans = store.lookup(tenant, fp, ids).spans
    sizes = {r: len(p) for r, p in payloads.items()}
    expires = dt.datetime.fromtimestamp(clock() + retention_s, dt.UTC)
    segments = tuple(
        DurableSegment(
            store_key=s.address,
            tenant_id=tenant,
            model=served.name,
            fingerprint=fp,
            start_pos=s.start,
            end_pos=s.end,
            nbytes=sizes.get((s.start, s.end), 0),
            expires_at=expires,
            node=node,
            region=store.config.region,
            numerics=served.numerics.label,
        )
        for s in spans
    )
    return PersistOutcome(
        persisted=True, note="", segments=segments, new_bytes=new_bytes, audit=tuple(claimed), chunks=digest
    )


def link_segments(
    s: Session | Connection, session_id: str, fingerprint: str, segments: Sequence[DurableSegment]
) -> list[bytes]:
    """Link the session to its current chunks of `fingerprint` and unlink the ones the store superseded
    (a shorter tail), deleting rows no session links any more (a few Core statements, whatever the
    number of segments). Returns the store keys of the rows deleted."""
    return SegmentRepository(s).link_current(session_id, fingerprint, segments)

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

from sqlalchemy.orm import Session

from orchestrator.db import DurableSegment, RetainedKeys, SegmentRepository
from orchestrator.engine.decoded_states import DecodedSources
from orchestrator.engine.model_compute import ModelCompute, TorchCompute, import_chunks, restore_decoded
from orchestrator.engine.payload_digests import PayloadDigests
from orchestrator.engine.pool_entry import chunks_digest_of
from orchestrator.engine.served_models import ServedModel
from orchestrator.planner import CacheInventory
from storage import AuditRecord, GlobalKVStore, MissReason, token_bytes

__all__ = [
    "StoredPrefix",
    "PersistOutcome",
    "read_prefix",
    "persist_chunks",
    "chunk_ranges",
    "encoded_ids",
]


@dataclass(kw_only=True)
class StoredPrefix:
    """The usable stored prefix [0, n_tokens) of a history for one model.

    Attributes:
        state: a batch-1 state holding the prefix's global KV, windows absent (None when n_tokens is 0);
            a `ModelState` under `TorchCompute`.
        blobs: the verified chunk payloads in order (what a mapper reads on a model swap).
        miss_reason: why the prefix stops before the end of the history (None when it covers it all).
        decoded: whether the state was filled from kept decoded KV instead of importing the chunks.
        payloads_read: whether `blobs` holds the payloads (False: the prefix was served from kept
            decoded KV without reading the values, `read_prefix(payloads_optional=True)`; `blobs` is
            empty, `ranges` and `payload_hashes()` still describe every chunk).
    """

    model: str
    n_tokens: int
    state: Any | None
    blobs: list[bytes] = field(default_factory=list)
    ranges: list[tuple[int, int]] = field(default_factory=list)
    miss_reason: str | None = None
    lookup_result: str = "miss"
    decoded: bool = False
    payloads_read: bool = True
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


def encoded_ids(history: Sequence[int], history_ids: bytes | None) -> bytes:
    """`history_ids` when the caller holds them (refused unless 4 bytes a token), else
    `token_bytes(history)`: the ids as the store takes them.

    Raises:
        ValueError: `history_ids` of another length than the history's.
    """
    if history_ids is None:
        return token_bytes(history)
    if len(history_ids) != 4 * len(history):
        raise ValueError(f"history_ids hold {len(history_ids)} bytes for {len(history)} tokens")
    return history_ids


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
    payloads_optional: bool = False,
    history_ids: bytes | None = None,
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
        payloads_optional: the caller needs no payload bytes when `decoded` serves the prefix (a turn
            continuing its own session's kept state): then the values are not read at all where the
            store knows each chunk's checksum and `digests` each checksum's payload digest, and they
            give `decoded`'s chunks digest (`_served_from_decoded`); otherwise everything is read.
        history_ids: `token_bytes(history)`, when the caller holds them (the store takes the ids in that
            form; a long history's conversion costs about 0.4 ms per 64K tokens).

    Raises:
        ValueError: `history_ids` that are not 4 bytes a token of `history`.
    """
    compute = compute if compute is not None else TorchCompute()
    name, fp = served.name, served.fingerprint_hex
    history_ids = encoded_ids(history, history_ids)
    if not history:
        return StoredPrefix(model=name, n_tokens=0, state=None, miss_reason=None, lookup_result="empty")
    if payloads_optional and decoded is not None and digests is not None:
        kept = _served_from_decoded(
            store, registry, tenant, served, history, history_ids, compute, decoded, digests, retained, now
        )
        if kept is not None:
            return kept
    # One index walk: the read reports the spans it started from (an unstored history is not counted
    # as a store miss, as when this looked the history up first and read only what it found).
    verified = store.longest_valid_prefix(tenant, fp, history_ids, count_unstored=False)
    if not verified.spans:
        miss = verified.miss
        assert miss is not None
        why = _miss_text(miss.reason, miss.at_token, miss.detail)
        return StoredPrefix(model=name, n_tokens=0, state=None, miss_reason=why)
    keys = [s.address for s in verified.spans]
    # A chunk serves while any session of the tenant that stored or read it is inside its granted
    # retention (ARCHITECTURE §1: past its retention is a miss).
    at = time.time() if now is None else now
    named = _within_retention(registry, retained, keys, at=at, tenant=tenant, fingerprint=fp)
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
        compute.fill_decoded(served, state, decoded.kept)
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


def _within_retention(
    registry: Callable[[], Session],
    retained: RetainedKeys | None,
    keys: list[bytes],
    *,
    at: float,
    tenant: str,
    fingerprint: str,
) -> Mapping[bytes, bool]:
    """Each key the registry names -> whether a session holding it is inside its retention at `at`."""
    if retained is not None:
        return retained(keys, now=at, tenant_id=tenant, fingerprint=fingerprint)
    with registry() as session:
        return SegmentRepository(session).within_retention(
            keys, now=at, tenant_id=tenant, fingerprint=fingerprint
        )


def _served_from_decoded(
    store: GlobalKVStore,
    registry: Callable[[], Session],
    tenant: str,
    served: ServedModel,
    history: Sequence[int],
    history_ids: bytes,
    compute: ModelCompute,
    decoded: DecodedSources,
    digests: PayloadDigests,
    retained: RetainedKeys | None,
    now: float | None,
) -> StoredPrefix | None:
    """The prefix `read_prefix` would serve from `decoded`, found without reading a value, or None (then
    `read_prefix` reads as ever).

    Proof, chunk by chunk, of what reading would establish: the store's index holds the chunk within
    its ceiling (`indexed_prefix`: what a read's lookup checks first), the registry names it within a
    holder's retention, and the checksum of its value as this process wrote or verified it maps to a
    payload digest (`digests`), so the ranges and digests give `decoded`'s chunks digest: the very bytes
    `decoded` is the import of. Reading would then only re-hash about 60-230 KiB per chunk to find what
    is known (on a 300-turn session of the no-op stand-in it was 28% of the turn). What is not proven
    is that the bytes on disk are still intact; nothing here uses them, and the next read of them
    (another session's import, any read after a restart) verifies them as before.
    """
    name, fp = served.name, served.fingerprint_hex
    indexed = store.indexed_prefix(tenant, fp, history_ids)
    spans = indexed.spans
    if not spans or spans[-1].end != decoded.n_tokens or any(c is None for c in indexed.checksums):
        return None
    hashes = digests.known([c for c in indexed.checksums if c is not None])
    ranges = [(s.start, s.end) for s in spans]
    if hashes is None or not decoded.matches(ranges, hashes):
        return None
    keys = [s.address for s in spans]
    at = time.time() if now is None else now
    named = _within_retention(registry, retained, keys, at=at, tenant=tenant, fingerprint=fp)
    if not all(named.get(key) for key in keys):
        return None  # the read says which chunk and why
    n = decoded.n_tokens
    state = restore_decoded(compute, served, decoded.kept, history[:n])
    store.record_served(spans, indexed.miss)
    miss_reason = None
    if indexed.miss is not None:
        miss_reason = _miss_text(indexed.miss.reason, indexed.miss.at_token, indexed.miss.detail)
    return StoredPrefix(
        model=name,
        n_tokens=n,
        state=state,
        blobs=[],
        ranges=ranges,
        miss_reason=miss_reason,
        lookup_result="hit" if n == len(history) else "partial",
        decoded=True,
        payloads_read=False,
        _hashes=hashes,
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
    digests: PayloadDigests | None = None,
    history_ids: bytes | None = None,
    exported: Mapping[tuple[int, int], bytes] | None = None,
) -> PersistOutcome:
    """Export the chunks of `history` not yet stored for this session and write them durably.

    Args:
        history: the whole history after the turn ([1, n] tokens the state covers exactly).
        already_stored: this session's stored prefix before the turn (full chunks below it are kept).
        known: payloads by range that the state was loaded from (verified stored chunks, maybe another
            session's found by content): used as they are instead of exporting them again, and written
            (a reference of this session on a chunk another session stored) when not yet this session's.
        known_hashes: sha256 of the payloads the state was loaded from, by range, where already computed
            (with or without the payloads in `known`).
        digests: told the payload digest of each value this put wrote, by its stored checksum, so that
            the next turn proves the chunk without reading it (`read_prefix(payloads_optional=True)`).
        history_ids: `token_bytes(history)`, when the caller holds them.
        exported: payloads by range the caller exported from `state` already (a turn end's one call
            there: `export_turn_end`); the ranges not in it or in `known` are exported here.

    Returns:
        The durable segments of the whole history to link in the registry, or why nothing was persisted;
        `chunks`, the `chunks_digest` of the whole history's chunks as the state holds them (what a pool
        entry of this state continues).
    """
    compute = compute if compute is not None else TorchCompute()
    known = known if known is not None else {}
    known_hashes = known_hashes if known_hashes is not None else {}
    exported = exported if exported is not None else {}
    n = len(history)
    if state.n_tokens != n:
        raise ValueError(f"state covers {state.n_tokens} tokens but the history has {n}")
    size = store.config.chunk_tokens
    fp = served.fingerprint_hex
    every = chunk_ranges(n, size)
    ranges = chunk_ranges(n, size, from_pos=already_stored)

    def payload(r: tuple[int, int]) -> bytes:
        held = known.get(r)
        if held is None:
            held = exported.get(r)
        return held if held is not None else compute.export_global(served, state, r[0], r[1])

    payloads = {r: payload(r) for r in ranges}

    def payload_hash(r: tuple[int, int]) -> bytes:
        if r in payloads and r not in known:
            return hashlib.sha256(payloads[r]).digest()  # exported now
        # A loaded range: the digest of the stored bytes the state was loaded from (a prefix served
        # from kept decoded state has digests but no payloads: `StoredPrefix.payloads_read`).
        held = known_hashes.get(r)
        if held is not None:
            return held
        # the kept full chunks below already_stored count in the digest as the state holds them
        return hashlib.sha256(payloads[r] if r in payloads else payload(r)).digest()

    hashes = {r: payload_hash(r) for r in every}
    digest = chunks_digest_of(every, [hashes[r] for r in every])
    new_bytes = 0
    claimed: list[AuditRecord] = []
    # the ids as the store takes them (u32 little-endian), encoded once for the put and the lookup
    ids = encoded_ids(history, history_ids)
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
        if digests is not None:
            for r, checksum in put.written.items():
                if r in hashes:
                    digests.remember(checksum, hashes[r])
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


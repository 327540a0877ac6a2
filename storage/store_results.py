"""Typed outcomes of the global KV store: misses, refusals and reports are values, not exceptions."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class MissReason(StrEnum):
    """Why a lookup stopped before the end of the history."""

    ABSENT = "absent"
    EXPIRED = "expired"
    CORRUPT = "corrupt"


@dataclass(frozen=True, kw_only=True)
class Miss:
    """Where and why the usable prefix ends. `at_token` is the first token not covered; `detail` names
    the defect for CORRUPT (a ChunkDefect value) and is empty otherwise."""

    reason: MissReason
    at_token: int
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class ChunkSpan:
    """One stored chunk on a history's chain: tokens [start, end)."""

    address: bytes
    start: int
    end: int


@dataclass(frozen=True, kw_only=True)
class LookupResult:
    """Index-only answer (no payload read): how many leading tokens have stored chunks.

    `miss` is None when the whole history is covered.
    """

    n_tokens: int
    spans: list[ChunkSpan]
    miss: Miss | None


@dataclass(frozen=True, kw_only=True)
class IndexedPrefix(LookupResult):
    """A `lookup` with `checksums[i]`, the checksum of spans[i]'s value as this process wrote or last
    verified it (None: not known; `GlobalKVStore.indexed_prefix`)."""

    checksums: list[bytes | None] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class PrefixResult:
    """Verified payloads of the longest valid stored prefix, in order: payloads[i] covers ranges[i].

    Concatenating the ranges gives [0, n_tokens). `miss` is None when the whole history is covered.
    `checksums[i]` is the stored sha256 that payloads[i]'s value (header and payload) verified against:
    two equal checksums name the same bytes, so a digest of a payload may be kept by its checksum.
    `spans` are the index's spans the read started from (the `lookup` it made: its first len(ranges)
    spans are the ranges read; any after them were not read, or failed).
    """

    n_tokens: int
    ranges: list[tuple[int, int]]
    payloads: list[bytes]
    miss: Miss | None
    checksums: list[bytes] = field(default_factory=list)
    spans: list[ChunkSpan] = field(default_factory=list)


class RefusalKind(StrEnum):
    RESIDENCY = "residency"
    CAPACITY = "capacity"
    IO_ERROR = "io_error"


@dataclass(frozen=True, kw_only=True)
class Refusal:
    """Why a write was not persisted; serving continues without persistence."""

    kind: RefusalKind
    message: str


@dataclass(frozen=True, kw_only=True)
class PutResult:
    """Outcome of put_chunks. `stored` are the ranges now durable for this session (new or shared);
    `new_bytes` counts values written; `refusal` is set when nothing more was persisted. `written` maps
    each range whose value this put wrote (not one it only shared) to that value's checksum."""

    stored: list[tuple[int, int]]
    new_bytes: int
    shared_chunks: int
    evicted_chunks: int
    refusal: Refusal | None = None
    written: dict[tuple[int, int], bytes] = field(default_factory=dict)

    @property
    def persisted(self) -> bool:
        return self.refusal is None


@dataclass(frozen=True, kw_only=True)
class PurgeResult:
    chunks_deleted: int
    bytes_deleted: int
    checkpoints_removed: int


@dataclass(frozen=True, kw_only=True)
class MaintenanceReport:
    expired_chunks: int
    expired_bytes: int
    compacted: bool
    checkpoints_removed: int


@dataclass(frozen=True, kw_only=True)
class RecoveryReport:
    """What open() found on disk. `orphans_removed` counts index entries or values without their
    counterpart (partial leftovers); `stale_checkpoints_removed` counts interrupted checkpoint dirs."""

    chunks: int
    bytes_stored: int
    tenants: int
    orphans_removed: int
    stale_checkpoints_removed: int
    audit_head_seq: int
    clock_high_water: float


@dataclass(frozen=True, kw_only=True)
class TenantStats:
    """What a tenant may learn about itself (nothing about other tenants)."""

    chunks: int
    bytes_stored: int


@dataclass(kw_only=True)
class StoreStats:
    """Counters for the orchestrator's metrics exporter; a snapshot copy is returned by stats()."""

    chunks: int = 0
    bytes_stored: int = 0
    capacity_bytes: int = 0
    tenants: int = 0
    chunk_hits: int = 0
    # of chunk_hits, those served without reading the value (`GlobalKVStore.record_served`)
    unread_chunk_hits: int = 0
    misses: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in MissReason})
    corrupt_by_defect: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=lambda: {k.value: 0 for k in RefusalKind})
    chunks_written: int = 0
    bytes_written: int = 0
    synced_writes: int = 0
    evicted_chunks: int = 0
    expired_chunks: int = 0
    purged_chunks: int = 0
    recovered_chunks: int = 0

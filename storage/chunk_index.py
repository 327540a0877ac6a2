"""Key layout of the store's RocksDB database and the in-memory index rebuilt from it on open.

Disk is the truth: every entry below is written in the same synced batch as the chunk it describes,
and `ChunkIndex` is only a cache of the `M` entries (rebuilt at open, never the sole copy).

One-byte prefixes (addr = 32-byte chunk address, tags = 16 bytes):
    C addr                      -> chunk value (chunk_format)
    M addr                      -> ChunkMeta
    E ceiling_us(8 BE) addr     -> ""   scheduled deletion, scanned in time order
    T tenant_tag addr           -> ""   chunks of a tenant (purge_tenant)
    F model_tag addr            -> ""   chunks of a model fingerprint (purge_model)
    R addr session_tag          -> ""   references (a chunk lives while any session refers to it)
    S session_tag addr          -> ""   chunks of a session (purge_session)
    G addr                      -> ceiling (f64) of a deleted chunk whose bytes await compaction
    Q checkpoint name           -> earliest ceiling (f64) of any bytes the checkpoint may hold
    K tenant_id                 -> 32-byte random salt (never returned by any API)
    Y tenant_id                 -> RetentionPolicy JSON
    W                           -> clock high-water mark (f64)
    V                           -> on-disk format version
    A seq / H                   -> audit records and head (audit_rocks)
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass

from storage.chunk_key import ADDRESS_BYTES, TAG_BYTES

CHUNK = b"C"
META = b"M"
EXPIRY = b"E"
TENANT_IDX = b"T"
MODEL_IDX = b"F"
REF = b"R"
SESSION_IDX = b"S"
PENDING = b"G"
CHECKPOINT_CEILING = b"Q"
SALT = b"K"
POLICY = b"Y"
CLOCK_HWM = b"W"
FORMAT = b"V"
STORE_FORMAT_VERSION = b"kvresume-store-1"

_META = struct.Struct(f"<{TAG_BYTES}s{TAG_BYTES}s{ADDRESS_BYTES}sQIQdddB")
_U64BE = struct.Struct(">Q")
F64 = struct.Struct("<d")


@dataclass(frozen=True, kw_only=True)
class ChunkMeta:
    """Index entry of one chunk. value_len is the stored value's size in bytes (header + payload +
    checksum); times are seconds on the store's clock."""

    tenant_tag: bytes
    model_tag: bytes
    parent: bytes
    start: int
    n_tokens: int
    value_len: int
    created_at: float
    floor_until: float
    ceiling_at: float
    is_tail: bool

    def encode(self) -> bytes:
        return _META.pack(
            self.tenant_tag,
            self.model_tag,
            self.parent,
            self.start,
            self.n_tokens,
            self.value_len,
            self.created_at,
            self.floor_until,
            self.ceiling_at,
            int(self.is_tail),
        )

    @classmethod
    def decode(cls, raw: bytes) -> ChunkMeta | None:
        """None when `raw` is not a meta entry of this format (a leftover to remove)."""
        if len(raw) != _META.size:
            return None
        t, m, p, start, n, vlen, created, floor, ceiling, tail = _META.unpack(raw)
        return cls(
            tenant_tag=t,
            model_tag=m,
            parent=p,
            start=start,
            n_tokens=n,
            value_len=vlen,
            created_at=created,
            floor_until=floor,
            ceiling_at=ceiling,
            is_tail=bool(tail),
        )


def chunk_key(addr: bytes) -> bytes:
    return CHUNK + addr


def meta_key(addr: bytes) -> bytes:
    return META + addr


def expiry_key(ceiling_at: float, addr: bytes) -> bytes:
    return EXPIRY + _U64BE.pack(max(0, int(ceiling_at * 1_000_000))) + addr


def expiry_bound(now: float) -> bytes:
    """Exclusive upper bound of expiry keys whose ceiling is <= now."""
    return EXPIRY + _U64BE.pack(max(0, int(now * 1_000_000)) + 1)


def ref_key(addr: bytes, stag: bytes) -> bytes:
    return REF + addr + stag


def session_key(stag: bytes, addr: bytes) -> bytes:
    return SESSION_IDX + stag + addr


def index_keys(addr: bytes, meta: ChunkMeta) -> list[bytes]:
    """Every per-chunk key except references (tails are found through ChunkMeta.parent)."""
    return [
        chunk_key(addr),
        meta_key(addr),
        expiry_key(meta.ceiling_at, addr),
        TENANT_IDX + meta.tenant_tag + addr,
        MODEL_IDX + meta.model_tag + addr,
    ]


def prefix_end(prefix: bytes) -> bytes:
    """Smallest key greater than every key starting with `prefix` (prefix is never all 0xff here)."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1])


class ChunkIndex:
    """In-memory view of the `M` entries: chunk metadata, per-parent tails, per-tenant totals and LRU
    order. Not thread-safe; the store holds its lock around every call."""

    def __init__(self) -> None:
        self.meta: dict[bytes, ChunkMeta] = {}
        self.tails: dict[bytes, dict[int, set[bytes]]] = {}
        self.lru: OrderedDict[bytes, None] = OrderedDict()
        self.bytes_stored = 0
        self.tenant_bytes: dict[bytes, int] = {}
        self.tenant_chunks: dict[bytes, int] = {}
        # The checksum (the value's last CHECKSUM_BYTES) of each indexed chunk's value as this process
        # wrote it or last verified it by reading it; RAM only (empty after a restart until reads fill
        # it), gone with the entry (`remove`). What `GlobalKVStore.indexed_prefix` reports.
        self.checksums: dict[bytes, bytes] = {}

    def __len__(self) -> int:
        return len(self.meta)

    def add(self, addr: bytes, meta: ChunkMeta) -> None:
        assert addr not in self.meta
        self.meta[addr] = meta
        self.lru[addr] = None
        if meta.is_tail:
            self.tails.setdefault(meta.parent, {}).setdefault(meta.n_tokens, set()).add(addr)
        self.bytes_stored += meta.value_len
        self.tenant_bytes[meta.tenant_tag] = self.tenant_bytes.get(meta.tenant_tag, 0) + meta.value_len
        self.tenant_chunks[meta.tenant_tag] = self.tenant_chunks.get(meta.tenant_tag, 0) + 1

    def replace(self, addr: bytes, meta: ChunkMeta) -> None:
        """Swap metadata of a chunk in place (same size and position; new times)."""
        old = self.meta[addr]
        assert old.value_len == meta.value_len and old.parent == meta.parent
        self.meta[addr] = meta

    def remove(self, addr: bytes) -> ChunkMeta | None:
        meta = self.meta.pop(addr, None)
        if meta is None:
            return None
        self.checksums.pop(addr, None)
        self.lru.pop(addr, None)
        if meta.is_tail:
            by_len = self.tails.get(meta.parent, {})
            by_len.get(meta.n_tokens, set()).discard(addr)
            if not by_len.get(meta.n_tokens):
                by_len.pop(meta.n_tokens, None)
            if not by_len:
                self.tails.pop(meta.parent, None)
        self.bytes_stored -= meta.value_len
        self.tenant_bytes[meta.tenant_tag] -= meta.value_len
        self.tenant_chunks[meta.tenant_tag] -= 1
        if not self.tenant_chunks[meta.tenant_tag]:
            del self.tenant_chunks[meta.tenant_tag], self.tenant_bytes[meta.tenant_tag]
        return meta

    def touch(self, addr: bytes) -> None:
        if addr in self.lru:
            self.lru.move_to_end(addr)

    def tail_lengths(self, parent: bytes) -> dict[int, set[bytes]]:
        return self.tails.get(parent, {})

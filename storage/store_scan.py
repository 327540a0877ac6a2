"""Read-only scan of a store's database: what recovery rebuilds the index from, and what
`kvresume admin store check` inspects. Writes nothing; knows nothing of the store object.

Every failure to read the database whole is a `StoreDamagedError`: an iterator that stops early
because RocksDB hit a corrupt block or an I/O error (its status says so; `valid()` alone cannot tell
the end of the data from a read error, which is how unreadable entries once looked missing and their
readable partners were deleted as leftovers), an entry of the store's own that does not decode (the
clock mark, a policy, a salt, the audit head), or a format mark that is not one this code wrote.
Only a format mark naming a newer version is a `StoreVersionError`: that store is not damaged.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

from rocksdict import Rdict

from storage.audit_rocks import HEAD_KEY
from storage.chunk_index import (
    CHECKPOINT_CEILING,
    CHUNK,
    CLOCK_HWM,
    EXPIRY,
    F64,
    FORMAT,
    META,
    MODEL_IDX,
    POLICY,
    REF,
    SALT,
    SESSION_IDX,
    STORE_FORMAT_VERSION,
    TENANT_IDX,
    ChunkMeta,
    index_keys,
)
from storage.chunk_key import ADDRESS_BYTES, TAG_BYTES
from storage.errors import StoreDamagedError, StoreFormatError, StoreVersionError
from storage.policy import RetentionPolicy

_FORMAT_MARK = re.compile(rb"kvresume-store-([1-9][0-9]{0,5})")
_SALT_BYTES = 32
_HEAD_BYTES = 8 + 32


def format_version(mark: bytes) -> int | None:
    """The version number a format mark names, or None when it is not a mark of ours."""
    match = _FORMAT_MARK.fullmatch(mark)
    return int(match.group(1)) if match else None


def check_format_mark(mark: bytes, where: str) -> None:
    """Accept this code's format mark; refuse a newer one; call anything else damage.

    Raises:
        StoreVersionError: the mark names a version newer than this code's.
        StoreDamagedError: the mark is not one this code or an older one wrote.
    """
    ours = format_version(STORE_FORMAT_VERSION)
    assert ours is not None
    found = format_version(mark)
    if found == ours:
        return
    if found is not None and found > ours:
        raise StoreVersionError(
            f"{where} holds store format {mark.decode()!r}, newer than this code's "
            f"{STORE_FORMAT_VERSION.decode()!r}: run the newer kvresume or point data_dir elsewhere"
        )
    raise StoreDamagedError(f"{where} has an unknown store format mark {mark[:64]!r}")


def iter_prefix(
    db: Rdict, prefix: bytes, *, values: bool = False, where: str
) -> Iterator[tuple[bytes, bytes | None]]:
    """Yield (key, value or None) for keys starting with `prefix`, in key order.

    Raises:
        StoreDamagedError: RocksDB stopped the iteration with an error (corruption, I/O).
    """
    it = db.iter()
    it.seek(prefix)
    while it.valid():
        key = it.key()
        if not key.startswith(prefix):
            return
        yield key, (it.value() if values else None)
        it.next()
    try:
        it.status()
    except Exception as exc:  # noqa: BLE001 - rocksdict raises a plain Exception carrying RocksDB's status
        raise StoreDamagedError(f"{where}: reading keys under {prefix!r} failed: {exc}") from exc


@dataclass(kw_only=True)
class StoreScan:
    """What a scan found. `leftovers` are keys no atomic batch of ours leaves behind on its own (index
    entries without their value, values without their entries, references to nothing); they are
    complete only because the scan read every entry without an error."""

    formatted: bool
    clock_high_water: float = 0.0
    salts: dict[str, bytes] = field(default_factory=dict)
    policies: dict[str, RetentionPolicy] = field(default_factory=dict)
    chunks: list[tuple[bytes, ChunkMeta]] = field(default_factory=list)
    leftovers: set[bytes] = field(default_factory=set)
    checkpoint_ceilings: set[bytes] = field(default_factory=set)
    keys: int = 0


def _decode(where: str, what: str, fn, raw: bytes):
    try:
        return fn(raw)
    except (ValueError, struct.error, TypeError, KeyError) as exc:
        raise StoreDamagedError(f"{where}: {what} does not decode ({exc}): {raw[:80]!r}") from exc


def scan_store(db: Rdict, where: str) -> StoreScan:
    """Read every entry recovery needs and cross-check chunks against their index entries.

    Raises:
        StoreVersionError: the format mark names a newer version.
        StoreDamagedError: the database cannot be read whole, or one of its entries is undecodable.
        StoreFormatError: the database holds data but no format mark (not a store of ours).
    """
    try:
        fmt = db.get(FORMAT)
        raw_hwm = db.get(CLOCK_HWM)
        raw_head = db.get(HEAD_KEY)
    except Exception as exc:  # noqa: BLE001 - rocksdict raises a plain Exception carrying RocksDB's status
        raise StoreDamagedError(f"{where}: reading the store's marks failed: {exc}") from exc
    if fmt is None:
        if any(True for _ in iter_prefix(db, b"", where=where)):
            raise StoreFormatError(f"{where} holds data without a store format mark")
        return StoreScan(formatted=False)
    check_format_mark(fmt, where)
    found = StoreScan(formatted=True)
    if raw_hwm is not None:
        found.clock_high_water = _decode(where, "the clock mark", lambda r: F64.unpack(r)[0], raw_hwm)
    if raw_head is not None and len(raw_head) != _HEAD_BYTES:
        raise StoreDamagedError(f"{where}: the audit head is {len(raw_head)} bytes, not {_HEAD_BYTES}")
    for key, salt in iter_prefix(db, SALT, values=True, where=where):
        tenant = _decode(where, "a tenant id", lambda r: r[1:].decode(), key)
        if salt is None or len(salt) != _SALT_BYTES:
            raise StoreDamagedError(f"{where}: the salt of tenant {tenant!r} is not {_SALT_BYTES} bytes")
        found.salts[tenant] = salt
    for key, raw in iter_prefix(db, POLICY, values=True, where=where):
        tenant = _decode(where, "a tenant id", lambda r: r[1:].decode(), key)
        assert raw is not None
        found.policies[tenant] = _decode(where, f"the policy of {tenant!r}", RetentionPolicy.from_json, raw)
    metas: list[tuple[bytes, ChunkMeta]] = []
    leftovers: list[bytes] = []
    for key, raw in iter_prefix(db, META, values=True, where=where):
        assert raw is not None
        meta = ChunkMeta.decode(raw)
        if meta is None or len(key) != 1 + ADDRESS_BYTES:
            leftovers.append(key)
        else:
            metas.append((key[1:], meta))
    values = {key[1:] for key, _ in iter_prefix(db, CHUNK, where=where)}
    known: set[bytes] = set()
    for addr, meta in sorted(metas, key=lambda item: item[1].created_at):
        if addr in values:
            found.chunks.append((addr, meta))
            known.add(addr)
        else:
            leftovers.extend(index_keys(addr, meta))
    leftovers.extend(CHUNK + a for a in values if a not in known)
    # Index entries end with the address; references start with it.
    for prefix, addr_at in ((EXPIRY, 9), (TENANT_IDX, 1 + TAG_BYTES), (MODEL_IDX, 1 + TAG_BYTES)):
        leftovers.extend(k for k, _ in iter_prefix(db, prefix, where=where) if k[addr_at:] not in known)
    leftovers.extend(k for k, _ in iter_prefix(db, REF, where=where) if k[1 : 1 + ADDRESS_BYTES] not in known)
    leftovers.extend(
        k for k, _ in iter_prefix(db, SESSION_IDX, where=where) if k[1 + TAG_BYTES :] not in known
    )
    found.leftovers = set(leftovers)
    found.checkpoint_ceilings = {k[1:] for k, _ in iter_prefix(db, CHECKPOINT_CEILING, where=where)}
    return found


def read_all(db: Rdict, where: str) -> int:
    """Read every key and value once (so RocksDB checks every block); returns how many entries.

    Raises:
        StoreDamagedError: a block failed its checksum or could not be read.
    """
    return sum(1 for _ in iter_prefix(db, b"", values=True, where=where))

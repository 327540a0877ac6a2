"""A seeded catalogue of damage to a store's RocksDB directory, for the chaos suite and the storage
tests: file-level damage (SST bytes, truncation, MANIFEST, CURRENT, the WAL) applied to a closed or
crash-copied directory, and entry-level damage written through RocksDB itself (the clock mark, the
audit head, a policy, the format mark, chunk values and index entries).

Each damage is a function `(db_dir, rng) -> str` returning what it did; `DAMAGES` names them all.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from rocksdict import Options, Rdict

Damage = Callable[[Path, random.Random], str]


def _flip(path: Path, rng: random.Random, n: int, *, lo: float = 0.0, hi: float = 1.0) -> str:
    data = bytearray(path.read_bytes())
    if not data:
        return f"{path.name}: empty, nothing flipped"
    spots = []
    for _ in range(n):
        i = rng.randrange(int(len(data) * lo), max(int(len(data) * hi), int(len(data) * lo) + 1))
        data[i] ^= 1 << rng.randrange(8)
        spots.append(i)
    path.write_bytes(bytes(data))
    return f"{path.name}: {n} bit flips at {sorted(spots)}"


def _largest(db_dir: Path, pattern: str) -> Path:
    files = sorted(db_dir.glob(pattern), key=lambda p: p.stat().st_size)
    assert files, f"no {pattern} in {db_dir}"
    return files[-1]


def sst_bitflips(db_dir: Path, rng: random.Random) -> str:
    return _flip(_largest(db_dir, "*.sst"), rng, rng.randint(1, 6), lo=0.05, hi=0.95)


def sst_truncate(db_dir: Path, rng: random.Random) -> str:
    path = _largest(db_dir, "*.sst")
    size = path.stat().st_size
    keep = rng.randrange(size // 10, size - 1)
    with path.open("r+b") as f:
        f.truncate(keep)
    return f"{path.name}: truncated {size} -> {keep} B"


def sst_delete(db_dir: Path, rng: random.Random) -> str:
    path = _largest(db_dir, "*.sst")
    path.unlink()
    return f"{path.name}: deleted"


def manifest_bitflips(db_dir: Path, rng: random.Random) -> str:
    return _flip(_largest(db_dir, "MANIFEST-*"), rng, rng.randint(1, 4), lo=0.1, hi=1.0)


def manifest_truncate(db_dir: Path, rng: random.Random) -> str:
    path = _largest(db_dir, "MANIFEST-*")
    size = path.stat().st_size
    keep = rng.randrange(0, max(size // 2, 1))
    with path.open("r+b") as f:
        f.truncate(keep)
    return f"{path.name}: truncated {size} -> {keep} B"


def current_garbage(db_dir: Path, rng: random.Random) -> str:
    (db_dir / "CURRENT").write_bytes(b"MANIFEST-%06d\n" % rng.randrange(900000, 999999))
    return "CURRENT names a MANIFEST that does not exist"


def current_delete(db_dir: Path, rng: random.Random) -> str:
    (db_dir / "CURRENT").unlink()
    return "CURRENT deleted"


def wal_bitflips(db_dir: Path, rng: random.Random) -> str:
    """Flip bits in the WAL (meaningful on a directory copied from a killed writer, whose last
    writes live only there)."""
    logs = [p for p in db_dir.glob("*.log") if p.stat().st_size > 0]
    if not logs:
        return "no non-empty WAL"
    return _flip(max(logs, key=lambda p: p.stat().st_size), rng, rng.randint(1, 4), lo=0.0, hi=1.0)


def wal_truncate(db_dir: Path, rng: random.Random) -> str:
    logs = [p for p in db_dir.glob("*.log") if p.stat().st_size > 0]
    if not logs:
        return "no non-empty WAL"
    path = max(logs, key=lambda p: p.stat().st_size)
    size = path.stat().st_size
    keep = rng.randrange(0, size)
    with path.open("r+b") as f:
        f.truncate(keep)
    return f"{path.name}: truncated {size} -> {keep} B"


def _with_db(db_dir: Path, edit: Callable[[Rdict], str]) -> str:
    db = Rdict(str(db_dir), Options(raw_mode=True))
    try:
        return edit(db)
    finally:
        db.close()


def clock_mark_2_bytes(db_dir: Path, rng: random.Random) -> str:
    return _with_db(db_dir, lambda db: (db.put(b"W", rng.randbytes(2)), "clock mark W is 2 bytes")[1])


def audit_head_1_byte(db_dir: Path, rng: random.Random) -> str:
    return _with_db(db_dir, lambda db: (db.put(b"H", rng.randbytes(1)), "audit head H is 1 byte")[1])


def policy_invalid_json(db_dir: Path, rng: random.Random) -> str:
    def edit(db: Rdict) -> str:
        keys = [k for k in db.keys() if k[:1] == b"Y"]
        key = rng.choice(keys) if keys else b"Ytenant-x"
        db.put(key, b'{"floor_s": 1, "ceil')
        return f"policy {key[1:].decode()!r} is invalid JSON"

    return _with_db(db_dir, edit)


def format_mark_garbage(db_dir: Path, rng: random.Random) -> str:
    return _with_db(db_dir, lambda db: (db.put(b"V", b"kvresume-st\x00re-1"), "format mark V edited")[1])


def format_mark_deleted(db_dir: Path, rng: random.Random) -> str:
    return _with_db(db_dir, lambda db: (db.delete(b"V"), "format mark V deleted")[1])


def chunk_value_edits(db_dir: Path, rng: random.Random) -> str:
    """Edit bytes inside stored chunk values through RocksDB: the database stays readable, the
    values fail their own checksums on read."""

    def edit(db: Rdict) -> str:
        keys = [k for k in db.keys() if k[:1] == b"C"]
        picked = rng.sample(keys, k=min(len(keys), rng.randint(1, 5)))
        for key in picked:
            value = bytearray(db.get(key))
            i = rng.randrange(len(value))
            value[i] ^= 1 << rng.randrange(8)
            db.put(key, bytes(value))
        return f"{len(picked)} chunk values edited"

    return _with_db(db_dir, edit)


def chunk_value_truncated(db_dir: Path, rng: random.Random) -> str:
    def edit(db: Rdict) -> str:
        keys = [k for k in db.keys() if k[:1] == b"C"]
        key = rng.choice(keys)
        value = db.get(key)
        db.put(key, value[: rng.randrange(len(value))])
        return "one chunk value truncated"

    return _with_db(db_dir, edit)


def chunk_values_swapped(db_dir: Path, rng: random.Random) -> str:
    def edit(db: Rdict) -> str:
        keys = [k for k in db.keys() if k[:1] == b"C"]
        a, b = rng.sample(keys, 2)
        va, vb = db.get(a), db.get(b)
        db.put(a, vb)
        db.put(b, va)
        return "two chunk values swapped"

    return _with_db(db_dir, edit)


def meta_edits(db_dir: Path, rng: random.Random) -> str:
    def edit(db: Rdict) -> str:
        keys = [k for k in db.keys() if k[:1] == b"M"]
        picked = rng.sample(keys, k=min(len(keys), rng.randint(1, 3)))
        for key in picked:
            value = bytearray(db.get(key))
            value[rng.randrange(len(value))] ^= 0xFF
            db.put(key, bytes(value))
        return f"{len(picked)} index entries edited"

    return _with_db(db_dir, edit)


DAMAGES: dict[str, Damage] = {
    f.__name__: f
    for f in (
        sst_bitflips,
        sst_truncate,
        sst_delete,
        manifest_bitflips,
        manifest_truncate,
        current_garbage,
        current_delete,
        wal_bitflips,
        wal_truncate,
        clock_mark_2_bytes,
        audit_head_1_byte,
        policy_invalid_json,
        format_mark_garbage,
        format_mark_deleted,
        chunk_value_edits,
        chunk_value_truncated,
        chunk_values_swapped,
        meta_edits,
    )
}

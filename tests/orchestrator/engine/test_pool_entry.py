"""pack_pool_entry / unpack_pool_entry: an entry continues exactly the history it was exported at."""

from __future__ import annotations

import hashlib
import random

import pytest

from orchestrator.engine import (
    chunks_digest,
    chunks_digest_of,
    history_digest,
    pack_pool_entry,
    unpack_pool_entry,
)
from storage import history_digest as storage_history_digest
from storage import token_bytes


def test_pack_pool_entry_round_trips_and_names_its_history() -> None:
    rng = random.Random(0)
    history = [rng.randrange(0, 2**32) for _ in range(1000)]
    fp = bytes(range(32))
    chunks = chunks_digest([(0, 512), (512, 1000)], [b"a", b"b"])
    blob = pack_pool_entry(fingerprint=fp, history=history, windows=b"windows-bytes", chunks=chunks)
    entry = unpack_pool_entry(blob)
    assert entry is not None
    assert entry.windows == b"windows-bytes" and entry.n_tokens == 1000 and entry.chunks == chunks
    # the digest the pool's prefix index finds entries by
    assert entry.digest == history_digest(history) == storage_history_digest(history)
    assert entry.continues(fp, history) is None
    assert "fingerprint" in entry.continues(bytes(32), history)
    assert "end at 1000" in entry.continues(fp, history + [5])
    edited = list(history)
    edited[17] ^= 1
    assert "another history" in entry.continues(fp, edited)
    # a digest the caller holds (hashed from the encoded ids) decides as the one computed here
    assert entry.continues(fp, history, digest=storage_history_digest(token_bytes(history))) is None
    assert "another history" in entry.continues(fp, history, digest=history_digest(edited))
    digest = history_digest(history)
    held = pack_pool_entry(fingerprint=fp, history=history, windows=b"windows-bytes", chunks=chunks,
                           digest=digest)  # fmt: skip
    assert held == blob


def test_unpack_pool_entry_rejects_foreign_bytes() -> None:
    blob = pack_pool_entry(fingerprint=bytes(32), history=[1, 2], windows=b"x", chunks=bytes(32))
    assert unpack_pool_entry(blob[:10]) is None
    assert unpack_pool_entry(b"XXXX" + blob[4:]) is None
    # version 1 entries (no chunks digest) are not read
    assert unpack_pool_entry(blob[:4] + b"\x01\x00" + blob[6:]) is None


def test_chunks_digest_names_ranges_and_bytes() -> None:
    base = chunks_digest([(0, 32), (32, 40)], [b"p0", b"p1"])
    assert base != chunks_digest([(0, 32), (32, 41)], [b"p0", b"p1"])
    assert base != chunks_digest([(0, 32), (32, 40)], [b"p0", b"p2"])
    assert base == chunks_digest([(0, 32), (32, 40)], [b"p0", b"p1"])
    hashes = [hashlib.sha256(p).digest() for p in (b"p0", b"p1")]
    assert chunks_digest_of([(0, 32), (32, 40)], hashes) == base
    with pytest.raises(ValueError, match="2 ranges but 1 payloads"):
        chunks_digest([(0, 32), (32, 40)], [b"p0"])

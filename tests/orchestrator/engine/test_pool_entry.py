"""pack_pool_entry / unpack_pool_entry: an entry continues exactly the history it was exported at."""

from __future__ import annotations

import random

from orchestrator.engine import history_digest, pack_pool_entry, unpack_pool_entry


def test_pack_pool_entry_round_trips_and_names_its_history() -> None:
    rng = random.Random(0)
    history = [rng.randrange(0, 2**32) for _ in range(1000)]
    fp = bytes(range(32))
    blob = pack_pool_entry(fingerprint=fp, history=history, windows=b"windows-bytes")
    entry = unpack_pool_entry(blob)
    assert entry is not None
    assert entry.windows == b"windows-bytes" and entry.n_tokens == 1000
    assert entry.digest == history_digest(history)
    assert entry.continues(fp, history) is None
    assert "fingerprint" in entry.continues(bytes(32), history)
    assert "end at 1000" in entry.continues(fp, history + [5])
    edited = list(history)
    edited[17] ^= 1
    assert "another history" in entry.continues(fp, edited)


def test_unpack_pool_entry_rejects_foreign_bytes() -> None:
    blob = pack_pool_entry(fingerprint=bytes(32), history=[1, 2], windows=b"x")
    assert unpack_pool_entry(blob[:10]) is None
    assert unpack_pool_entry(b"XXXX" + blob[4:]) is None
    assert unpack_pool_entry(blob[:4] + b"\x02\x00" + blob[6:]) is None

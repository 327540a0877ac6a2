"""Tenant isolation: tenant B cannot hit, list, time or size-probe tenant A's entries.

Non-interference: B runs the same calls against a store where A stored a prefix and one where A did
not; every answer B gets, and every database operation its calls perform (key kind, found or not, rows
scanned), must be identical. Timing can then differ only through RocksDB's shared caches.
"""

from __future__ import annotations

import hashlib
from typing import Any

from storage import GlobalKVStore, StoreConfig
from tests.storage.conftest import CHUNK, FP, FakeClock, payloads_for


class _RecordingDB:
    """Wraps the store's Rdict and records (op, key kind, outcome) for every read."""

    def __init__(self, db: Any) -> None:
        self._db = db
        self.ops: list[tuple[str, bytes, object]] = []

    def get(self, key: bytes, *args: Any) -> Any:
        value = self._db.get(key, *args)
        self.ops.append(("get", key[:1], value is None))
        return value

    def iter(self, *args: Any) -> Any:
        outer = self
        inner = self._db.iter(*args)

        class _It:
            def seek(self, key: bytes) -> None:
                outer.ops.append(("seek", key[:1], None))
                inner.seek(key)

            def valid(self) -> bool:
                return inner.valid()

            def key(self) -> bytes:
                return inner.key()

            def value(self) -> bytes:
                return inner.value()

            def next(self) -> None:
                outer.ops.append(("next", b"", None))
                inner.next()

        return _It()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def _fixed_payloads(tokens: list[int]) -> dict[tuple[int, int], bytes]:
    """Deterministic payloads so that both runs of B's session send identical bytes."""
    return {r: hashlib.sha256(repr((tokens, r)).encode()).digest() for r in payloads_for(tokens)}


def _b_session(
    store: GlobalKVStore, prefix_a: list[int]
) -> tuple[list[Any], list[tuple[str, bytes, object]]]:
    """Every tenant-facing call B can make, probing A's prefix; returns answers and DB operations."""
    recorder = _RecordingDB(store._db)
    store._db = recorder
    own = [9] * (2 * CHUNK)
    answers: list[Any] = []
    put = store.put_chunks("tB", "b1", FP, own, _fixed_payloads(own))
    answers.append((put.stored, put.new_bytes, put.shared_chunks, put.refusal))
    for probe in (prefix_a, prefix_a[:CHUNK], prefix_a + [1, 2, 3]):
        got = store.lookup("tB", FP, probe)
        answers.append((got.n_tokens, got.miss, len(got.spans)))
        got = store.longest_valid_prefix("tB", FP, probe)
        answers.append((got.n_tokens, got.miss, got.payloads))
        # B writing exactly A's tokens shares nothing with A.
        res = store.put_chunks("tB", "b2", FP, probe, _fixed_payloads(probe))
        answers.append((res.new_bytes > 0, res.shared_chunks))
    answers.append(store.tenant_stats("tB"))
    answers.append(store.session_chunks("tB", "b2"))
    answers.append(store.get_policy("tB"))
    purged = store.purge_session("tB", "b2", actor="tB")
    answers.append((purged.chunks_deleted, purged.bytes_deleted))
    store._db = recorder._db
    return answers, recorder.ops


def test_tenant_b_cannot_observe_tenant_a(tmp_path) -> None:
    prefix_a = [(i * 37) % 5000 for i in range(3 * CHUNK + 2)]
    results = []
    for with_a in (True, False):
        cfg = StoreConfig(path=str(tmp_path / f"store-{with_a}"), chunk_tokens=CHUNK, compression_ratios=(4,))
        store = GlobalKVStore(cfg, clock=FakeClock())
        try:
            if with_a:
                store.put_chunks("tA", "a1", FP, prefix_a, payloads_for(prefix_a))
                a_addrs = {s.address for s in store.lookup("tA", FP, prefix_a).spans}
            else:
                # A exists (has a salt and a policy) but stored nothing here.
                store.put_chunks("tA", "a1", FP, [3] * CHUNK, {(0, CHUNK): b"other"})
                store.purge_session("tA", "a1", actor="tA")
            results.append(_b_session(store, prefix_a))
            b_addrs = {s.address for s in store.lookup("tB", FP, prefix_a).spans}
            if with_a:
                assert a_addrs and not (a_addrs & b_addrs)
                assert store.lookup("tA", FP, prefix_a).n_tokens == len(prefix_a)
        finally:
            store.close()
    (answers_with, ops_with), (answers_without, ops_without) = results
    assert answers_with == answers_without
    assert ops_with == ops_without
    assert answers_with[1][0] == 0, "B's lookup of A's prefix must find nothing"


def test_salt_never_leaves_the_store(make_store) -> None:
    store = make_store()
    toks = [1] * CHUNK
    store.put_chunks("tA", "s", FP, toks, {(0, CHUNK): b"p"})
    salt = store._salts["tA"]
    exposed = [
        store.stats(),
        store.tenant_stats("tA"),
        store.get_policy("tA"),
        store.lookup("tA", FP, toks),
        store.longest_valid_prefix("tA", FP, toks),
        store.recovery,
        *store.audit.iter_records(),
    ]
    for obj in exposed:
        text = repr(obj).encode()
        assert salt not in text and salt.hex().encode() not in text

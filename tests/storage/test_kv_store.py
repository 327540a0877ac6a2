"""GlobalKVStore: put_chunks / lookup / longest_valid_prefix, sharing, tails, bad input, corruption."""

from __future__ import annotations

import os
import random

import pytest
from rocksdict import Options, Rdict

from storage import AuditAction, GlobalKVStore, MissReason, StoreConfig, StoreFormatError
from storage.chunk_format import decode_chunk
from storage.chunk_index import CHUNK as CHUNK_PREFIX
from tests.storage.conftest import CHUNK, FP, payloads_for


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 129_280) for _ in range(n)]


def _raw_db(store: GlobalKVStore) -> Rdict:
    """Close the store and open its database directly, as an outside writer would."""
    path = str(store.config.db_path)
    store.close()
    return Rdict(path, Options(raw_mode=True))


def test_longest_valid_prefix_roundtrip_full_and_partial(make_store) -> None:
    store = make_store()
    toks = _tokens(3 * CHUNK + 5)
    pays = payloads_for(toks)
    res = store.put_chunks("tA", "s1", FP, toks, pays)
    assert res.persisted and res.stored == sorted(pays) and res.shared_chunks == 0
    got = store.longest_valid_prefix("tA", FP, toks)
    assert got.miss is None and got.n_tokens == len(toks)
    assert got.payloads == [pays[r] for r in sorted(pays)]
    # A longer history sees the stored prefix and where it ends.
    longer = toks + _tokens(20, seed=1)
    got = store.longest_valid_prefix("tA", FP, longer)
    assert (
        got.n_tokens == len(toks) and got.miss.reason == MissReason.ABSENT and got.miss.at_token == len(toks)
    )
    # A history that diverges inside chunk 2 keeps chunks 0 and 1 only.
    diverged = toks[: 2 * CHUNK + 3] + [7, 7, 7, 7, 7, 7, 7, 7]
    assert store.longest_valid_prefix("tA", FP, diverged).n_tokens == 2 * CHUNK
    # Token ids as u32 little-endian bytes address the same chunks.
    raw = b"".join(t.to_bytes(4, "little") for t in toks)
    assert store.lookup("tA", FP, raw).n_tokens == len(toks)


def test_put_chunks_shares_prefix_within_tenant(make_store) -> None:
    store = make_store()
    toks = _tokens(2 * CHUNK)
    first = store.put_chunks("tA", "s1", FP, toks, payloads_for(toks))
    again = store.put_chunks("tA", "s2", FP, toks, payloads_for(toks))
    assert first.new_bytes > 0 and again.new_bytes == 0 and again.shared_chunks == 2
    assert store.stats().chunks == 2
    assert store.session_chunks("tA", "s1") == store.session_chunks("tA", "s2") == 2


def test_put_chunks_tail_superseded_by_longer_tail_and_full_chunk(make_store) -> None:
    store = make_store()
    toks = _tokens(2 * CHUNK)
    store.put_chunks("tA", "s1", FP, toks, payloads_for(toks, upto=CHUNK + 3))
    assert store.stats().chunks == 2
    batches = store.batches_written
    store.put_chunks("tA", "s1", FP, toks, {(CHUNK, CHUNK + 6): b"six"})
    assert store.stats().chunks == 2, "the 3-token tail was superseded"
    # the tail goes in the batch that writes its successor: one write, one change in the log
    assert store.batches_written == batches + 1
    assert store.longest_valid_prefix("tA", FP, toks).n_tokens == CHUNK + 6
    # Another session holding the 6-token tail keeps it alive when s1 moves on to the full chunk.
    store.put_chunks("tA", "s2", FP, toks[: CHUNK + 6], {(0, CHUNK): b"x", (CHUNK, CHUNK + 6): b"six"})
    batches = store.batches_written
    store.put_chunks("tA", "s1", FP, toks, {(CHUNK, 2 * CHUNK): b"full"})
    assert store.batches_written == batches + 1  # s1's reference dropped in the same batch
    assert store.stats().chunks == 3
    assert store.longest_valid_prefix("tA", FP, toks[: CHUNK + 6]).payloads[-1] == b"six"
    assert store.longest_valid_prefix("tA", FP, toks).payloads[-1] == b"full"
    actions = [(r.action, r.reason) for r in store.audit.iter_records()]
    assert (AuditAction.PURGE, "superseded_tail") in actions


@pytest.mark.parametrize(
    "ranges, match",
    [
        ({(1, CHUNK): b"x"}, "multiple of chunk_tokens"),
        ({(0, CHUNK + 1): b"x"}, "span at most"),
        ({(0, 3): b"x", (CHUNK, 2 * CHUNK): b"y"}, "must be the last"),
        ({(0, 100 * CHUNK): b"x"}, "within"),
        ({(0, CHUNK): b""}, "non-empty"),
    ],
)
def test_put_chunks_rejects_bad_ranges(make_store, ranges, match) -> None:
    store = make_store()
    with pytest.raises(ValueError, match=match):
        store.put_chunks("tA", "s1", FP, _tokens(2 * CHUNK), ranges)


def test_put_chunks_rejects_bad_ids_and_tokens(make_store) -> None:
    store = make_store()
    with pytest.raises(ValueError, match="tenant"):
        store.put_chunks("", "s1", FP, _tokens(CHUNK), {(0, CHUNK): b"x"})
    with pytest.raises(ValueError, match="token ids"):
        store.put_chunks("tA", "s1", FP, [-1] * CHUNK, {(0, CHUNK): b"x"})
    with pytest.raises(ValueError, match="u32"):
        store.lookup("tA", FP, b"abc")
    with pytest.raises(ValueError, match="max_payload_bytes"):
        make_store(path=store.config.path + "2", max_payload_bytes=4).put_chunks(
            "tA", "s1", FP, _tokens(CHUNK), {(0, CHUNK): b"12345"}
        )


def test_longest_valid_prefix_wrong_fingerprint_is_absent(make_store) -> None:
    store = make_store()
    toks = _tokens(2 * CHUNK)
    store.put_chunks("tA", "s1", FP, toks, payloads_for(toks))
    got = store.longest_valid_prefix("tA", FP + "-other", toks)
    assert got.n_tokens == 0 and got.payloads == [] and got.miss.reason == MissReason.ABSENT


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "empty"])
def test_longest_valid_prefix_corrupt_value_is_a_miss_with_audit(make_store, damage) -> None:
    store = make_store()
    toks = _tokens(3 * CHUNK)
    pays = payloads_for(toks)
    store.put_chunks("tA", "s1", FP, toks, pays)
    second = store.lookup("tA", FP, toks).spans[1].address
    db = _raw_db(store)
    value = bytearray(db.get(CHUNK_PREFIX + second))
    if damage == "flip_payload":
        value[-40] ^= 0x10
    elif damage == "flip_header":
        value[20] ^= 0x01
    elif damage == "truncate":
        value = value[: len(value) // 2]
    else:
        value = bytearray()
    db.put(CHUNK_PREFIX + second, bytes(value))
    db.close()
    store = make_store()
    got = store.longest_valid_prefix("tA", FP, toks)
    assert got.n_tokens == CHUNK and got.payloads == [pays[(0, CHUNK)]]
    assert got.miss.reason == MissReason.CORRUPT and got.miss.at_token == CHUNK and got.miss.detail
    stats = store.stats()
    assert stats.misses["corrupt"] == 1 and sum(stats.corrupt_by_defect.values()) == 1
    records = [r for r in store.audit.iter_records() if r.action == AuditAction.READ_CORRUPT]
    assert len(records) == 1 and records[0].subject == f"chunk:{second.hex()}" and records[0].tenant == "tA"
    assert store.audit.verify().ok
    # The bad value is gone: the chunk can be stored again and then served.
    store.put_chunks("tA", "s1", FP, toks, {(CHUNK, 2 * CHUNK): b"fresh"})
    assert store.longest_valid_prefix("tA", FP, toks).n_tokens == 3 * CHUNK


def test_longest_valid_prefix_value_moved_to_other_tenant_key_is_a_miss(make_store) -> None:
    store = make_store()
    toks = _tokens(CHUNK)
    store.put_chunks("tA", "s1", FP, toks, {(0, CHUNK): b"secret-of-A"})
    store.put_chunks("tB", "s1", FP, toks, {(0, CHUNK): b"own-of-B"})
    a_addr = store.lookup("tA", FP, toks).spans[0].address
    b_addr = store.lookup("tB", FP, toks).spans[0].address
    assert a_addr != b_addr
    db = _raw_db(store)
    db.put(CHUNK_PREFIX + b_addr, db.get(CHUNK_PREFIX + a_addr))
    db.close()
    store = make_store()
    got = store.longest_valid_prefix("tB", FP, toks)
    assert got.payloads == [] and got.miss.reason == MissReason.CORRUPT
    assert got.miss.detail == "address_mismatch"
    assert store.longest_valid_prefix("tA", FP, toks).payloads == [b"secret-of-A"]


def test_value_header_names_tenant_and_fingerprint(make_store) -> None:
    store = make_store()
    toks = _tokens(CHUNK)
    store.put_chunks("tA", "s1", FP, toks, {(0, CHUNK): b"p"})
    addr = store.lookup("tA", FP, toks).spans[0].address
    value = store._db.get(CHUNK_PREFIX + addr)
    from storage.chunk_key import tenant_tag

    tag = tenant_tag(store._salts["tA"])
    header, _ = decode_chunk(value, address=addr, tenant_tag=tag, model_fingerprint=FP)
    assert (header.start, header.n_tokens, header.model_fingerprint) == (0, CHUNK, FP)
    assert header.ceiling_at - header.created_at == store.get_policy("tA").ceiling_s


def test_recovery_rebuilds_index_from_disk_and_removes_leftovers(make_store) -> None:
    store = make_store()
    toks = _tokens(2 * CHUNK + 2)
    pays = payloads_for(toks)
    store.put_chunks("tA", "s1", FP, toks, pays)
    before = store.stats()
    db = _raw_db(store)
    # A leftover that no atomic batch of ours can produce: an index entry whose value is gone.
    orphan_meta = b"M" + os.urandom(32)
    db.put(orphan_meta, db.get(next(k for k in db.keys() if k[:1] == b"M")))
    db.put(b"C" + os.urandom(32), b"stray value")
    db.close()
    store = make_store()
    assert store.recovery.chunks == before.chunks == 3
    assert store.recovery.bytes_stored == before.bytes_stored
    assert store.recovery.orphans_removed >= 2
    assert store.longest_valid_prefix("tA", FP, toks).payloads == [pays[r] for r in sorted(pays)]
    assert store._db.get(orphan_meta) is None


def test_store_refuses_foreign_database(tmp_path) -> None:
    path = tmp_path / "store" / "db"
    path.mkdir(parents=True)
    db = Rdict(str(path), Options(raw_mode=True))
    db.put(b"hello", b"world")
    db.close()
    with pytest.raises(StoreFormatError):
        GlobalKVStore(StoreConfig(path=str(tmp_path / "store")))


def test_store_config_validation() -> None:
    with pytest.raises(ValueError, match="compression ratios"):
        StoreConfig(path="x", chunk_tokens=100, compression_ratios=(4, 128))
    with pytest.raises(ValueError, match="unknown"):
        StoreConfig.from_json('{"version": 1, "path": "x", "nope": 1}')
    cfg = StoreConfig(path="x", chunk_tokens=256)
    assert StoreConfig.from_json(cfg.to_json()) == cfg


def test_longest_valid_prefix_value_deleted_under_the_index_is_corrupt(make_store) -> None:
    store = make_store()
    toks = _tokens(2 * CHUNK)
    store.put_chunks("tA", "s1", FP, toks, payloads_for(toks))
    second = store.lookup("tA", FP, toks).spans[1].address
    db = _raw_db(store)
    db.delete(CHUNK_PREFIX + second)
    db.close()
    store = make_store()
    # Recovery treats an index entry without its value as a leftover and removes it.
    assert store.recovery.orphans_removed > 0
    got = store.longest_valid_prefix("tA", FP, toks)
    assert got.n_tokens == CHUNK and got.miss.reason == MissReason.ABSENT
    # The same loss while the store is open is reported as corruption.
    store.put_chunks("tA", "s1", FP, toks, payloads_for(toks))
    store._db.delete(CHUNK_PREFIX + second)
    got = store.longest_valid_prefix("tA", FP, toks)
    assert got.miss.reason == MissReason.CORRUPT and got.miss.detail == "value_missing"


def test_longest_valid_prefix_returns_the_checksums_its_values_verified_against(make_store) -> None:
    import hashlib

    store = make_store()
    toks = list(range(3 * CHUNK + 5))
    store.put_chunks("tA", "s1", FP, toks, payloads_for(toks))
    got = store.longest_valid_prefix("tA", FP, toks)
    assert got.n_tokens == len(toks) and len(got.checksums) == len(got.payloads) == 4
    for span, checksum in zip(store.lookup("tA", FP, toks).spans, got.checksums, strict=True):
        value = store._db.get(b"C" + span.address)
        # the checksum closes the value: sha256 over everything before it
        assert value[-32:] == checksum == hashlib.sha256(value[:-32]).digest()


def test_longest_valid_prefix_spans_and_count_unstored_keep_lookup_first_counters(make_store) -> None:
    """`count_unstored=False` counts what the slow twin counted (`lookup` first, then the read only when
    it found a chunk), and `spans` are the lookup's: random stored, partly stored, diverging, unstored
    histories and unknown tenants."""
    import secrets

    rng = random.Random(secrets.randbits(64))
    store = make_store()
    stored = []
    for i in range(4):
        toks = _tokens(rng.randrange(1, 4 * CHUNK), seed=rng.randrange(1 << 30))
        store.put_chunks(rng.choice(["tA", "tB"]), f"s{i}", FP, toks, payloads_for(toks))
        stored.append(toks)

    def twin(tenant: str, toks: list[int]) -> None:
        if store.lookup(tenant, FP, toks).spans:
            store.longest_valid_prefix(tenant, FP, toks)

    for _ in range(40):
        base = rng.choice(stored)
        toks = rng.choice(
            [
                base,
                base + _tokens(rng.randrange(1, 2 * CHUNK), seed=rng.randrange(99)),
                base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(0, 99)] * rng.randrange(1, CHUNK),
                _tokens(rng.randrange(1, 3 * CHUNK), seed=rng.randrange(1 << 30)),
            ]
        )
        tenant = rng.choice(["tA", "tB", "tC"])
        before = store.stats()
        twin(tenant, toks)
        mid = store.stats()
        got = store.longest_valid_prefix(tenant, FP, toks, count_unstored=False)
        after = store.stats()
        assert got.spans == store.lookup(tenant, FP, toks).spans
        assert [(s.start, s.end) for s in got.spans[: len(got.ranges)]] == got.ranges
        assert after.chunk_hits - mid.chunk_hits == mid.chunk_hits - before.chunk_hits
        assert {k: after.misses[k] - mid.misses[k] for k in after.misses} == {
            k: mid.misses[k] - before.misses[k] for k in mid.misses
        }
        # counted by default: an unstored history is a miss at token 0
        if not got.spans:
            store.longest_valid_prefix(tenant, FP, toks)
            assert sum(store.stats().misses.values()) == sum(after.misses.values()) + 1


def test_indexed_prefix_reports_the_checksums_a_read_verifies(make_store, clock) -> None:
    """`indexed_prefix` against its slow twin, `longest_valid_prefix` (which reads and verifies every
    value): the same spans and miss, and each known checksum the one the read verified; a checksum is
    known from the write, forgotten with the entry, unknown after a restart until a read verifies it."""
    rng = random.Random(os.urandom(8))
    store = make_store()
    histories = []
    for s in range(4):
        toks = _tokens(rng.randrange(1, 5 * CHUNK), seed=rng.randrange(1 << 30))
        store.put_chunks("tA", f"s{s}", FP, toks, payloads_for(toks))
        histories.append(toks)
    for toks in histories:
        probe = toks + _tokens(3, seed=rng.randrange(1 << 30))
        fast, slow = store.indexed_prefix("tA", FP, probe), store.longest_valid_prefix("tA", FP, probe)
        assert fast.spans == slow.spans and fast.miss == slow.miss and fast.n_tokens == slow.n_tokens
        assert fast.checksums == slow.checksums  # known from the write, all of them
    hits = store.stats().chunk_hits
    store.indexed_prefix("tA", FP, histories[0])
    assert store.stats().chunk_hits == hits  # counts nothing: the caller reports what it served
    fast = store.indexed_prefix("tA", FP, histories[0])
    store.record_served(fast.spans, fast.miss)
    stats = store.stats()
    assert stats.chunk_hits == hits + len(fast.spans) and stats.unread_chunk_hits == len(fast.spans)

    # After a restart nothing is known until a read verifies it
    store.close()
    store = make_store()
    toks = histories[1]
    assert set(store.indexed_prefix("tA", FP, toks).checksums) == {None}
    slow = store.longest_valid_prefix("tA", FP, toks)
    assert store.indexed_prefix("tA", FP, toks).checksums == slow.checksums

    # A purged session's chunks are gone from the index, and their checksums with them
    store.purge_session("tA", "s1", actor="test")
    gone = store.indexed_prefix("tA", FP, toks)
    assert len(gone.checksums) == len(gone.spans) < len(slow.spans)
    # written anew: the new value's checksum (its header has the new times)
    clock.now += 10
    store.put_chunks("tA", "s1", FP, toks, payloads_for(toks))
    again = store.longest_valid_prefix("tA", FP, toks)
    assert store.indexed_prefix("tA", FP, toks).checksums == again.checksums != slow.checksums


def test_a_value_damaged_after_its_checksum_is_known_is_found_by_the_next_read(make_store) -> None:
    """What `indexed_prefix` knows is what was written, not what is on disk now: the next read still
    verifies the bytes, finds the damage and forgets the chunk."""
    store = make_store()
    toks = _tokens(2 * CHUNK)
    store.put_chunks("tA", "s1", FP, toks, payloads_for(toks))
    second = store.lookup("tA", FP, toks).spans[1].address
    value = bytearray(store._db.get(CHUNK_PREFIX + second))
    value[-40] ^= 0x10
    store._db.put(CHUNK_PREFIX + second, bytes(value))
    assert None not in store.indexed_prefix("tA", FP, toks).checksums
    got = store.longest_valid_prefix("tA", FP, toks)
    assert got.n_tokens == CHUNK and got.miss.reason == MissReason.CORRUPT
    assert len(store.indexed_prefix("tA", FP, toks).spans) == 1

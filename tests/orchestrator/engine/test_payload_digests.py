"""PayloadDigests against its slow twin (every payload hashed) on random chunk values, with repeats,
evictions and another writer's bytes of the same payload; and read_prefix's digests equal to hashing."""

from __future__ import annotations

import hashlib
import os
import random
import secrets

import pytest

from orchestrator.engine.payload_digests import PayloadDigests, payload_digests_reference
from storage import token_bytes
from storage.chunk_format import ChunkHeader, encode_chunk


def _value(payload: bytes, created_at: float) -> tuple[bytes, bytes]:
    header = ChunkHeader(
        address=os.urandom(32),
        tenant_tag=os.urandom(16),
        model_fingerprint="fp",
        start=0,
        n_tokens=8,
        created_at=created_at,
        floor_until=created_at,
        ceiling_at=created_at + 1,
        payload_len=len(payload),
    )
    value = encode_chunk(header, payload)
    return payload, value[-32:]


@pytest.mark.parametrize("max_entries", [0, 1, 3, 1 << 16])
def test_payload_digests_equal_the_reference_on_random_chunks(max_entries: int) -> None:
    rng = random.Random(secrets.randbits(64))
    digests = PayloadDigests(max_entries)
    # the same payload under two values (another writer's header): two checksums, one digest
    pool = []
    for _ in range(12):
        payload = os.urandom(rng.randrange(1, 3000))
        pool.append(_value(payload, rng.random()))
        if rng.random() < 0.3:
            pool.append(_value(payload, rng.random() + 5))
    for _ in range(200):
        picked = [rng.choice(pool) for _ in range(rng.randrange(0, 8))]
        payloads = [p for p, _ in picked]
        assert digests.of(payloads, [c for _, c in picked]) == payload_digests_reference(payloads)
        assert len(digests) <= max_entries
    assert digests.misses >= min(len({c for _, c in pool}), 1)
    if max_entries >= len(pool):
        assert digests.hits > 0


def test_payload_digests_refuse_mismatched_lists_and_negative_sizes() -> None:
    with pytest.raises(ValueError, match="2 payloads but 1 checksums"):
        PayloadDigests().of([b"a", b"b"], [b"x" * 32])
    with pytest.raises(ValueError, match="max_entries"):
        PayloadDigests(-1)


def test_read_prefix_payload_hashes_with_digests_equal_hashing(tmp_path) -> None:
    """Over a real node's stored history: read_prefix with digests (a second read hashes nothing) gives
    the payload hashes that hashing every blob gives."""
    from orchestrator.engine import TorchCompute
    from orchestrator.engine.global_kv import read_prefix
    from orchestrator.engine.prefix_reuse import find_reuse
    from tests.orchestrator.engine.node_harness import new_session, registry, run_turn, start_node

    rng = random.Random(secrets.randbits(64))
    models = registry()
    node = start_node(tmp_path, models)
    try:
        sid = new_session(node, "a")
        history: list[int] = []
        for n in (70, 9):
            ids = [rng.randrange(16, 512) for _ in range(n)]
            history += ids + run_turn(node, sid, ids, model="a").tokens
        store, sessions, served = node.service.store, node.service.ctx.sessions, models.get("a")
        args = dict(tenant="acme", served=served, history=history, compute=TorchCompute())
        plain = read_prefix(store, sessions, **args)
        expected = [hashlib.sha256(b).digest() for b in plain.blobs]
        digests = PayloadDigests()
        for _ in range(2):
            fast = read_prefix(store, sessions, digests=digests, **args)
            assert fast.ranges == plain.ranges and fast.blobs == plain.blobs and len(expected) >= 2
            assert fast.payload_hashes() == expected == plain.payload_hashes()
        assert digests.hits == digests.misses == len(expected)
        # the history's ids handed in encoded give the same prefix; ids of another length are refused
        held = read_prefix(store, sessions, history_ids=token_bytes(history), **args)
        assert held.ranges == plain.ranges and held.blobs == plain.blobs and held.n_tokens == plain.n_tokens
        with pytest.raises(ValueError, match=f"hold {4 * len(history) - 4} bytes for {len(history)} tokens"):
            read_prefix(store, sessions, history_ids=token_bytes(history[:-1]), **args)
        # find_reuse likewise: the turn hands in the ids it read (the turn rows' blobs)
        reuse_args = dict(
            tenant="acme", session_id=sid, served=served, history=history, new_tokens=[17, 18], last_model="a"
        )
        pool, compute = node.service.pool, TorchCompute()
        plain_reuse = find_reuse(store, pool, sessions, compute, **reuse_args)
        ids = token_bytes(history)
        held_reuse = find_reuse(store, pool, sessions, compute, history_ids=ids, **reuse_args)
        assert held_reuse.prefix.ranges == plain_reuse.prefix.ranges and plain_reuse.prefix.n_tokens > 0
        assert held_reuse.pool == plain_reuse.pool and held_reuse.source_session == plain_reuse.source_session
        with pytest.raises(ValueError, match=f"hold {4 * len(history) + 4} bytes for {len(history)} tokens"):
            find_reuse(store, pool, sessions, compute, history_ids=token_bytes(history + [5]), **reuse_args)
    finally:
        node.stop()


def test_known_and_remember_hash_nothing() -> None:
    """`known` answers only from what is kept (all or None) and `remember` keeps a digest the writer
    computed: the next turn proves a chunk it wrote without reading or hashing it."""
    digests = PayloadDigests(4)
    payloads = [_value(os.urandom(100), float(i)) for i in range(6)]
    assert digests.known([c for _, c in payloads[:2]]) is None
    for payload, checksum in payloads:
        digests.remember(checksum, hashlib.sha256(payload).digest())
    assert len(digests) == 4 and digests.known([payloads[0][1]]) is None  # the oldest two went
    got = digests.known([c for _, c in payloads[2:]])
    assert got == payload_digests_reference([p for p, _ in payloads[2:]])
    assert digests.known([]) == [] and digests.misses == 0
    assert PayloadDigests(0).known([payloads[0][1]]) is None
    none = PayloadDigests(0)
    none.remember(payloads[0][1], b"x" * 32)
    assert len(none) == 0

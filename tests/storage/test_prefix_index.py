"""WindowPool.find_prefix and its PrefixIndex: against a linear scan of every pooled history (the slow
twin, `longest_prefix_by_scan`) on random histories that share prefixes, and the pool's lifecycle rules
(TTL, budget eviction, discard of a session, a tenant or a namespace) applied to the index."""

from __future__ import annotations

import random

import pytest

from storage import (
    ContentKey,
    PoolConfig,
    PrefixIndex,
    WindowPool,
    history_digest,
    longest_prefix_by_scan,
    prefix_digests,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _pool(budget: int = 1 << 20, ttl: float = 60.0) -> tuple[WindowPool, Clock]:
    clock = Clock()
    return WindowPool(PoolConfig(budget_bytes=budget, ttl_s=ttl), clock=clock), clock


def test_history_digest_matches_prefix_digests() -> None:
    ids = [5, 70000, 0, 2**32 - 1, 9]
    got = prefix_digests(ids, [1, 3, 5, 6])
    assert got == {n: history_digest(ids[:n]) for n in (1, 3, 5)}
    with pytest.raises(ValueError, match="ints in"):
        history_digest([-1])


def test_content_key_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="n_tokens=0"):
        ContentKey(namespace="fp", n_tokens=0, digest=bytes(32))
    with pytest.raises(ValueError, match="digest must be 32 bytes"):
        ContentKey(namespace="fp", n_tokens=3, digest=b"x")
    with pytest.raises(ValueError, match="namespace"):
        ContentKey(namespace="", n_tokens=3, digest=bytes(32))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_find_prefix_matches_linear_scan_on_random_histories(seed: int) -> None:
    rng = random.Random(seed)
    pool, _ = _pool()
    # A few stems, each history a stem plus a random extension: many share long prefixes, some are
    # prefixes of others, some are equal (two sessions with one history).
    stems = [[rng.randrange(8) for _ in range(rng.randrange(1, 40))] for _ in range(4)]
    live: dict[str, list[int]] = {}
    for i in range(60):
        stem = rng.choice(stems)
        cut = rng.randrange(1, len(stem) + 1)
        history = stem[:cut] + [rng.randrange(8) for _ in range(rng.randrange(0, 20))]
        if rng.random() < 0.15 and live:
            history = list(rng.choice(list(live.values())))
        session = f"s{i % 45}"  # some sessions are put again: their old history leaves the index
        pool.put("acme", session, b"w" * 10, content=ContentKey.of("fp", history))
        live[session] = history
        if rng.random() < 0.1:
            gone = rng.choice(list(live))
            pool.discard("acme", gone)
            del live[gone]
    assert pool.indexed() == len(live)
    for _ in range(200):
        stem = rng.choice(stems + list(live.values()))
        prompt = stem[: rng.randrange(0, len(stem) + 1)] + [
            rng.randrange(8) for _ in range(rng.randrange(0, 10))
        ]
        limit = rng.randrange(0, len(prompt) + 2)
        n, sessions = longest_prefix_by_scan(live.items(), prompt, limit)
        got = pool.find_prefix("acme", "fp", prompt, max_tokens=limit)
        if n == 0:
            assert got is None
        else:
            assert got is not None and got.n_tokens == n and got.session in sessions
            assert got.value == b"w" * 10
            assert got.digest == history_digest(prompt[:n])  # the digest the turn reuses


def test_find_prefix_is_per_tenant_and_per_namespace() -> None:
    pool, _ = _pool()
    history = [1, 2, 3, 4]
    pool.put("acme", "a", b"acme", content=ContentKey.of("fp1", history))
    assert pool.find_prefix("globex", "fp1", history + [5]) is None
    assert pool.find_prefix("acme", "fp2", history + [5]) is None
    got = pool.find_prefix("acme", "fp1", history + [5])
    assert got is not None and (got.session, got.n_tokens, got.value) == ("a", 4, b"acme")
    # bytes input (u32 little-endian) is the same prompt
    raw = b"".join(t.to_bytes(4, "little") for t in history + [5])
    assert pool.find_prefix("acme", "fp1", raw) == got
    # an entry put without a content key is not found by content
    pool.put("acme", "plain", b"x")
    assert pool.indexed() == 1


def test_find_prefix_skips_expired_entries_and_refreshes_the_found_one() -> None:
    pool, clock = _pool(ttl=10.0)
    pool.put("acme", "short", b"s", content=ContentKey.of("fp", [1, 2]))
    clock.now = 5.0
    pool.put("acme", "long", b"l", content=ContentKey.of("fp", [1, 2, 3]))
    clock.now = 12.0  # "short" expired (put at 0), "long" alive (put at 5)
    got = pool.find_prefix("acme", "fp", [1, 2, 3, 4])
    assert got is not None and got.session == "long"
    assert pool.find_prefix("acme", "fp", [1, 2, 9]) is None  # "short" expired: dropped, not returned
    assert pool.indexed() == 1
    clock.now = 21.0  # refreshed at 12 by the hit: alive until 22
    assert pool.find_prefix("acme", "fp", [1, 2, 3, 4]) is not None
    clock.now = 40.0
    assert pool.find_prefix("acme", "fp", [1, 2, 3, 4]) is None
    assert pool.indexed() == 0 and pool.stats().entries == 0


def test_budget_eviction_and_replacement_leave_the_index() -> None:
    pool, _ = _pool(budget=25)
    pool.put("acme", "a", b"x" * 10, content=ContentKey.of("fp", [1]))
    pool.put("acme", "b", b"x" * 10, content=ContentKey.of("fp", [1, 2]))
    pool.put("acme", "c", b"x" * 10, content=ContentKey.of("fp", [1, 2, 3]))  # evicts "a"
    assert pool.find_prefix("acme", "fp", [1, 9]) is None
    assert pool.indexed() == 2
    # a session's new entry replaces its old history in the index
    pool.put("acme", "b", b"y" * 10, content=ContentKey.of("fp", [7, 7]))
    assert pool.find_prefix("acme", "fp", [1, 2, 9]) is None
    got = pool.find_prefix("acme", "fp", [7, 7, 7])
    assert got is not None and got.value == b"y" * 10
    # a refused put drops the session's old entry and indexes nothing
    assert not pool.put("acme", "b", b"z" * 26, content=ContentKey.of("fp", [8])).stored
    assert pool.find_prefix("acme", "fp", [7, 7, 7]) is None and pool.indexed() == 1


def test_discard_tenant_and_namespace_clear_the_index() -> None:
    pool, _ = _pool()
    pool.put("acme", "a", b"1", content=ContentKey.of("fp1", [1, 2]))
    pool.put("acme", "b", b"2", content=ContentKey.of("fp2", [1, 2]))
    pool.put("globex", "c", b"3", content=ContentKey.of("fp1", [1, 2]))
    assert pool.discard_namespace("fp1", tenant="acme") == 1
    assert pool.find_prefix("acme", "fp1", [1, 2, 3]) is None
    assert pool.find_prefix("globex", "fp1", [1, 2, 3]) is not None
    assert pool.discard_tenant("acme") == 1
    assert pool.find_prefix("acme", "fp2", [1, 2, 3]) is None
    assert pool.discard_namespace("fp1") == 1
    assert pool.indexed() == 0 and pool.stats().entries == 0


def test_prefix_index_lengths_stay_consistent() -> None:
    index = PrefixIndex()
    k3, k3b, k5 = ContentKey.of("n", [1, 2, 3]), ContentKey.of("n", [4, 5, 6]), ContentKey.of("n", [1] * 5)
    index.add("t", "a", k3)
    index.add("t", "b", k3b)
    index.add("t", "c", k5)
    index.add("t", "c", k5)  # idempotent
    assert index.lengths("t", "n", 10) == [3, 5] and index.lengths("t", "n", 4) == [3]
    index.remove("t", "a", k3)
    assert index.lengths("t", "n", 10) == [3, 5]  # "b" still holds a 3-token history
    index.remove("t", "b", k3b)
    index.remove("t", "b", k3b)  # idempotent
    assert index.lengths("t", "n", 10) == [5]
    index.remove("t", "c", k5)
    assert index.lengths("t", "n", 10) == [] and len(index) == 0

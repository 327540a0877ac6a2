"""WindowPool: byte budget with LRU, TTL on an injected clock, tenant-scoped keys, thread safety."""

from __future__ import annotations

import os
import random
import threading

import pytest

from storage import PoolConfig, PoolMiss, WindowPool
from storage.window_pool import default_budget_bytes
from tests.storage.conftest import FakeClock


def test_window_pool_get_put_replace() -> None:
    pool = WindowPool(PoolConfig(budget_bytes=1000, ttl_s=60), clock=FakeClock())
    assert pool.get("tA", "s1") == PoolMiss.ABSENT
    assert pool.put("tA", "s1", b"abc").stored
    assert pool.get("tA", "s1") == b"abc"
    pool.put("tA", "s1", b"defg")
    assert pool.get("tA", "s1") == b"defg" and pool.stats().bytes_used == 4
    assert pool.get("tB", "s1") == PoolMiss.ABSENT, "another tenant's session of the same id is invisible"


def test_window_pool_lru_under_budget() -> None:
    pool = WindowPool(PoolConfig(budget_bytes=300, ttl_s=60), clock=FakeClock())
    for s in ("a", "b", "c"):
        pool.put("t", s, bytes(100))
    assert pool.get("t", "a") == bytes(100)  # a becomes most recent
    res = pool.put("t", "d", bytes(150))
    assert res.stored and res.evicted == 2
    assert pool.get("t", "b") == PoolMiss.ABSENT and pool.get("t", "c") == PoolMiss.ABSENT
    assert pool.get("t", "a") == bytes(100) and pool.get("t", "d") == bytes(150)
    assert pool.stats().bytes_used == 250 and pool.stats().evicted_lru == 2
    refused = pool.put("t", "huge", bytes(301))
    assert not refused.stored and "budget" in refused.reason and pool.stats().refused == 1


def test_window_pool_ttl_with_injected_clock() -> None:
    clock = FakeClock(0.0)
    pool = WindowPool(PoolConfig(budget_bytes=1000, ttl_s=300), clock=clock)
    pool.put("t", "s", b"x")
    clock.advance(299)
    assert pool.get("t", "s") == b"x"  # refreshes the TTL
    clock.advance(299)
    assert pool.get("t", "s") == b"x"
    clock.advance(300)
    assert pool.get("t", "s") == PoolMiss.EXPIRED
    pool.put("t", "s2", b"y")
    clock.advance(301)
    assert pool.sweep() == 1 and pool.stats().entries == 0 and pool.stats().bytes_used == 0


def test_window_pool_discard_and_discard_tenant() -> None:
    pool = WindowPool(PoolConfig(budget_bytes=1000), clock=FakeClock())
    pool.put("tA", "1", b"a")
    pool.put("tA", "2", b"b")
    pool.put("tB", "1", b"c")
    assert pool.discard("tA", "1") and not pool.discard("tA", "1")
    assert pool.discard_tenant("tA") == 1
    assert pool.get("tB", "1") == b"c"


def test_window_pool_config_validation_and_default_budget() -> None:
    with pytest.raises(ValueError, match="budget_bytes"):
        PoolConfig(budget_bytes=0)
    with pytest.raises(ValueError, match="ttl_s"):
        PoolConfig(ttl_s=0)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert default_budget_bytes() == int(ram * 0.10)
    assert WindowPool().stats().budget_bytes == int(ram * 0.10)
    with pytest.raises(ValueError):
        WindowPool().put("", "s", b"x")


def test_window_pool_concurrent_use_keeps_budget() -> None:
    pool = WindowPool(PoolConfig(budget_bytes=5000, ttl_s=60), clock=FakeClock())
    errors: list[str] = []

    def worker(w: int) -> None:
        rng = random.Random(w)
        for _ in range(400):
            s = str(rng.randrange(30))
            if rng.random() < 0.5:
                value = bytes([w]) * rng.randrange(1, 400)
                pool.put(f"t{w % 2}", s, value)
            else:
                got = pool.get(f"t{w % 2}", s)
                if isinstance(got, bytes) and len(set(got)) > 1:
                    errors.append("torn value")
            if pool.stats().bytes_used > 5000:
                errors.append("over budget")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = pool.stats()
    assert stats.bytes_used <= 5000 and stats.entries <= 60

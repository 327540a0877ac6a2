"""Damage at open and while serving: nothing readable is deleted, a damaged database is quarantined
(moved aside whole, audited, counted, purged, expired), health says why, a newer format refuses, and
`check_store` / `repair_store` do the same offline."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
from rocksdict import Options, Rdict

from storage import (
    AuditAction,
    CheckStatus,
    GlobalKVStore,
    HealthReason,
    RetentionPolicy,
    StoreConfig,
    StoreDamagedError,
    StoreLockedError,
    StoreVersionError,
    check_store,
    open_store,
    repair_store,
)
from storage.store_health import WriteHealth
from tests.storage.conftest import CHUNK, FP, payloads_for


def _cfg(root: Path, **kw: object) -> StoreConfig:
    return StoreConfig(path=str(root), chunk_tokens=CHUNK, compression_ratios=(4,), **kw)  # type: ignore[arg-type]


def _fill(root: Path, *, sessions: int = 20, clock=None, **kw: object) -> dict[str, list[int]]:
    rng = random.Random(7)
    hist: dict[str, list[int]] = {}
    store = GlobalKVStore(_cfg(root, **kw), clock=clock or time.time)
    for i in range(sessions):
        toks = [rng.randrange(1, 9999) for _ in range(4 * CHUNK + 3)]
        assert store.put_chunks("tA", f"s{i}", FP, toks, payloads_for(toks, size=2000)).persisted
        hist[f"s{i}"] = toks
    store.close()
    return hist


def _flip_sst(root: Path, flips: int = 4, seed: int = 0) -> None:
    rng = random.Random(seed)
    sst = max((root / "db").glob("*.sst"), key=lambda p: p.stat().st_size)
    data = bytearray(sst.read_bytes())
    for _ in range(flips):
        data[rng.randrange(len(data) // 10, len(data) * 9 // 10)] ^= 1 << rng.randrange(8)
    sst.write_bytes(bytes(data))


def _files(root: Path, pattern: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((root / "db").glob(pattern))}


def test_open_after_unreadable_sst_deletes_nothing(tmp_path: Path) -> None:
    # Issue 13 item 4: four bit flips in the single SST once made recovery delete 42-70 keys.
    root = tmp_path / "s"
    _fill(root)
    _flip_sst(root)
    ssts = _files(root, "*.sst")
    with pytest.raises(StoreDamagedError, match="checksum mismatch|Corruption"):
        GlobalKVStore(_cfg(root))
    assert _files(root, "*.sst") == ssts
    # No batch was written: every WAL the failed open left is empty.
    assert all(not data for data in _files(root, "*.log").values())


def test_open_store_quarantines_damage_and_starts_empty(tmp_path: Path) -> None:
    root = tmp_path / "s"
    hist = _fill(root)
    _flip_sst(root)
    store = open_store(_cfg(root))
    try:
        entry = store.quarantined_at_open
        assert entry is not None and entry.reason == "damaged_at_open" and "Corruption" in entry.detail
        assert (entry.path / "db").is_dir() and any((entry.path / "db").glob("*.sst"))
        assert store.stats().chunks == 0
        assert store.longest_valid_prefix("tA", FP, hist["s0"]).n_tokens == 0
        health = store.health()
        assert not health.serving and health.reasons == (HealthReason.QUARANTINED,)
        # RocksDB may still append to the LOG of the closed copy, so its size only grows.
        assert health.quarantined_stores == 1 and health.quarantined_bytes >= entry.nbytes > 0
        first = next(iter(store.audit.iter_records()))
        assert first.action == AuditAction.QUARANTINE and first.subject == f"store:quarantine/{entry.name}"
        assert first.nbytes == entry.nbytes
        # The empty store works.
        toks = hist["s1"]
        assert store.put_chunks("tA", "s1", FP, toks, payloads_for(toks)).persisted
    finally:
        store.close()
    again = open_store(_cfg(root))
    try:
        assert again.quarantined_at_open is None and again.stats().chunks == 5
        assert again.health().reasons == (HealthReason.QUARANTINED,)
    finally:
        again.close()


def test_newer_format_refuses_with_nothing_moved(tmp_path: Path) -> None:
    root = tmp_path / "s"
    _fill(root, sessions=2)
    db = Rdict(str(root / "db"), Options(raw_mode=True))
    db.put(b"V", b"kvresume-store-7")
    db.close()
    with pytest.raises(StoreVersionError, match="kvresume-store-7"):
        open_store(_cfg(root))
    assert not (root / "quarantine").exists()
    assert check_store(_cfg(root)).status == CheckStatus.NEWER_VERSION


def test_read_error_while_serving_degrades_then_quarantines_at_next_open(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = open_store(_cfg(root))
    rng = random.Random(3)
    hist = {}
    for i in range(30):
        toks = [rng.randrange(1, 9999) for _ in range(4 * CHUNK + 3)]
        assert store.put_chunks("tA", f"s{i}", FP, toks, payloads_for(toks, size=3000)).persisted
        hist[f"s{i}"] = toks
    # Written straight to a new SST, never read: the block cache holds none of its blocks.
    store._db.flush(True)
    sst = max((root / "db").glob("*.sst"), key=lambda p: p.stat().st_size)
    os.truncate(sst, sst.stat().st_size // 3)
    misses = [store.longest_valid_prefix("tA", FP, h).miss for h in hist.values()]
    assert any(m is not None and m.detail == "read_error" for m in misses)
    assert store.health().reasons == (HealthReason.READ_ERROR,)
    store.close()
    assert check_store(_cfg(root)).status == CheckStatus.DAMAGED
    reopened = open_store(_cfg(root))
    try:
        assert reopened.quarantined_at_open is not None
        assert reopened.quarantined_at_open.reason == "read_error_while_serving"
        assert reopened.health().reasons == (HealthReason.QUARANTINED,)
    finally:
        reopened.close()


def test_quarantined_copy_counts_against_capacity_and_goes_first(tmp_path: Path) -> None:
    root = tmp_path / "s"
    _fill(root, sessions=10)
    _flip_sst(root)
    store = open_store(_cfg(root))
    entry = store.quarantined_at_open
    store.close()
    assert entry is not None
    # Room for the new write only if the quarantined copy's bytes are freed.
    store = GlobalKVStore(_cfg(root, capacity_bytes=entry.nbytes + 1000))
    try:
        toks = list(range(1, CHUNK + 1))
        got = store.put_chunks("tB", "s", FP, toks, payloads_for(toks, size=600))
        assert got.persisted and not entry.path.exists()
        assert store.health().serving
        records = [r for r in store.audit.iter_records() if r.action == AuditAction.QUARANTINE]
        assert [r.reason for r in records] == ["damaged_at_open", "removed_capacity"]
    finally:
        store.close()


def test_purge_and_ceiling_remove_quarantined_copies(tmp_path: Path, clock) -> None:
    # The quarantine stamp is wall time; the store's clock starts there too.
    clock.now = time.time()
    for how in ("purge", "ceiling"):
        root = tmp_path / how
        _fill(root, sessions=4)
        _flip_sst(root)
        store = open_store(_cfg(root), clock=clock)
        try:
            entry = store.quarantined_at_open
            assert entry is not None
            if how == "purge":
                store.purge_session("tZ", "nobody", actor="admin:test")
                store.purge_tenant("tA", actor="admin:test")
            else:
                store.set_policy("tA", RetentionPolicy(ceiling_s=40 * 86400.0), actor="admin:test")
                # The longest ceiling of any policy (40 days) bounds every chunk in the copy.
                clock.now = entry.quarantined_at + 39 * 86400.0
                store.run_maintenance()
                assert entry.path.exists()
                clock.now = entry.quarantined_at + 40 * 86400.0 + 1
                store.run_maintenance()
            assert not entry.path.exists() and store.health().serving
            reasons = [r.reason for r in store.audit.iter_records() if r.action == AuditAction.QUARANTINE]
            assert reasons == [
                "damaged_at_open",
                "removed_purge" if how == "purge" else "removed_past_ceiling",
            ]
        finally:
            store.close()


def test_check_and_repair_offline(tmp_path: Path) -> None:
    root = tmp_path / "s"
    _fill(root, sessions=4)
    ok = check_store(_cfg(root))
    assert ok.status == CheckStatus.OK and ok.chunks == 20 and ok.audit_ok and ok.entries > 20
    _flip_sst(root)
    bad = check_store(_cfg(root))
    assert bad.status == CheckStatus.DAMAGED and "Corruption" in bad.detail and not bad.healthy
    sst = _files(root, "*.sst")
    assert check_store(_cfg(root)).status == CheckStatus.DAMAGED and _files(root, "*.sst") == sst
    repaired = repair_store(_cfg(root), actor="admin:test")
    assert repaired.quarantined is not None and [q.name for q in repaired.removed] == [
        repaired.quarantined.name
    ]
    after = check_store(_cfg(root))
    assert after.status == CheckStatus.OK and after.chunks == 0 and after.quarantined == []
    assert check_store(_cfg(tmp_path / "never")).status == CheckStatus.EMPTY


def test_write_health_needs_consecutive_failures() -> None:
    health = WriteHealth(threshold=3)
    for _ in range(2):
        health.failed("No space left on device")
    assert not health.failing
    health.ok()
    for _ in range(3):
        health.failed("No space left on device")
    assert health.failing and health.last_error == "No space left on device"
    health.ok()
    assert not health.failing and health.failures == 0
    with pytest.raises(ValueError, match="threshold"):
        WriteHealth(threshold=0)


def test_a_store_open_elsewhere_is_locked_not_damaged(tmp_path: Path) -> None:
    root = tmp_path / "s"
    _fill(root, sessions=2)
    live = GlobalKVStore(_cfg(root))
    try:
        # A second serve on the same data_dir, or a repair while the node runs: refused, nothing moved.
        with pytest.raises(StoreLockedError, match="open elsewhere"):
            open_store(_cfg(root))
        with pytest.raises(StoreLockedError):
            repair_store(_cfg(root))
        assert not (root / "quarantine").exists() and live.stats().chunks == 10
        # A read-only check takes no lock.
        assert check_store(_cfg(root)).status == CheckStatus.OK
    finally:
        live.close()

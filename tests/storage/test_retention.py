"""Retention: ceiling (served never after, gone from disk), floor, capacity, purges, residency,
clock skew, policy changes, checkpoints; each with its audit records."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from storage import AuditAction, MissReason, RefusalKind, RetentionPolicy
from tests.storage.conftest import CHUNK, FP, payloads_for

HOUR = 3600.0


def _toks(seed: int, n: int = 2 * CHUNK) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 100_000 for i in range(n)]


def _files_containing(root: Path, marker: bytes) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file() and marker in path.read_bytes():
            hits.append(str(path.relative_to(root)))
    return hits


def _actions(store) -> list[AuditAction]:
    return [r.action for r in store.audit.iter_records()]


def test_ceiling_never_served_after_and_marker_gone_from_disk(make_store, clock) -> None:
    store = make_store()
    store.set_policy("tA", RetentionPolicy(floor_s=HOUR, ceiling_s=2 * HOUR), actor="admin")
    marker = b"MARKER-" + os.urandom(16).hex().encode()
    toks = _toks(1)
    store.put_chunks("tA", "s1", FP, toks, {(0, CHUNK): marker * 20, (CHUNK, 2 * CHUNK): os.urandom(64)})
    keep = _toks(2)
    store.put_chunks("tA", "s2", FP, keep, payloads_for(keep))
    store.create_checkpoint("before-ceiling")
    store._db.flush(True)
    root = Path(store.config.path)
    assert _files_containing(root, marker), "the marker must be on disk before the ceiling"
    clock.advance(HOUR)
    store.put_chunks("tA", "s2", FP, keep + _toks(3, CHUNK), {(2 * CHUNK, 3 * CHUNK): b"later"})
    clock.advance(HOUR)
    # Past the ceiling and before any maintenance: never served.
    got = store.longest_valid_prefix("tA", FP, toks)
    assert got.payloads == [] and got.miss.reason == MissReason.EXPIRED
    report = store.run_maintenance()
    assert report.expired_chunks == 4 and report.checkpoints_removed == 1
    assert _files_containing(root, marker) == []
    assert store.list_checkpoints() == []
    # The chunk stored later is untouched.
    assert store.longest_valid_prefix("tA", FP, keep + _toks(3, CHUNK)).miss.reason == MissReason.ABSENT
    assert store.stats().chunks == 1
    assert _actions(store).count(AuditAction.EXPIRE) == 4 and store.audit.verify().ok


def test_ceiling_physical_deletion_by_background_maintenance(make_store, clock) -> None:
    import time

    store = make_store(maintenance_interval_s=0.05)
    store.set_policy("tA", RetentionPolicy(floor_s=0, ceiling_s=10), actor="admin")
    marker = b"BGMARK-" + os.urandom(8).hex().encode()
    store.put_chunks("tA", "s1", FP, _toks(1), {(0, CHUNK): marker * 10})
    store.start_maintenance()
    clock.advance(11)
    deadline = time.monotonic() + 10
    while store.stats().chunks and time.monotonic() < deadline:
        time.sleep(0.05)
    store.stop_maintenance()
    assert store.stats().chunks == 0
    assert _files_containing(Path(store.config.path), marker) == []


def test_clock_stepping_back_cannot_revive_expired_chunk(make_store, clock) -> None:
    store = make_store()
    store.set_policy("tA", RetentionPolicy(floor_s=0, ceiling_s=HOUR), actor="admin")
    toks = _toks(1)
    store.put_chunks("tA", "s1", FP, toks, payloads_for(toks))
    start = clock.now
    clock.advance(HOUR + 1)
    assert store.lookup("tA", FP, toks).miss.reason == MissReason.EXPIRED
    clock.now = start - 10 * HOUR  # clock skew: the wall clock jumps back
    assert store.longest_valid_prefix("tA", FP, toks).miss.reason == MissReason.EXPIRED
    # The high-water mark survives a restart.
    path = store.config.path
    store.close()
    store = make_store(path=path)
    assert store.recovery.clock_high_water >= start + HOUR + 1
    assert store.lookup("tA", FP, toks).miss.reason == MissReason.EXPIRED
    assert store.run_maintenance().expired_chunks == 2


def test_clock_jumping_forward_expires_but_never_serves_stale(make_store, clock) -> None:
    store = make_store()
    toks = _toks(1)
    store.put_chunks("tA", "s1", FP, toks, payloads_for(toks))
    clock.advance(10 * 365 * 24 * HOUR)
    assert store.longest_valid_prefix("tA", FP, toks).payloads == []


def test_floor_protects_and_capacity_refuses_with_reason(make_store, clock) -> None:
    store = make_store(capacity_bytes=3 * 300)
    store.set_policy("tA", RetentionPolicy(floor_s=HOUR, ceiling_s=10 * HOUR), actor="admin")
    a, b = _toks(1), _toks(2)
    assert store.put_chunks("tA", "s1", FP, a, payloads_for(a, size=200)).persisted
    res = store.put_chunks("tA", "s2", FP, b, payloads_for(b, size=200))
    assert not res.persisted and res.refusal.kind == RefusalKind.CAPACITY
    assert "floor" in res.refusal.message and res.stored == []
    assert store.longest_valid_prefix("tA", FP, a).n_tokens == 2 * CHUNK, (
        "nothing inside its floor is evicted"
    )
    assert store.stats().refusals["capacity"] == 1 and AuditAction.REFUSE in _actions(store)
    # Past the floor, least recently used chunks are evicted first.
    clock.advance(HOUR + 1)
    res = store.put_chunks("tA", "s2", FP, b, payloads_for(b, size=200))
    assert res.persisted and res.evicted_chunks == 2
    assert store.lookup("tA", FP, a).n_tokens == 0
    assert _actions(store).count(AuditAction.EVICT) == 2
    assert store.stats().bytes_stored <= 3 * 300


def test_eviction_order_is_least_recently_used(make_store, clock) -> None:
    store = make_store(capacity_bytes=4 * 360)  # four 350-byte values
    store.set_policy("tA", RetentionPolicy(floor_s=0, ceiling_s=10 * HOUR), actor="admin")
    a, b, c = _toks(1), _toks(2), _toks(3)
    store.put_chunks("tA", "s1", FP, a, payloads_for(a, size=200))
    store.put_chunks("tA", "s2", FP, b, payloads_for(b, size=200))
    assert store.longest_valid_prefix("tA", FP, a).n_tokens == 2 * CHUNK  # a is now most recent
    store.put_chunks("tA", "s3", FP, c, payloads_for(c, size=200))
    assert store.lookup("tA", FP, a).n_tokens == 2 * CHUNK
    assert store.lookup("tA", FP, b).n_tokens == 0


def test_floor_longer_than_ceiling_ceiling_wins(make_store, clock) -> None:
    store = make_store()
    policy = RetentionPolicy(floor_s=72 * HOUR, ceiling_s=HOUR)
    assert policy.effective_floor_s == HOUR
    store.set_policy("tA", policy, actor="admin")
    toks = _toks(1)
    store.put_chunks("tA", "s1", FP, toks, payloads_for(toks))
    clock.advance(HOUR)
    assert store.lookup("tA", FP, toks).miss.reason == MissReason.EXPIRED
    assert store.run_maintenance().expired_chunks == 2


def test_set_policy_shorter_ceiling_applies_to_stored_chunks(make_store, clock) -> None:
    store = make_store()
    toks = _toks(1)
    store.put_chunks("tA", "s1", FP, toks, payloads_for(toks))
    clock.advance(2 * HOUR)
    store.set_policy("tA", RetentionPolicy(floor_s=0, ceiling_s=HOUR), actor="admin")
    assert store.lookup("tA", FP, toks).miss.reason == MissReason.EXPIRED
    assert store.run_maintenance().expired_chunks == 2
    rec = [r for r in store.audit.iter_records() if r.action == AuditAction.POLICY_CHANGE][-1]
    assert rec.actor == "admin" and "ceiling_s=3600.0" in rec.reason


def test_purge_session_keeps_shared_chunks(make_store) -> None:
    store = make_store()
    shared = _toks(1, CHUNK)
    own1 = shared + _toks(2, CHUNK)
    own2 = shared + _toks(3, CHUNK)
    store.put_chunks("tA", "s1", FP, own1, payloads_for(own1))
    store.put_chunks("tA", "s2", FP, own2, payloads_for(own2))
    assert store.stats().chunks == 3
    res = store.purge_session("tA", "s1", actor="admin")
    assert res.chunks_deleted == 1 and res.bytes_deleted > 0
    assert store.lookup("tA", FP, own1).n_tokens == CHUNK
    assert store.lookup("tA", FP, own2).n_tokens == 2 * CHUNK
    assert store.session_chunks("tA", "s1") == 0
    res = store.purge_session("tA", "s2", actor="admin")
    assert res.chunks_deleted == 2 and store.stats().chunks == 0


def test_purge_tenant_removes_every_byte_checkpoints_included(make_store) -> None:
    store = make_store()
    marker = b"TENANTMARK-" + os.urandom(8).hex().encode()
    a = _toks(1)
    store.put_chunks("tA", "s1", FP, a, {(0, CHUNK): marker * 10, (CHUNK, 2 * CHUNK): marker * 10})
    store.put_chunks("tB", "s1", FP, a, payloads_for(a))
    store.create_checkpoint("nightly")
    root = Path(store.config.path)
    assert _files_containing(root / "checkpoints", marker)
    res = store.purge_tenant("tA", actor="admin", reason="gdpr_erasure")
    assert res.chunks_deleted == 2 and res.checkpoints_removed == 1
    assert _files_containing(root, marker) == []
    assert store.lookup("tA", FP, a).n_tokens == 0
    assert store.lookup("tB", FP, a).n_tokens == 2 * CHUNK
    # The tenant's salt is gone: a new write starts a new chain that cannot reach any remnant.
    assert "tA" not in store._salts
    purge = [r for r in store.audit.iter_records() if r.subject == "tenant:tA"]
    assert purge[-1].reason == "gdpr_erasure" and purge[-1].nbytes == res.bytes_deleted


def test_purge_model_removes_that_fingerprint_only(make_store) -> None:
    store = make_store()
    a = _toks(1)
    store.put_chunks("tA", "s1", FP, a, payloads_for(a))
    store.put_chunks("tB", "s1", FP, a, payloads_for(a))
    store.put_chunks("tA", "s1", "other-fp", a, payloads_for(a))
    res = store.purge_model(FP, actor="admin")
    assert res.chunks_deleted == 4
    assert store.lookup("tA", "other-fp", a).n_tokens == 2 * CHUNK
    assert store.lookup("tB", FP, a).n_tokens == 0


def test_purge_model_for_one_tenant_removes_its_bytes_and_keeps_the_others(make_store) -> None:
    store = make_store()
    marker = b"TENANTMODELMARK-" + os.urandom(8).hex().encode()
    a = _toks(1)
    shared = a[:CHUNK] + _toks(2, CHUNK)
    # tA's two sessions share their first chunk (one chunk, two references).
    store.put_chunks("tA", "s1", FP, a, {(0, CHUNK): marker * 10, (CHUNK, 2 * CHUNK): marker * 10})
    store.put_chunks("tA", "s2", FP, shared, payloads_for(shared))
    store.put_chunks("tA", "s1", "other-fp", a, payloads_for(a))
    store.put_chunks("tB", "s1", FP, a, payloads_for(a))
    assert store.stats().chunks == 2 + 1 + 2 + 2
    store.create_checkpoint("nightly")
    store._db.flush(True)
    root = Path(store.config.path)
    assert _files_containing(root, marker), "the marker must be on disk before the purge"
    res = store.purge_model(FP, tenant="tA", actor="admin", reason="model_retired")
    assert res.chunks_deleted == 3 and res.checkpoints_removed == 1 and res.bytes_deleted > 0
    # Physically gone when the call returns, checkpoints included.
    assert _files_containing(root, marker) == []
    assert store.lookup("tA", FP, a).n_tokens == 0 and store.lookup("tA", FP, shared).n_tokens == 0
    assert store.session_chunks("tA", "s2") == 0
    # Other fingerprint of the same tenant, and the same fingerprint of another tenant, untouched.
    assert store.lookup("tA", "other-fp", a).n_tokens == 2 * CHUNK
    assert store.longest_valid_prefix("tB", FP, a).n_tokens == 2 * CHUNK
    assert store.stats().chunks == 4
    purged = [r for r in store.audit.iter_records() if r.action == AuditAction.PURGE]
    assert [r.tenant for r in purged] == ["tA"] * 4
    assert purged[-1].subject == f"model:{FP}" and purged[-1].nbytes == res.bytes_deleted
    assert store.audit.verify().ok
    # A tenant that never wrote here: nothing to do, nothing else touched.
    assert store.purge_model(FP, tenant="tC", actor="admin").chunks_deleted == 0
    assert store.stats().chunks == 4


def test_residency_refuses_to_persist_outside_allowed_regions(make_store) -> None:
    store = make_store(region="eu-west")
    a = _toks(1)
    store.put_chunks("tA", "s1", FP, a, payloads_for(a))
    store.set_policy("tA", RetentionPolicy(allowed_regions=("us-east",)), actor="admin")
    # The policy change purges what this node held for the tenant.
    assert store.stats().chunks == 0
    res = store.put_chunks("tA", "s1", FP, a, payloads_for(a))
    assert (
        not res.persisted and res.refusal.kind == RefusalKind.RESIDENCY and "eu-west" in res.refusal.message
    )
    assert store.lookup("tA", FP, a).n_tokens == 0
    assert store.put_chunks("tB", "s1", FP, a, payloads_for(a)).persisted
    store.set_policy("tA", RetentionPolicy(allowed_regions=("us-east", "eu-west")), actor="admin")
    assert store.put_chunks("tA", "s1", FP, a, payloads_for(a)).persisted
    refusals = [r for r in store.audit.iter_records() if r.action == AuditAction.REFUSE]
    assert [(r.tenant, r.reason) for r in refusals] == [("tA", "residency")]


def test_policy_json_roundtrip_and_validation() -> None:
    p = RetentionPolicy(floor_s=1.0, ceiling_s=2.0, allowed_regions=("a", "b"))
    assert RetentionPolicy.from_json(p.to_json()) == p
    assert RetentionPolicy.from_json(RetentionPolicy().to_json()) == RetentionPolicy()
    with pytest.raises(ValueError, match="ceiling_s"):
        RetentionPolicy(ceiling_s=0)
    with pytest.raises(ValueError, match="unknown"):
        RetentionPolicy.from_json(b'{"version":1,"floor_s":1,"bogus":2}')
    assert RetentionPolicy().floor_s == 72 * HOUR


def test_create_checkpoint_is_a_consistent_copy(make_store, tmp_path) -> None:
    from storage import GlobalKVStore, StoreConfig

    store = make_store()
    a = _toks(1)
    pays = payloads_for(a)
    store.put_chunks("tA", "s1", FP, a, pays)
    target = store.create_checkpoint("snap")
    with pytest.raises(ValueError):
        store.create_checkpoint("../escape")
    restored_root = tmp_path / "restored"
    restored_root.mkdir()
    target.rename(restored_root / "db")
    restored = GlobalKVStore(
        StoreConfig(path=str(restored_root), chunk_tokens=CHUNK, compression_ratios=(4,))
    )
    try:
        assert restored.longest_valid_prefix("tA", FP, a).payloads == [pays[r] for r in sorted(pays)]
        assert restored.audit.verify().ok
    finally:
        restored.close()


def test_evicted_and_superseded_bytes_leave_disk_at_next_maintenance(make_store, clock) -> None:
    store = make_store(capacity_bytes=2 * 360)
    store.set_policy("tA", RetentionPolicy(floor_s=0, ceiling_s=10 * HOUR), actor="admin")
    marker = b"EVICTMARK-" + os.urandom(8).hex().encode()
    tail_marker = b"TAILMARK-" + os.urandom(8).hex().encode()
    a, b = _toks(1), _toks(2)
    store.put_chunks("tA", "s1", FP, a, {(0, CHUNK): (marker * 20)[:200], (CHUNK, CHUNK + 2): tail_marker})
    store.put_chunks("tA", "s1", FP, a, {(CHUNK, 2 * CHUNK): b"full"})  # supersedes the tail
    store._db.flush(True)
    assert store.put_chunks("tA", "s2", FP, b, payloads_for(b, upto=CHUNK, size=200)).evicted_chunks >= 1
    root = Path(store.config.path)
    assert store.lookup("tA", FP, a).n_tokens == 0
    report = store.run_maintenance()
    assert report.compacted and report.expired_chunks == 0
    assert _files_containing(root, marker) == [] and _files_containing(root, tail_marker) == []


def test_checkpoint_kept_until_earliest_ceiling_it_holds(make_store, clock) -> None:
    store = make_store()
    store.set_policy("tA", RetentionPolicy(floor_s=0, ceiling_s=2 * HOUR), actor="admin")
    a = _toks(1)
    store.put_chunks("tA", "s1", FP, a, payloads_for(a))
    store.create_checkpoint("c1")
    clock.advance(HOUR)
    assert store.run_maintenance().checkpoints_removed == 0 and store.list_checkpoints() == ["c1"]
    clock.advance(HOUR)
    report = store.run_maintenance()
    assert report.expired_chunks == 2 and report.checkpoints_removed == 1 and store.list_checkpoints() == []

"""Group commit and audit delivery of the global KV store: concurrent writers share WAL syncs, no
callback runs and no sync happens under the store lock, claimed records are the caller's to
acknowledge, and records never acknowledged are delivered again when the store opens."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from storage import AuditRecord, GlobalKVStore, StoreConfig
from storage.wal_sync import GroupSync
from tests.storage.conftest import CHUNK, FP, FakeClock, payloads_for


def _config(tmp_path: Path) -> StoreConfig:
    return StoreConfig(path=str(tmp_path / "store"), chunk_tokens=CHUNK, compression_ratios=(4,))


def test_group_sync_one_sync_covers_every_waiter_behind_it() -> None:
    started, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def slow_sync() -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            started.set()
            assert release.wait(10)

    group = GroupSync(slow_sync)
    first = group.note_write()
    leader = threading.Thread(target=group.wait, args=(first,))
    leader.start()
    assert started.wait(10)
    # Three writes land while the first sync runs: they wait, and one sync after it covers all three.
    tickets = [group.note_write() for _ in range(3)]
    followers = [threading.Thread(target=group.wait, args=(t,)) for t in tickets]
    for th in followers:
        th.start()
    release.set()
    for th in [leader, *followers]:
        th.join(10)
        assert not th.is_alive()
    assert group.syncs == len(calls) == 2


def test_group_sync_error_reaches_every_waiter_it_covered() -> None:
    group = GroupSync(lambda: (_ for _ in ()).throw(OSError("disk gone")))
    errors: list[BaseException] = []

    def wait(ticket: int) -> None:
        try:
            group.wait(ticket)
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wait, args=(group.note_write(),)) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert len(errors) == 3 and group.syncs == 0


def test_concurrent_puts_share_wal_syncs(tmp_path: Path) -> None:
    store = GlobalKVStore(_config(tmp_path), clock=FakeClock())
    try:
        n_threads, per_thread = 8, 6
        barrier = threading.Barrier(n_threads)
        syncs0, batches0 = store.wal_syncs, store.batches_written

        def writer(w: int) -> None:
            barrier.wait()
            for i in range(per_thread):
                toks = [w * 1000 + i * 10 + j for j in range(CHUNK + 3)]
                assert store.put_chunks("tA", f"s{w}-{i}", FP, toks, payloads_for(toks)).persisted

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        batches = store.batches_written - batches0
        syncs = store.wal_syncs - syncs0
        # One batch per put (plus the tenant's salt); every put waited for a sync, fewer syncs than puts.
        assert batches == n_threads * per_thread + 1
        assert 1 <= syncs < batches
        assert store.audit.verify().ok
    finally:
        store.close()


def test_on_audit_runs_outside_the_store_lock_after_the_batch_is_durable(tmp_path: Path) -> None:
    delivered: list[AuditRecord] = []
    probes: list[bool] = []
    holder: list[GlobalKVStore] = []

    def on_audit(records: list[AuditRecord]) -> None:
        store = holder[0]
        probes.append(store._lock.held())
        # Another thread can take the store lock while the consumer runs (as its SQL would need).
        other = threading.Thread(target=store.stats)
        other.start()
        other.join(10)
        probes.append(other.is_alive())
        delivered.extend(records)

    cfg = _config(tmp_path)
    store = GlobalKVStore(cfg, clock=FakeClock(), on_audit=on_audit)
    holder.append(store)
    try:
        toks = list(range(2 * CHUNK))
        store.put_chunks("tA", "s1", FP, toks, payloads_for(toks))
        store.purge_session("tA", "s1", actor="admin")
    finally:
        store.close()
    assert delivered and not any(probes)
    assert [r.seq for r in delivered] == list(range(1, len(delivered) + 1))
    assert store.audit_acked_seq == len(delivered)


def test_claimed_records_never_acknowledged_are_redelivered_at_open(tmp_path: Path) -> None:
    delivered: list[AuditRecord] = []
    cfg = _config(tmp_path)
    store = GlobalKVStore(cfg, clock=FakeClock(), on_audit=delivered.extend)
    toks = list(range(CHUNK + 2))
    claimed: list[AuditRecord] = []
    put = store.put_chunks("tA", "s1", FP, toks, payloads_for(toks), audit_claim=claimed)
    assert put.persisted and [r.action.value for r in claimed] == ["store", "store"]
    # The claimed records are the caller's: the consumer did not get them.
    assert delivered == []
    acked = list(claimed)
    claimed2: list[AuditRecord] = []
    more = list(range(100, 100 + CHUNK))
    store.put_chunks("tA", "s2", FP, more, payloads_for(more), audit_claim=claimed2)
    store.ack_audit(acked)
    # The caller "crashed" before recording claimed2: it neither acknowledged nor released them.
    store.close()
    assert store.audit_acked_seq == 2

    reopened = GlobalKVStore(cfg, clock=FakeClock(), on_audit=delivered.extend)
    try:
        assert [r.hash for r in delivered] == [r.hash for r in claimed2]
        assert reopened.audit_acked_seq == reopened.audit.head()[0] == 3
    finally:
        reopened.close()
    delivered.clear()
    again = GlobalKVStore(cfg, clock=FakeClock(), on_audit=delivered.extend)
    again.close()
    assert delivered == []


def test_release_audit_delivers_claimed_records(tmp_path: Path) -> None:
    delivered: list[AuditRecord] = []
    store = GlobalKVStore(_config(tmp_path), clock=FakeClock(), on_audit=delivered.extend)
    try:
        toks = list(range(CHUNK))
        claimed: list[AuditRecord] = []
        store.put_chunks("tA", "s1", FP, toks, payloads_for(toks), audit_claim=claimed)
        store.release_audit(claimed)
        assert delivered == claimed and store.audit_acked_seq == 1
    finally:
        store.close()


def test_a_failed_delivery_is_retried_with_the_next_one(tmp_path: Path) -> None:
    delivered: list[AuditRecord] = []
    failing = [True]

    def on_audit(records: list[AuditRecord]) -> None:
        if failing[0]:
            raise RuntimeError("registry down")
        delivered.extend(records)

    store = GlobalKVStore(_config(tmp_path), clock=FakeClock(), on_audit=on_audit)
    try:
        toks = list(range(CHUNK))
        store.put_chunks("tA", "s1", FP, toks, payloads_for(toks))
        assert store.audit_acked_seq == 0
        failing[0] = False
        more = list(range(50, 50 + CHUNK))
        store.put_chunks("tA", "s2", FP, more, payloads_for(more))
        assert [r.seq for r in delivered] == [1, 2] and store.audit_acked_seq == 2
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["tenant", "session", "model"])
def test_a_purge_during_the_sync_of_a_put_deletes_what_it_wrote(tmp_path: Path, kind: str) -> None:
    store = GlobalKVStore(_config(tmp_path), clock=FakeClock())
    try:
        store.put_chunks("tA", "s0", FP, [7] * CHUNK, payloads_for([7] * CHUNK))
        wait = store._wal.wait
        purges: list[int] = []

        started: list[bool] = []
        purge = {
            "tenant": lambda: store.purge_tenant("tA", actor="t"),
            "session": lambda: store.purge_session("tA", "s1", actor="t"),
            "model": lambda: store.purge_model(FP, actor="t"),
        }

        def wait_with_a_purge(ticket: int) -> None:
            if not started:
                started.append(True)
                # The put released the lock and waits for its sync: a tenant purge runs meanwhile.
                th = threading.Thread(target=lambda: purges.append(purge[kind]().chunks_deleted))
                th.start()
                th.join(10)
            wait(ticket)

        store._wal.wait = wait_with_a_purge  # type: ignore[method-assign]
        toks = list(range(CHUNK + 3))
        put = store.put_chunks("tA", "s1", FP, toks, payloads_for(toks))
        store._wal.wait = wait  # type: ignore[method-assign]
        # The purge removed what was indexed; the put's own chunks went when its sync returned.
        assert purges == [0 if kind == "session" else 1] and put.stored == []
        assert store.stats().chunks == (1 if kind == "session" else 0)
        assert store.lookup("tA", FP, toks).n_tokens == 0
        actions = [(r.action.value, r.reason) for r in store.audit.iter_records()]
        assert actions[-2:] == [("purge", "purged_during_write")] * 2
        assert store.audit.verify().ok
    finally:
        store.close()
    reopened = GlobalKVStore(_config(tmp_path), clock=FakeClock())
    try:
        assert reopened.recovery.chunks == (1 if kind == "session" else 0)
    finally:
        reopened.close()

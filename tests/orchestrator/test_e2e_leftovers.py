"""Leftovers collected (issue 13 items 9-10): orphan chunks of turns that never committed are deleted
after the grace period with an audit record each, and registry rows go as soon as the store expires
their chunks, so GetStoreStats (read from SQL) is right without a restart.

Real node (SQLite + RocksDB, loopback gRPC, seeded random-init v41-tiny "a", chunks of 32 tokens).
Narration: acme runs a 70-token turn (2 full chunks + a tail stored, rows linked) -> a sweep deletes
nothing -> a turn that "never committed" leaves two chunks in the store with no row (written straight
to the store, as a crash between the store's batch and the SQL commit does) -> within the grace period
they stay; past it the sweep deletes exactly those two, one PURGE record each, mirrored into acme's
SQL chain -> globex runs a turn, its ceiling drops to 1 ms, the maintenance pass expires its chunks and
its rows are gone at once: GetStoreStats counts acme's segments only.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch
from sqlalchemy import select

from orchestrator.db import ORPHAN_REASON, collect_orphans
from orchestrator.db.models import AuditRow, CacheSegment
from storage import AuditAction
from tests.orchestrator.engine.node_harness import admin_md, md, registry, run_turn, start_node


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 512) for _ in range(n)]


def _rows(node, tenant: str) -> int:
    with node.service.ctx.sessions() as s:
        return len(s.scalars(select(CacheSegment).where(CacheSegment.tenant_id == tenant)).all())


def _scenario(tmp_path: Path, database_url: str | None) -> None:
    torch.set_num_threads(1)
    models = registry()
    node = start_node(tmp_path, models, database_url=database_url, orphan_grace_s=3600.0)
    try:
        pb, svc = node.pb, node.service
        store, ctx = svc.store, svc.ctx
        sid = node.sessions.CreateSession(
            pb.sessions.CreateSessionRequest(model="a"), metadata=md("acme")
        ).session.session_id
        t = run_turn(node, sid, _ids(1, 70), tenant="acme", max_new=1)
        assert t.stats.persisted
        committed = store.tenant_stats("acme").chunks
        assert committed >= 2 and _rows(node, "acme") == committed
        # Every chunk of a committed turn has its row: nothing is an orphan, whatever the grace.
        assert collect_orphans(ctx.serializable, store, node=ctx.node, grace_s=0.0, now=time.time()) == (0, 0)

        fp = models.get("a").fingerprint_hex
        lost = _ids(2, 64)
        payloads = {(0, 32): b"\x01" * 300, (32, 64): b"\x02" * 300}
        put = store.put_chunks("acme", "never-committed", fp, lost, payloads)
        assert put.persisted and store.tenant_stats("acme").chunks == committed + 2
        # Within the grace period the chunks may still be a running turn's: they stay.
        sweep = {"node": ctx.node, "grace_s": 3600.0}
        assert collect_orphans(ctx.serializable, store, **sweep, now=time.time()) == (0, 0)
        chunks, freed = collect_orphans(
            ctx.serializable, store, node=ctx.node, grace_s=3600.0, now=time.time() + 3601.0
        )
        assert chunks == 2 and freed > 600
        assert store.tenant_stats("acme").chunks == committed and _rows(node, "acme") == committed
        records = list(store.audit.iter_records())
        purged = [r for r in records if r.action == AuditAction.PURGE and r.reason == ORPHAN_REASON]
        assert len(purged) == 2 and all(r.subject.startswith("chunk:") and r.tenant == "acme" for r in purged)
        with ctx.sessions() as s:
            mirrored = s.scalars(
                select(AuditRow).where(AuditRow.chain == "acme", AuditRow.reason == ORPHAN_REASON)
            ).all()
        assert sorted(r.source_hash for r in mirrored) == sorted(r.hash for r in purged)
        # The session the turn was resumed from still continues as a full hit.
        again = run_turn(node, sid, _ids(3, 5), tenant="acme", max_new=1)
        assert again.path == "FULL_HIT", again.plan.reason

        gid = node.sessions.CreateSession(
            pb.sessions.CreateSessionRequest(model="a"), metadata=md("globex")
        ).session.session_id
        assert run_turn(node, gid, _ids(4, 70), tenant="globex", max_new=1).stats.persisted
        assert _rows(node, "globex") >= 2
        node.admin.SetRetentionPolicy(
            pb.admin.RetentionPolicy(tenant_id="globex", floor_s=0.0, ceiling_s=0.001), metadata=admin_md()
        )
        time.sleep(0.01)
        assert store.run_maintenance().expired_chunks >= 2
        assert _rows(node, "globex") == 0
        stats = node.admin.GetStoreStats(pb.admin.StoreStatsRequest(), metadata=admin_md())
        assert stats.segments == _rows(node, "acme") == store.tenant_stats("acme").chunks
    finally:
        node.stop()


def test_orphans_are_collected_and_expired_rows_go_at_once(tmp_path: Path) -> None:
    _scenario(tmp_path, None)


def test_orphans_are_collected_and_expired_rows_go_at_once_postgres(
    tmp_path: Path, postgres_url: str
) -> None:
    _scenario(tmp_path, postgres_url)


def _past_retention(tmp_path: Path, database_url: str | None) -> None:
    """Chunks whose registry row is past the retention of every session that held it are collected by
    the sweep (reason retention_expired, one PURGE record each) and their rows go with the records."""
    import datetime as dt

    from sqlalchemy import update

    from orchestrator.db import RETENTION_REASON

    torch.set_num_threads(1)
    node = start_node(tmp_path, registry(), database_url=database_url, orphan_grace_s=3600.0)
    try:
        pb, store, ctx = node.pb, node.service.store, node.service.ctx
        sid = node.sessions.CreateSession(
            pb.sessions.CreateSessionRequest(model="a"), metadata=md("acme")
        ).session.session_id
        assert run_turn(node, sid, _ids(5, 70), tenant="acme", max_new=1).stats.persisted
        stored = store.tenant_stats("acme").chunks
        assert stored >= 2 and _rows(node, "acme") == stored
        # inside their retention: nothing goes, whatever the grace
        assert collect_orphans(ctx.serializable, store, node=ctx.node, grace_s=0.0, now=time.time()) == (0, 0)
        past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        with ctx.sessions() as s:
            s.execute(update(CacheSegment).values(expires_at=past))
            s.commit()
        chunks, _ = collect_orphans(ctx.serializable, store, node=ctx.node, grace_s=0.0, now=time.time())
        assert chunks == stored and store.tenant_stats("acme").chunks == 0 and _rows(node, "acme") == 0
        purged = [r for r in store.audit.iter_records() if r.reason == RETENTION_REASON]
        assert len(purged) == stored and all(r.action == AuditAction.PURGE for r in purged)
    finally:
        node.stop()


def test_chunks_past_their_retention_are_collected(tmp_path: Path) -> None:
    _past_retention(tmp_path, None)


def test_chunks_past_their_retention_are_collected_postgres(tmp_path: Path, postgres_url: str) -> None:
    _past_retention(tmp_path, postgres_url)

"""link_current returns the store keys whose rows it deleted (a superseded tail), and the turn's
forget_gone_chunks skips them: the rows left are those of the slow twin (forget told nothing, running
its DELETE for every gone key), on fresh random chains, and the skipped DELETE is the one that found no
row."""

from __future__ import annotations

import datetime as dt
import random

import pytest

from orchestrator.db import (
    DurableSegment,
    SegmentRepository,
    SessionRepository,
    TenantRepository,
    forget_gone_chunks,
    make_engine,
    run_serializable,
    serializable_factory,
)
from orchestrator.db.models import CacheSegment, SessionSegment
from storage import AuditAction, AuditRecord

LATER = dt.datetime(2100, 1, 1, tzinfo=dt.UTC)


def _seg(key: bytes, start: int, end: int, node: str = "n1") -> DurableSegment:
    return DurableSegment(
        store_key=key,
        tenant_id="acme",
        model="small",
        fingerprint="fp",
        start_pos=start,
        end_pos=end,
        nbytes=(end - start) * 890,
        expires_at=LATER,
        node=node,
    )


def _gone(key: bytes, seq: int) -> AuditRecord:
    return AuditRecord(
        seq=seq,
        ts_us=seq,
        actor="storage",
        action=AuditAction.EVICT,
        tenant="acme",
        subject=f"chunk:{key.hex()}",
        reason="superseded",
        nbytes=0,
        prev_hash="0" * 64,
        hash=f"{seq:064x}",
    )


def _scenario(seed: int, url: str, *, skip: bool) -> tuple[list[tuple], list[tuple], list[int]]:
    """Two sessions share a chain prefix; session A's turns each supersede its tail; the store's
    records name A's superseded tails and some of B's chunks as gone (another eviction)."""
    rng = random.Random(seed)
    engine = make_engine(url)
    factory = serializable_factory(engine)
    forgotten: list[int] = []
    try:

        def setup(s):
            TenantRepository(s).ensure("acme")
            a = SessionRepository(s).create(tenant_id="acme", model="small", retention_s=60).id
            b = SessionRepository(s).create(tenant_id="acme", model="small", retention_s=60).id
            return a, b

        a, b = run_serializable(factory, setup)
        n = rng.randint(2, 6)
        prefix = [_seg(bytes([1, k]), 64 * k, 64 * (k + 1)) for k in range(n)]
        run_serializable(factory, lambda s: SegmentRepository(s).link_current(b, "fp", prefix))
        seq = 0
        for turn in range(rng.randint(2, 5)):
            tail = _seg(bytes([2, turn]), 64 * n, 64 * n + 1 + turn)
            segments = [*prefix, tail]
            seq += 1
            records = [_gone(bytes([2, turn - 1]), seq)] if turn else []
            if rng.random() < 0.5:
                seq += 1
                records.append(_gone(rng.choice(prefix).store_key, seq))

            def work(s, segments=segments, records=records):
                dropped = SegmentRepository(s).link_current(a, "fp", segments)
                return forget_gone_chunks(s, node="n1", records=records, deleted=dropped if skip else ())

            forgotten.append(run_serializable(factory, work))
        with engine.connect() as conn:
            segs = sorted(
                tuple(r)
                for r in conn.execute(
                    CacheSegment.__table__.select().with_only_columns(
                        CacheSegment.store_key, CacheSegment.start_pos, CacheSegment.end_pos
                    )
                )
            )
            links = sorted(
                (r.session_id == a, r.store_key)
                for r in conn.execute(
                    SessionSegment.__table__.join(CacheSegment.__table__)
                    .select()
                    .with_only_columns(SessionSegment.session_id, CacheSegment.store_key)
                )
            )
        return segs, links, forgotten
    finally:
        engine.dispose()


@pytest.mark.parametrize("seed", range(6))
def test_skipping_the_rows_link_current_deleted_leaves_the_slow_twins_rows(registry_copy, seed) -> None:
    fast = _scenario(seed, registry_copy("fast"), skip=True)
    twin = _scenario(seed, registry_copy("twin"), skip=False)
    assert fast[:2] == twin[:2]
    # The twin's DELETE of a superseded tail found nothing (link_current had deleted it): same counts.
    assert fast[2] == twin[2]
    # Only the last turn's tail survives; every superseded one went.
    assert len([key for key, *_ in fast[0] if key[0] == 2]) == 1


def test_link_current_returns_the_keys_it_deleted(registry_copy) -> None:
    engine = make_engine(registry_copy("r"))
    try:
        factory = serializable_factory(engine)

        def setup(s):
            TenantRepository(s).ensure("acme")
            return SessionRepository(s).create(tenant_id="acme", model="small", retention_s=60).id

        sid = run_serializable(factory, setup)
        first = [_seg(b"\x01", 0, 64), _seg(b"\x02", 64, 70)]
        assert run_serializable(factory, lambda s: SegmentRepository(s).link_current(sid, "fp", first)) == []
        second = [_seg(b"\x01", 0, 64), _seg(b"\x03", 64, 75)]
        assert run_serializable(factory, lambda s: SegmentRepository(s).link_current(sid, "fp", second)) == [
            b"\x02"
        ]
    finally:
        engine.dispose()


def test_postgres_connections_plan_each_execution_and_keep_the_urls_options(postgres_url) -> None:
    """make_engine's PostgreSQL connections plan every execution with its parameters (no generic plan
    kept from an empty registry's statistics: orchestrator/db/engine.py), across the pool's connections
    and after a statement was prepared, and the URL's own options (the test schema's search_path) hold."""
    from sqlalchemy import text

    from orchestrator.db import make_engine

    engine = make_engine(postgres_url)
    try:
        with engine.connect() as a, engine.connect() as b:
            for conn in (a, b):
                for _ in range(7):  # past psycopg's threshold for preparing a statement on the server
                    assert conn.execute(text("show plan_cache_mode")).scalar() == "force_custom_plan"
                assert conn.execute(text("show search_path")).scalar().startswith("kvr_test_")
    finally:
        engine.dispose()

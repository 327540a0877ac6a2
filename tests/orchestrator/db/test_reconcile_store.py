"""Registry vs storage's real GlobalKVStore: rows past what the store durably holds are dropped on start,
and Purger drives the store's own purge (its PurgeResult feeds the reply)."""

from __future__ import annotations

import datetime as dt

from orchestrator.db import (
    DurableSegment,
    Purger,
    SegmentRepository,
    SessionRepository,
    SqlAuditSink,
    TenantRepository,
    TurnRepository,
    TurnTimings,
    make_session_factory,
    reconcile_with_prefixes,
    serializable_factory,
)
from storage import GlobalKVStore, StoreConfig

LATER = dt.datetime(2100, 1, 1, tzinfo=dt.UTC)
FP = "fp-small-v1"


def _seg(start: int, end: int) -> DurableSegment:
    return DurableSegment(
        store_key=f"acme/{FP}/{start}-{end}".encode(),
        tenant_id="acme",
        model="small",
        fingerprint=FP,
        start_pos=start,
        end_pos=end,
        nbytes=(end - start) * 10,
        expires_at=LATER,
        node="n1",
    )


def test_reconcile_and_purge_against_the_real_store(sqlite_engine, tmp_path) -> None:
    store = GlobalKVStore(
        StoreConfig(
            path=str(tmp_path / "kv"),
            region="eu-1",
            chunk_tokens=8,
            compression_ratios=(4,),
            capacity_bytes=1 << 20,
        )
    )
    try:
        factory = make_session_factory(sqlite_engine)
        history = list(range(100, 120))
        with factory() as s, s.begin():
            TenantRepository(s).ensure("acme")
            row = SessionRepository(s).create(tenant_id="acme", model="small", retention_s=60, node="n1")
            sid = row.id
            turns = TurnRepository(s)
            t = turns.begin(row, model="small", input_tokens=history[:18])
            turns.finish(t, row, output_tokens=history[18:], timings=TurnTimings())
        # The store holds chunks [0, 8) and [8, 16); the registry also claims [16, 20), which the store
        # never made durable (the state a lost disk or a bug would leave).
        put = store.put_chunks(
            "acme", sid, FP, history, {(0, 8): b"a" * 80, (8, 16): b"b" * 80}, actor="test"
        )
        assert put.refusal is None
        with factory() as s, s.begin():
            for start, end in ((0, 8), (8, 16), (16, 20)):
                SegmentRepository(s).link(sid, _seg(start, end))

        def prefix(tenant: str, fp: str, tokens: list[int]) -> int:
            return store.lookup(tenant, fp, tokens).n_tokens

        report = reconcile_with_prefixes(serializable_factory(sqlite_engine), node="n1", stored_prefix=prefix)
        assert (report.rows_checked, report.dangling_rows_deleted) == (3, 1)
        with factory() as s:
            assert [(x.start_pos, x.end_pos) for x in SegmentRepository(s).for_session(sid)] == [
                (0, 8),
                (8, 16),
            ]
        # A second pass finds nothing to fix.
        again = reconcile_with_prefixes(serializable_factory(sqlite_engine), node="n1", stored_prefix=prefix)
        assert again.dangling_rows_deleted == 0

        out = Purger(serializable_factory(sqlite_engine), SqlAuditSink(sqlite_engine), store).purge_session(
            sid, tenant_id="acme", actor="tenant:acme", reason="tenant_request"
        )
        assert out is not None and out.segments_deleted == 2
        assert store.lookup("acme", FP, history).n_tokens == 0
        assert store.session_chunks("acme", sid) == 0
    finally:
        store.close()


def test_store_audit_mirrors_into_the_sql_chain(sqlite_engine, tmp_path) -> None:
    sink = SqlAuditSink(sqlite_engine)
    store = GlobalKVStore(
        StoreConfig(
            path=str(tmp_path / "kv"),
            region="eu-1",
            chunk_tokens=8,
            compression_ratios=(4,),
            capacity_bytes=1 << 20,
        ),
        on_audit=sink.mirror,
    )
    try:
        store.put_chunks("acme", "s1", FP, list(range(8)), {(0, 8): b"x" * 80}, actor="service")
        store.purge_session("acme", "s1", actor="admin", reason="test")
        mine = list(store.audit.iter_records())
    finally:
        store.close()
    mirrored = list(sink.iter_records())
    fields = ("ts_us", "actor", "action", "tenant", "subject", "reason", "nbytes")
    assert [tuple(getattr(r, f) for f in fields) for r in mirrored] == [
        tuple(getattr(r, f) for f in fields) for r in mine
    ]
    assert sink.verify().ok and len(mirrored) >= 3

"""SqlAuditSink: storage's chain format in SQL, tamper detection, and concurrent appenders (replicas)."""

from __future__ import annotations

import threading

import pytest
from rocksdict import Options, Rdict
from sqlalchemy import delete, update
from sqlalchemy.orm import Session

from orchestrator.db.audit_sink import SqlAuditSink
from orchestrator.db.engine import make_engine
from orchestrator.db.models import AuditRow
from storage import AuditAction, AuditEvent, RocksAuditSink, verify_chain


def _event(i: int, tenant: str = "acme") -> AuditEvent:
    return AuditEvent(
        actor="test",
        action=AuditAction.STORE,
        tenant=tenant,
        subject=f"chunk:{i:04x}",
        reason="turn_end",
        nbytes=890 * i,
    )


def test_append_matches_storage_rocks_sink_byte_for_byte(sqlite_engine, tmp_path) -> None:
    clock = iter(float(t) for t in range(1_700_000_000, 1_700_000_100))
    sql = SqlAuditSink(sqlite_engine, clock=lambda: next(clock))
    db = Rdict(str(tmp_path / "rocks"), options=Options(raw_mode=True))
    try:
        clock2 = iter(float(t) for t in range(1_700_000_000, 1_700_000_100))
        rocks = RocksAuditSink(db, clock=lambda: next(clock2))
        # One tenant's chain in SQL is the same chain as storage's sink given the same events.
        for e in [_event(i) for i in range(5)]:
            assert sql.append(e) == rocks.append(e)
        assert sql.chain_head("acme") == rocks.head()
        assert list(sql.iter_records(chain="acme", batch=2)) == list(rocks.iter_records())
    finally:
        db.close()
    purge = AuditEvent(actor="admin", action=AuditAction.PURGE, tenant="", subject="model:small", reason="a")
    # A record of no tenant starts the node-wide chain "" at seq 1.
    assert sql.append(purge).seq == 1
    assert sql.heads() == {"": sql.chain_head(""), "acme": sql.chain_head("acme")}
    assert sql.chains() == ["", "acme"]
    assert sql.verify().ok and sql.verify().records == 6
    assert sql.head()[0] == 6


def test_verify_detects_edit_and_truncation_in_any_chain(sqlite_engine) -> None:
    sink = SqlAuditSink(sqlite_engine)
    sink.append_many([_event(i, t) for i in range(4) for t in ("a", "b")])
    with Session(sqlite_engine) as s, s.begin():
        s.execute(update(AuditRow).where(AuditRow.chain == "b", AuditRow.seq == 2).values(nbytes=1))
    result = sink.verify()
    # A broken chain counts its records up to the break: 4 of a, 2 of b.
    assert (result.ok, result.first_break_seq, result.reason) == (False, 2, "hash mismatch")
    assert result.records == 6
    verdicts = {v.chain: v.result.ok for v in sink.verify_chains()}
    assert verdicts == {"": True, "a": True, "b": False}
    with Session(sqlite_engine) as s, s.begin():
        s.execute(update(AuditRow).where(AuditRow.chain == "b", AuditRow.seq == 2).values(nbytes=890))
        s.execute(delete(AuditRow).where(AuditRow.chain == "a", AuditRow.seq == 4))
    result = sink.verify()
    assert not result.ok and result.reason == "chain ends at seq 3 but head says 4"


def test_query_filters_by_tenant_action_chain_and_seq(sqlite_engine) -> None:
    clock = iter(float(t) for t in range(1_700_000_000, 1_700_000_100))
    sink = SqlAuditSink(sqlite_engine, clock=lambda: next(clock))
    for i, t in ((1, "a"), (2, "b"), (3, "a")):
        sink.append(_event(i, t))
    sink.append(AuditEvent(actor="admin", action="purge", tenant="a", subject="tenant:a", reason="admin"))
    assert [r.seq for r in sink.query(tenant="a")] == [1, 2, 3]
    assert [r.seq for r in sink.query(tenant="a", action="purge")] == [3]
    assert [(c, r.seq) for c, r in sink.query_chained()] == [("a", 1), ("b", 1), ("a", 2), ("a", 3)]
    assert [r.seq for r in sink.query(chain="a", after_seq=1, limit=1)] == [2]


def test_mirror_skips_records_already_mirrored(sqlite_engine, tmp_path) -> None:
    db = Rdict(str(tmp_path / "rocks"), options=Options(raw_mode=True))
    try:
        rocks = RocksAuditSink(db)
        store_records = [rocks.append(_event(i, t)) for i, t in ((1, "a"), (2, "b"), (3, "a"))]
    finally:
        db.close()
    sink = SqlAuditSink(sqlite_engine)
    first = sink.mirror(store_records[:2])
    # The store re-delivers what it was not told is held (a crash before the acknowledgement).
    again = sink.mirror(store_records)
    assert [(r.tenant, r.seq) for r in first] == [("a", 1), ("b", 1)]
    assert [(r.tenant, r.seq) for r in again] == [("a", 2)]
    mirrored = [r for _, r in sink.query_chained()]
    assert [(r.ts_us, r.subject) for r in mirrored] == [(r.ts_us, r.subject) for r in store_records]
    assert sink.verify().ok


def _hammer(url: str, replicas: int, per_replica: int, *, shared: bool = False) -> None:
    """Replicas append at once, each to its own tenant's chain, or (`shared`) all to one tenant's."""
    barrier = threading.Barrier(replicas)
    errors: list[BaseException] = []

    def replica(r: int) -> None:
        engine = make_engine(url)  # each replica has its own engine and connection pool
        try:
            sink = SqlAuditSink(engine)
            barrier.wait()
            for i in range(per_replica):
                sink.append(_event(r * 1000 + i, tenant="shared" if shared else f"t{r}"))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread below
            errors.append(exc)
        finally:
            engine.dispose()

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    engine = make_engine(url)
    try:
        sink = SqlAuditSink(engine)
        if shared:
            records = list(sink.iter_records(chain="shared"))
            assert [rec.seq for rec in records] == list(range(1, replicas * per_replica + 1))
            assert verify_chain(records, head=sink.chain_head("shared")).ok
            return
        # Each replica appended to its own tenant's chain: gap-free, and every chain verifies.
        for r in range(replicas):
            records = list(sink.iter_records(chain=f"t{r}"))
            assert [rec.seq for rec in records] == list(range(1, per_replica + 1))
            assert verify_chain(records, head=sink.chain_head(f"t{r}")).ok
        assert sink.verify().ok and sink.verify().records == replicas * per_replica
    finally:
        engine.dispose()


def test_concurrent_appenders_postgres(postgres_url) -> None:
    from orchestrator.db.migrate import upgrade

    upgrade(postgres_url)
    _hammer(postgres_url, replicas=4, per_replica=15)


def test_concurrent_appenders_sqlite(sqlite_url) -> None:
    _hammer(sqlite_url, replicas=3, per_replica=10)


def test_concurrent_appenders_to_one_chain_postgres(postgres_url) -> None:
    from orchestrator.db.migrate import upgrade

    upgrade(postgres_url)
    _hammer(postgres_url, replicas=4, per_replica=10, shared=True)


def test_run_serializable_reraises_non_conflicts(sqlite_engine) -> None:
    from sqlalchemy.exc import IntegrityError

    from orchestrator.db.transactions import run_serializable, serializable_factory

    def work(s: Session) -> None:
        s.add(
            AuditRow(
                chain="",
                seq=1,
                ts_us=0,
                actor="x",
                action="store",
                tenant="",
                subject="",
                reason="",
                nbytes=0,
                prev_hash="0" * 64,
                hash=None,
            )
        )

    with pytest.raises(IntegrityError):
        run_serializable(serializable_factory(sqlite_engine), work)


def test_store_records_missing_from_sql_are_mirrored_when_the_store_opens(sqlite_engine, tmp_path) -> None:
    from storage import GlobalKVStore, StoreConfig

    sink = SqlAuditSink(sqlite_engine)
    cfg = StoreConfig(path=str(tmp_path / "kv"), chunk_tokens=8, compression_ratios=(4,))
    store = GlobalKVStore(cfg, on_audit=sink.mirror)
    claimed: list = []
    toks = list(range(11))
    store.put_chunks("acme", "s1", "fp", toks, {(0, 8): b"a", (8, 11): b"b"}, audit_claim=claimed)
    # A crash before the turn's transaction committed: SQL never got the claimed records.
    store.close()
    assert sink.chain_head("acme") == (0, "0" * 64)
    for _ in range(2):
        # Opening re-delivers them once; a second open finds them acknowledged (or skips them).
        store = GlobalKVStore(cfg, on_audit=sink.mirror)
        store.close()
    mirrored = list(sink.iter_records(chain="acme"))
    assert [(r.subject, r.ts_us) for r in mirrored] == [(r.subject, r.ts_us) for r in claimed]
    assert sink.verify().ok


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_migration_keeps_the_old_chain_and_downgrade_merges_the_chains(backend, tmp_path, request) -> None:
    from sqlalchemy import text

    from orchestrator.db.migrate import downgrade, upgrade
    from storage import seal

    url = (
        f"sqlite:///{tmp_path / 'm.sqlite3'}"
        if backend == "sqlite"
        else request.getfixturevalue("postgres_url")
    )
    upgrade(url, "0002")
    old = []
    prev = "0" * 64
    for i, tenant in enumerate(("a", "b", "a"), start=1):
        rec = seal(_event(i, tenant), seq=i, ts_us=1000 + i, prev_hash=prev)
        old.append(rec)
        prev = rec.hash
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            for rec in old:
                values = {**rec.__dict__, "action": str(rec.action)}
                conn.execute(
                    text(
                        "insert into audit_log (seq, ts_us, actor, action, tenant, subject, reason, nbytes, "
                        "prev_hash, hash) values (:seq, :ts_us, :actor, :action, :tenant, :subject, :reason, "
                        ":nbytes, :prev_hash, :hash)"
                    ),
                    values,
                )
            conn.execute(text("update audit_head set seq = 3, hash = :h where id = 1"), {"h": prev})
        upgrade(url)
        sink = SqlAuditSink(engine, clock=lambda: 2.0)
        # The records written before the split stay one chain, "" (same seq and hashes).
        assert list(sink.iter_records(chain="")) == old and sink.chain_head("") == (3, prev)
        sink.append(_event(9, "a"))
        assert sink.chain_head("a")[0] == 1 and sink.verify().ok
        engine.dispose()
        downgrade(url, "0002")
        engine = make_engine(url)
        with engine.connect() as conn:
            rows = conn.execute(text("select * from audit_log order by seq")).mappings().all()
            head = conn.execute(text("select seq, hash from audit_head where id = 1")).one()
        from storage import AuditRecord

        merged = [AuditRecord(**{**r, "action": AuditAction(r["action"])}) for r in rows]
        assert [r.subject for r in merged] == [r.subject for r in old] + ["chunk:0009"]
        assert verify_chain(merged, head=(head.seq, head.hash)).ok
        upgrade(url)
    finally:
        engine.dispose()


def test_appends_of_other_tenants_never_wait_for_an_open_append_postgres(postgres_url) -> None:
    from orchestrator.db.migrate import upgrade
    from orchestrator.db.transactions import serializable_factory

    upgrade(postgres_url)
    engine, other = make_engine(postgres_url), make_engine(postgres_url)
    try:
        sink, sink2 = SqlAuditSink(engine), SqlAuditSink(other)
        sink.append_many([_event(0, "a"), _event(0, "b")])
        done: dict[str, threading.Event] = {"a": threading.Event(), "b": threading.Event()}

        def append(tenant: str) -> None:
            sink2.append(_event(7, tenant))
            done[tenant].set()

        with serializable_factory(engine)() as s, s.begin():
            # An append of tenant a, not yet committed: it holds a's chain head.
            sink.append_in(s, [_event(1, "a")])
            threads = {t: threading.Thread(target=append, args=(t,)) for t in ("a", "b")}
            for th in threads.values():
                th.start()
            # Tenant b's append commits meanwhile; tenant a's waits for the open transaction.
            assert done["b"].wait(10)
            assert not done["a"].wait(0.5)
        threads["a"].join(10)
        assert done["a"].is_set()
        assert (sink.chain_head("a")[0], sink.chain_head("b")[0]) == (3, 2) and sink.verify().ok
    finally:
        engine.dispose()
        other.dispose()

"""SqlAuditSink on SQLite seals after the head it last moved without reading it (`remember_heads`), and
falls back to reading the head when that hint is stale: the audit_log and audit_head rows are the ones
the reference (every append reads its heads) writes, on fresh random scripts of appends, mirrors,
transactions rolled back after their append (the hint runs ahead) and appends by another sink on the
same database (the hint falls behind)."""

from __future__ import annotations

import random

import pytest
from sqlalchemy import select

from orchestrator.db import make_engine, run_serializable, serializable_factory
from orchestrator.db.audit_sink import SqlAuditSink
from orchestrator.db.models import AuditHead, AuditRow
from storage import AuditAction, AuditEvent, AuditRecord

_TENANTS = ("", "acme", "beta")


class _Rollback(Exception):
    pass


def _event(rng: random.Random, i: int) -> AuditEvent:
    return AuditEvent(
        actor=rng.choice(["storage", "admin"]),
        action=rng.choice([AuditAction.STORE, AuditAction.EVICT]),
        tenant=rng.choice(_TENANTS),
        subject=f"chunk:{i:06x}",
        reason="turn_end",
        nbytes=rng.randrange(10_000),
    )


def _store_record(rng: random.Random, i: int) -> AuditRecord:
    e = _event(rng, i)
    return AuditRecord(
        seq=i, ts_us=1_000 + i, actor=e.actor, action=e.action, tenant=e.tenant, subject=e.subject,
        reason=e.reason, nbytes=e.nbytes, prev_hash="0" * 64, hash=f"{i:064x}",
    )  # fmt: skip


def _script(seed: int, url: str, *, remember: bool) -> tuple[list[tuple], list[tuple]]:
    rng = random.Random(seed)
    engine = make_engine(url)
    ticks = iter(range(1_700_000_000, 1_700_100_000))
    sink = SqlAuditSink(engine, clock=lambda: float(next(ticks)))
    sink.remember_heads = remember
    other = SqlAuditSink(engine, clock=lambda: float(next(ticks)))
    factory = serializable_factory(engine)
    try:
        for step in range(rng.randint(6, 20)):
            events = [_event(rng, 100 * step + k) for k in range(rng.randint(1, 4))]
            what = rng.random()
            if what < 0.35:
                sink.append_many(events)
            elif what < 0.55:
                records = [_store_record(rng, 100 * step + k) for k in range(rng.randint(1, 3))]
                run_serializable(factory, lambda s, r=records: sink.mirror_in(s, r))
            elif what < 0.75:

                def doomed(s, events=events):
                    sink.append_in(s, events)
                    raise _Rollback

                with pytest.raises(_Rollback):
                    run_serializable(factory, doomed)
            else:
                other.append_many(events)
        assert sink.verify().ok
        with engine.connect() as conn:
            log = sorted(tuple(r) for r in conn.execute(select(AuditRow.__table__)))
            heads = sorted(tuple(r) for r in conn.execute(select(AuditHead.__table__)))
        return log, heads
    finally:
        engine.dispose()


@pytest.mark.parametrize("seed", range(10))
def test_remembered_heads_write_the_reference_rows(registry_copy, seed) -> None:
    fast = _script(seed, registry_copy("fast"), remember=True)
    twin = _script(seed, registry_copy("twin"), remember=False)
    assert fast == twin
    assert fast[0], "the script appended nothing"


def test_a_remembered_head_saves_the_head_read(registry_copy) -> None:
    from sqlalchemy import event

    engine = make_engine(registry_copy("r"))
    try:
        sink = SqlAuditSink(engine)
        statements: list[str] = []
        event.listen(engine, "before_cursor_execute", lambda c, cur, stmt, *a: statements.append(stmt))
        e = AuditEvent(actor="a", action=AuditAction.STORE, tenant="acme", subject="s", reason="r", nbytes=1)
        sink.append(e)
        statements.clear()
        sink.append(e)
        assert not any(s.startswith("SELECT") for s in statements), statements
        # another writer moved the head: the next append reads it and still chains on
        SqlAuditSink(engine).append(e)
        sink.append(e)
        assert sink.verify().ok and sink.chain_head("acme")[0] == 4
    finally:
        engine.dispose()

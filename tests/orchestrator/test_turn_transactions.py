"""What a turn costs the registry and the store: SQL write transactions and store batches per turn
(SQLAlchemy engine events, store counters), the store's audit records mirrored in the turn's own
transaction, and no SQL statement ever run by a thread that holds the store lock."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import event

from tests.orchestrator.engine.node_harness import (
    admin_md,
    finishes_in_the_writer_process,
    md,
    registry,
    run_turn,
    start_node,
)


def _ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(16, 512, (n,), generator=g).tolist()


@dataclass
class Probe:
    """Counts commits and statements on the node's engine, and statements run under the store lock."""

    store: Any
    commits: int = 0
    statements: int = 0
    under_lock: list[str] = field(default_factory=list)

    def attach(self, engine: Any) -> None:
        event.listen(engine, "commit", self._commit)
        event.listen(engine, "before_cursor_execute", self._execute)

    def _commit(self, conn: Any) -> None:
        self.commits += 1

    def _execute(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.statements += 1
        if self.store._lock.held():
            self.under_lock.append(statement.split("\n")[0][:80])


@pytest.fixture(params=["sqlite", "sqlite-inline", "postgres"])
def node(request, tmp_path: Path):
    torch.set_num_threads(1)
    url = request.getfixturevalue("postgres_url") if request.param == "postgres" else None
    # SQLite's finishes run in the registry writer process by default; "inline" in the turn's thread
    writer = "inline" if request.param == "sqlite-inline" else "process"
    n = start_node(tmp_path, registry(), database_url=url, registry_writer=writer)
    finishes_in_the_writer_process(n)
    yield n
    n.stop()


def test_one_write_transaction_and_one_sync_per_turn(node) -> None:
    store, ctx = node.service.store, node.service.ctx
    sqlite = ctx.engine.dialect.name == "sqlite"
    probe = Probe(store)
    probe.attach(ctx.engine)
    writer = node.service.engine.registry_writer
    # the transactions the registry writer process committed (there is one on a SQLite file by default)
    elsewhere = (lambda: writer.stats()["finishes"]) if writer is not None else (lambda: 0)
    sid = node.sessions.CreateSession(
        node.pb.sessions.CreateSessionRequest(model="a"), metadata=md()
    ).session.session_id
    run_turn(node, sid, _ids(1, 40))
    for i in range(3):
        commits, finishes, batches, syncs = probe.commits, elsewhere(), store.batches_written, store.wal_syncs
        sql_head = ctx.audit.chain_head("acme")[0]
        result = run_turn(node, sid, _ids(2 + i, 9))
        assert result.stats.persisted
        # SQLite: the turn's one transaction (in the writer process, or here when inline); PostgreSQL: a
        # reservation (replicas race) and the finish.
        assert probe.commits - commits + elsewhere() - finishes == (1 if sqlite else 2)
        assert elsewhere() - finishes == (1 if writer is not None else 0)
        # The turn's chunks in one batch, the superseded tail in a second, one WAL sync for both.
        assert store.batches_written - batches <= 2 and store.wal_syncs - syncs == 1
        # The turn's store records (new chunks, the superseded tail) went into that same transaction.
        assert ctx.audit.chain_head("acme")[0] > sql_head
    assert store.audit_acked_seq == store.audit.head()[0]
    store_records = [r for r in store.audit.iter_records() if r.tenant == "acme"]
    mirrored = [r for r in ctx.audit.iter_records(chain="acme") if r.actor == "storage"]
    assert [(r.subject, r.ts_us) for r in mirrored] == [(r.subject, r.ts_us) for r in store_records]
    assert ctx.audit.verify().ok
    assert probe.under_lock == []


def test_no_sql_runs_under_the_store_lock_with_concurrent_sessions_and_admin_calls(node) -> None:
    store, ctx = node.service.store, node.service.ctx
    probe = Probe(store)
    probe.attach(ctx.engine)
    errors: list[BaseException] = []

    def session(k: int, tenant: str) -> None:
        try:
            sid = node.sessions.CreateSession(
                node.pb.sessions.CreateSessionRequest(model="a"), metadata=md(tenant)
            ).session.session_id
            for i in range(3):
                run_turn(node, sid, _ids(100 * k + i, 12 if i else 40), tenant=tenant)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=session, args=(k, ("acme", "globex")[k % 2])) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    pb = node.pb
    node.admin.Purge(pb.admin.PurgeRequest(tenant_id="globex"), metadata=admin_md())
    verdict = node.admin.VerifyAudit(pb.admin.VerifyAuditRequest(), metadata=admin_md())
    assert verdict.ok and probe.statements > 0
    assert probe.under_lock == []
    chains = {c.chain: c for c in verdict.chains}
    assert set(chains) == {"", "acme", "globex"} and all(c.ok for c in chains.values())
    assert verdict.records == verdict.head_seq == sum(c.head_seq for c in chains.values())
    page = node.admin.QueryAudit(pb.admin.QueryAuditRequest(chain="globex", limit=1000), metadata=admin_md())
    assert page.records and {(r.chain, r.tenant) for r in page.records} == {("globex", "globex")}
    # Each tenant's records are in its own chain.
    assert {c for c in ctx.audit.chains() if ctx.audit.chain_head(c)[0] > 0} == {"acme", "globex"}

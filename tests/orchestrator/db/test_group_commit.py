"""GroupCommit: SQLite units waiting behind a leader share one transaction and one COMMIT (a savepoint
each); a failing unit rolls back alone and gets its own error; the rows and audit chains a group leaves
are those of its slow twin (each unit in its own run_serializable transaction, in the same order);
nobody is answered before the shared COMMIT; PostgreSQL runs each unit alone."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import event, func, select
from sqlalchemy.orm import Session

from orchestrator.db import (
    GroupCommit,
    SqlAuditSink,
    make_engine,
    run_serializable,
    serializable_factory,
)
from orchestrator.db.models import AuditHead, AuditRow
from storage import AuditAction, AuditEvent


class Refused(Exception):
    """A unit's own failure (after it wrote: its savepoint must take its writes back)."""


def _event(tenant: str, i: int) -> AuditEvent:
    return AuditEvent(
        actor="test", action=AuditAction.STORE, tenant=tenant, subject=f"chunk:{i:04x}", reason="turn_end"
    )


def _units(seed: int, sink: SqlAuditSink, n: int) -> list[tuple[Callable[[Session], Any], bool]]:
    """n units appending 1-3 records to random tenants' chains; about one in four then fails."""
    rng = random.Random(seed)
    units = []
    for k in range(n):
        events = [_event(rng.choice(["a", "b", "c"]), 100 * k + j) for j in range(rng.randint(1, 3))]
        fails = rng.random() < 0.25

        def work(s: Session, events=events, fails=fails, k=k) -> int:
            sink.append_in(s, events, ts_us=1_700_000_000_000_000 + k)
            if fails:
                raise Refused(f"unit {k}")
            return k

        units.append((work, fails))
    return units


def _rows(engine) -> tuple[list[tuple], list[tuple]]:
    with engine.connect() as conn:
        log = [tuple(r) for r in conn.execute(select(AuditRow.__table__).order_by("chain", "seq"))]
        heads = [tuple(r) for r in conn.execute(select(AuditHead.__table__).order_by("chain"))]
    return log, heads


def _run_grouped(
    gc: GroupCommit, units, *, hold: Callable[[Session], Any], after: Callable[[int], None] | None = None
) -> tuple[list[Any], list[threading.Thread]]:
    """Run `hold` first (it leads a batch of its own and blocks), queue every unit behind it in order,
    then let it go: the units run as one group, in queue order."""
    outcomes: list[Any] = [None] * len(units)
    threads = [threading.Thread(target=lambda: gc.run(hold))]
    threads[0].start()

    def one(i: int) -> None:
        try:
            outcomes[i] = gc.run(units[i][0])
            if after is not None:
                after(i)
        except Exception as exc:  # noqa: BLE001 - the outcome the test compares
            outcomes[i] = exc

    for i in range(len(units)):
        th = threading.Thread(target=one, args=(i,))
        th.start()
        threads.append(th)
        deadline = time.monotonic() + 10
        while len(gc._queue) < i + 1 and time.monotonic() < deadline:
            time.sleep(0.001)
    return outcomes, threads


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_group_leaves_the_rows_of_its_slow_twin_and_failures_roll_back_alone(
    registry_copy, seed
) -> None:
    engines = [make_engine(registry_copy(name)) for name in ("group", "twin")]
    group_engine, twin_engine = engines
    try:
        n = 12
        group_sink, twin_sink = SqlAuditSink(group_engine), SqlAuditSink(twin_engine)
        gc = GroupCommit(serializable_factory(group_engine))
        assert gc.grouped
        go = threading.Event()
        commits: list[int] = []
        event.listen(group_engine, "commit", lambda conn: commits.append(1))
        outcomes, threads = _run_grouped(
            gc,
            _units(seed, group_sink, n),
            hold=lambda s: go.wait(10) and group_sink.append_in(s, [_event("a", 9999)], ts_us=1),
        )
        go.set()
        for th in threads:
            th.join(20)
        # The holder's batch, then all n units in one batch: two commits in all.
        assert (gc.batches, gc.units, len(commits)) == (2, n + 1, 2)

        twin = serializable_factory(twin_engine)
        run_serializable(twin, lambda s: twin_sink.append_in(s, [_event("a", 9999)], ts_us=1))
        expected: list[Any] = []
        for work, _ in _units(seed, twin_sink, n):
            try:
                expected.append(run_serializable(twin, work))
            except Refused as exc:
                expected.append(exc)
        assert [type(o) for o in outcomes] == [type(e) for e in expected]
        assert [str(o) for o in outcomes] == [str(e) for e in expected]
        assert any(isinstance(e, Refused) for e in expected) or seed != 1
        # Bit-identical audit_log and audit_head rows: same seqs, hashes, chain order.
        assert _rows(group_engine) == _rows(twin_engine)
        assert group_sink.verify().ok
    finally:
        for e in engines:
            e.dispose()


def test_no_unit_is_answered_before_the_shared_commit(registry_copy) -> None:
    engine = make_engine(registry_copy("r"))
    try:
        sink = SqlAuditSink(engine)
        gc = GroupCommit(serializable_factory(engine))
        go = threading.Event()
        visible: list[int] = []
        # A slow COMMIT (as its WAL sync can be): the answers must wait for it.
        event.listen(engine, "commit", lambda conn: time.sleep(0.05))

        def seen(k: int) -> None:
            # Read through another connection the moment the unit is answered: committed data only.
            with engine.connect() as conn:
                n = conn.scalar(select(func.count()).where(AuditRow.subject == f"chunk:{k:04x}"))
            visible.append(n)

        units = [(lambda s, k=k: sink.append_in(s, [_event("a", k)]), False) for k in range(6)]
        outcomes, threads = _run_grouped(
            gc, units, hold=lambda s: go.wait(10) and s.execute(select(1)), after=seen
        )
        go.set()
        for th in threads:
            th.join(10)
        assert all(isinstance(o, list) for o in outcomes), outcomes
        assert visible == [1] * 6 and gc.batches == 2
        assert sink.chain_head("a")[0] == 6
    finally:
        engine.dispose()


def test_a_failed_commit_fails_every_unit_of_the_batch(registry_copy) -> None:
    engine = make_engine(registry_copy("r"))
    try:
        sink = SqlAuditSink(engine)
        gc = GroupCommit(serializable_factory(engine))
        go = threading.Event()
        units = [(lambda s, k=k: sink.append_in(s, [_event("a", k)]), False) for k in range(3)]
        outcomes, threads = _run_grouped(gc, units, hold=lambda s: go.wait(10) and s.execute(select(1)))

        commits: list[int] = []

        def refuse(conn: Any) -> None:
            # The holder's batch commits; the group's COMMIT fails.
            commits.append(1)
            if len(commits) > 1:
                raise RuntimeError("disk gone")

        event.listen(engine, "commit", refuse)
        go.set()
        for th in threads:
            th.join(10)
        assert all(isinstance(o, RuntimeError) for o in outcomes), outcomes
        assert sink.chain_head("a")[0] == 0
    finally:
        engine.dispose()


def test_postgres_runs_each_unit_alone(postgres_url) -> None:
    engine = make_engine(postgres_url)
    try:
        gc = GroupCommit(serializable_factory(engine))
        assert not gc.grouped
        assert gc.run(lambda s: 7) == 7 and gc.batches == 0
    finally:
        engine.dispose()


def test_bad_arguments_name_the_value(sqlite_engine) -> None:
    with pytest.raises(ValueError, match="max_batch=0"):
        GroupCommit(serializable_factory(sqlite_engine), max_batch=0)
    with pytest.raises(ValueError, match="attempts=0"):
        GroupCommit(serializable_factory(sqlite_engine), attempts=0)

"""WriterQueue: this process's SQLite writers take turns before BEGIN IMMEDIATE (instead of polling
SQLite's lock with growing sleeps), the turn ends when the connection is back in the pool, a failed
transaction hands it on, and a writer that waits past the timeout goes on to SQLite's own lock."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import text

from orchestrator.db import make_engine, run_serializable, serializable_factory
from orchestrator.db.engine import WRITER_OPTION, WriterQueue


@pytest.fixture
def engine(tmp_path: Path):
    engine = make_engine(f"sqlite:///{tmp_path / 'q.sqlite3'}")
    with engine.begin() as conn:
        conn.execute(text("create table t (id integer primary key, who text)"))
    yield engine
    engine.dispose()


def test_writers_take_turns_and_a_failed_one_hands_on(engine) -> None:
    factory = serializable_factory(engine)
    inside = threading.Event()
    release = threading.Event()
    order: list[str] = []

    def first(s):
        s.execute(text("insert into t (who) values ('first')"))
        inside.set()
        release.wait(10)
        order.append("first")

    def second(s):
        # the transaction (and its turn in the queue) begins at its first statement
        s.execute(text("insert into t (who) values ('second')"))
        order.append("second")

    a = threading.Thread(target=run_serializable, args=(factory, first))
    a.start()
    assert inside.wait(10)
    b = threading.Thread(target=run_serializable, args=(factory, second))
    b.start()
    time.sleep(0.2)
    # the second writer waits for its turn while the first holds it
    assert order == []
    release.set()
    a.join(10)
    b.join(10)
    assert order == ["first", "second"]

    def failing(s):
        s.execute(text("insert into t (who) values ('failed')"))
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_serializable(factory, failing)
    # the failed writer's rollback returned its connection and its turn: the next one runs at once
    run_serializable(factory, second)
    with engine.connect() as conn:
        assert [w for (w,) in conn.execute(text("select who from t order by id"))] == [
            "first",
            "second",
            "second",
        ]


class _Conn:
    """What `WriterQueue.on_begin` uses of a SQLAlchemy Connection: its info, its options and the
    driver connection it begins on."""

    def __init__(self) -> None:
        self.info: dict = {}
        self.sql: list[str] = []
        self.connection = self
        self.driver_connection = self

    def get_execution_options(self) -> dict:
        return {WRITER_OPTION: True}

    def execute(self, sql: str) -> None:
        self.sql.append(sql)


def test_a_writer_waiting_past_the_timeout_goes_on_to_sqlite() -> None:
    queue = WriterQueue(timeout_s=0.05)
    holder, late = _Conn(), _Conn()
    queue.on_begin(holder)
    t0 = time.monotonic()
    queue.on_begin(late)
    # it waited its timeout, then asked SQLite (whose busy handler decides) without holding the queue
    assert time.monotonic() - t0 >= 0.05 and late.sql == ["BEGIN IMMEDIATE"] and not late.info
    queue.on_release(None, type("Record", (), {"info": late.info})())
    queue.on_release(None, type("Record", (), {"info": holder.info})())
    again = _Conn()
    queue.on_begin(again)
    assert again.info  # the holder's release freed the queue

"""Engines and session factories for the registry database (SQLite file by default, or PostgreSQL).

Knows nothing of the schema; `migrate.py` creates it through Alembic, never `create_all`.
"""

from __future__ import annotations

import sqlite3
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

__all__ = ["make_engine", "make_session_factory"]

# SQLite waits this long for a writer lock instead of failing at once with "database is locked".
_SQLITE_BUSY_TIMEOUT_MS = 30_000
# Connections a SQLite engine keeps open (and as many more at peaks): the default gRPC workers' number.
_SQLITE_POOL_SIZE = 64


def make_engine(url: str, *, echo: bool = False) -> Engine:
    """Create an Engine for `url`; SQLite files get foreign keys on, WAL, and a busy timeout.

    Raises:
        ValueError: `url` is not a SQLite or PostgreSQL URL.
    """
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            echo=echo,
            connect_args={"timeout": _SQLITE_BUSY_TIMEOUT_MS / 1000},
            # Every running turn reads and writes through a pooled connection: SQLAlchemy's default of
            # 5 + 10 had 64 concurrent turns queueing for connections (most of their waiting in the
            # no-op service benchmark). A SQLite connection is a file handle; keep enough of them.
            pool_size=_SQLITE_POOL_SIZE,
            max_overflow=_SQLITE_POOL_SIZE,
        )
        event.listen(engine, "connect", _sqlite_on_connect)
        # pysqlite's own BEGIN handling is disabled; `WriterQueue.on_begin` emits BEGIN IMMEDIATE for
        # writers (`serializable_factory`), so that a read-then-write transaction cannot deadlock
        # against another writer (serialisable on SQLite), and a deferred BEGIN for readers, which in
        # WAL mode neither take nor wait for the write lock.
        queue = WriterQueue()
        event.listen(engine, "begin", queue.on_begin)
        for name in ("checkin", "invalidate", "soft_invalidate", "detach", "close"):
            event.listen(engine, name, queue.on_release)
        return engine
    if backend == "postgresql":
        engine = create_engine(url, echo=echo, pool_pre_ping=True)
        event.listen(engine, "connect", _postgres_on_connect)
        return engine
    raise ValueError(f"database URL backend {backend!r} is not supported (sqlite or postgresql)")


@contextmanager
def scratch_schema(server_url: str, prefix: str) -> Iterator[str]:
    """A fresh, empty schema on the PostgreSQL server at `server_url`, named `prefix` and a random suffix:
    yields a URL whose search_path points at it, and drops the schema (cascade) afterwards. For the tests'
    and benchmarks' registries on a shared server."""
    schema = f"{prefix}{uuid.uuid4().hex[:12]}"
    admin = make_engine(server_url)
    try:
        with admin.begin() as conn:
            conn.execute(text(f'create schema "{schema}"'))
        url = make_url(server_url).update_query_dict({"options": f"-csearch_path={schema}"})
        try:
            yield url.render_as_string(hide_password=False)
        finally:
            with admin.begin() as conn:
                conn.execute(text(f'drop schema "{schema}" cascade'))
    finally:
        admin.dispose()


def _postgres_on_connect(dbapi_connection: Any, connection_record: object) -> None:
    """Plan every execution with its own parameters (`plan_cache_mode = force_custom_plan`).

    Why: psycopg prepares a statement on the server from its fifth execution, and PostgreSQL then may
    keep one generic plan for it, chosen from the statistics of that moment. A registry that started
    empty plans the per-turn statements while its tables hold a few rows, and the plan stays as they
    grow: the read of a 250-chunk session's links took 24 ms a turn under such a plan, against 1 ms
    planned per execution (benchmarks/bench_link_current.py, a fresh schema; orchestrator/README.md,
    session 23). Planning these small statements costs far less than that.
    """
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SET SESSION plan_cache_mode = force_custom_plan")
    finally:
        cursor.close()
    dbapi_connection.commit()


def _sqlite_on_connect(dbapi_connection: object, connection_record: object) -> None:
    # Disable pysqlite's implicit transaction handling; `_sqlite_on_begin` issues BEGIN instead.
    dbapi_connection.isolation_level = None  # type: ignore[attr-defined]
    cursor = dbapi_connection.cursor()  # type: ignore[attr-defined]
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={_SQLITE_BUSY_TIMEOUT_MS}")
    cursor.close()


WRITER_OPTION = "kvresume_sqlite_writer"
"""Execution option that makes a SQLite transaction take the write lock at BEGIN (BEGIN IMMEDIATE)."""


_HOLDS_QUEUE = "kvresume_holds_writer_queue"


class WriterQueue:
    """This process's SQLite writers wait here, one at a time, before they ask for SQLite's write lock.

    A writer that finds SQLite's lock taken polls for it with growing sleeps (its busy handler: 1, 2,
    5 ... 100 ms), so under many concurrent turns writers slept far past the moment the lock was free
    (some turns waited seconds). A writer queued here instead wakes as soon as the previous writer's
    connection is back in the pool (after its COMMIT or ROLLBACK).

    Writers of other processes (an offline CLI) still meet SQLite's busy handler. A writer that waits
    here longer than the busy timeout goes on to BEGIN IMMEDIATE without its turn (SQLite then decides,
    as it did without the queue), so a thread that opens a second write transaction while holding one
    fails after the timeout as before instead of waiting forever.
    """

    def __init__(self, timeout_s: float = _SQLITE_BUSY_TIMEOUT_MS / 1000) -> None:
        self._lock = threading.Lock()
        self._timeout_s = timeout_s

    def on_begin(self, connection: Any) -> None:
        """The engine's `begin` event: BEGIN IMMEDIATE for writers (after their turn here), BEGIN else."""
        writer = connection.get_execution_options().get(WRITER_OPTION, False)
        if writer and not connection.info.get(_HOLDS_QUEUE) and self._lock.acquire(timeout=self._timeout_s):
            connection.info[_HOLDS_QUEUE] = True
        sql = "BEGIN IMMEDIATE" if writer else "BEGIN"
        try:
            # On the driver connection: `exec_driver_sql`'s execution path cost about 20 us a statement
            # (every write transaction begins here while the others wait for the queue).
            connection.connection.driver_connection.execute(sql)
        except sqlite3.Error as exc:
            self._release(connection.info)
            # wrapped as SQLAlchemy wraps a statement's error, so that run_serializable still sees a
            # "database is locked" as a conflict to rerun
            raise DBAPIError.instance(sql, (), exc, sqlite3.Error) from exc
        except BaseException:
            self._release(connection.info)
            raise

    def on_release(self, dbapi_connection: Any, record: Any, *args: Any) -> None:
        """The pool's checkin / invalidate / detach / close events: the connection's transaction is over."""
        if record is not None:
            self._release(record.info)

    def _release(self, info: dict[Any, Any]) -> None:
        if info.pop(_HOLDS_QUEUE, False):
            self._lock.release()


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """A factory of ORM Sessions for reads; the caller (RPC handler) owns each Session's unit of work.
    On SQLite their transactions begin deferred (no write lock): write through `serializable_factory`."""
    return sessionmaker(engine, expire_on_commit=False)

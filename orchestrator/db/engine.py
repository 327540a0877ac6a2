"""Engines and session factories for the registry database (SQLite file by default, or PostgreSQL).

Knows nothing of the schema; `migrate.py` creates it through Alembic, never `create_all`.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

__all__ = ["make_engine", "make_session_factory"]

# SQLite waits this long for a writer lock instead of failing at once with "database is locked".
_SQLITE_BUSY_TIMEOUT_MS = 30_000


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
        engine = create_engine(url, echo=echo, connect_args={"timeout": _SQLITE_BUSY_TIMEOUT_MS / 1000})
        event.listen(engine, "connect", _sqlite_on_connect)
        # pysqlite's own BEGIN handling is disabled; `_sqlite_on_begin` emits BEGIN IMMEDIATE for
        # writers (`serializable_factory`), so that a read-then-write transaction cannot deadlock
        # against another writer (serialisable on SQLite), and a deferred BEGIN for readers, which in
        # WAL mode neither take nor wait for the write lock.
        event.listen(engine, "begin", _sqlite_on_begin)
        return engine
    if backend == "postgresql":
        return create_engine(url, echo=echo, pool_pre_ping=True)
    raise ValueError(f"database URL backend {backend!r} is not supported (sqlite or postgresql)")


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


def _sqlite_on_begin(connection: object) -> None:
    writer = connection.get_execution_options().get(WRITER_OPTION, False)  # type: ignore[attr-defined]
    connection.exec_driver_sql("BEGIN IMMEDIATE" if writer else "BEGIN")  # type: ignore[attr-defined]


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """A factory of ORM Sessions for reads; the caller (RPC handler) owns each Session's unit of work.
    On SQLite their transactions begin deferred (no write lock): write through `serializable_factory`."""
    return sessionmaker(engine, expire_on_commit=False)

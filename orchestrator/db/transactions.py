"""Serialisable units of work with retry: what several orchestrator replicas need to share one database.

Knows nothing of what the work does; it reruns the whole function when the database reports a
serialisation conflict, so the function must be free of side effects outside its Session.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TypeVar

import structlog
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.db.engine import WRITER_OPTION

__all__ = [
    "connection_of",
    "is_retryable",
    "run_serializable",
    "run_serializable_connection",
    "serializable_engine",
    "serializable_factory",
]

T = TypeVar("T")
U = TypeVar("U")
log = structlog.get_logger(__name__)

# PostgreSQL SQLSTATEs that mean "another transaction won; run yours again": serialization_failure,
# deadlock_detected, and unique_violation (two appenders raced for the same next seq).
_RETRY_SQLSTATES = {"40001", "40P01", "23505"}


def serializable_engine(engine: Engine) -> Engine:
    """`engine` with the options of a serialisable writer: SERIALIZABLE on PostgreSQL, BEGIN IMMEDIATE
    on SQLite (writers serialise on the database's write lock)."""
    if engine.dialect.name == "postgresql":
        return engine.execution_options(isolation_level="SERIALIZABLE")
    if engine.dialect.name == "sqlite":
        return engine.execution_options(**{WRITER_OPTION: True})
    return engine


def serializable_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose transactions run on `serializable_engine(engine)`."""
    return sessionmaker(serializable_engine(engine), expire_on_commit=False)


def connection_of(unit: Session | Connection) -> Connection:
    """The Core connection a unit of work runs its statements on: a Session's (in its transaction,
    begun if none) or the Connection itself (`run_serializable_connection`)."""
    return unit if isinstance(unit, Connection) else unit.connection()


def is_retryable(exc: BaseException) -> bool:
    """True for a conflict that a rerun of the transaction may resolve."""
    if not isinstance(exc, DBAPIError):
        return False
    sqlstate = getattr(exc.orig, "sqlstate", None)
    if sqlstate in _RETRY_SQLSTATES:
        return True
    # SQLite reports lock contention past busy_timeout as "database is locked".
    return "database is locked" in str(exc.orig)


def run_serializable(
    factory: sessionmaker[Session],
    work: Callable[[Session], T],
    *,
    attempts: int = 30,
    backoff_s: float = 0.002,
) -> T:
    """Run `work(session)` in one transaction and commit; rerun it on serialisation conflicts.

    Raises:
        ValueError: attempts < 1.
        sqlalchemy.exc.DBAPIError: a non-retryable database error, or the last conflict after
            `attempts` tries.
    """

    @contextmanager
    def transaction() -> Iterator[Session]:
        with factory() as session, session.begin():
            yield session

    return _with_retries(transaction, work, attempts=attempts, backoff_s=backoff_s)


def run_serializable_connection(
    engine: Engine,
    work: Callable[[Connection], T],
    *,
    attempts: int = 30,
    backoff_s: float = 0.002,
) -> T:
    """`run_serializable` for work that runs only Core or driver statements: the same transaction on
    `engine` (a `serializable_engine`: BEGIN IMMEDIATE on SQLite after its writer queue, SERIALIZABLE on
    PostgreSQL), commit, and reruns, on one pooled Connection without an ORM Session (whose begin,
    connection lookup, flush and commit bookkeeping cost a turn's write about 0.1 ms of CPU while the
    other turns wait for its write lock).

    Raises:
        ValueError: attempts < 1.
        sqlalchemy.exc.DBAPIError: as `run_serializable`.
    """

    @contextmanager
    def transaction() -> Iterator[Connection]:
        with engine.connect() as conn, conn.begin():
            yield conn

    return _with_retries(transaction, work, attempts=attempts, backoff_s=backoff_s)


def _with_retries(
    transaction: Callable[[], AbstractContextManager[U]],
    work: Callable[[U], T],
    *,
    attempts: int,
    backoff_s: float,
) -> T:
    """`work(unit)` inside `transaction()` (which commits on a clean exit), rerun on retryable
    conflicts, up to `attempts` times."""
    if attempts < 1:
        raise ValueError(f"attempts={attempts} must be >= 1")
    for attempt in range(1, attempts + 1):
        try:
            with transaction() as unit:
                return work(unit)
        except DBAPIError as exc:
            if attempt == attempts or not is_retryable(exc):
                raise
            log.debug("serializable_retry", attempt=attempt, sqlstate=getattr(exc.orig, "sqlstate", None))
            # Jittered exponential backoff so that racing replicas do not collide again in lockstep.
            time.sleep(backoff_s * (2 ** min(attempt, 8)) * random.random())
    raise AssertionError("unreachable")

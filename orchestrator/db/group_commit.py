"""Group commit: the SQLite write transactions waiting for this process's writer lock share one
transaction and one COMMIT, each inside its own SAVEPOINT.

SQLite has one writer at a time. Under many concurrent turns each turn's finish waited in the writer
queue behind the others' whole transactions (BEGIN IMMEDIATE, its statements, the COMMIT and its WAL
sync). Here the first waiter becomes the leader: it takes every unit of work queued so far, runs them in
one transaction, one SAVEPOINT each, and commits once; the others wait for its COMMIT. A unit whose work
raises is rolled back to its savepoint and gets its own error; the rest commit. No unit is answered
before the COMMIT that holds it has returned, so nothing acknowledged can be lost on a kill.

A batch of one runs through `run_serializable` as before (no savepoint), and so does every unit on
PostgreSQL, where each turn keeps its own SERIALIZABLE transaction (replicas race there, and a conflict
reruns one turn, not a group). The units run in queue order on the leader's thread: like
`run_serializable`'s work they must touch nothing outside their Session, since a retryable failure of
the batch reruns them all.

Status: not wired into the turn finish. In alternating no-op runs (bench_service, load ~6) it cut
commits per turn at 64 sessions from 1.20 to 0.23 but gained no turns/s there (23.9 and 19.0 vs 19.6
and 19.8) and lost about half at 8 sessions (13.5 and 14.0 vs 25.2 and 22.7 turns/s). Suspected, not
measured: `notify_all` wakes every waiter per batch, and each woken thread waits for the GIL.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import structlog
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.db.transactions import is_retryable, run_serializable

__all__ = ["GroupCommit"]

T = TypeVar("T")
log = structlog.get_logger(__name__)


class _Unit(Generic[T]):
    """One caller's work and, once its batch is over, its result or its error."""

    __slots__ = ("work", "done", "result", "error")

    def __init__(self, work: Callable[[Session], T]) -> None:
        self.work = work
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None

    def outcome(self) -> T:
        if self.error is not None:
            raise self.error
        return self.result


class GroupCommit:
    """Runs units of write work in shared SQLite transactions (see the module doc); on other databases
    each unit runs alone through `run_serializable`.

    Raises:
        ValueError: max_batch < 1 or attempts < 1.
    """

    def __init__(
        self,
        factory: sessionmaker[Session],
        *,
        max_batch: int = 64,
        attempts: int = 30,
        backoff_s: float = 0.002,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        if attempts < 1:
            raise ValueError(f"attempts={attempts} must be >= 1")
        self._factory = factory
        bind = factory.kw.get("bind")
        self._grouped = bind is not None and bind.dialect.name == "sqlite"
        self._max_batch = max_batch
        self._attempts = attempts
        self._backoff_s = backoff_s
        self._cond = threading.Condition()
        self._queue: list[_Unit[Any]] = []
        self._leading = False
        # Batches committed and units they held (for tests and the benchmark: units / batches is the
        # mean group size).
        self.batches = 0
        self.units = 0

    @property
    def grouped(self) -> bool:
        """True when units may share a transaction (SQLite)."""
        return self._grouped

    def run(self, work: Callable[[Session], T]) -> T:
        """Run `work(session)` in a committed write transaction (maybe shared) and return its result.

        Raises:
            whatever `work` raised (its savepoint rolled back, the others' work committed), or the
            database error that failed the shared transaction (nothing of the batch committed).
        """
        if not self._grouped:
            return run_serializable(self._factory, work, attempts=self._attempts, backoff_s=self._backoff_s)
        unit: _Unit[T] = _Unit(work)
        with self._cond:
            self._queue.append(unit)
            while self._leading and not unit.done:
                self._cond.wait()
            if unit.done:
                return unit.outcome()
            self._leading = True
        try:
            # Lead until this unit's batch is over: each batch takes the queue's front, so it is in
            # the first one unless more than max_batch units were waiting.
            while not unit.done:
                with self._cond:
                    batch = self._queue[: self._max_batch]
                    del self._queue[: len(batch)]
                self._commit(batch)
                with self._cond:
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._leading = False
                self._cond.notify_all()
        return unit.outcome()

    def _commit(self, batch: list[_Unit[Any]]) -> None:
        """Run `batch` and mark every unit done, whatever happens (a unit never waits for ever)."""
        try:
            if len(batch) == 1:
                self._alone(batch[0])
            else:
                self._together(batch)
            self.batches += 1
            self.units += len(batch)
        except BaseException as exc:
            for u in batch:
                if not u.done:
                    u.error, u.done = exc, True
            if not isinstance(exc, Exception):
                raise
        finally:
            for u in batch:
                u.done = True

    def _alone(self, unit: _Unit[Any]) -> None:
        # The slow twin: the unit's own transaction, exactly as without group commit.
        try:
            unit.result = run_serializable(
                self._factory, unit.work, attempts=self._attempts, backoff_s=self._backoff_s
            )
        except Exception as exc:
            unit.error = exc

    def _together(self, batch: list[_Unit[Any]]) -> None:
        for attempt in range(1, self._attempts + 1):
            for u in batch:
                u.result, u.error = None, None
            try:
                with self._factory() as session, session.begin():
                    for u in batch:
                        try:
                            with session.begin_nested():
                                u.result = u.work(session)
                        except Exception as exc:
                            # Lock contention (another process) fails the whole batch: rerun it all.
                            if is_retryable(exc):
                                raise
                            u.error = exc
                return
            except Exception as exc:
                if attempt == self._attempts or not is_retryable(exc):
                    for u in batch:
                        u.result = None
                        if u.error is None:
                            u.error = exc
                    return
                log.debug("group_commit_retry", attempt=attempt, units=len(batch))
                time.sleep(self._backoff_s * (2 ** min(attempt, 8)) * random.random())

"""`RegistryWriter`: the service's side of the registry writer process (worker.py).

A turn's thread sends its finish (`FinishRequest`) on a connection of its own and waits for the answer:
None once the transaction committed there, or the error it raised there (PreconditionError,
sqlalchemy's errors once its reruns are spent), raised here. The turn engine starts the process in the
background at the node's first concurrent turns, and again after it died; their finishes run inline
until it is up (`available`). A node that never runs two turns at once never starts it (nor
does a test suite's many short-lived nodes).

Failure: when the process dies (killed, out of memory), the finishes in flight raise
`RegistryWriterError` (their turns fail as a failed transaction does: nothing committed that the turn
did not see committed, the store's records go back to the store) and the next finish starts a new
process. A finish that was sent but not answered may have committed there; the turn then fails although
its row exists, as when a commit's answer is lost.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import structlog

from orchestrator.api import UnavailableError
from orchestrator.child_process import ChildProcess, Reply, dumps, loads
from orchestrator.registry_writer.finish import FinishRequest
from orchestrator.registry_writer.worker import WriterConfig

__all__ = ["RegistryWriter", "RegistryWriterError"]

log = structlog.get_logger(__name__)


class RegistryWriterError(UnavailableError):
    """The registry writer process died or could not start: retry the turn."""


class RegistryWriter:
    """Runs turns' finishes in a registry writer process of its own (see the module docstring).

    Args:
        database_url: the registry (a SQLite file, migrated).
        connections: most finishes in flight at once (the rest wait for a connection; SQLite runs one
            write transaction at a time anyway).
        start_timeout_s: how long a start may take.
        child_start: "preloaded" or "exec" (orchestrator/child_launcher.py).
    """

    def __init__(
        self,
        database_url: str,
        *,
        connections: int = 8,
        python: str | None = None,
        start_timeout_s: float = 60.0,
        child_start: str = "preloaded",
    ) -> None:
        if connections < 1:
            raise ValueError(f"connections={connections} must be >= 1")
        self._url = database_url
        self._child_start = child_start
        self._connections = connections
        self._python = python or sys.executable
        self._start_timeout_s = start_timeout_s
        self._proc: ChildProcess | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._starting = threading.Lock()  # held by the one background start at a time
        self.starts = 0

    def started(self) -> bool:
        """Whether a process is up (started and not known dead); never waits."""
        proc = self._proc
        return proc is not None and not proc.dead

    def start(self) -> None:
        """Start the process now, unless one is up; returns once it is ready.

        Raises:
            RegistryWriterError: it could not start.
        """
        self._process()

    def available(self) -> bool:
        """Whether a process is up to take a finish now; when none is, one starts in the background (the
        caller runs its finish inline meanwhile). Never waits."""
        if self.started():
            return True
        self.start_soon()
        return False

    def start_soon(self) -> None:
        """Start the process in the background, unless one is up or starting."""
        if self.started() or not self._starting.acquire(blocking=False):
            return
        threading.Thread(
            target=self._start_quietly, name="kvresume-registry-writer-start", daemon=True
        ).start()

    def _start_quietly(self) -> None:
        try:
            self._process()
        except RegistryWriterError as exc:
            log.error("registry_writer_not_started", error=str(exc))  # the next start_soon tries again
        finally:
            self._starting.release()

    def _process(self) -> ChildProcess:
        with self._lock:
            if self._closed:
                raise RegistryWriterError("the registry writer was closed")
            if self._proc is None or self._proc.dead:
                self._proc = ChildProcess(
                    "orchestrator.registry_writer",
                    WriterConfig(database_url=self._url, authkey=os.urandom(32)),
                    connections=self._connections,
                    python=self._python,
                    start_timeout_s=self._start_timeout_s,
                    error=RegistryWriterError,
                    what="the registry writer process",
                    start=self._child_start,
                )
                self.starts += 1
                log.info("registry_writer_started", pid=self._proc.proc.pid, starts=self.starts)
            return self._proc

    def _call(self, op: str, *args: Any) -> Any:
        payload = dumps((op, args))
        for attempt in (1, 2):
            proc = self._process()
            conn = proc.checkout()
            try:
                conn.send_bytes(payload)
            except (EOFError, OSError) as exc:
                # Not sent: the process had ended (killed while idle). Nothing of the call ran there, so
                # it runs once more on a new process.
                self._lost(proc, conn, exc)
                if attempt == 1:
                    continue
                raise RegistryWriterError(f"the registry writer process is not reachable: {exc}") from exc
            try:
                reply: Reply = loads(conn.recv_bytes())
            except (EOFError, OSError) as exc:
                # Sent, unanswered: it may have committed there before the process ended.
                self._lost(proc, conn, exc)
                raise RegistryWriterError(
                    f"the registry writer process ended during {op} (exit code {proc.proc.poll()})"
                ) from exc
            proc.checkin(conn)
            if reply.error is not None:
                raise reply.error
            return reply.value
        raise AssertionError("unreachable")

    def _lost(self, proc: ChildProcess, conn: Any, exc: BaseException) -> None:
        conn.close()
        with self._lock:
            if not proc.dead:
                log.error("registry_writer_died", pid=proc.proc.pid, error=f"{type(exc).__name__}: {exc}")
                proc.kill()

    def finish(self, req: FinishRequest) -> None:
        """Run `req`'s transaction there; returns once it committed.

        Raises:
            PreconditionError: the session was deleted, closed or advanced during the turn.
            RegistryWriterError: the process died or could not start.
            sqlalchemy.exc.DBAPIError: as `run_serializable_connection`.
        """
        self._call("finish", req)

    def stats(self) -> dict[str, Any]:
        """The process's finishes, their CPU and wall seconds, and its CPU seconds (worker.op_stats)."""
        return self._call("stats")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()

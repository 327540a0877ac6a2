"""The registry writer process (`python -m orchestrator.registry_writer`): runs turns' finishes, each one
SQLite write transaction (`finish.write_finish`), for the service that started it.

Why a process: on SQLite a turn's finish holds the database's one write lock from BEGIN IMMEDIATE to
COMMIT, so every other turn's finish waits for it. The sqlite3 module lets go of the GIL around every
statement step, and in the service's process, where 64 turns' threads and the gRPC threads want the GIL,
each step then waited to get it back: measured (Intel Xeon, 2 vCPUs, the no-op service at 64 sessions),
a finish held the write lock 5.1-5.6 ms for 1.1 ms of its thread's CPU, the lock was held 80-83% of the
run, and each turn waited about 290 ms for it. Here nothing else wants this process's GIL.

Start-up and connections as orchestrator/child_process.py has them. Each call is one request `(op, args)`
and one `child_process.Reply`.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from orchestrator.child_process import serve_calls, serve_connections
from orchestrator.db import SqlAuditSink, make_engine, run_serializable_connection, serializable_engine
from orchestrator.registry_writer.finish import DriverFinish, FinishRequest, write_finish

__all__ = ["WriterConfig", "serve_forever"]


@dataclass(frozen=True, kw_only=True)
class WriterConfig:
    """The registry (already migrated by the parent) and the connections' key."""

    database_url: str
    authkey: bytes


class _Writer:
    def __init__(self, config: WriterConfig) -> None:
        engine = make_engine(config.database_url)
        self._writer = serializable_engine(engine)
        # its own sink: it remembers the chains' heads it moved, and a head another writer (the service's
        # own appends) moved since is read again (SqlAuditSink's guarded move)
        self._audit = SqlAuditSink(engine)
        self._driver = DriverFinish(engine.dialect)
        self._lock = threading.Lock()
        # [finishes, thread CPU seconds, wall seconds]
        self._times = [0, 0.0, 0.0]
        # the service that started this process (a finish commits only while it lives)
        self.parent = os.getppid()

    def _write(self, conn: Any, req: FinishRequest) -> None:
        write_finish(conn, conn, req, self._audit, self._driver)
        # Checked just before the COMMIT: a service killed while its finish ran here never hears of it, so
        # the finish rolls back, as it would have in the service's own thread. Without this a kill -9 of
        # the service left the finishes in flight here to commit (the lifeline ends this process a few
        # milliseconds later): turns whose end no client saw.
        if os.getppid() != self.parent:
            raise RuntimeError("registry writer: the service that asked for this finish has ended")

    def op_finish(self, req: FinishRequest) -> None:
        c0, w0 = time.thread_time(), time.perf_counter()
        run_serializable_connection(self._writer, lambda conn: self._write(conn, req))
        with self._lock:
            self._times[0] += 1
            self._times[1] += time.thread_time() - c0
            self._times[2] += time.perf_counter() - w0

    def op_stats(self) -> dict[str, Any]:
        """Finishes run, their thread CPU and wall seconds, and the process's CPU seconds."""
        with self._lock:
            calls, cpu, wall = self._times
        t = os.times()
        return {
            "finishes": calls,
            "finish_cpu_s": cpu,
            "finish_wall_s": wall,
            "process_cpu_s": t.user + t.system,
        }

    def call(self, request: tuple[str, tuple[Any, ...]]) -> Any:
        op, args = request
        handler = getattr(self, f"op_{op}", None)
        if handler is None:
            raise ValueError(f"registry writer: unknown operation {op!r}")
        return handler(*args)

    def serve(self, conn: Connection) -> None:
        serve_calls(conn, self.call, "registry writer")


def serve_forever(config: WriterConfig) -> None:
    """Open the registry, print the ready line, and serve connections until the process ends."""
    writer = _Writer(config)
    serve_connections(config.authkey, writer.serve, "kvresume-registry-writer-conn")

"""Registry sessions made one request ahead for keyless HTTP requests, so that the registry write of a new
session (a serializable transaction and its commit, about 12 ms on SQLite here) is not on a stateless
request's path to its first token.

Each (tenant, model) that sent a keyless request keeps one spare: a real, empty session of the tenant
(it counts toward `max_sessions_per_tenant` and is listed by ListSessions), made on the front door's
threads after the turn that took the previous one ended (between an agent's requests, not beside a turn
that is starting). The first keyless request of a tenant creates its session itself. A
purge of the tenant or of the spare drops it from here; a spare that cannot be made (the tenant's session
limit, the registry down) is not, and the next request creates its session itself and gets that error.
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor

import structlog

from orchestrator.api import ServiceContext
from orchestrator.api.turn_runner import create_session

__all__ = ["SpareSessions"]

log = structlog.get_logger(__name__)


class SpareSessions:
    """One spare session per (tenant, model); thread-safe."""

    def __init__(self, ctx: ServiceContext, executor: Executor) -> None:
        self._ctx = ctx
        self._executor = executor
        self._lock = threading.Lock()
        self._spare: dict[tuple[str, str], str] = {}
        self._making: set[tuple[str, str]] = set()

    def _create(self, tenant: str, model: str) -> str:
        sid, _ = create_session(
            self._ctx, tenant_id=tenant, model=model, retention_hint_s=None, convert=lambda row: row.id
        )
        return sid

    def take(self, tenant: str, model: str) -> str:
        """A new session of the tenant for `model`: the spare when there is one, else one created now.

        Raises:
            ResourceExhaustedError: SESSION_LIMIT (no spare, and the tenant is at its limit).
        """
        with self._lock:
            sid = self._spare.pop((tenant, model), None)
        return sid if sid is not None else self._create(tenant, model)

    def refill(self, tenant: str, model: str) -> None:
        """Make a spare for (tenant, model) on the front door's threads, unless one is there or being made."""
        key = (tenant, model)
        with self._lock:
            if key in self._spare or key in self._making:
                return
            self._making.add(key)
        try:
            self._executor.submit(self._make, key)
        except RuntimeError:
            # the executor is shut down (server stopping): no spare
            with self._lock:
                self._making.discard(key)

    def _make(self, key: tuple[str, str]) -> None:
        try:
            sid = self._create(*key)
        except Exception as exc:  # noqa: BLE001 - a spare is an optimisation; the next request reports it
            log.info("spare_session_not_made", tenant=key[0], model=key[1], error=str(exc))
            with self._lock:
                self._making.discard(key)
            return
        with self._lock:
            self._making.discard(key)
            if key in self._spare:
                return
            self._spare[key] = sid

    def forget_session(self, session_id: str) -> None:
        with self._lock:
            for key in [k for k, v in self._spare.items() if v == session_id]:
                del self._spare[key]

    def forget_tenant(self, tenant: str) -> None:
        with self._lock:
            for key in [k for k in self._spare if k[0] == tenant]:
                del self._spare[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._spare)

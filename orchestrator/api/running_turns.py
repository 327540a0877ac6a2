"""Running turns of this process: one per session at a time, each with a cancel flag that Abort sets.

Knows nothing of how a turn runs; the turn engine polls `TurnHandle.cancelled` between steps. A turn is
found by its session or by its request id (unique among a tenant's running turns).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from orchestrator.api.errors import PreconditionError

__all__ = ["TurnHandle", "RunningTurns"]


@dataclass(kw_only=True, eq=False)
class TurnHandle:
    """A running turn; `cancel` is idempotent and thread-safe."""

    session_id: str
    request_id: str
    tenant_id: str = ""
    _event: threading.Event = field(default_factory=threading.Event)
    reason: str = ""
    # Set with the cancel: the turn's input and streamed tokens join the history (Abort keep_partial).
    keep_partial: bool = False
    # Set when the turn left the running turns (`RunningTurns.finish`): a cancel has nothing to stop.
    finished: bool = False

    def cancel(self, reason: str, *, keep_partial: bool = False) -> None:
        """Ask the turn to stop at its next step; the first cancel's reason and choice win."""
        if not self._event.is_set():
            self.reason = reason
            self.keep_partial = keep_partial
            self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until cancelled or `timeout_s` passed; True when cancelled."""
        return self._event.wait(timeout_s)


class RunningTurns:
    """The registry of running turns; `start` refuses a second turn on the same session."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_session: dict[str, TurnHandle] = {}
        self._by_request: dict[tuple[str, str], TurnHandle] = {}

    def start(self, session_id: str, request_id: str, tenant_id: str = "") -> TurnHandle:
        """Register a turn.

        Raises:
            PreconditionError: the session already has a running turn, or the tenant has a running turn
                with this request id.
        """
        with self._lock:
            if (tenant_id, request_id) in self._by_request:
                other = self._by_request[(tenant_id, request_id)].session_id
                raise PreconditionError(
                    f"request_id {request_id!r} is already running (session {other})",
                    reason="TURN_RUNNING",
                    field="request_id",
                    retry_after_s=1.0,
                )
            if session_id in self._by_session:
                running = self._by_session[session_id].request_id
                raise PreconditionError(
                    f"session {session_id} already has a running turn ({running})",
                    reason="TURN_RUNNING",
                    retry_after_s=1.0,
                )
            handle = TurnHandle(session_id=session_id, request_id=request_id, tenant_id=tenant_id)
            self._by_session[session_id] = handle
            self._by_request[(tenant_id, request_id)] = handle
            return handle

    def finish(self, handle: TurnHandle) -> None:
        handle.finished = True
        with self._lock:
            if self._by_session.get(handle.session_id) is handle:
                del self._by_session[handle.session_id]
            key = (handle.tenant_id, handle.request_id)
            if self._by_request.get(key) is handle:
                del self._by_request[key]

    def count(self) -> int:
        """How many turns run now."""
        with self._lock:
            return len(self._by_session)

    def find(self, *, tenant_id: str, session_id: str = "", request_id: str = "") -> TurnHandle | None:
        """The running turn of this tenant with this session and/or request id (both must match when
        both are given); None when none runs."""
        with self._lock:
            if request_id:
                handle = self._by_request.get((tenant_id, request_id))
                if handle is not None and session_id and handle.session_id != session_id:
                    return None
                return handle
            handle = self._by_session.get(session_id)
            return handle if handle is not None and handle.tenant_id == tenant_id else None

    def abort(self, session_id: str, reason: str, *, keep_partial: bool = False) -> bool:
        """Cancel the session's running turn (whoever's tenant it is: the caller checked); False when none
        runs."""
        with self._lock:
            handle = self._by_session.get(session_id)
        if handle is None:
            return False
        handle.cancel(reason, keep_partial=keep_partial)
        return True

    def running(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._by_session

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_session)

"""Running turns of this process: one per session at a time, each with a cancel flag that Abort sets.

Knows nothing of how a turn runs; the turn engine polls `TurnHandle.cancelled` between steps.
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
    _event: threading.Event = field(default_factory=threading.Event)
    reason: str = ""

    def cancel(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
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

    def start(self, session_id: str, request_id: str) -> TurnHandle:
        """Register a turn.

        Raises:
            PreconditionError: the session already has a running turn.
        """
        with self._lock:
            if session_id in self._by_session:
                running = self._by_session[session_id].request_id
                raise PreconditionError(f"session {session_id} already has a running turn ({running})")
            handle = TurnHandle(session_id=session_id, request_id=request_id)
            self._by_session[session_id] = handle
            return handle

    def finish(self, handle: TurnHandle) -> None:
        with self._lock:
            if self._by_session.get(handle.session_id) is handle:
                del self._by_session[handle.session_id]

    def abort(self, session_id: str, reason: str) -> bool:
        """Cancel the session's running turn; False when none runs."""
        with self._lock:
            handle = self._by_session.get(session_id)
        if handle is None:
            return False
        handle.cancel(reason)
        return True

    def running(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._by_session

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_session)

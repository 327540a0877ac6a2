"""Which tenant owns a session, remembered after the registry said so: a turn checks ownership before it
registers as running (another tenant's request must not occupy the session or learn that it exists),
and that check would otherwise be one more registry read on every turn.

Knows nothing of turns. Only positive answers are kept, and they cannot go stale in a way that matters:
a session never changes tenant, and whatever a remembered owner lets through, the turn's own registry
read (`TurnPreparation.prepare`) checks again — a session deleted or closed meanwhile still gets
NOT_FOUND or SESSION_CLOSED there.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["SessionOwners"]


class SessionOwners:
    """A bounded LRU map session id -> owning tenant id (thread-safe)."""

    def __init__(self, capacity: int = 65536) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity={capacity} must be positive")
        self._capacity = capacity
        self._lock = threading.Lock()
        self._owners: OrderedDict[str, str] = OrderedDict()

    def owned_by(self, session_id: str, tenant_id: str) -> bool:
        """True when `tenant_id` is remembered as the session's owner (False: unknown, or another's)."""
        with self._lock:
            owner = self._owners.get(session_id)
            if owner is None:
                return False
            self._owners.move_to_end(session_id)
            return owner == tenant_id

    def remember(self, session_id: str, tenant_id: str) -> None:
        """Record the owner the registry named; the least recently used entry goes past the capacity."""
        with self._lock:
            self._owners[session_id] = tenant_id
            self._owners.move_to_end(session_id)
            while len(self._owners) > self._capacity:
                self._owners.popitem(last=False)

    def forget(self, session_id: str) -> None:
        """Drop a deleted session (its id then reads from the registry again)."""
        with self._lock:
            self._owners.pop(session_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._owners)

"""Admission control: at most `limit` turns per model at once; the next one is refused with a retry hint.

Knows nothing of forward passes; both schedulers admit turns through it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from orchestrator.api import ResourceExhaustedError

__all__ = ["Admission"]

# What RetryInfo tells a refused caller: about one turn's worth of steps on this machine.
_RETRY_AFTER_S = 1.0


class Admission:
    """Counts admitted turns per model (thread-safe)."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"admission limit={limit} must be positive")
        self.limit = limit
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}

    @contextmanager
    def admit(self, model: str) -> Iterator[None]:
        """Hold a slot of `model` for the body.

        Raises:
            ResourceExhaustedError: `limit` turns of the model run already (reason CAPACITY, RetryInfo).
        """
        with self._lock:
            running = self._running.get(model, 0)
            if running >= self.limit:
                raise ResourceExhaustedError(
                    f"model {model} is running {running} turns, the limit (max_running_turns); retry shortly",
                    reason="CAPACITY",
                    retry_after_s=_RETRY_AFTER_S,
                )
            self._running[model] = running + 1
        try:
            yield
        finally:
            with self._lock:
                self._running[model] -= 1

    def running(self, model: str) -> int:
        with self._lock:
            return self._running.get(model, 0)

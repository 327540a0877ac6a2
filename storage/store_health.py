"""Health of one node's store, as data: whether it serves as a cache right now and, if not, why.

Knows nothing of gRPC: the orchestrator maps `StoreHealth.serving` onto the named health service
`kvresume.store` and `reasons` onto a gauge. Three conditions degrade a store (the node still serves
turns cold, so the overall service stays SERVING):
- `quarantined`: a damaged database was moved aside at open (or by `admin store repair`) and its
  copy still holds tenant data (until it is removed: repair, purge, or past the longest ceiling);
- `read_error`: RocksDB reported corruption or an I/O error on a read while serving (the store
  quarantines itself at its next open);
- `write_failing`: the last `threshold` write attempts all failed (a full disk, a read-only
  filesystem); the first successful write clears it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import StrEnum

DEFAULT_WRITE_FAILURE_THRESHOLD = 3


class HealthReason(StrEnum):
    """Why a store is degraded. The values are gauge labels: never rename one."""

    QUARANTINED = "quarantined"
    READ_ERROR = "read_error"
    WRITE_FAILING = "write_failing"


@dataclass(frozen=True, kw_only=True)
class StoreHealth:
    """A snapshot. `serving` is True exactly when `reasons` is empty."""

    reasons: tuple[HealthReason, ...]
    detail: str
    quarantined_stores: int
    quarantined_bytes: int
    consecutive_write_failures: int

    @property
    def serving(self) -> bool:
        return not self.reasons


class WriteHealth:
    """Counts consecutive failed write attempts; thread-safe.

    Args:
        threshold: this many failures in a row, with no success between, make writes "failing".
            One failed write is not persistent: a single refused batch (one oversized sync, a
            transient EIO) must not flip health.
    """

    def __init__(self, threshold: int = DEFAULT_WRITE_FAILURE_THRESHOLD) -> None:
        if threshold < 1:
            raise ValueError(f"write failure threshold must be >= 1, got {threshold}")
        self.threshold = threshold
        self._lock = threading.Lock()
        self._failures = 0
        self._last_error = ""

    def ok(self) -> None:
        with self._lock:
            self._failures = 0
            self._last_error = ""

    def failed(self, error: str) -> None:
        with self._lock:
            self._failures += 1
            self._last_error = error

    @property
    def failures(self) -> int:
        with self._lock:
            return self._failures

    @property
    def failing(self) -> bool:
        with self._lock:
            return self._failures >= self.threshold

    @property
    def last_error(self) -> str:
        with self._lock:
            return self._last_error

"""Group commit for the store's write-ahead log: batches are written unsynced under the store lock (so
their order, and the audit chain's, is the lock's order), and durability is one WAL sync shared by
every writer waiting at that moment, run outside the lock. Knows nothing of what the batches hold.

References: the leader/follower group commit of RocksDB's own write thread and of PostgreSQL's
`commit_delay`; here the leader is whichever waiter finds no sync in progress.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["GroupSync", "ReleaseHookLock"]


class GroupSync:
    """Tickets for written batches, and a wait that returns once the WAL holding a ticket is synced.

    Args:
        sync: makes every write issued so far durable (`Rdict.flush_wal(True)`); called outside any
            lock of the caller, by one thread at a time.
    """

    def __init__(self, sync: Callable[[], None]) -> None:
        self._sync = sync
        self._cond = threading.Condition(threading.Lock())
        self._written = 0
        self._synced = 0
        self._syncing = False
        self.syncs = 0

    def note_write(self) -> int:
        """The ticket of a batch whose (unsynced) write just returned; call in write order."""
        with self._cond:
            self._written += 1
            return self._written

    def wait(self, ticket: int) -> None:
        """Return once every write up to `ticket` is durable. A waiter that finds no sync running
        becomes the leader and syncs for all writes issued so far; the others wait for it.

        Raises:
            Exception: whatever the sync raised (every waiter it covered tries again itself, so each
                one either sees a successful sync or the error).
        """
        with self._cond:
            while self._synced < ticket:
                if self._syncing:
                    self._cond.wait()
                    continue
                self._syncing = True
                target = self._written
                self._cond.release()
                ok = False
                try:
                    self._sync()
                    ok = True
                finally:
                    self._cond.acquire()
                    self._syncing = False
                    if ok:
                        self.syncs += 1
                        self._synced = max(self._synced, target)
                    self._cond.notify_all()


class ReleaseHookLock:
    """A reentrant lock that calls `on_release()` in the releasing thread after its outermost release,
    with the lock no longer held (the store syncs its WAL and hands out audit records there)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = threading.local()
        self.on_release: Callable[[], None] | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got:
            self._depth.n = getattr(self._depth, "n", 0) + 1
        return got

    def release(self) -> None:
        self._depth.n -= 1
        outermost = self._depth.n == 0
        self._lock.release()
        if outermost and self.on_release is not None:
            self.on_release()

    def held(self) -> bool:
        """True when the calling thread holds the lock."""
        return getattr(self._depth, "n", 0) > 0

    def __enter__(self) -> ReleaseHookLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

"""Window pool: encoder local-window state of live sessions in host RAM, under a byte budget, a
minutes-scale TTL and LRU eviction. Knows nothing of what the bytes mean (model/ serialises them).

Losing an entry (TTL, pressure, restart) costs the caller one bounded replay, nothing else, so the
pool never persists and never blocks a turn: a put that cannot fit is a typed refusal.

An entry put with a `ContentKey` (the history it continues, by digest) is also found by content:
`find_prefix` returns the tenant's entry of the longest such history a prompt starts with. The pool owns
that index (`prefix_index.PrefixIndex`) and updates it with every put, drop, expiry and eviction, so the
index never names an entry the pool no longer holds.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from storage.prefix_index import ContentKey, PrefixIndex, prefix_digests

DEFAULT_TTL_S = 10 * 60.0
DEFAULT_RAM_FRACTION = 0.10


def default_budget_bytes(fraction: float = DEFAULT_RAM_FRACTION) -> int:
    """`fraction` of this host's physical RAM."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * fraction)


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """Args:
    budget_bytes: most bytes of values held at once (None: 10% of physical RAM).
    ttl_s: seconds after its last put or get at which an entry is dropped.
    """

    budget_bytes: int | None = None
    ttl_s: float = DEFAULT_TTL_S

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and self.budget_bytes < 1:
            raise ValueError(f"budget_bytes must be >= 1 or None, got {self.budget_bytes}")
        if not (math.isfinite(self.ttl_s) and self.ttl_s > 0):
            raise ValueError(f"ttl_s must be finite and > 0, got {self.ttl_s}")

    @property
    def effective_budget_bytes(self) -> int:
        return self.budget_bytes if self.budget_bytes is not None else default_budget_bytes()


class PoolMiss(StrEnum):
    ABSENT = "absent"
    EXPIRED = "expired"


@dataclass(frozen=True, kw_only=True)
class PoolPut:
    """Outcome of a put: `stored` False only when the value alone exceeds the whole budget."""

    stored: bool
    evicted: int
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class PrefixMatch:
    """A pooled entry found by content: its session, the length of the history it continues, its value,
    and `digest`, the `history_digest` of the prompt's first `n_tokens` ids (what the lookup matched)."""

    session: str
    n_tokens: int
    value: bytes
    digest: bytes


@dataclass(frozen=True, kw_only=True)
class PoolStats:
    entries: int
    bytes_used: int
    budget_bytes: int
    hits: int
    misses_absent: int
    misses_expired: int
    evicted_lru: int
    expired: int
    refused: int


class WindowPool:
    """Thread-safe LRU + TTL map from (tenant, session) to opaque bytes, with a per-tenant prefix index.

    Keys include the tenant, so one tenant's get or content lookup can never return another's entry.
    """

    def __init__(
        self, config: PoolConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or PoolConfig()
        self._budget = self.config.effective_budget_bytes
        self._clock = clock
        self._lock = threading.Lock()
        # key -> (value, expires_at); order is recency, oldest first.
        self._entries: OrderedDict[tuple[str, str], tuple[bytes, float]] = OrderedDict()
        self._content: dict[tuple[str, str], ContentKey] = {}
        self._index = PrefixIndex()
        self._bytes = 0
        self._drop_listeners: list[Callable[[str, str, bytes], None]] = []
        self._hits = self._absent = self._expired_misses = self._evicted = self._expired = self._refused = 0
        # Every put and refresh stamps its entry now + ttl_s and moves it to the end, so while the clock
        # never goes back the expiries rise along the recency order and the expired entries are the
        # oldest ones: a sweep stops at the first live entry instead of reading the whole pool on every
        # put. `_in_order` is False once a stamp went below the latest (a clock that went back); sweeps
        # then scan everything, as `ordered_sweep = False` always does (the twin tests compare).
        self.ordered_sweep = True
        self._in_order = True
        self._latest_expiry = -math.inf

    def on_drop(self, listener: Callable[[str, str, bytes], None]) -> None:
        """Call `listener(tenant, session, value)` whenever an entry leaves the pool (replaced by a put,
        discarded, expired, evicted): state derived from that value (the engine's decoded states) goes
        with it.

        The listener runs under the pool's lock, so it must not call the pool (take only its own lock).
        """
        with self._lock:
            self._drop_listeners.append(listener)

    def put(self, tenant: str, session: str, value: bytes, *, content: ContentKey | None = None) -> PoolPut:
        """Store (replace) a session's window state; evicts least recently used entries to fit.

        Args:
            content: the history the value continues; when given, `find_prefix` finds the entry by it.
        """
        if not tenant or not session:
            raise ValueError(f"tenant and session must be non-empty, got {tenant!r}, {session!r}")
        size = len(value)
        with self._lock:
            now = self._clock()
            self._drop((tenant, session))
            if size > self._budget:
                self._refused += 1
                return PoolPut(stored=False, evicted=0, reason=f"value {size} B > budget {self._budget} B")
            self._sweep(now)
            evicted = 0
            while self._bytes + size > self._budget:
                key = next(iter(self._entries))
                self._drop(key)
                self._evicted += 1
                evicted += 1
            self._entries[(tenant, session)] = (bytes(value), self._stamp(now))
            self._bytes += size
            if content is not None:
                self._content[(tenant, session)] = content
                self._index.add(tenant, session, content)
            return PoolPut(stored=True, evicted=evicted)

    def get(self, tenant: str, session: str) -> bytes | PoolMiss:
        """The session's window state, refreshing its TTL and recency, or why there is none."""
        key = (tenant, session)
        with self._lock:
            now = self._clock()
            entry = self._entries.get(key)
            if entry is None:
                self._absent += 1
                return PoolMiss.ABSENT
            value, expires_at = entry
            if now >= expires_at:
                self._drop(key)
                self._expired += 1
                self._expired_misses += 1
                return PoolMiss.EXPIRED
            self._entries[key] = (value, self._stamp(now))
            self._entries.move_to_end(key)
            self._hits += 1
            return value

    def find_prefix(
        self, tenant: str, namespace: str, token_ids: list[int] | bytes, *, max_tokens: int | None = None
    ) -> PrefixMatch | None:
        """The tenant's live entry of the longest indexed history of `namespace` that `token_ids` starts
        with (at most `max_tokens` long), refreshing its TTL and recency like `get`; None when none.

        The prompt is hashed outside the lock (one pass, snapshots at the indexed lengths); an entry
        that expired is dropped and the next shorter history is tried.
        """
        n_ids = len(token_ids) // 4 if isinstance(token_ids, bytes) else len(token_ids)
        limit = n_ids if max_tokens is None else min(max_tokens, n_ids)
        if limit <= 0:
            return None
        with self._lock:
            lengths = self._index.lengths(tenant, namespace, limit)
        if not lengths:
            return None
        digests = prefix_digests(token_ids, lengths)
        with self._lock:
            now = self._clock()
            for n in sorted(digests, reverse=True):
                for session in reversed(self._index.sessions(tenant, namespace, n, digests[n])):
                    key = (tenant, session)
                    entry = self._entries.get(key)
                    if entry is None:
                        continue
                    value, expires_at = entry
                    if now >= expires_at:
                        self._drop(key)
                        self._expired += 1
                        continue
                    self._entries[key] = (value, self._stamp(now))
                    self._entries.move_to_end(key)
                    self._hits += 1
                    return PrefixMatch(session=session, n_tokens=n, value=value, digest=digests[n])
            return None

    def discard(self, tenant: str, session: str) -> bool:
        """Drop a session's entry (session closed or purged); True if there was one."""
        with self._lock:
            return self._drop((tenant, session))

    def discard_tenant(self, tenant: str) -> int:
        with self._lock:
            keys = [k for k in self._entries if k[0] == tenant]
            for key in keys:
                self._drop(key)
            return len(keys)

    def discard_namespace(self, namespace: str, *, tenant: str | None = None) -> int:
        """Drop every entry put with a content key of `namespace` (optionally of one tenant): a model's
        purge makes its windows stale. Returns how many."""
        with self._lock:
            keys = [
                k
                for k, c in self._content.items()
                if c.namespace == namespace and (tenant is None or k[0] == tenant)
            ]
            for key in keys:
                self._drop(key)
            return len(keys)

    def indexed(self) -> int:
        """Entries the prefix index names (each one a live or not yet swept pool entry)."""
        with self._lock:
            return len(self._index)

    def sweep(self) -> int:
        """Drop every expired entry now; returns how many."""
        with self._lock:
            return self._sweep(self._clock())

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                entries=len(self._entries),
                bytes_used=self._bytes,
                budget_bytes=self._budget,
                hits=self._hits,
                misses_absent=self._absent,
                misses_expired=self._expired_misses,
                evicted_lru=self._evicted,
                expired=self._expired,
                refused=self._refused,
            )

    def _drop(self, key: tuple[str, str]) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._bytes -= len(entry[0])
        content = self._content.pop(key, None)
        if content is not None:
            self._index.remove(key[0], key[1], content)
        for listener in self._drop_listeners:
            listener(key[0], key[1], entry[0])
        return True

    def _stamp(self, now: float) -> float:
        """The expiry of an entry put or refreshed at `now` (it goes to the end of the recency order)."""
        expires_at = now + self.config.ttl_s
        if expires_at < self._latest_expiry:
            self._in_order = False
        else:
            self._latest_expiry = expires_at
        return expires_at

    def _sweep(self, now: float) -> int:
        if not (self.ordered_sweep and self._in_order):
            return self._sweep_all(now)
        dead = 0
        entries = self._entries
        while entries:
            key, (_, expires_at) = next(iter(entries.items()))
            if now < expires_at:
                break
            self._drop(key)
            dead += 1
        self._expired += dead
        return dead

    def _sweep_all(self, now: float) -> int:
        """`_sweep`'s reference: every entry read. Afterwards the order holds again if the expiries left
        rise along the recency order."""
        dead = [k for k, (_, expires_at) in self._entries.items() if now >= expires_at]
        for key in dead:
            self._drop(key)
        self._expired += len(dead)
        latest = -math.inf
        for _, expires_at in self._entries.values():
            if expires_at < latest:
                break
            latest = expires_at
        else:
            self._in_order, self._latest_expiry = True, latest
        return len(dead)

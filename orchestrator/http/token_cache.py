"""The ids of message texts a tenant sent before, per model: an agent resends its whole conversation on
every request, and without this each request would re-tokenise every earlier message: rendering a
42-message, 4 KB conversation takes 0.98 ms, 0.16 ms from the cache (one sha256 and a lookup per piece,
short pieces included: their tokenizer call costs more than that), on the path to the first token.

Bounded (least recently used first) and in memory only. It holds what tenants sent, so a tenant purge
clears the tenant's entries and a session purge clears them too (a text is not tied to one session: the
whole tenant's cache goes, and is rebuilt by the next requests).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["TokenCache"]



class TokenCache:
    """tenant -> (model, sha256(text)) -> ids; thread-safe."""

    def __init__(self, *, max_per_tenant: int = 4096) -> None:
        if max_per_tenant <= 0:
            raise ValueError(f"max_per_tenant={max_per_tenant} must be positive")
        self._max = max_per_tenant
        self._lock = threading.Lock()
        self._by_tenant: dict[str, OrderedDict[tuple[str, bytes], tuple[int, ...]]] = {}

    def encoder(
        self, tenant: str, model: str, encode: Callable[[str], list[int]]
    ) -> Callable[[str], list[int]]:
        """`encode`, answered from the cache for texts of this tenant and model seen before."""

        def cached(text: str) -> list[int]:
            if not text:
                return encode(text)
            key = (model, hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).digest())
            with self._lock:
                entries = self._by_tenant.get(tenant)
                hit = entries.get(key) if entries is not None else None
                if hit is not None:
                    entries.move_to_end(key)  # type: ignore[union-attr]
                    return list(hit)
            ids = encode(text)
            with self._lock:
                entries = self._by_tenant.setdefault(tenant, OrderedDict())
                entries[key] = tuple(ids)
                while len(entries) > self._max:
                    entries.popitem(last=False)
            return ids

        return cached

    def forget_tenant(self, tenant: str | None) -> None:
        """Drop the tenant's entries (every tenant's when None: an admin's session purge)."""
        with self._lock:
            if tenant is None:
                self._by_tenant.clear()
            else:
                self._by_tenant.pop(tenant, None)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(e) for e in self._by_tenant.values())

"""The ids the model generated for each answer text it returned, per tenant, so that a client resending the
conversation renders those answers as the ids already in the history (re-tokenising a text may not give
back the ids the model produced: `a` + `bc` and `ab` + `c` decode alike).

Bounded (least recently used entries go first) and in memory only: it holds tenant data, so a tenant purge
and a session purge clear what they cover, and a restart forgets it all (the text is re-tokenised then).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["AnswerRecord"]


@dataclass(frozen=True, kw_only=True)
class _Answer:
    ids: tuple[int, ...]
    session_id: str


def _key(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).digest()


class AnswerRecord:
    """tenant -> sha256(text) -> the generated ids; thread-safe.

    Not keyed by model: the served family shares one tokenizer (a served set never mixes the trained
    siblings with the byte-codec stand-ins), so a cascade to the other sibling reads the same ids.

    Args:
        max_per_tenant: answers kept per tenant (the least recently used beyond it are dropped).
    """

    def __init__(self, *, max_per_tenant: int = 4096) -> None:
        if max_per_tenant <= 0:
            raise ValueError(f"max_per_tenant={max_per_tenant} must be positive")
        self._max = max_per_tenant
        self._lock = threading.Lock()
        self._by_tenant: dict[str, OrderedDict[bytes, _Answer]] = {}

    def remember(self, *, tenant: str, session_id: str, text: str, ids: Sequence[int]) -> None:
        """Record that the model answered `text` with `ids` in `session_id` (a committed turn)."""
        if not text or not ids:
            return
        with self._lock:
            answers = self._by_tenant.setdefault(tenant, OrderedDict())
            key = _key(text)
            answers[key] = _Answer(ids=tuple(ids), session_id=session_id)
            answers.move_to_end(key)
            while len(answers) > self._max:
                answers.popitem(last=False)

    def lookup(self, *, tenant: str, text: str) -> tuple[int, ...] | None:
        """The ids the model generated for `text` for this tenant, or None when it did not (or forgot)."""
        with self._lock:
            answers = self._by_tenant.get(tenant)
            if answers is None:
                return None
            key = _key(text)
            found = answers.get(key)
            if found is not None:
                answers.move_to_end(key)
            return found.ids if found is not None else None

    def forget_session(self, session_id: str, *, tenant: str | None = None) -> int:
        """Drop the answers of one session (of any tenant when `tenant` is None: an admin purge); returns
        how many."""
        with self._lock:
            tenants = [tenant] if tenant is not None else list(self._by_tenant)
            dropped = 0
            for t in tenants:
                answers = self._by_tenant.get(t, OrderedDict())
                gone = [k for k, a in answers.items() if a.session_id == session_id]
                for k in gone:
                    del answers[k]
                dropped += len(gone)
            return dropped

    def forget_tenant(self, tenant: str) -> int:
        """Drop every answer of the tenant; returns how many."""
        with self._lock:
            return len(self._by_tenant.pop(tenant, {}))

    def __len__(self) -> int:
        with self._lock:
            return sum(len(a) for a in self._by_tenant.values())

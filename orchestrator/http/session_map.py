"""Which registry session an HTTP request continues: `prompt_cache_key` (or `X-Session-Id`) -> the tenant's
session, and whether the request's rendered tokens extend that session's committed history.

Knows nothing of the chat format: it compares token ids. The key map is bounded and in memory only (it
holds tenant data, so purges clear what they cover); after a restart a key starts a new session, and
content-addressed reuse finds the stored prefix.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.api import PreconditionError, ServiceContext
from orchestrator.chat import AnswerRecord
from orchestrator.db import SessionRepository
from orchestrator.db.models import SessionStatus
from orchestrator.http.spare_sessions import SpareSessions
from orchestrator.http.token_cache import TokenCache

__all__ = ["ForgettingPurger", "SessionKeys", "SessionTarget", "continued_session"]


class SessionKeys:
    """(tenant, key) -> session id, least recently used dropped past `max_keys`; thread-safe."""

    def __init__(self, *, max_keys: int = 65536) -> None:
        if max_keys <= 0:
            raise ValueError(f"max_keys={max_keys} must be positive")
        self._max = max_keys
        self._lock = threading.Lock()
        self._map: OrderedDict[tuple[str, str], str] = OrderedDict()

    def get(self, tenant: str, key: str) -> str | None:
        with self._lock:
            sid = self._map.get((tenant, key))
            if sid is not None:
                self._map.move_to_end((tenant, key))
            return sid

    def set(self, tenant: str, key: str, session_id: str) -> None:
        with self._lock:
            self._map[(tenant, key)] = session_id
            self._map.move_to_end((tenant, key))
            while len(self._map) > self._max:
                self._map.popitem(last=False)

    def forget_session(self, session_id: str) -> None:
        with self._lock:
            for k in [k for k, v in self._map.items() if v == session_id]:
                del self._map[k]

    def forget_tenant(self, tenant: str) -> None:
        with self._lock:
            for k in [k for k in self._map if k[0] == tenant]:
                del self._map[k]


@dataclass(frozen=True, kw_only=True)
class SessionTarget:
    """An existing session the request continues, and the tokens past its committed history."""

    session_id: str
    history_len: int
    new_tokens: tuple[int, ...]


def continued_session(
    ctx: ServiceContext, keys: SessionKeys, *, tenant: str, key: str, tokens: Sequence[int]
) -> SessionTarget | None:
    """The session `key` names, when `tokens` strictly extend its committed history; None otherwise (no
    such key, a closed or purged session, or an edited history: the caller starts a new session).

    Raises:
        PreconditionError: TURN_RUNNING, the session runs a turn now (HTTP 409). Checked before its history
            is read: the history of a running session is the one before that turn, and comparing with it
            would start a second session instead of refusing.
    """
    sid = keys.get(tenant, key)
    if sid is None:
        return None
    if ctx.running.running(sid):
        raise PreconditionError(
            f"session {sid} (key {key!r}) already has a running turn",
            reason="TURN_RUNNING",
            retry_after_s=1.0,
        )
    with ctx.sessions() as s:
        repo = SessionRepository(s)
        row = repo.get(sid, tenant_id=tenant)
        if row is None or row.status != SessionStatus.OPEN:
            return None
        history = repo.history(sid)
    if len(tokens) <= len(history) or list(tokens[: len(history)]) != history:
        return None
    return SessionTarget(session_id=sid, history_len=len(history), new_tokens=tuple(tokens[len(history) :]))


class ForgettingPurger:
    """The context's purger, also clearing the HTTP front door's tenant data (answer record, key map, spare
    sessions, token cache) of what a purge removes; every other attribute is the wrapped purger's."""

    def __init__(
        self,
        inner: Any,
        *,
        answers: AnswerRecord,
        keys: SessionKeys,
        spares: SpareSessions,
        tokens: TokenCache,
    ) -> None:
        self._inner = inner
        self._answers = answers
        self._keys = keys
        self._spares = spares
        self._tokens = tokens

    def purge_session(self, session_id: str, *, tenant_id: str | None, actor: str, reason: str) -> Any:
        outcome = self._inner.purge_session(session_id, tenant_id=tenant_id, actor=actor, reason=reason)
        if outcome is not None:
            self._answers.forget_session(session_id, tenant=tenant_id)
            self._keys.forget_session(session_id)
            self._spares.forget_session(session_id)
            self._tokens.forget_tenant(tenant_id)
        return outcome

    def purge_tenant(self, tenant_id: str, *, actor: str, reason: str) -> Any:
        outcome = self._inner.purge_tenant(tenant_id, actor=actor, reason=reason)
        self._answers.forget_tenant(tenant_id)
        self._keys.forget_tenant(tenant_id)
        self._spares.forget_tenant(tenant_id)
        self._tokens.forget_tenant(tenant_id)
        return outcome

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

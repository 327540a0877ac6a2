"""A new session's registry statements on SQLite as driver statements (`DriverSelect`, `DriverDML`): the
tenant read (and its insert on first use), the count of its sessions, its effective policy and the
session insert, in the caller's write transaction. The slow twin is the ORM path of
`TenantRepository.ensure`, `SessionRepository.count`, `PolicyRepository.effective` and
`SessionRepository.create` in a Session, which costs a CreateSession about 1 ms of CPU more (identity
map, unit-of-work flush, four executions through the ORM), while other writers wait for its write lock.

SQLite only: its writers hold the write lock from BEGIN IMMEDIATE, so a tenant read absent cannot be
inserted by another writer before this one's insert (the race `ensure` guards with a savepoint).
Knows nothing of limits and policies' meaning; the caller decides.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import bindparam, func, insert, select
from sqlalchemy.engine import Dialect

from orchestrator.db.models import SessionRow, SessionStatus, Tenant
from orchestrator.db.repositories.driver_dml import DriverDML
from orchestrator.db.repositories.driver_select import DriverSelect
from orchestrator.db.repositories.policies import _EFFECTIVE, EffectivePolicy, effective_policy
from orchestrator.db.repositories.tenants import TENANT_SALT_BYTES

__all__ = ["SessionCreate"]

_TENANTS, _SESSIONS = Tenant.__table__, SessionRow.__table__
# Every column of a session row: the insert sets them all, as the ORM's flush of a new SessionRow does.
_SESSION_KEYS = [c.key for c in _SESSIONS.columns]
_SESSION_KEY_SET = frozenset(_SESSION_KEYS)


class SessionCreate:
    """`SessionCreate(dialect)` compiles the statements once; each method runs on `raw`, the sqlite3
    connection of the caller's write transaction (BEGIN IMMEDIATE)."""

    def __init__(self, dialect: Dialect) -> None:
        self._tenant = DriverSelect(select(_TENANTS.c.id).where(_TENANTS.c.id == bindparam("tid")), dialect)
        self._add_tenant = DriverDML(insert(_TENANTS), dialect, keys=["id", "salt"])
        self._count = DriverSelect(
            select(func.count()).select_from(_SESSIONS).where(_SESSIONS.c.tenant_id == bindparam("tid")),
            dialect,
        )
        self._policy = DriverSelect(_EFFECTIVE, dialect)
        self._add_session = DriverDML(insert(_SESSIONS), dialect, keys=_SESSION_KEYS)

    def ensure_tenant(self, raw: Any, tenant_id: str) -> None:
        """`TenantRepository.ensure`: the tenant row, inserted with a fresh salt when absent.

        Raises:
            ValueError: an empty tenant id.
        """
        if not tenant_id:
            raise ValueError("tenant id must be non-empty")
        if not self._tenant.rows(raw, {"tid": tenant_id}):
            # created_at: the column's default, computed as the ORM's flush computes it
            self._add_tenant.execute(raw, {"id": tenant_id, "salt": secrets.token_bytes(TENANT_SALT_BYTES)})

    def count(self, raw: Any, tenant_id: str) -> int:
        """`SessionRepository.count`: the tenant's sessions, open and closed."""
        return self._count.rows(raw, {"tid": tenant_id})[0][0] or 0

    def effective_policy(
        self, raw: Any, tenant_id: str, *, default_floor_s: float, default_ceiling_s: float
    ) -> EffectivePolicy:
        """`PolicyRepository.effective`."""
        rows = self._policy.rows(raw, {"tid": tenant_id})
        return effective_policy(
            tenant_id,
            rows[0] if rows else None,
            default_floor_s=default_floor_s,
            default_ceiling_s=default_ceiling_s,
        )

    def create(
        self,
        raw: Any,
        *,
        tenant_id: str,
        model: str,
        retention_s: float,
        retention_hint_s: float | None,
        node: str,
        region: str,
        clock: Callable[[], Any],
    ) -> SessionRow:
        """`SessionRepository.create`: inserts the row and returns it as a transient SessionRow (not in
        any Session) with the values stored, stamps included.

        Args:
            clock: the columns' default stamp (`models.utcnow`), called for created_at, then updated_at.

        Raises:
            ValueError: an empty model name.
        """
        if not model:
            raise ValueError("model must be non-empty")
        values = dict(
            id=uuid.uuid4().hex,
            tenant_id=tenant_id,
            model=model,
            status=SessionStatus.OPEN,
            parent_session_id=None,
            forked_at_turn=None,
            history_tokens=0,
            turn_count=0,
            retention_hint_s=retention_hint_s,
            retention_s=retention_s,
            node=node,
            region=region,
            created_at=clock(),
            updated_at=clock(),
        )
        assert values.keys() == _SESSION_KEY_SET, "a session column without a value"
        self._add_session.execute(raw, values)
        return SessionRow(**values)

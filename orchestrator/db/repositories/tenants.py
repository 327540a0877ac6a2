"""Tenants: rows created on first authenticated use, each with a server-generated random salt."""

from __future__ import annotations

import secrets

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from orchestrator.db.models import Tenant

__all__ = ["TenantRepository", "TENANT_SALT_BYTES"]

TENANT_SALT_BYTES = 32


class TenantRepository:
    """Reads and creates tenants inside the caller's Session (never commits)."""

    def __init__(self, session: Session) -> None:
        self._s = session

    def get(self, tenant_id: str) -> Tenant | None:
        return self._s.get(Tenant, tenant_id)

    def ensure(self, tenant_id: str) -> Tenant:
        """Return the tenant, creating it with a fresh salt; safe when two replicas race to create it."""
        if not tenant_id:
            raise ValueError("tenant id must be non-empty")
        found = self.get(tenant_id)
        if found is not None:
            return found
        try:
            with self._s.begin_nested():
                tenant = Tenant(id=tenant_id, salt=secrets.token_bytes(TENANT_SALT_BYTES))
                self._s.add(tenant)
            return tenant
        except IntegrityError:
            # Another replica created it between our read and insert; theirs is the one to use.
            found = self._s.scalars(select(Tenant).where(Tenant.id == tenant_id)).one()
            return found

    def rotate_salt(self, tenant_id: str) -> bool:
        """Give the tenant a fresh salt, so that anything keyed by the old one is unreachable."""
        tenant = self.get(tenant_id)
        if tenant is None:
            return False
        tenant.salt = secrets.token_bytes(TENANT_SALT_BYTES)
        self._s.flush()
        return True

    def list_ids(self) -> list[str]:
        return list(self._s.scalars(select(Tenant.id).order_by(Tenant.id)))

    def delete(self, tenant_id: str) -> bool:
        """Delete the tenant row (sessions, turns, policies and segment rows cascade). True if it existed."""
        tenant = self.get(tenant_id)
        if tenant is None:
            return False
        self._s.delete(tenant)
        self._s.flush()
        return True

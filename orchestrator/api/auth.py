"""Bearer-token authentication: per-tenant tokens and one admin token, both from the settings.

Knows nothing of what callers may do beyond "tenant" or "admin"; servicers decide per method.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from orchestrator.api.errors import PermissionDeniedError, UnauthenticatedError

__all__ = ["Caller", "Authenticator"]

_BEARER = "bearer "


@dataclass(frozen=True, kw_only=True)
class Caller:
    """Who is calling: a tenant (tenant_id set) or the admin (is_admin)."""

    tenant_id: str | None
    is_admin: bool

    @property
    def actor(self) -> str:
        """The audit actor name of this caller."""
        return "admin" if self.is_admin else f"tenant:{self.tenant_id}"


class Authenticator:
    """Resolves `authorization: Bearer <token>` metadata to a Caller.

    Every configured token is compared in constant time, so timing does not reveal which tenant's
    token a guess is close to.
    """

    def __init__(self, *, tenant_tokens: Mapping[str, str], admin_token: str) -> None:
        self._tenants = [(tenant, token.encode()) for tenant, token in tenant_tokens.items()]
        self._admin = admin_token.encode() if admin_token else None

    def identify(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> Caller:
        """The caller of these metadata.

        Raises:
            UnauthenticatedError: no bearer token, or one that matches no configured token.
        """
        header = None
        for key, value in metadata or ():
            if key.lower() == "authorization":
                header = value.decode() if isinstance(value, bytes) else value
        if header is None or not header.lower().startswith(_BEARER):
            raise UnauthenticatedError("missing bearer token (metadata 'authorization: Bearer <token>')")
        presented = header[len(_BEARER) :].strip().encode()
        matched_tenant = None
        for tenant, token in self._tenants:
            if hmac.compare_digest(presented, token):
                matched_tenant = tenant
        is_admin = self._admin is not None and hmac.compare_digest(presented, self._admin)
        if is_admin:
            return Caller(tenant_id=None, is_admin=True)
        if matched_tenant is not None:
            return Caller(tenant_id=matched_tenant, is_admin=False)
        raise UnauthenticatedError("unknown bearer token")

    def tenant(self, context: grpc.ServicerContext) -> Caller:
        """A tenant caller; the admin token is refused (admin work goes through the Admin service)."""
        caller = self.identify(context.invocation_metadata())
        if caller.tenant_id is None:
            raise PermissionDeniedError("this call needs a tenant token")
        return caller

    def admin(self, context: grpc.ServicerContext) -> Caller:
        caller = self.identify(context.invocation_metadata())
        if not caller.is_admin:
            raise PermissionDeniedError("this call needs the admin token")
        return caller

    def any(self, context: grpc.ServicerContext) -> Caller:
        return self.identify(context.invocation_metadata())

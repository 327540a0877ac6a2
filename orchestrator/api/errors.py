"""Errors the service raises toward callers; `status_table.py` maps each class to one gRPC status code.

Subclasses of OrchestratorError; each docstring says what the caller should do.
"""

from __future__ import annotations

from orchestrator.errors import OrchestratorError

__all__ = [
    "InvalidRequestError",
    "NotFoundError",
    "UnauthenticatedError",
    "PermissionDeniedError",
    "PreconditionError",
    "ResourceExhaustedError",
    "UnavailableError",
    "DeadlineError",
    "CancelledError",
]


class InvalidRequestError(OrchestratorError):
    """The request itself is wrong (empty turn, token id out of vocabulary, bad parameters): fix it."""


class NotFoundError(OrchestratorError):
    """No such session/mapper for this caller (another tenant's session reads as absent): check the id."""


class UnauthenticatedError(OrchestratorError):
    """No valid bearer token: send `authorization: Bearer <token>`."""


class PermissionDeniedError(OrchestratorError):
    """The token is valid but not allowed to do this (admin call with a tenant token): use another token."""


class PreconditionError(OrchestratorError):
    """The target is in the wrong state (closed session, turn already running): change state, then retry."""


class ResourceExhaustedError(OrchestratorError):
    """A limit was reached (request size, sessions per tenant, capacity): shrink the request or back off."""


class UnavailableError(OrchestratorError):
    """The service or a dependency is temporarily down: retry with backoff."""


class DeadlineError(OrchestratorError):
    """The work did not finish within the caller's deadline: retry with a longer deadline."""


class CancelledError(OrchestratorError):
    """The turn was aborted (Abort call or client cancellation): nothing of it was kept."""

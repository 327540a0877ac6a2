"""Errors the service raises toward callers; `status_table.py` maps each class to one gRPC status code.

Subclasses of OrchestratorError; each docstring says what the caller should do, and each has the stable
reason code (ErrorInfo.reason) it carries unless the raise site names a more precise one.
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
    "MAX_NAME_CHARS",
    "check_name_length",
    "model_not_served",
]

# The registry's columns for ids and model names are 128 characters; longer values are refused before
# any lookup, and their text is never echoed (a 100 KB name in an error detail overflows gRPC's metadata).
MAX_NAME_CHARS = 128


class InvalidRequestError(OrchestratorError):
    """The request itself is wrong (empty turn, token id out of vocabulary, bad parameters): fix it."""

    default_reason = "INVALID_ARGUMENT"


class NotFoundError(OrchestratorError):
    """No such session/mapper for this caller (another tenant's session reads as absent): check the id."""

    default_reason = "SESSION_NOT_FOUND"


class UnauthenticatedError(OrchestratorError):
    """No valid bearer token: send `authorization: Bearer <token>`."""

    default_reason = "UNAUTHENTICATED"


class PermissionDeniedError(OrchestratorError):
    """The token is valid but not allowed to do this (admin call with a tenant token): use another token."""

    default_reason = "PERMISSION_DENIED"


class PreconditionError(OrchestratorError):
    """The target is in the wrong state (closed session, turn already running): change state, then retry."""

    default_reason = "STATE_CHANGED"


class ResourceExhaustedError(OrchestratorError):
    """A limit was reached (request size, sessions per tenant, capacity): shrink the request or back off."""

    default_reason = "CAPACITY"
    # Every RESOURCE_EXHAUSTED carries a RetryInfo; under reason REQUEST_TOO_LARGE only a smaller request
    # helps.
    default_retry_after_s = 1.0


class UnavailableError(OrchestratorError):
    """The service or a dependency is temporarily down: retry with backoff."""

    default_reason = "UNAVAILABLE"


class DeadlineError(OrchestratorError):
    """The work did not finish within the caller's deadline: retry with a longer deadline."""

    default_reason = "DEADLINE_EXCEEDED"


class CancelledError(OrchestratorError):
    """The turn was cancelled before it started streaming, or its client went away: nothing was kept."""

    default_reason = "CANCELLED"


def check_name_length(field: str, value: str) -> None:
    """Refuse an id or name longer than the registry holds, naming the field, not echoing the value.

    Raises:
        InvalidRequestError: `value` is longer than MAX_NAME_CHARS.
    """
    if len(value) > MAX_NAME_CHARS:
        raise InvalidRequestError(
            f"{field} of {len(value)} characters exceeds the limit of {MAX_NAME_CHARS}", field=field
        )


def model_not_served(name: str, served: tuple[str, ...] | list[str]) -> NotFoundError:
    """The one NOT_FOUND of a model this node does not serve (reason MODEL_NOT_SERVED), naming those it
    does."""
    return NotFoundError(
        f"model {name!r} is not served here (served: {', '.join(served)})", reason="MODEL_NOT_SERVED"
    )

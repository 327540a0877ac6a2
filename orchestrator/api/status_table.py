"""The one table from exceptions to gRPC status codes, and the decorators servicers use to apply it.

Only orchestrator/ maps exceptions to status codes (STYLE rule 14), and only here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
import structlog
from sqlalchemy.exc import OperationalError

from orchestrator.api import errors
from storage import StorageError, StoreClosedError

__all__ = ["STATUS_TABLE", "status_for", "unary_errors", "stream_errors"]

log = structlog.get_logger(__name__)

# Most specific first: status_for walks the table in order and takes the first isinstance match.
STATUS_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (errors.InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (errors.UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (errors.PreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (StoreClosedError, grpc.StatusCode.UNAVAILABLE),
    (OperationalError, grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.CancelledError, grpc.StatusCode.CANCELLED),
    (NotImplementedError, grpc.StatusCode.UNIMPLEMENTED),
    (StorageError, grpc.StatusCode.INTERNAL),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and caller-facing message of an exception (INTERNAL for anything unexpected)."""
    for cls, code in STATUS_TABLE:
        if isinstance(exc, cls):
            if isinstance(exc, OperationalError):
                # Driver messages can carry connection strings; say only what the caller needs.
                return code, "registry database unavailable"
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, "internal error"


F = TypeVar("F", bound=Callable[..., Any])


# Status details travel in gRPC metadata (8 KiB by default); a message quoting a huge input would turn
# the status into RESOURCE_EXHAUSTED, so details are cut to this many characters.
_MAX_DETAIL_CHARS = 1024


def _abort(context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    code, message = status_for(exc)
    if len(message) > _MAX_DETAIL_CHARS:
        message = message[:_MAX_DETAIL_CHARS] + f"... ({len(message)} characters)"
    if code == grpc.StatusCode.INTERNAL:
        log.exception("rpc_failed", method=method, code=code.name)
    else:
        log.info("rpc_rejected", method=method, code=code.name, detail=message)
    context.abort(code, message)


def unary_errors(method: F) -> F:
    """Wrap a unary servicer method so that exceptions become status codes through STATUS_TABLE.

    Wrapped methods raise instead of calling `context.abort` (which raises a bare Exception).
    """

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every exception is mapped, unknown ones to INTERNAL
            _abort(context, exc, method.__name__)

    return wrapper  # type: ignore[return-value]


def stream_errors(method: F) -> F:
    """Like `unary_errors` for server-streaming methods (generators)."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every exception is mapped, unknown ones to INTERNAL
            _abort(context, exc, method.__name__)

    return wrapper  # type: ignore[return-value]

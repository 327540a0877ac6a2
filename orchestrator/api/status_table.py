"""The one table from exceptions to gRPC status codes, and the decorators servicers use to apply it.

Only orchestrator/ maps exceptions to status codes (STYLE rule 14), and only here. Every failed call carries
google.rpc.Status details: an ErrorInfo (stable reason, domain kvresume.v1, the field at fault) and, on
RESOURCE_EXHAUSTED, UNAVAILABLE and a concurrent turn, a RetryInfo. The HTTP column (`HTTP_BY_CODE`,
`http_error_for`) gives the HTTP front door's status and OpenAI error type for the same errors.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import structlog
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from sqlalchemy.exc import OperationalError

from orchestrator.api import errors
from orchestrator.errors import OrchestratorError
from storage import StorageError, StoreClosedError, StoreDamagedError

__all__ = [
    "STATUS_TABLE",
    "ERROR_DOMAIN",
    "HTTP_BY_CODE",
    "HTTP_BY_REASON",
    "CallerError",
    "HttpError",
    "error_for",
    "http_error_for",
    "rich_status",
    "status_for",
    "unary_errors",
    "stream_errors",
    "async_errors",
]

log = structlog.get_logger(__name__)

# Most specific first: status_for walks the table in order and takes the first isinstance match. The
# third column is the ErrorInfo reason of exceptions that are not OrchestratorErrors (those carry their own).
STATUS_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode, str], ...] = (
    (errors.InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
    (errors.NotFoundError, grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND"),
    (errors.UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED"),
    (errors.PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED"),
    (errors.PreconditionError, grpc.StatusCode.FAILED_PRECONDITION, "STATE_CHANGED"),
    (errors.ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED, "CAPACITY"),
    (errors.UnavailableError, grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE"),
    (StoreClosedError, grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE"),
    # A read error while serving (the store is marked for quarantine at its next open): retry elsewhere.
    (StoreDamagedError, grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE"),
    (OperationalError, grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE"),
    (errors.DeadlineError, grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"),
    (errors.CancelledError, grpc.StatusCode.CANCELLED, "CANCELLED"),
    (NotImplementedError, grpc.StatusCode.UNIMPLEMENTED, "UNIMPLEMENTED"),
    (StorageError, grpc.StatusCode.INTERNAL, "INTERNAL"),
)
# The HTTP column of the table: each status code's HTTP status and OpenAI error `type` (what the HTTP front
# door answers; the openai client raises its error class by the HTTP status).
HTTP_BY_CODE: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    # a closed session, or a turn already running on it (TURN_RUNNING): a conflict with its state
    grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    # nginx's "client closed request": the caller went away before its turn was planned
    grpc.StatusCode.CANCELLED: (499, "cancelled_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented_error"),
    grpc.StatusCode.INTERNAL: (500, "server_error"),
}
# Reasons whose HTTP status differs from their code's: a request over a size limit is not helped by a retry
# (429 would make OpenAI clients retry it), so it is a 400 as OpenAI answers a context-length overflow.
HTTP_BY_REASON: dict[str, tuple[int, str]] = {
    "REQUEST_TOO_LARGE": (400, "invalid_request_error"),
}
# The ErrorInfo domain of every error (kvresume.client.ERROR_DOMAIN says the same to clients).
ERROR_DOMAIN = "kvresume.v1"
# When the caller may retry an UNAVAILABLE registry or store.
_UNAVAILABLE_RETRY_S = 1.0


@dataclass(frozen=True, kw_only=True)
class CallerError:
    """What a failed call tells its caller: status code, message and the machine-readable details."""

    code: grpc.StatusCode
    message: str
    reason: str
    field: str | None = None
    retry_after_s: float | None = None


def error_for(exc: BaseException) -> CallerError:
    """The caller-facing form of an exception (INTERNAL for anything unexpected)."""
    for cls, code, reason in STATUS_TABLE:
        if isinstance(exc, cls):
            message = str(exc)
            if isinstance(exc, OperationalError):
                # Driver messages can carry connection strings; say only what the caller needs.
                message = "registry database unavailable"
            field = retry = None
            if isinstance(exc, OrchestratorError):
                reason, field, retry = exc.reason, exc.field, exc.retry_after_s
            if code == grpc.StatusCode.UNAVAILABLE and retry is None:
                retry = _UNAVAILABLE_RETRY_S
            return CallerError(code=code, message=message, reason=reason, field=field, retry_after_s=retry)
    return CallerError(code=grpc.StatusCode.INTERNAL, message="internal error", reason="INTERNAL")


@dataclass(frozen=True, kw_only=True)
class HttpError:
    """What a failed HTTP request tells its caller: status, OpenAI error type, and the details (`code`: the
    gRPC status code's name, for the metrics)."""

    status: int
    type: str
    code: str
    message: str
    reason: str
    field: str | None = None
    retry_after_s: float | None = None


def http_error_for(exc: BaseException) -> HttpError:
    """The HTTP form of an exception, through the same table as its gRPC status (500 when unexpected)."""
    err = error_for(exc)
    status, kind = HTTP_BY_REASON.get(err.reason) or HTTP_BY_CODE[err.code]
    retry = err.retry_after_s if status != 400 else None
    return HttpError(
        status=status,
        type=kind,
        code=err.code.name,
        message=err.message,
        reason=err.reason,
        field=err.field,
        retry_after_s=retry,
    )


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and caller-facing message of an exception (INTERNAL for anything unexpected)."""
    err = error_for(exc)
    return err.code, err.message


def rich_status(err: CallerError) -> grpc.Status:
    """A grpc.Status whose trailer carries google.rpc.Status with ErrorInfo (and RetryInfo)."""
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=ERROR_DOMAIN)
    if err.field:
        info.metadata["field"] = err.field
    details = [info]
    if err.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(err.retry_after_s * 1e9))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    packed = []
    for d in details:
        wrapped = any_pb2.Any()
        wrapped.Pack(d)
        packed.append(wrapped)
    status = status_pb2.Status(code=err.code.value[0], message=err.message, details=packed)
    return rpc_status.to_status(status)


F = TypeVar("F", bound=Callable[..., Any])


# Status details travel in gRPC metadata (8 KiB by default); a message quoting a huge input would turn
# the status into RESOURCE_EXHAUSTED, so details are cut to this many characters.
_MAX_DETAIL_CHARS = 1024


def _abort(context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    context.abort_with_status(_caller_status(exc, method))


def _caller_status(exc: BaseException, method: str) -> grpc.Status:
    """The status a caller gets for `exc` (logged: INTERNAL with its traceback, others as a rejection)."""
    err = error_for(exc)
    if len(err.message) > _MAX_DETAIL_CHARS:
        cut = err.message[:_MAX_DETAIL_CHARS] + f"... ({len(err.message)} characters)"
        err = dataclasses.replace(err, message=cut)
    if err.code == grpc.StatusCode.INTERNAL:
        log.exception("rpc_failed", method=method, code=err.code.name)
    else:
        log.info("rpc_rejected", method=method, code=err.code.name, reason=err.reason, detail=err.message)
    return rich_status(err)


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


def async_errors(method: F) -> F:
    """Like `unary_errors` for a coroutine method of the asyncio server (a stream written with
    `context.write`): the status goes out with `await context.abort`, its code also set on the context
    for the RPC count."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - every exception is mapped, unknown ones to INTERNAL
            status = _caller_status(exc, method.__name__)
            context.set_code(status.code)
            await context.abort(status.code, status.details, status.trailing_metadata)

    return wrapper  # type: ignore[return-value]

"""Errors of the HTTP API as OpenAI's error JSON, `{"error": {"message", "type", "param", "code"}}`, with the
status from the one status table (`orchestrator/api/status_table.py`, its HTTP column).

`code` is the stable ErrorInfo reason of the gRPC API (`SESSION_NOT_FOUND`, `TURN_RUNNING`, ...), `param` the
request field at fault; a retryable error carries `Retry-After` (whole seconds, rounded up).
"""

from __future__ import annotations

import math

from fastapi.responses import JSONResponse

from orchestrator.api.status_table import HttpError, http_error_for

__all__ = ["error_response", "http_error"]

# A message quoting a huge input is cut, as the gRPC status details are.
_MAX_MESSAGE_CHARS = 1024


def http_error(exc: BaseException) -> HttpError:
    """The HTTP form of an exception (500 "internal error" for anything unexpected)."""
    return http_error_for(exc)


def error_response(err: HttpError) -> JSONResponse:
    message = err.message
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + f"... ({len(err.message)} characters)"
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    body = {"error": {"message": message, "type": err.type, "param": err.field, "code": err.reason}}
    return JSONResponse(body, status_code=err.status, headers=headers)

"""An ASGI middleware that refuses request bodies over `max_request_bytes` (the gRPC server's message limit)
before the app sees them: by Content-Length when sent, else by counting the body as it arrives.

Knows nothing of the routes; the refusal is the status table's (REQUEST_TOO_LARGE, HTTP 400) in OpenAI's
error JSON.
"""

from __future__ import annotations

from typing import Any

from orchestrator.api import ResourceExhaustedError
from orchestrator.http.errors import error_response, http_error

__all__ = ["BodyLimit"]


def _refusal(limit: int, seen: int | None) -> Any:
    size = f"of {seen} bytes " if seen is not None else ""
    exc = ResourceExhaustedError(
        f"request body {size}exceeds the limit of {limit} bytes", reason="REQUEST_TOO_LARGE", field="body"
    )
    return error_response(http_error(exc))


class BodyLimit:
    """Wraps an ASGI app; `limit` in bytes."""

    def __init__(self, app: Any, *, limit: int) -> None:
        self._app = app
        self._limit = limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self._limit:
                await _refusal(self._limit, int(value))(scope, receive, send)
                return
        # The body is read here, up to the limit (a chunked body has no Content-Length), and handed on in
        # one message (the routes read it whole anyway); past the limit nothing of it reaches the app.
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            if len(body) > self._limit:
                await _refusal(self._limit, None)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self._app(scope, replay, send)

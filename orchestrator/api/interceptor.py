"""A server interceptor that gives every RPC a request id in the log context and counts RPCs by status.

Knows nothing of the services; it wraps unary and server-streaming handlers alike.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import structlog

from orchestrator.api.metrics import ServiceMetrics

__all__ = ["RequestInterceptor", "REQUEST_ID_KEY", "request_id_of"]

REQUEST_ID_KEY = "x-request-id"


def request_id_of(context: Any) -> str:
    """The caller's `x-request-id`, or a fresh one (a thread-pool or an asyncio context)."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and value:
            return value if isinstance(value, str) else value.decode()
    return uuid.uuid4().hex


def _code_name(context: grpc.ServicerContext, failed: bool, *, gone: bool = False) -> str:
    """The status the caller got: the one set, else CANCELLED (or DEADLINE_EXCEEDED) when the call ended
    on the client's side first, else OK or, for an exception that set no status, UNKNOWN.

    Args:
        gone: gRPC closed the response stream (GeneratorExit): the client went away mid-stream.
    """
    code = context.code()
    if code is not None:
        return code.name
    if gone or not context.is_active():
        # gRPC reports the remaining time as 0 once the deadline passed; without a deadline it is huge.
        return "DEADLINE_EXCEEDED" if context.time_remaining() <= 0 else "CANCELLED"
    return "UNKNOWN" if failed else "OK"


class RequestInterceptor(grpc.ServerInterceptor):
    """Binds `request_id` and `rpc` into structlog's contextvars and counts `kvresume_rpcs_total`."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self._metrics = metrics

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        counter = self._metrics.rpcs

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                structlog.contextvars.bind_contextvars(request_id=request_id_of(context), rpc=method)
                failed = True
                try:
                    response = inner(request, context)
                    failed = False
                    return response
                finally:
                    counter.labels(method=method, code=_code_name(context, failed)).inc()
                    structlog.contextvars.unbind_contextvars("request_id", "rpc")

            return grpc.unary_unary_rpc_method_handler(
                unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                structlog.contextvars.bind_contextvars(request_id=request_id_of(context), rpc=method)
                failed = True
                gone = False
                try:
                    yield from inner_stream(request, context)
                    failed = False
                except GeneratorExit:
                    # gRPC closes the generator when a response could not be sent: the client is gone.
                    gone = True
                    raise
                finally:
                    counter.labels(method=method, code=_code_name(context, failed, gone=gone)).inc()
                    structlog.contextvars.unbind_contextvars("request_id", "rpc")

            return grpc.unary_stream_rpc_method_handler(
                stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

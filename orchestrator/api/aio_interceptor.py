"""The asyncio server's interceptor: what `RequestInterceptor` does for the thread-pool server (a request id
in the log context, `kvresume_rpcs_total` by status), and the hosting of our synchronous servicer methods.

grpc.aio runs a plain (non-async) handler on its migration pool with a context that lacks
`abort_with_status`, `code` and `is_active`, and never calls a streaming handler's `add_callback`
callbacks; our servicers use all four. So every sync handler is wrapped here into an async one that runs
the body on the worker pool with a `ThreadContext`: the synchronous ServicerContext surface our servicers
use, over the call's asyncio context. An abort in the body becomes the call's status on the loop. Sync
streams (WatchJob, Health.Watch) advance one item per worker stretch (`AsyncSteps`). Async handlers (the
Sessions Turn of the asyncio server, reflection) run on the loop as they are.

Knows nothing of the services.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import threading
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Executor
from typing import Any

import grpc
import structlog

from orchestrator.api.async_steps import END, AsyncSteps
from orchestrator.api.interceptor import request_id_of
from orchestrator.api.metrics import ServiceMetrics

__all__ = ["AsyncRequestInterceptor", "ThreadAbort", "ThreadContext", "status_name"]

# What the thread-pool server's context reports as the remaining time of a call without a deadline (the
# servicers compare against a large bound, as they do there).
_NO_DEADLINE_S = float(1 << 31)
_CODES_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def status_name(code: Any) -> str | None:
    """A status code's name, from a grpc.StatusCode or the integer the asyncio context keeps."""
    if code is None:
        return None
    if isinstance(code, grpc.StatusCode):
        return code.name
    found = _CODES_BY_VALUE.get(int(code))
    return found.name if found is not None else None


class ThreadAbort(Exception):
    """A sync handler body aborted its call; the wrapper sends the status from the loop."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: Any) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.trailing_metadata = tuple(trailing_metadata or ())


class ThreadContext:
    """The grpc.ServicerContext of the thread-pool server, as our servicers use it, for a body running on a
    worker thread of the asyncio server. Reads go to the call's asyncio context; `abort` raises
    ThreadAbort; callbacks run when the call ends, on the loop."""

    def __init__(self, context: grpc.aio.ServicerContext, loop: asyncio.AbstractEventLoop) -> None:
        self._context = context
        self._loop = loop
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] | None = []

    def invocation_metadata(self) -> Any:
        return self._context.invocation_metadata()

    def time_remaining(self) -> float:
        remaining = self._context.time_remaining()
        return _NO_DEADLINE_S if remaining is None else remaining

    def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        raise ThreadAbort(code, details, trailing_metadata)

    def abort_with_status(self, status: grpc.Status) -> None:
        raise ThreadAbort(status.code, status.details, status.trailing_metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._context.set_code(code)

    def set_details(self, details: str) -> None:
        self._context.set_details(details)

    def set_trailing_metadata(self, metadata: Any) -> None:
        self._context.set_trailing_metadata(metadata)

    def code(self) -> grpc.StatusCode | None:
        name = status_name(self._context.code())
        return None if name is None or name == "OK" else grpc.StatusCode[name]

    def is_active(self) -> bool:
        return self._callbacks is not None and not self._context.done()

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Run `callback` when the call ends; False (and never run) when it already has, as grpc's."""
        with self._lock:
            if self._callbacks is None:
                return False
            first = not self._callbacks
            self._callbacks.append(callback)
        if first:
            self._loop.call_soon_threadsafe(self._context.add_done_callback, lambda _ctx: self.ended())
        return True

    def ended(self) -> None:
        """The call is over: run the callbacks, once. grpc.aio runs done callbacks only after the handler
        has returned, so the hosting wrapper calls this as soon as it is cancelled (the client went away),
        which is when the thread-pool server runs its termination callbacks."""
        with self._lock:
            callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            callback()

    def peer(self) -> str:
        return self._context.peer()

    def auth_context(self) -> Any:
        return self._context.auth_context()


def _ended_early(context: grpc.aio.ServicerContext) -> str:
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"


class AsyncRequestInterceptor(grpc.aio.ServerInterceptor):
    """Request ids and RPC counts for every method, and sync handlers hosted on `executor`."""

    def __init__(self, metrics: ServiceMetrics, executor: Executor) -> None:
        self._metrics = metrics
        self._executor = executor

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], handler_call_details: Any
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary is not None:
            inner = handler.unary_unary
            body = inner if inspect.iscoroutinefunction(inner) else self._hosted_unary(inner)
            return grpc.unary_unary_rpc_method_handler(
                self._counted(method, body),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            inner = handler.unary_stream
            if inspect.isasyncgenfunction(inner):
                raise TypeError(f"{method}: async-generator streams are not hosted; write a coroutine")
            body = inner if inspect.iscoroutinefunction(inner) else self._hosted_stream(inner)
            return grpc.unary_stream_rpc_method_handler(
                self._counted(method, body),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        # Client- and bidi-streaming (reflection) run as they are; we serve none of our own.
        return handler

    def _counted(
        self, method: str, body: Callable[[Any, Any], Awaitable[Any]]
    ) -> Callable[[Any, Any], Awaitable[Any]]:
        counter = self._metrics.rpcs

        async def counted(request: Any, context: grpc.aio.ServicerContext) -> Any:
            structlog.contextvars.bind_contextvars(request_id=request_id_of(context), rpc=method)
            code = "UNKNOWN"
            try:
                response = await body(request, context)
                code = status_name(context.code()) or "OK"
                return response
            except asyncio.CancelledError:
                code = _ended_early(context)
                raise
            except ThreadAbort as aborted:
                code = aborted.code.name
                await context.abort(aborted.code, aborted.details, aborted.trailing_metadata)
            except BaseException:
                # An abort of an async body (AbortError) set the code first (status_table's async path).
                name = status_name(context.code())
                code = name if name not in (None, "OK") else "UNKNOWN"
                raise
            finally:
                counter.labels(method=method, code=code).inc()
                structlog.contextvars.unbind_contextvars("request_id", "rpc")

        return counted

    def _hosted_unary(self, inner: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Awaitable[Any]]:
        executor = self._executor

        async def hosted(request: Any, context: grpc.aio.ServicerContext) -> Any:
            loop = asyncio.get_running_loop()
            thread_context = ThreadContext(context, loop)
            run = functools.partial(contextvars.copy_context().run, inner, request, thread_context)
            try:
                return await loop.run_in_executor(executor, run)
            except asyncio.CancelledError:
                thread_context.ended()
                raise

        return hosted

    def _hosted_stream(self, inner: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Awaitable[None]]:
        executor = self._executor

        async def hosted(request: Any, context: grpc.aio.ServicerContext) -> None:
            thread_context = ThreadContext(context, asyncio.get_running_loop())

            def items() -> Iterator[Any]:
                # The handler itself runs on the worker too (Health.Watch does its work when called).
                yield from inner(request, thread_context)

            steps: AsyncSteps[Any] = AsyncSteps(items(), executor)
            try:
                while (item := await steps.next()) is not END:
                    await context.write(item)
            except asyncio.CancelledError:
                thread_context.ended()
                raise
            finally:
                await steps.close()

        return hosted

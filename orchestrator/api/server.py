"""Server assembly: our four services plus the standard gRPC health (with the named service
`kvresume.store`, store_health_watch.py) and reflection services, on one of two servers
(`grpc_server`):

- "async" (opt-in for now): grpc.aio on an event loop of its own thread. Sessions.Turn is a coroutine whose
  waits for the scheduler hold no thread (async_steps.py); every other method is the same sync code,
  run on the `grpc_workers` pool by the interceptor (aio_interceptor.py).
- "threads" (the default): grpc's thread-pool server, a worker per call for its whole length.

Knows nothing of the turn engine beyond the TurnHandler protocol carried by the context.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent import futures
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from orchestrator.api import admin_servicer, mappers_servicer, models_servicer, sessions_servicer
from orchestrator.api.aio_interceptor import AsyncRequestInterceptor
from orchestrator.api.context import ServiceContext
from orchestrator.api.interceptor import RequestInterceptor
from orchestrator.api.store_health_watch import StoreHealthWatch

__all__ = ["RunningServer", "build_server"]

T = TypeVar("T")

# How long stopping waits for the calls the server cancelled to close their turns (each waits out at
# most the pass in flight, a bounded step).
_CLOSE_CALLS_S = 10.0


class _LoopThread:
    """An asyncio event loop running in a daemon thread of its own (the asyncio server's)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvresume-grpc-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for its result here."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


@dataclass(kw_only=True)
class RunningServer:
    """A started server with the port it bound (useful with port 0) and its health servicer."""

    server: Any  # grpc.Server, or grpc.aio.Server when `loop` is set
    port: int
    health: health.HealthServicer
    service_names: tuple[str, ...]
    store_watch: StoreHealthWatch | None = None
    loop: _LoopThread | None = None
    executor: futures.ThreadPoolExecutor | None = None

    def stop(self, grace_s: float | None = 1.0) -> None:
        """Flip health to NOT_SERVING, then stop accepting calls and wait for the grace period."""
        if self.store_watch is not None:
            self.store_watch.stop()
        self.health.enter_graceful_shutdown()
        if self.loop is None:
            self.server.stop(grace_s).wait()
            return
        self.loop.run(_stop_async(self.server, grace_s))
        self.loop.close()
        if self.executor is not None:
            self.executor.shutdown(wait=True)


async def _stop_async(server: Any, grace_s: float | None) -> None:
    await server.stop(grace_s)
    # The server cancelled the calls still running; let each close its turn (on the worker pool) before
    # the loop stops, as a cancelled call of the thread-pool server does in its own thread.
    calls = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    if calls:
        await asyncio.wait(calls, timeout=_CLOSE_CALLS_S)


def build_server(ctx: ServiceContext, *, host: str | None = None, port: int | None = None) -> RunningServer:
    """Create, bind and start the server.

    Args:
        host, port: where to listen (default: the settings'); port 0 picks a free port.

    Raises:
        OSError: the address could not be bound.
    """
    settings = ctx.settings
    options = [
        ("grpc.max_receive_message_length", settings.max_request_bytes),
        ("grpc.max_send_message_length", settings.max_request_bytes),
        # gRPC sets SO_REUSEPORT by default, so a second server on a taken port binds too and the two
        # split the calls between them (seen: four `session list` calls returned 13, 0, 0, 0 sessions).
        ("grpc.so_reuseport", 0),
    ]
    if settings.grpc_server == "async":
        return _build_async(ctx, options, host=host, port=port)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=settings.grpc_workers),
        options=options,
        interceptors=[RequestInterceptor(ctx.metrics)],
    )
    health_servicer, names = _add_services(ctx, server, asyncio_server=False)
    bound = _bind(server, ctx, host, port)
    server.start()
    return _serving(ctx, server=server, port=bound, health_servicer=health_servicer, names=names)


def _build_async(
    ctx: ServiceContext, options: list[tuple[str, Any]], *, host: str | None, port: int | None
) -> RunningServer:
    settings = ctx.settings
    executor = futures.ThreadPoolExecutor(
        max_workers=settings.grpc_workers, thread_name_prefix="kvresume-rpc"
    )
    loop = _LoopThread()

    async def start() -> tuple[Any, int, health.HealthServicer, tuple[str, ...]]:
        server = grpc.aio.server(
            migration_thread_pool=executor,
            options=options,
            interceptors=[AsyncRequestInterceptor(ctx.metrics, executor)],
        )
        health_servicer, names = _add_services(ctx, server, asyncio_server=True, executor=executor)
        bound = _bind(server, ctx, host, port)
        await server.start()
        return server, bound, health_servicer, names

    try:
        server, bound, health_servicer, names = loop.run(start())
    except BaseException:
        loop.close()
        executor.shutdown(wait=False)
        raise
    return _serving(
        ctx, server=server, port=bound, health_servicer=health_servicer, names=names, loop=loop,
        executor=executor,
    )  # fmt: skip


def _add_services(
    ctx: ServiceContext, server: Any, *, asyncio_server: bool, executor: futures.Executor | None = None
) -> tuple[health.HealthServicer, tuple[str, ...]]:
    stubs = ctx.stubs
    sessions_class = sessions_servicer.servicer_class(ctx, asyncio_server=asyncio_server)
    sessions = sessions_class(ctx, executor) if asyncio_server else sessions_class(ctx)
    stubs.sessions_grpc.add_SessionsServicer_to_server(sessions, server)
    stubs.admin_grpc.add_AdminServicer_to_server(admin_servicer.servicer_class(ctx)(ctx), server)
    stubs.mappers_grpc.add_MappersServicer_to_server(mappers_servicer.servicer_class(ctx)(ctx), server)
    stubs.models_grpc.add_ModelsServicer_to_server(models_servicer.servicer_class(ctx)(ctx), server)
    # The sync health servicer on both servers (the store watch sets it from its thread); on the asyncio
    # server the interceptor hosts its methods on the worker pool.
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = stubs.service_names
    reflection.enable_server_reflection(
        (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    return health_servicer, names


def _bind(server: Any, ctx: ServiceContext, host: str | None, port: int | None) -> int:
    settings = ctx.settings
    address = (
        f"{host if host is not None else settings.grpc_host}:{settings.grpc_port if port is None else port}"
    )
    if settings.tls_enabled:
        assert settings.tls_cert_file is not None and settings.tls_key_file is not None
        creds = grpc.ssl_server_credentials(
            [(settings.tls_key_file.read_bytes(), settings.tls_cert_file.read_bytes())]
        )
    try:
        bound = (
            server.add_secure_port(address, creds)
            if settings.tls_enabled
            else server.add_insecure_port(address)
        )
    except RuntimeError as exc:
        # grpcio raises RuntimeError("Failed to bind ...") where older versions returned 0
        raise OSError(f"could not bind the gRPC server to {address} (in use?): {exc}") from exc
    if bound == 0:
        raise OSError(f"could not bind the gRPC server to {address} (in use?)")
    return bound


def _serving(
    ctx: ServiceContext,
    *,
    server: Any,
    port: int,
    health_servicer: health.HealthServicer,
    names: tuple[str, ...],
    loop: _LoopThread | None = None,
    executor: futures.ThreadPoolExecutor | None = None,
) -> RunningServer:
    for name in ("", *names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    # The store's own health service; "" stays SERVING while it is degraded (turns run cold).
    watch = StoreHealthWatch(health_servicer, ctx.metrics, read=ctx.store_health, probe=ctx.store_probe)
    watch.start()
    return RunningServer(
        server=server,
        port=port,
        health=health_servicer,
        service_names=names,
        store_watch=watch,
        loop=loop,
        executor=executor,
    )

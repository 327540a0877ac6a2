"""Server assembly: our four services plus the standard gRPC health (with the named service
`kvresume.store`, store_health_watch.py) and reflection services.

Knows nothing of the turn engine beyond the TurnHandler protocol carried by the context.
"""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from orchestrator.api import admin_servicer, mappers_servicer, models_servicer, sessions_servicer
from orchestrator.api.context import ServiceContext
from orchestrator.api.interceptor import RequestInterceptor
from orchestrator.api.store_health_watch import StoreHealthWatch

__all__ = ["RunningServer", "build_server"]


@dataclass(kw_only=True)
class RunningServer:
    """A started server with the port it bound (useful with port 0) and its health servicer."""

    server: grpc.Server
    port: int
    health: health.HealthServicer
    service_names: tuple[str, ...]
    store_watch: StoreHealthWatch | None = None

    def stop(self, grace_s: float | None = 1.0) -> None:
        """Flip health to NOT_SERVING, then stop accepting calls and wait for the grace period."""
        if self.store_watch is not None:
            self.store_watch.stop()
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()


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
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=settings.grpc_workers),
        options=options,
        interceptors=[RequestInterceptor(ctx.metrics)],
    )
    stubs = ctx.stubs
    stubs.sessions_grpc.add_SessionsServicer_to_server(sessions_servicer.servicer_class(ctx)(ctx), server)
    stubs.admin_grpc.add_AdminServicer_to_server(admin_servicer.servicer_class(ctx)(ctx), server)
    stubs.mappers_grpc.add_MappersServicer_to_server(mappers_servicer.servicer_class(ctx)(ctx), server)
    stubs.models_grpc.add_ModelsServicer_to_server(models_servicer.servicer_class(ctx)(ctx), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = stubs.service_names
    reflection.enable_server_reflection(
        (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
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
    server.start()
    for name in ("", *names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    # The store's own health service; "" stays SERVING while it is degraded (turns run cold).
    watch = StoreHealthWatch(health_servicer, ctx.metrics, read=ctx.store_health, probe=ctx.store_probe)
    watch.start()
    return RunningServer(
        server=server, port=bound, health=health_servicer, service_names=names, store_watch=watch
    )

"""`kvresume serve`: run the gRPC service (Sessions, Admin, Mappers, health, reflection) and /metrics."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import threading
from collections.abc import Callable

import structlog

from model import configure_torch
from orchestrator.api import RunningServer, ServiceContext, build_server, configure_logging
from orchestrator.cli.numerics_flag import add_numerics_flag, enter_numerics
from orchestrator.engine import build_node
from orchestrator.numerics_env import profile_report
from orchestrator.settings import Settings, load_settings

log = structlog.get_logger(__name__)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from --config / environment / the flags shared by the service commands."""
    return load_settings(
        toml_path=getattr(args, "config", None),
        overrides={
            "database_url": getattr(args, "database_url", None),
            "data_dir": getattr(args, "data_dir", None),
            "grpc_host": getattr(args, "host", None),
            "grpc_port": getattr(args, "port", None),
            "metrics_port": getattr(args, "metrics_port", None),
            "region": getattr(args, "region", None),
            "served_models": getattr(args, "models", None),
            "model_numerics": getattr(args, "numerics", None),
        },
    )


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="settings TOML (default: $KVRESUME_CONFIG)")
    parser.add_argument("--database-url", help="SQLAlchemy URL of the registry (default: SQLite in data dir)")
    parser.add_argument("--data-dir", help="data directory")


def serve(
    settings: Settings,
    stop: threading.Event,
    *,
    on_ready: Callable[[ServiceContext, RunningServer, int | None], None] | None = None,
    preload: bool = False,
) -> None:
    """Run the service until `stop` is set: registry migrated, store and pool opened, models registered,
    the turn engine wired, gRPC server, metrics endpoint.

    Args:
        on_ready: called once serving, with the context, the server and the metrics port (None: off).
        preload: load every served model before serving (else each on its first turn).
    """
    node = build_node(settings, maintenance=True, preload=preload)
    ctx = node.ctx
    running = build_server(ctx)
    metrics_server = None
    metrics_port: int | None = None
    if settings.metrics_enabled:
        metrics_server, _ = ctx.metrics.serve(settings.metrics_port, addr=settings.grpc_host)
        metrics_port = metrics_server.server_port  # type: ignore[attr-defined]
    log.info(
        "service_started",
        grpc=f"{settings.grpc_host}:{running.port}",
        metrics_port=metrics_port,
        region=settings.region,
        tls=settings.tls_enabled,
        turn_engine=ctx.turn_handler is not None,
    )
    try:
        if on_ready is not None:
            on_ready(ctx, running, metrics_port)
        stop.wait()
    finally:
        log.info("service_stopping")
        running.stop(grace_s=5.0)
        if metrics_server is not None:
            metrics_server.shutdown()  # type: ignore[attr-defined]
            metrics_server.server_close()  # type: ignore[attr-defined]
        node.close()


def check_port_free(host: str, port: int, what: str) -> None:
    """Fail before the models load (minutes on a large one) when `host:port` is taken; port 0 is any.

    Raises:
        OSError: naming the address; the server's own bind still decides (this probe can race).
    """
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # REUSEADDR: a port left in TIME_WAIT by a stopped server is free; a listening one is not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise OSError(f"{what} address {host}:{port} is not available: {exc.strerror}") from exc


def _run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    rc = enter_numerics(args, settings.model_numerics)
    if rc is not None:
        return rc
    check_port_free(settings.grpc_host, settings.grpc_port, "gRPC")
    if settings.metrics_enabled:
        check_port_free(settings.grpc_host, settings.metrics_port, "metrics")
    configure_logging(json=True if args.json_logs else None)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    configure_torch(settings.model_numerics, threads=settings.torch_threads or len(os.sched_getaffinity(0)))
    log.info("numerics_profile", **profile_report(settings.model_numerics))
    serve(settings, stop, preload=True)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="run the gRPC service and the metrics endpoint")
    add_settings_flags(parser)
    parser.add_argument("--host", help="gRPC listen host")
    parser.add_argument("--port", type=int, help="gRPC listen port (0: any free port)")
    parser.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0: any free port)")
    parser.add_argument("--region", help="this node's region label")
    parser.add_argument(
        "--models",
        help="served models as name=checkpoint:<dir> or name=random:<preset>[@seed], comma-separated "
        "(default: the sibling family; env KVRESUME_SERVED_MODELS)",
    )
    parser.add_argument("--json-logs", action="store_true", help="JSON log lines even on a TTY")
    add_numerics_flag(parser, default=None, what="the served models")
    parser.set_defaults(handler=_run)

"""`kvresume serve`: run the gRPC service (Sessions, Models, Admin, Mappers, health, reflection), /metrics,
and with `--http-port` the OpenAI-compatible HTTP API in the same process.

A server without tenant tokens would refuse every call, so `serve` refuses to start without them
(settings `tenant_tokens`, env `KVRESUME_TENANT_TOKENS='tenant=token,...'`), unless `--insecure-dev` is
given on a loopback host: then the well-known development tokens below stand in for the missing ones.
Both checks run before anything heavy is imported or loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import socket
import threading
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from orchestrator.cli.numerics_flag import add_numerics_flag, enter_numerics
from orchestrator.cli.output import add_json_flag, text_stream, write_json
from orchestrator.cli.settings_flags import add_settings_flags, settings_from_args
from orchestrator.cpu_split import enter_cpu_split
from orchestrator.numerics_env import resolve_cpu_path
from orchestrator.settings import Settings

if TYPE_CHECKING:
    from orchestrator.api import RunningServer, ServiceContext
    from orchestrator.http import RunningHttpServer

__all__ = ["DEV_ADMIN_TOKEN", "DEV_TENANT", "DEV_TOKEN", "check_port_free", "serve", "with_tokens"]

# `--insecure-dev`'s stand-ins for tokens that are not configured: known to everyone, loopback only.
DEV_TENANT, DEV_TOKEN, DEV_ADMIN_TOKEN = "dev", "dev", "dev-admin"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def with_tokens(settings: Settings, *, insecure_dev: bool) -> Settings:
    """The settings `serve` may start with: tenant tokens configured, or the development tokens under
    `insecure_dev` on a loopback host (each of tenant tokens and admin token only where none is set).

    Raises:
        ValueError: no tenant tokens and no `insecure_dev`, or `insecure_dev` on a host that is not a
            loopback address.
    """
    if insecure_dev:
        if not _is_loopback(settings.grpc_host):
            raise ValueError(
                f"--insecure-dev serves well-known tokens, so only on a loopback host; the gRPC host is "
                f"{settings.grpc_host!r} (use --host 127.0.0.1, or configure tenant_tokens and admin_token)"
            )
        changes: dict[str, object] = {}
        if not settings.tenant_tokens:
            changes["tenant_tokens"] = {DEV_TENANT: DEV_TOKEN}
        if not settings.admin_token:
            changes["admin_token"] = DEV_ADMIN_TOKEN
        return dataclasses.replace(settings, **changes)
    if not settings.tenant_tokens:
        raise ValueError(
            "no tenant tokens are configured, so every call would be refused: set tenant_tokens in the "
            "settings TOML (--config) or KVRESUME_TENANT_TOKENS='tenant=token,...' (and admin_token / "
            "KVRESUME_ADMIN_TOKEN for Admin calls), or pass --insecure-dev to serve the development tokens "
            f"on a loopback host (tenant {DEV_TENANT!r} with token {DEV_TOKEN!r}, admin token "
            f"{DEV_ADMIN_TOKEN!r})"
        )
    return settings


def serve(
    settings: Settings,
    stop: threading.Event,
    *,
    on_ready: Callable[[ServiceContext, RunningServer, int | None], None] | None = None,
    preload: bool = False,
    on_http_ready: Callable[[RunningHttpServer], None] | None = None,
    model_cpus: Collection[int] = (),
) -> None:
    """Run the service until `stop` is set: registry migrated, store and pool opened, models registered,
    the turn engine wired, gRPC server, metrics endpoint, and the HTTP API when `settings.http_port` is set.

    Args:
        on_ready: called once serving, with the context, the server and the metrics port (None: off).
        preload: load every served model before serving (else each on its first turn).
        on_http_ready: called before `on_ready` with the HTTP server, when one is served.
        model_cpus: the model process's CPUs (`cpu_split.enter_cpu_split`, which pinned this process to
            the others); empty: no pinning.
    """
    import structlog

    from orchestrator.api import build_server
    from orchestrator.engine import build_node
    from orchestrator.heap import YOUNG_THRESHOLD, tune_gc_for_serving

    log = structlog.get_logger(__name__)
    node = build_node(settings, maintenance=True, preload=preload, model_cpus=model_cpus)
    ctx = node.ctx
    running = build_server(ctx)
    metrics_server = None
    metrics_port: int | None = None
    if settings.metrics_enabled:
        metrics_server, _ = ctx.metrics.serve(settings.metrics_port, addr=settings.grpc_host)
        metrics_port = metrics_server.server_port  # type: ignore[attr-defined]
    http = None
    if settings.http_port:
        from orchestrator.http import start_http_server

        http = start_http_server(ctx, host=settings.grpc_host, port=settings.http_port)
    # ready: the collector tuned for serving (orchestrator/heap.py), for as long as this service runs
    # (`kvresume serve` runs one a process; a caller that runs it in its own process, a test, gets the
    # collector back when it stops)
    tuned = tune_gc_for_serving() if settings.tune_gc else None
    if tuned is not None:
        log.info("gc_tuned_for_serving", frozen_objects=tuned.objects, ms=round(tuned.seconds * 1e3, 1),
                 young_threshold=YOUNG_THRESHOLD)  # fmt: skip
    log.info(
        "service_started",
        grpc=f"{settings.grpc_host}:{running.port}",
        metrics_port=metrics_port,
        http_port=http.port if http is not None else None,
        region=settings.region,
        tls=settings.tls_enabled,
        turn_engine=ctx.turn_handler is not None,
    )
    try:
        if http is not None and on_http_ready is not None:
            on_http_ready(http)
        if on_ready is not None:
            on_ready(ctx, running, metrics_port)
        stop.wait()
    finally:
        log.info("service_stopping")
        # first, so that nothing below can keep the caller's objects frozen
        if tuned is not None:
            tuned.release()
        if http is not None:
            http.stop(grace_s=5.0)
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
    configured = settings_from_args(args)
    settings = with_tokens(configured, insecure_dev=args.insecure_dev)
    # "auto" becomes the path this CPU computes exactly, so the fingerprints and the log name it
    settings = dataclasses.replace(settings, model_numerics=resolve_cpu_path(settings.model_numerics))
    rc = enter_numerics(args, settings.model_numerics)
    if rc is not None:
        return rc
    check_port_free(settings.grpc_host, settings.grpc_port, "gRPC")
    if settings.metrics_enabled:
        check_port_free(settings.grpc_host, settings.metrics_port, "metrics")
    if settings.http_port:
        check_port_free(settings.grpc_host, settings.http_port, "HTTP")

    import os
    import signal

    import structlog

    from model import configure_torch
    from orchestrator.api import configure_logging
    from orchestrator.numerics_env import profile_report

    configure_logging(json=True if args.json_logs else None)
    log = structlog.get_logger(__name__)
    dev: dict[str, str] = {}
    if not configured.tenant_tokens and settings.tenant_tokens:
        dev |= {"tenant": DEV_TENANT, "token": DEV_TOKEN}
    if not configured.admin_token and settings.admin_token:
        dev["admin_token"] = DEV_ADMIN_TOKEN
    if dev:
        log.warning(
            "insecure_dev_tokens",
            **dev,
            note="--insecure-dev: well-known development tokens; anyone on this host can call with them",
        )
    if not settings.admin_token:
        log.warning("no_admin_token", note="Admin calls and mapper registration will be refused")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # The model process on CPUs of its own and this process on the others (the setting's measurements:
    # orchestrator/cpu_split.py). Before torch starts its threads here, so that they inherit the pinning;
    # build_node gives the model process at most one thread per CPU of its own.
    split, _ = enter_cpu_split(
        settings.model_process_cpus,
        model_process=settings.model_process,
        model_threads=settings.torch_threads,
        device=settings.model_device,
    )
    if split is not None:
        log.info("cpu_split", model_process_cpus=sorted(split.model), service_cpus=sorted(split.service))
    # Counted after the split: more torch threads than the CPUs this process kept made every parallel op
    # of its own (the weights' fingerprint at start) wait for its threads to take turns on one CPU
    # (v41-tiny's start: 4 s of weight initialisation instead of 0.15 s).
    threads = settings.torch_threads or len(os.sched_getaffinity(0))
    configure_torch(settings.model_numerics, threads=threads)
    log.info("numerics_profile", **profile_report(settings.model_numerics))

    http_ports: list[int] = []

    def on_ready(ctx: ServiceContext, running: RunningServer, metrics_port: int | None) -> None:
        models = list(ctx.model_catalog.names) if ctx.model_catalog is not None else []
        http = f"http://{settings.grpc_host}:{http_ports[0]}/v1" if http_ports else None
        doc = {
            "grpc": f"{settings.grpc_host}:{running.port}",
            "metrics_port": metrics_port,
            "http": http,
            "region": settings.region,
            "models": models,
            "tls": settings.tls_enabled,
            "insecure_dev": args.insecure_dev,
        }
        metrics = f", /metrics on port {metrics_port}" if metrics_port is not None else ""
        metrics += f", OpenAI-compatible HTTP at {http}" if http is not None else ""
        print(f"kvresume serve: serving {', '.join(models) or 'no models'} on {doc['grpc']} "
              f"(region {settings.region}{metrics}); Ctrl-C stops", file=text_stream(args.json), flush=True)
        write_json(doc, args.json)

    serve(
        settings,
        stop,
        on_ready=on_ready,
        preload=True,
        on_http_ready=lambda h: http_ports.append(h.port),
        model_cpus=split.model if split is not None else (),
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="run the gRPC service and the metrics endpoint (server)")
    add_settings_flags(parser)
    parser.add_argument("--host", help="gRPC listen host (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="gRPC listen port (default 50051; 0: any free port)")
    parser.add_argument(
        "--metrics-port", type=int, help="Prometheus /metrics port (default 50052; 0: any free port)"
    )
    parser.add_argument(
        "--http-port",
        type=int,
        help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models) on "
        "this port of the gRPC host (default: off; setting http_port, env KVRESUME_HTTP_PORT)",
    )
    parser.add_argument("--region", help="this node's region label (default 'local')")
    parser.add_argument(
        "--models",
        help="served models as name=checkpoint:<dir> or name=random:<preset>[@seed], comma-separated "
        "(default: the sibling family; env KVRESUME_SERVED_MODELS)",
    )
    parser.add_argument(
        "--insecure-dev",
        action="store_true",
        help=f"local development only: serve on a loopback host with tenant {DEV_TENANT!r} (token "
        f"{DEV_TOKEN!r}) and admin token {DEV_ADMIN_TOKEN!r} where no tokens are configured (without "
        "tokens and without this flag, serve refuses to start)",
    )
    parser.add_argument("--json-logs", action="store_true", help="JSON log lines even on a TTY")
    add_json_flag(parser, what="the address, region and models once serving")
    add_numerics_flag(parser, default=None, what="the served models")
    parser.set_defaults(handler=_run)

"""The HTTP front door served by uvicorn in a thread of its own, with its own asyncio event loop, beside the
gRPC server of the same process (threading model: orchestrator/README.md, "The HTTP API").

Knows nothing of the routes beyond `build_app`.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from orchestrator.api import ServiceContext
from orchestrator.http.body_limit import BodyLimit
from orchestrator.http.front_door import FrontDoor
from orchestrator.http.routes import build_app

__all__ = ["RunningHttpServer", "start_http_server"]

_START_TIMEOUT_S = 30.0


@dataclass(kw_only=True)
class RunningHttpServer:
    """A started HTTP server: the port it bound (useful with port 0) and its front door."""

    port: int
    host: str
    door: FrontDoor
    _server: uvicorn.Server
    _thread: threading.Thread

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting requests, let running ones finish for up to `grace_s`, then stop the threads."""
        self._server.should_exit = True
        self._thread.join(grace_s + 5.0)
        self.door.close()


def start_http_server(
    ctx: ServiceContext, *, host: str, port: int, grace_s: float = 5.0
) -> RunningHttpServer:
    """Bind `host:port` (0: any free port) and serve the OpenAI-compatible API on it.

    Raises:
        OSError: the address could not be bound, or the server did not start.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # REUSEADDR: a port in TIME_WAIT after a stopped server is free; a listening one still is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"could not bind the HTTP server to {host}:{port}: {exc.strerror}") from exc
    bound = sock.getsockname()[1]
    door = FrontDoor(ctx)
    config = uvicorn.Config(
        BodyLimit(build_app(door), limit=ctx.settings.max_request_bytes),
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=grace_s,
        # bodies are bounded by BodyLimit (max_request_bytes); this bounds the connections one process holds
        limit_concurrency=max(ctx.settings.grpc_workers * 2, 64),
    )
    server = uvicorn.Server(config)
    # uvicorn installs signal handlers only on the main thread; `serve` owns SIGINT/SIGTERM.
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="kvresume-http", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            door.close()
            raise OSError(f"the HTTP server on {host}:{bound} did not start")
        time.sleep(0.01)
    return RunningHttpServer(port=bound, host=host, door=door, _server=server, _thread=thread)

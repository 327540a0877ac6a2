"""`serve` with `http_port` serves the OpenAI-compatible API beside gRPC in one process, and stops both."""

from __future__ import annotations

import json
import socket
import threading
import urllib.request

from orchestrator.cli.serve_cmd import serve
from tests.orchestrator.api.conftest import make_settings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_http_beside_grpc_then_stops(tmp_path) -> None:
    port = _free_port()
    settings = make_settings(tmp_path, http_port=port, metrics_port=0)
    stop = threading.Event()
    seen: dict[str, object] = {}

    def on_http_ready(http) -> None:
        seen["port"] = http.port

    def on_ready(ctx, running, metrics_port) -> None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": "Bearer tok-acme"}
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            seen["models"] = json.loads(resp.read())
        stop.set()

    serve(settings, stop, on_ready=on_ready, on_http_ready=on_http_ready)
    assert seen["port"] == port
    assert seen["models"]["object"] == "list"
    # stopped: the port is free again
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))

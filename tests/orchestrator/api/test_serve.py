"""`serve` runs the whole service: health SERVING on gRPC, Prometheus text on /metrics, clean stop."""

from __future__ import annotations

import gc
import socket
import threading
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.api import build_context, build_server
from orchestrator.cli import main
from orchestrator.cli.serve_cmd import serve
from orchestrator.heap import YOUNG_THRESHOLD
from tests.orchestrator.api.conftest import make_settings


def test_serve_answers_health_and_metrics_then_stops(tmp_path) -> None:
    settings = make_settings(tmp_path, metrics_port=0)
    stop = threading.Event()
    seen: dict[str, object] = {}
    collector = gc.get_threshold(), gc.get_freeze_count()

    def on_ready(ctx, running, metrics_port) -> None:
        # serving, the collector is tuned (orchestrator/heap.py) ...
        seen["tuned"] = gc.get_threshold()[0] == YOUNG_THRESHOLD and gc.get_freeze_count() > 0
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            seen["health"] = reply.status
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
            seen["metrics"] = resp.read().decode()
        stop.set()

    serve(settings, stop, on_ready=on_ready)
    assert seen["tuned"]
    # ... and stopped, this process (a test's) gets its collector back
    assert (gc.get_threshold(), gc.get_freeze_count()) == collector
    assert seen["health"] == health_pb2.HealthCheckResponse.SERVING
    assert "kvresume_running_turns 0.0" in seen["metrics"]


def test_a_second_server_on_a_taken_port_fails_naming_the_address(tmp_path) -> None:
    # gRPC's default SO_REUSEPORT let a second server bind the same port and take half the calls
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    ctx = build_context(make_settings(tmp_path / "one"))
    first = build_server(ctx, host="127.0.0.1", port=0)
    other = build_context(make_settings(tmp_path / "two"))
    try:
        with pytest.raises(OSError, match=f"could not bind the gRPC server to 127.0.0.1:{first.port}"):
            build_server(other, host="127.0.0.1", port=first.port)
    finally:
        first.stop(grace_s=None)
        ctx.close()
        other.close()


def test_serve_cli_refuses_a_taken_port_before_loading_models(tmp_path, capsys) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc = main(["serve", "--insecure-dev", "--data-dir", str(tmp_path), "--port", str(port),
                   "--metrics-port", "0", "--models", "x=random:v41-tiny@1"])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"gRPC address 127.0.0.1:{port} is not available" in err
    # nothing was set up: the registry was never created
    assert not (tmp_path / "registry.sqlite3").exists()

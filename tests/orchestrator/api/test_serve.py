"""`serve` runs the whole service: health SERVING on gRPC, Prometheus text on /metrics, clean stop."""

from __future__ import annotations

import threading
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.cli.serve_cmd import serve
from tests.orchestrator.api.conftest import make_settings


def test_serve_answers_health_and_metrics_then_stops(tmp_path) -> None:
    settings = make_settings(tmp_path, metrics_port=0)
    stop = threading.Event()
    seen: dict[str, object] = {}

    def on_ready(ctx, running, metrics_port) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            seen["health"] = reply.status
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
            seen["metrics"] = resp.read().decode()
        stop.set()

    serve(settings, stop, on_ready=on_ready)
    assert seen["health"] == health_pb2.HealthCheckResponse.SERVING
    assert "kvresume_running_turns 0.0" in seen["metrics"]

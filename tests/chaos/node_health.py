"""Helpers of the chaos suite's node-level runs: the gRPC health answers of a running node."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

STORE = "kvresume.store"


def health_status(channel: grpc.Channel, service: str) -> str:
    """The health service's answer for `service` (SERVING, NOT_SERVING, ...)."""
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=5
    )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def degraded_gauge(metrics_text: bytes) -> dict[str, float]:
    """`kvresume_store_degraded` series by reason, from a Prometheus exposition."""
    out: dict[str, float] = {}
    for line in metrics_text.decode().splitlines():
        if line.startswith("kvresume_store_degraded{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('reason="', 1)[1].split('"', 1)[0]] = float(value)
    return out

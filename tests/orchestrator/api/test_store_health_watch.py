"""StoreHealthWatch publishes the store's health to the named health service `kvresume.store` and the
kvresume_store_degraded gauge, probes while writes fail, and leaves the overall service alone."""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2

from orchestrator.api.metrics import ServiceMetrics
from orchestrator.api.store_health_watch import STORE_HEALTH_SERVICE, StoreHealthWatch
from storage import HealthReason, StoreHealth
from tests.chaos.node_health import degraded_gauge


def _state(*reasons: HealthReason) -> StoreHealth:
    return StoreHealth(
        reasons=reasons, detail="", quarantined_stores=0, quarantined_bytes=0, consecutive_write_failures=0
    )


def _status(servicer: health.HealthServicer, service: str) -> int:
    return servicer.Check(health_pb2.HealthCheckRequest(service=service), None).status


def test_watch_publishes_reasons_and_probes_while_writes_fail() -> None:
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    metrics = ServiceMetrics()
    states = [_state(HealthReason.WRITE_FAILING)]
    probes: list[bool] = []

    def probe() -> bool:
        probes.append(True)
        states[0] = _state()
        return True

    watch = StoreHealthWatch(servicer, metrics, read=lambda: states[0], probe=lambda: False)
    watch.poll()
    assert _status(servicer, STORE_HEALTH_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert _status(servicer, "") == health_pb2.HealthCheckResponse.SERVING
    assert degraded_gauge(metrics.exposition()) == {
        "quarantined": 0.0,
        "read_error": 0.0,
        "write_failing": 1.0,
    }

    # A probe that succeeds (space returned) clears it within the same poll.
    watch = StoreHealthWatch(servicer, metrics, read=lambda: states[0], probe=probe)
    watch.poll()
    assert probes == [True]
    assert _status(servicer, STORE_HEALTH_SERVICE) == health_pb2.HealthCheckResponse.SERVING
    assert degraded_gauge(metrics.exposition())["write_failing"] == 0.0

    states[0] = _state(HealthReason.QUARANTINED, HealthReason.READ_ERROR)
    watch.poll()
    assert probes == [True]
    assert degraded_gauge(metrics.exposition()) == {
        "quarantined": 1.0,
        "read_error": 1.0,
        "write_failing": 0.0,
    }


def test_watch_without_a_store_serves_and_a_failing_read_does_not() -> None:
    servicer = health.HealthServicer()
    StoreHealthWatch(servicer, ServiceMetrics(), read=None, probe=None).poll()
    assert _status(servicer, STORE_HEALTH_SERVICE) == health_pb2.HealthCheckResponse.SERVING

    def broken() -> StoreHealth:
        raise OSError("quarantine dir unreadable")

    StoreHealthWatch(servicer, ServiceMetrics(), read=broken, probe=None).poll()
    assert _status(servicer, STORE_HEALTH_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING

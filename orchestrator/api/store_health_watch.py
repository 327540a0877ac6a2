"""The named gRPC health service `kvresume.store`: the store's health (storage.StoreHealth) polled on a
thread and published to the standard health servicer and the `kvresume_store_degraded` gauge.

Knows nothing of the store beyond the two callables the context carries. The overall service ("")
and the API services stay SERVING while the store is degraded: a node without a usable store still
serves every turn cold. While writes fail the watch probes with one small write per poll, so health
recovers when space returns even if no turn writes meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog
from grpc_health.v1 import health, health_pb2

from orchestrator.api.metrics import ServiceMetrics
from storage import HealthReason, StoreHealth

__all__ = ["STORE_HEALTH_SERVICE", "StoreHealthWatch"]

log = structlog.get_logger(__name__)

STORE_HEALTH_SERVICE = "kvresume.store"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class StoreHealthWatch:
    """Publishes the store's health every `interval_s` seconds until `stop()`.

    Args:
        servicer: the server's health servicer.
        metrics: where the gauge lives.
        read: the store's `health()`; None means no store is attached (always SERVING).
        probe: the store's `probe_write()`, called while writes are failing.
        interval_s: seconds between polls.
    """

    def __init__(
        self,
        servicer: health.HealthServicer,
        metrics: ServiceMetrics,
        *,
        read: Callable[[], StoreHealth] | None,
        probe: Callable[[], bool] | None,
        interval_s: float = 1.0,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"store health interval_s must be > 0, got {interval_s}")
        self._servicer = servicer
        self._metrics = metrics
        self._read = read
        self._probe = probe
        self._interval_s = interval_s
        self._stop = threading.Event()
        # Polls from the thread and from callers (tests, a shutdown) publish one at a time.
        self._poll_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._last: tuple[HealthReason, ...] | None = None

    def poll(self) -> StoreHealth | None:
        """Read (probing first while writes fail) and publish once; returns what was read."""
        with self._poll_lock:
            return self._poll()

    def _poll(self) -> StoreHealth | None:
        if self._read is None:
            self._servicer.set(STORE_HEALTH_SERVICE, _SERVING)
            return None
        try:
            state = self._read()
            if HealthReason.WRITE_FAILING in state.reasons and self._probe is not None and self._probe():
                state = self._read()
        except Exception as exc:  # noqa: BLE001 - a failing health read is itself a degraded store
            log.error("store_health_read_failed", error=str(exc))
            self._servicer.set(STORE_HEALTH_SERVICE, _NOT_SERVING)
            return None
        self._servicer.set(STORE_HEALTH_SERVICE, _SERVING if state.serving else _NOT_SERVING)
        self._metrics.set_store_health(
            reasons=[r.value for r in state.reasons],
            known=[r.value for r in HealthReason],
            quarantined_bytes=state.quarantined_bytes,
        )
        if state.reasons != self._last and (self._last is not None or state.reasons):
            log.warning(
                "store_health_changed",
                serving=state.serving,
                reasons=[r.value for r in state.reasons],
                detail=state.detail,
            )
            self._last = state.reasons
        return state

    def start(self) -> None:
        """Publish now, then on a daemon thread every interval."""
        self.poll()
        if self._read is None or self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.wait(self._interval_s):
                self.poll()

        self._thread = threading.Thread(target=loop, name="kvresume-store-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

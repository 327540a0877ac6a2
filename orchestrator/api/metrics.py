"""Prometheus metrics of the service, on a registry owned by the server (no module-level collectors).

Knows nothing of where the numbers come from; the turn engine, store and servicers report into it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

__all__ = ["ServiceMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServiceMetrics:
    """All metrics of one service instance, prefixed `kvresume_`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.turns = Counter(
            "kvresume_turns", "Turns by resume path and outcome", ["path", "outcome"], registry=r
        )
        self.turn_tokens = Counter(
            "kvresume_turn_tokens", "Prompt tokens of turns by kind", ["kind"], registry=r
        )
        self.cache_lookups = Counter(
            "kvresume_cache_lookups",
            "Stored-KV lookups by result (hit, partial, miss, corrupt)",
            ["result"],
            registry=r,
        )
        self.stored_bytes = Gauge("kvresume_stored_bytes", "Bytes of global KV in the store", registry=r)
        self.pool_bytes = Gauge("kvresume_pool_bytes", "Bytes held by the window pool", registry=r)
        self.pool_budget_bytes = Gauge(
            "kvresume_pool_budget_bytes", "Byte budget of the window pool", registry=r
        )
        self.pool_entries = Gauge("kvresume_pool_entries", "Sessions with windows in the pool", registry=r)
        self.running_turns = Gauge("kvresume_running_turns", "Turns running now", registry=r)
        self.ttft = Histogram(
            "kvresume_ttft_seconds",
            "Time to first token by path",
            ["path"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.turn_latency = Histogram(
            "kvresume_turn_seconds",
            "Whole-turn latency by path",
            ["path"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rpcs = Counter("kvresume_rpcs", "RPCs by method and status code", ["method", "code"], registry=r)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "0.0.0.0") -> tuple[object, object]:
        """Serve `/metrics` over HTTP on `port`; returns (server, thread) for shutdown."""
        return start_http_server(port, addr=addr, registry=self.registry)

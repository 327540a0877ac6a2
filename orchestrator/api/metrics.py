"""Prometheus metrics of the service, on a registry owned by the server (no module-level collectors).

Knows nothing of where the numbers come from; the turn engine, store and servicers report into it, and
the cumulative counts that storage/ keeps itself (pool and store evictions, expiries, refusals) are read
at scrape time through `read_storage_counts`. The names, labels and meanings are listed in
orchestrator/README.md ("Metrics").
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["ServiceMetrics", "StorageCounts", "package_version"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Gaps between streamed token chunks: one decode step each, milliseconds on a GPU, tens of them on a CPU.
_INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def package_version(distribution: str = "kvresume") -> str:
    """The installed version of `distribution`, or "unknown" when it is not installed (a bare checkout)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True, kw_only=True)
class StorageCounts:
    """Cumulative counts since start that storage/ keeps on its own objects (None: that part not wired).

    Attributes:
        pool_expired: window-pool entries dropped idle past their TTL.
        pool_evicted_lru: entries dropped, least recently used first, to fit the pool's byte budget.
        pool_refused: puts refused because the value alone exceeds the whole budget.
        store_expired_chunks: stored chunks deleted past their retention ceiling.
        store_evicted_chunks: stored chunks evicted (LRU, past their floor) to fit the store's capacity.
        store_unread_chunk_hits: stored chunks a full hit served from kept decoded state without reading
            them (`GlobalKVStore.record_served`).
        store_refusals: writes the store refused, by kind (capacity, residency, io_error).
    """

    pool_expired: int | None = None
    pool_evicted_lru: int | None = None
    pool_refused: int | None = None
    store_expired_chunks: int | None = None
    store_evicted_chunks: int | None = None
    store_unread_chunk_hits: int | None = None
    store_refusals: Mapping[str, int] = field(default_factory=dict)


class _StorageCollector(Collector):
    """Exposes `StorageCounts` as counters; the counts live in storage/, so they are read, not kept."""

    def __init__(self) -> None:
        self.read: Callable[[], StorageCounts] = StorageCounts

    def describe(self) -> list[Metric]:
        # Registration must not call `read` (the sources are wired after the registry is built).
        return []

    def collect(self) -> Iterator[Metric]:
        c = self.read()
        pool = CounterMetricFamily(
            "kvresume_pool_evictions",
            "Window-pool entries dropped by cause (ttl: idle past the TTL; budget: LRU to fit the budget)",
            labels=["cause"],
        )
        if c.pool_expired is not None:
            pool.add_metric(["ttl"], c.pool_expired)
        if c.pool_evicted_lru is not None:
            pool.add_metric(["budget"], c.pool_evicted_lru)
        yield pool
        if c.pool_refused is not None:
            yield CounterMetricFamily(
                "kvresume_pool_refused_puts",
                "Window-pool puts refused: the value alone exceeds the whole budget",
                value=c.pool_refused,
            )
        if c.store_expired_chunks is not None:
            yield CounterMetricFamily(
                "kvresume_store_expired_chunks",
                "Stored KV chunks deleted past their retention ceiling",
                value=c.store_expired_chunks,
            )
        if c.store_evicted_chunks is not None:
            yield CounterMetricFamily(
                "kvresume_store_evicted_chunks",
                "Stored KV chunks evicted (least recently used, past their floor) to fit kv_capacity_bytes",
                value=c.store_evicted_chunks,
            )
        if c.store_unread_chunk_hits is not None:
            yield CounterMetricFamily(
                "kvresume_store_unread_chunk_hits",
                "Stored KV chunks a full hit served from kept decoded state without reading them",
                value=c.store_unread_chunk_hits,
            )
        refusals = CounterMetricFamily(
            "kvresume_store_refusals",
            "Writes the store refused by kind (capacity: full inside retention floors; residency; io_error)",
            labels=["kind"],
        )
        for kind, n in sorted(c.store_refusals.items()):
            refusals.add_metric([kind], n)
        yield refusals


class ServiceMetrics:
    """All metrics of one service instance, prefixed `kvresume_`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.turns = Counter(
            "kvresume_turns",
            "Turns by model, resume path and outcome",
            ["model", "path", "outcome"],
            registry=r,
        )
        self.turn_tokens = Counter(
            "kvresume_turn_tokens", "Prompt tokens of turns by model and kind", ["model", "kind"], registry=r
        )
        self.generated_tokens = Counter(
            "kvresume_generated_tokens", "Generated tokens handed to Turn streams", ["model"], registry=r
        )
        self.persist_failures = Counter(
            "kvresume_persist_failures",
            "Turns whose KV should have been stored but was not (the store refused or failed)",
            ["model"],
            registry=r,
        )
        self.cache_lookups = Counter(
            "kvresume_cache_lookups",
            "Stored-KV lookups by result (hit, partial, miss, corrupt)",
            ["result"],
            registry=r,
        )
        self.stored_bytes = Gauge("kvresume_stored_bytes", "Bytes of global KV in the store", registry=r)
        self.store_capacity_bytes = Gauge(
            "kvresume_store_capacity_bytes", "Capacity of the global KV store (kv_capacity_bytes)", registry=r
        )
        self.store_degraded = Gauge(
            "kvresume_store_degraded",
            "1 while the store is degraded for this reason (quarantined, read_error, write_failing), else 0",
            ["reason"],
            registry=r,
        )
        self.store_quarantined_bytes = Gauge(
            "kvresume_store_quarantined_bytes", "Bytes of damaged stores moved aside", registry=r
        )
        self.pool_bytes = Gauge("kvresume_pool_bytes", "Bytes held by the window pool", registry=r)
        self.pool_budget_bytes = Gauge(
            "kvresume_pool_budget_bytes", "Byte budget of the window pool", registry=r
        )
        self.pool_entries = Gauge("kvresume_pool_entries", "Sessions with windows in the pool", registry=r)
        self.decoded_state_lookups = Counter(
            "kvresume_decoded_state_lookups",
            "Full-hit candidates by whether kept decoded KV filled the state (hit) or the chunks were "
            "imported (miss)",
            ["result"],
            registry=r,
        )
        self.decoded_state_bytes = Gauge(
            "kvresume_decoded_state_bytes", "Bytes of decoded global KV kept beside pool entries", registry=r
        )
        self.running_turns = Gauge("kvresume_running_turns", "Turns running now", registry=r)
        self.ttft = Histogram(
            "kvresume_ttft_seconds",
            "Time to first token by model and path (also of turns aborted after their first token)",
            ["model", "path"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "kvresume_inter_token_seconds",
            "Seconds between consecutive streamed token chunks of a turn, by model",
            ["model"],
            buckets=_INTER_TOKEN_BUCKETS,
            registry=r,
        )
        self.turn_latency = Histogram(
            "kvresume_turn_seconds",
            "Whole-turn latency by model and path",
            ["model", "path"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rpcs = Counter("kvresume_rpcs", "RPCs by method and status code", ["method", "code"], registry=r)
        self.build_info = Gauge(
            "kvresume_build_info",
            "1, labelled with the version and the numerics settings (cpu path, device, kernels)",
            ["version", "numerics", "device", "kernel_backend"],
            registry=r,
        )
        self.served_model_info = Gauge(
            "kvresume_served_model_info",
            "1 per served model, labelled with its source and fingerprint (empty until loaded)",
            ["model", "source", "fingerprint"],
            registry=r,
        )
        # the batching scheduler (orchestrator/scheduler): one series per served model
        self.queue_wait = Histogram(
            "kvresume_scheduler_queue_wait_seconds",
            "Seconds a forward-pass request waited for its scheduler step, by model and kind",
            ["model", "kind"],
            buckets=_INTER_TOKEN_BUCKETS,
            registry=r,
        )
        self.batch_sequences = Histogram(
            "kvresume_scheduler_batch_sequences",
            "Sequences decoded together in one scheduler step, by model",
            ["model"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.step_tokens = Histogram(
            "kvresume_scheduler_step_tokens",
            "Tokens (decode rows plus prefill/replay rows) run in one scheduler step, by model",
            ["model"],
            buckets=(1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096),
            registry=r,
        )
        self.step_seconds = Histogram(
            "kvresume_scheduler_step_seconds",
            "Wall seconds of one scheduler step, by model",
            ["model"],
            buckets=_INTER_TOKEN_BUCKETS,
            registry=r,
        )
        # Beside step_seconds: a step whose thread was on the CPU for much less than its wall time waited
        # for the GIL (the service's threads in this process) or for a core. With a model process the
        # model's own CPU is not this thread's.
        self.step_cpu_seconds = Histogram(
            "kvresume_scheduler_step_cpu_seconds",
            "CPU seconds of the thread that ran one scheduler step, by model",
            ["model"],
            buckets=_INTER_TOKEN_BUCKETS,
            registry=r,
        )
        self.scheduler_running = Gauge(
            "kvresume_scheduler_running_turns",
            "Turns admitted by the model's scheduler (running or waiting for a step)",
            ["model"],
            registry=r,
        )
        self.scheduler_waiting = Gauge(
            "kvresume_scheduler_waiting_requests",
            "Forward-pass requests queued for the model's next step",
            ["model"],
            registry=r,
        )
        self._storage = _StorageCollector()
        r.register(self._storage)
        # Label children by (metric, label values), see `child`.
        self._children: dict[tuple[int, tuple[tuple[str, str], ...]], Any] = {}
        self._cleared = (id(self.served_model_info),)

    def child(self, metric: Any, **labels: str) -> Any:
        """`metric.labels(**labels)`, kept after the first call: prometheus_client's `labels()` checks the
        names and takes the metric's lock each time, and a turn asks for about 40 children.

        Only for metrics whose children are never removed (a `clear()` would orphan a kept child;
        `served_model_info` is cleared). Concurrent first calls both ask `labels()`, which returns the
        same child to both.
        """
        assert id(metric) not in self._cleared, "served_model_info is cleared: use labels()"
        key = (id(metric), tuple(labels.items()))
        kept = self._children.get(key)
        if kept is None:
            kept = self._children[key] = metric.labels(**labels)
        return kept

    def read_storage_counts(self, read: Callable[[], StorageCounts]) -> None:
        """Read the pool's and the store's cumulative counts through `read` at every scrape."""
        self._storage.read = read

    def set_store_health(
        self, *, reasons: Iterable[str], known: Iterable[str], quarantined_bytes: int
    ) -> None:
        """One `kvresume_store_degraded` series per known reason: 1 for those in `reasons`."""
        now = set(reasons)
        for reason in known:
            self.store_degraded.labels(reason=reason).set(1 if reason in now else 0)
        self.store_quarantined_bytes.set(quarantined_bytes)

    def set_build_info(self, *, numerics: str, device: str, kernel_backend: str) -> None:
        self.build_info.labels(
            version=package_version(), numerics=numerics, device=device, kernel_backend=kernel_backend
        ).set(1)

    def set_served_models(self, models: Mapping[str, Mapping[str, str]]) -> None:
        """One `kvresume_served_model_info` series per model: name -> {"source", "fingerprint"}."""
        self.served_model_info.clear()
        for name, labels in models.items():
            self.served_model_info.labels(
                model=name, source=labels.get("source", ""), fingerprint=labels.get("fingerprint", "")
            ).set(1)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "0.0.0.0") -> tuple[object, object]:
        """Serve `/metrics` over HTTP on `port`; returns (server, thread) for shutdown."""
        return start_http_server(port, addr=addr, registry=self.registry)

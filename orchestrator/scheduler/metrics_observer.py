"""Scheduler steps into the service metrics (queue wait, batch size, step tokens and time, gauges)."""

from __future__ import annotations

from orchestrator.api import ServiceMetrics

__all__ = ["MetricsObserver"]


class MetricsObserver:
    """`SchedulerObserver` over `ServiceMetrics`."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self._m = metrics

    def step(self, model: str, *, sequences: int, tokens: int, seconds: float) -> None:
        if sequences:
            self._m.batch_sequences.labels(model=model).observe(sequences)
        self._m.step_tokens.labels(model=model).observe(tokens)
        self._m.step_seconds.labels(model=model).observe(seconds)

    def waited(self, model: str, kind: str, seconds: float) -> None:
        self._m.queue_wait.labels(model=model, kind=kind).observe(seconds)

    def gauges(self, model: str, *, running: int, waiting: int) -> None:
        self._m.scheduler_running.labels(model=model).set(running)
        self._m.scheduler_waiting.labels(model=model).set(waiting)

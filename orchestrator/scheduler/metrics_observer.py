"""Scheduler steps into the service metrics (queue wait, batch size, step tokens and time, gauges)."""

from __future__ import annotations

from orchestrator.api import ServiceMetrics

__all__ = ["MetricsObserver"]


class MetricsObserver:
    """`SchedulerObserver` over `ServiceMetrics`."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self._m = metrics

    def step(self, model: str, *, sequences: int, tokens: int, seconds: float, cpu_seconds: float) -> None:
        if sequences:
            self._m.child(self._m.batch_sequences, model=model).observe(sequences)
        self._m.child(self._m.step_tokens, model=model).observe(tokens)
        self._m.child(self._m.step_seconds, model=model).observe(seconds)
        self._m.child(self._m.step_cpu_seconds, model=model).observe(cpu_seconds)

    def waited(self, model: str, kind: str, seconds: float) -> None:
        self._m.child(self._m.queue_wait, model=model, kind=kind).observe(seconds)

    def gauges(self, model: str, *, running: int, waiting: int) -> None:
        self._m.child(self._m.scheduler_running, model=model).set(running)
        self._m.child(self._m.scheduler_waiting, model=model).set(waiting)

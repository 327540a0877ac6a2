"""The batching scheduler's metrics (issue 11 item 4) as a scrape sees them: queue wait per pass, batch size,
rows, wall and CPU seconds per step, and the running and waiting gauges, over a stand-in compute that burns
CPU in its passes."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from orchestrator.api.metrics import ServiceMetrics
from orchestrator.scheduler import BatchingScheduler, MetricsObserver, WorkOwner

BURN_S = 0.02


class Served:
    name = "m"


def _burn(seconds: float) -> None:
    # on the CPU, not asleep: the step's thread time must see it
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


class BurningCompute:
    """Each batched pass burns BURN_S of CPU; the first prefill holds the loop until `gate` opens."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.steps: list[tuple[str, int]] = []

    def prefill(self, served, tokens: Sequence[int], state, *, prompt_end: int):
        self.entered.set()
        self.gate.wait()
        _burn(BURN_S)
        self.steps.append(("prefill", len(tokens)))
        return list(tokens)

    def decode(self, served, token: int, state):
        return token

    def decode_many(self, served, tokens: Sequence[int], states):
        _burn(BURN_S)
        self.steps.append(("decode_many", len(tokens)))
        return list(tokens)


def _sample(metrics: ServiceMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, {"model": "m", **labels})
    assert value is not None, f"{name} {labels} was never reported"
    return value


def test_metrics_observer_reports_every_step_of_the_batching_scheduler() -> None:
    metrics = ServiceMetrics()
    compute = BurningCompute()
    sched = BatchingScheduler(compute, max_batch_sequences=8, step_token_budget=16,
                              observer=MetricsObserver(metrics))  # fmt: skip
    owners = [WorkOwner(tenant_id=f"t{i % 2}", session_id=f"s{i}") for i in range(7)]
    try:
        # the first pass runs inline and holds the loop while five decodes and a 4-row chunk queue up
        first = threading.Thread(
            target=lambda: sched.prefill(Served(), [1], None, prompt_end=1, owner=owners[0])
        )
        first.start()
        assert compute.entered.wait(10)
        calls = [lambda i=i: sched.decode(Served(), 100 + i, object(), owner=owners[1 + i]) for i in range(5)]
        calls.append(lambda: sched.prefill(Served(), [2] * 4, None, prompt_end=4, owner=owners[6]))
        threads = [threading.Thread(target=c) for c in calls]
        for th in threads:
            th.start()
        deadline = time.monotonic() + 10
        while sched.waiting("m") < len(calls) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sched.waiting("m") == len(calls)
        # the queued passes' wait includes this pause, whatever the machine's speed
        time.sleep(0.2)
        compute.gate.set()
        for th in [first, *threads]:
            th.join(timeout=10)
    finally:
        compute.gate.set()
        sched.close()

    steps = 2  # the lone first chunk; then the five decodes and the chunk together
    assert compute.steps == [("prefill", 1), ("decode_many", 5), ("prefill", 4)]
    assert _sample(metrics, "kvresume_scheduler_queue_wait_seconds_count", kind="decode") == 5
    assert _sample(metrics, "kvresume_scheduler_queue_wait_seconds_count", kind="prefill") == 2
    # the queued passes waited out the blocked first step
    assert _sample(metrics, "kvresume_scheduler_queue_wait_seconds_sum", kind="decode") >= 5 * 0.15
    assert _sample(metrics, "kvresume_scheduler_batch_sequences_count") == 1
    assert _sample(metrics, "kvresume_scheduler_batch_sequences_sum") == 5
    assert _sample(metrics, "kvresume_scheduler_step_tokens_count") == steps
    assert _sample(metrics, "kvresume_scheduler_step_tokens_sum") == 1 + 5 + 4
    wall = _sample(metrics, "kvresume_scheduler_step_seconds_sum")
    cpu = _sample(metrics, "kvresume_scheduler_step_cpu_seconds_sum")
    assert _sample(metrics, "kvresume_scheduler_step_cpu_seconds_count") == steps
    # three burning passes ran on the steps' threads; the first step also waited at the gate, off the CPU
    assert 3 * BURN_S <= cpu < wall
    assert wall >= 0.2
    assert _sample(metrics, "kvresume_scheduler_waiting_requests") == 0

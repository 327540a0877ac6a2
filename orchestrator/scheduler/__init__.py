"""Schedulers: how the turns of many sessions share a served model's forward passes.

Sits between the turn engine (which plans turns, owns SQL and storage) and the model compute, as vLLM's
v1 scheduler sits beside its model runner: `batching` (the default) runs every session's decode token of
a step in one batch-invariant pass plus bounded prefill chunks; `serial` runs each pass alone (the
baseline). Both give every session the same tokens and stored bytes. A turn hands its generation over
as a decode chain (`chains`): the scheduler samples each token and queues its decode as the pass before
ends, and the turn streams what comes.
"""

from orchestrator.scheduler.admission import Admission
from orchestrator.scheduler.batching import DEFAULT_STEP_TOKEN_BUDGET, BatchingScheduler
from orchestrator.scheduler.chains import Continued, DecodeChain
from orchestrator.scheduler.fair_order import FairOrder
from orchestrator.scheduler.metrics_observer import MetricsObserver
from orchestrator.scheduler.pass_wait import PassWait, await_pass, wait_inline
from orchestrator.scheduler.serial import SerialScheduler
from orchestrator.scheduler.work import NullObserver, PassRequest, SchedulerObserver, StepCompute, WorkOwner

__all__ = [
    "DEFAULT_STEP_TOKEN_BUDGET",
    "Admission",
    "BatchingScheduler",
    "Continued",
    "DecodeChain",
    "FairOrder",
    "MetricsObserver",
    "NullObserver",
    "PassRequest",
    "PassWait",
    "await_pass",
    "wait_inline",
    "SchedulerObserver",
    "SerialScheduler",
    "StepCompute",
    "WorkOwner",
    "TurnScheduler",
    "build_scheduler",
]

TurnScheduler = BatchingScheduler | SerialScheduler


def build_scheduler(
    kind: str,
    compute: StepCompute,
    *,
    max_batch_sequences: int = 64,
    step_token_budget: int = DEFAULT_STEP_TOKEN_BUDGET,
    max_running_turns: int = 96,
    observer: SchedulerObserver | None = None,
) -> TurnScheduler:
    """The scheduler named by the `scheduler` setting ("batching" or "serial").

    Raises:
        ValueError: another name.
    """
    if kind == "batching":
        return BatchingScheduler(
            compute,
            max_batch_sequences=max_batch_sequences,
            step_token_budget=step_token_budget,
            max_running_turns=max_running_turns,
            observer=observer,
        )
    if kind == "serial":
        return SerialScheduler(compute, max_running_turns=max_running_turns, observer=observer)
    raise ValueError(f"scheduler {kind!r} must be 'batching' or 'serial'")

"""The serial scheduler: every forward pass runs alone, in the turn's own thread, one at a time per model
(the compute holds the model's lock). The baseline the batching scheduler is measured against
(`scheduler = "serial"`), and the simplest correct one.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any

from orchestrator.scheduler.admission import Admission
from orchestrator.scheduler.chains import DecodeChain, continue_chain
from orchestrator.scheduler.work import NullObserver, SchedulerObserver, StepCompute, WorkOwner

__all__ = ["SerialScheduler"]


def _ran(call: Any, *args: Any, **kwargs: Any) -> Future:
    """A done future holding what `call` returned or raised."""
    future: Future = Future()
    try:
        future.set_result(call(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - the waiting turn gets it from the future
        future.set_exception(exc)
    return future


class SerialScheduler:
    """Runs each pass as it is asked for. `chunk_tokens` None: the engine's own prefill chunk applies."""

    name = "serial"
    chunk_tokens: int | None = None

    def __init__(
        self, compute: StepCompute, *, max_running_turns: int = 96, observer: SchedulerObserver | None = None
    ) -> None:
        self.compute = compute
        self._admission = Admission(max_running_turns)
        self._observer = observer if observer is not None else NullObserver()

    def admit(self, model: str, owner: WorkOwner) -> AbstractContextManager[None]:
        return self._admission.admit(model)

    def prefill(
        self, served: Any, tokens: Sequence[int], state: Any, *, prompt_end: int, owner: WorkOwner
    ) -> Any:
        return self.compute.prefill(served, tokens, state, prompt_end=prompt_end)

    def decode(self, served: Any, token: int, state: Any, *, owner: WorkOwner) -> Any:
        return self.compute.decode(served, token, state)

    # The serial scheduler has no queue: a submitted pass runs now, in the asking thread, and its future
    # is done when it returns (the one-at-a-time baseline holds its thread through its passes).
    # (`follow_up` is the batching loop's hint; with no steps there is nothing to wait for)
    # A decode chain (chains.py) samples here, in the asking thread, and queues nothing: the turn
    # submits the next decode itself (its Continued has no `next`).
    def submit_prefill(
        self, served: Any, tokens: Sequence[int], state: Any, *, prompt_end: int, owner: WorkOwner,
        follow_up: bool = False, chain: DecodeChain | None = None,
    ) -> Future:
        return _ran(
            self._chained, chain, self.prefill, served, tokens, state, prompt_end=prompt_end, owner=owner
        )

    def submit_decode(
        self, served: Any, token: int, state: Any, *, owner: WorkOwner, follow_up: bool = False,
        chain: DecodeChain | None = None,
    ) -> Future:
        return _ran(self._chained, chain, self.decode, served, token, state, owner=owner)

    @staticmethod
    def _chained(chain: DecodeChain | None, call: Any, *args: Any, **kwargs: Any) -> Any:
        out = call(*args, **kwargs)
        return out if chain is None else continue_chain(chain, out, queue=None)

    def running(self, model: str) -> int:
        return self._admission.running(model)

    def close(self) -> None:
        pass

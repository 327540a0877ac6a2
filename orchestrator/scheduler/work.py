"""What the schedulers schedule: forward-pass requests of turns, who owns them, and the compute they run.

Knows nothing of gRPC, SQL or how a turn is planned; the turn engine hands its passes in and waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from orchestrator.scheduler.chains import DecodeChain

__all__ = ["LOGITS_WANTED", "WorkOwner", "StepCompute", "PassRequest", "SchedulerObserver", "NullObserver"]


@dataclass(frozen=True, kw_only=True)
class WorkOwner:
    """The turn a request belongs to: fairness is round-robin over tenants, then over their sessions."""

    tenant_id: str
    session_id: str


class StepCompute(Protocol):
    """The model operations a scheduler runs (the engine's ModelCompute, plus a batched decode)."""

    def prefill(self, served: Any, tokens: Sequence[int], state: Any, *, prompt_end: int) -> Any: ...

    def decode(self, served: Any, token: int, state: Any) -> Any: ...

    def decode_many(self, served: Any, tokens: Sequence[int], states: Sequence[Any]) -> list[Any]:
        """One step for many sequences; each output equals that sequence's `decode` bit for bit."""
        ...

    # Optional (a compute without it gets one `prefill` per chunk):
    # prefill_many(served, chunks, states, prompt_ends) -> list, each equal to that chunk's `prefill`.


@dataclass(kw_only=True, eq=False)
class PassRequest:
    """One forward pass a turn waits for: a prefill chunk (`tokens`) or a decode step (`token`)."""

    owner: WorkOwner
    served: Any
    state: Any
    seq: int
    enqueued_at: float
    tokens: Sequence[int] | None = None
    prompt_end: int = 0
    token: int | None = None
    # the turn will ask for its next pass as soon as this one returns (a chunk before the prompt's last,
    # a prompt or decode with more tokens to generate): the step loop waits briefly for it (batching.py)
    follow_up: bool = False
    # the turn's decode chain (chains.py): after the pass, the step samples the next token and queues
    # its decode; the future then holds a `Continued`, not the bare output
    chain: DecodeChain | None = None
    future: Future = field(default_factory=Future)

    @property
    def is_decode(self) -> bool:
        return self.token is not None

    @property
    def rows(self) -> int:
        return 1 if self.token is not None else len(self.tokens or ())

    @property
    def logits_wanted(self) -> str:
        """What of this pass's logits anyone reads (`LOGITS_WANTED`): a chain's sampler reads them (all of
        them, or only their greedy choice); nothing else in the service does, so a pass without a chain
        (a chunk before the prompt's last, a turn's last decode, which only persists its token) needs
        none. A compute that sends its outputs across a process boundary sends only that."""
        if self.chain is None:
            return "none"
        return "argmax" if self.chain.greedy else "full"


# what a pass's output must carry of its logits (PassRequest.logits_wanted): the rows, only their greedy
# choice (`engine.sampler.ChosenToken`), or nothing
LOGITS_WANTED = ("full", "argmax", "none")


class SchedulerObserver(Protocol):
    """Where a scheduler reports its steps (the service metrics)."""

    def step(self, model: str, *, sequences: int, tokens: int, seconds: float, cpu_seconds: float) -> None:
        """A step ran: decode `sequences`, `tokens` rows in all, `seconds` of wall time, of which the
        thread that ran it was on the CPU `cpu_seconds` (the rest it waited, for the GIL or a core)."""
        ...

    def waited(self, model: str, kind: str, seconds: float) -> None: ...

    def gauges(self, model: str, *, running: int, waiting: int) -> None: ...


class NullObserver:
    """Reports nowhere (tests, benchmarks without metrics)."""

    def step(self, model: str, *, sequences: int, tokens: int, seconds: float, cpu_seconds: float) -> None:
        pass

    def waited(self, model: str, kind: str, seconds: float) -> None:
        pass

    def gauges(self, model: str, *, running: int, waiting: int) -> None:
        pass

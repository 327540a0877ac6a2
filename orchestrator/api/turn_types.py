"""Domain types of the Turn RPC: what the servicer hands the turn engine and what the engine yields back.

Protobuf types stop at the servicer (STYLE rule 3); the engine sees only these dataclasses.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from orchestrator.api.running_turns import TurnHandle
from orchestrator.planner import Plan, TokenCounts

__all__ = [
    "GenerationSpec",
    "TurnInput",
    "PlanEvent",
    "TokenChunkEvent",
    "FinishReason",
    "TurnStatsEvent",
    "TurnEvent",
    "TurnHandler",
]


@dataclass(frozen=True, kw_only=True)
class GenerationSpec:
    """Validated generation parameters (greedy when temperature is 0)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be positive")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature={self.temperature} must be finite and >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must lie in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class TurnInput:
    """One turn request: exactly one of `tokens` (ids, checked against the vocabulary by the engine) or
    `text` (tokenized by the engine with the model's tokenizer)."""

    session_id: str
    tenant_id: str
    request_id: str
    tokens: tuple[int, ...] | None
    text: str | None
    generation: GenerationSpec
    model: str | None = None
    # time.monotonic() value of the caller's deadline (None: none); past it the engine raises DeadlineError.
    deadline_monotonic: float | None = None

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.text is None):
            raise ValueError("a turn carries exactly one of tokens or text")
        if not (self.tokens or self.text):
            raise ValueError(f"empty turn for session {self.session_id}: no tokens and no text")


@dataclass(frozen=True, kw_only=True)
class PlanEvent:
    plan: Plan
    turn_index: int


@dataclass(frozen=True, kw_only=True)
class TokenChunkEvent:
    ids: tuple[int, ...]
    text: str = ""


class FinishReason(enum.StrEnum):
    LENGTH = "length"
    STOP = "stop"
    ABORTED = "aborted"


@dataclass(frozen=True, kw_only=True)
class TurnStatsEvent:
    turn_index: int
    ttft_s: float
    decode_tokens_per_s: float
    counts: TokenCounts
    generated_tokens: int
    finish_reason: FinishReason
    total_s: float
    persisted: bool
    # Tokens of the session's history whose global KV is stored after the turn.
    stored_tokens: int = 0
    # False when the turn was aborted without keep_partial: the session stays at its previous turn.
    kept: bool = True


TurnEvent = PlanEvent | TokenChunkEvent | TurnStatsEvent


class TurnHandler(Protocol):
    """The turn engine as the Sessions servicer sees it.

    `run_turn` yields one PlanEvent first, then TokenChunkEvents, then one TurnStatsEvent. It checks
    `handle.cancelled` between steps and, when set after the plan, stops and ends with a TurnStatsEvent
    whose finish_reason is ABORTED: with `handle.keep_partial` and at least one token generated, the turn
    is recorded up to the tokens already streamed (kept=True); otherwise nothing of it is kept
    (kept=False). A cancel before the plan raises `CancelledError`. It raises the errors of
    `orchestrator.api.errors` for expected failures (InvalidRequestError for a token id outside the
    vocabulary, NotFoundError for an unknown model).
    """

    def run_turn(self, turn: TurnInput, handle: TurnHandle) -> Iterator[TurnEvent]: ...

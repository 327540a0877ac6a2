"""Turns of a session: begin (reserve the next index), record the plan, finish with tokens and timings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from orchestrator.db.models import (
    ResumePathName,
    SessionRow,
    TurnRow,
    TurnStatus,
    tokens_to_blob,
)

__all__ = ["TurnRepository", "TurnCounts", "TurnTimings"]


@dataclass(frozen=True, kw_only=True)
class TurnCounts:
    """Token counts by kind (ARCHITECTURE §1)."""

    cached: int = 0
    replayed_encoder: int = 0
    replayed_decoder: int = 0
    prefilled: int = 0
    mapped: int = 0

    def __post_init__(self) -> None:
        for name in ("cached", "replayed_encoder", "replayed_decoder", "prefilled", "mapped"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class TurnTimings:
    ttft_s: float | None = None
    decode_tokens_per_s: float | None = None
    total_s: float | None = None


class TurnRepository:
    def __init__(self, session: Session) -> None:
        self._s = session

    def begin(self, session_row: SessionRow, *, model: str, input_tokens: Sequence[int]) -> TurnRow:
        """Insert a RUNNING turn at the session's next index (the unique index rejects a concurrent twin)."""
        if not input_tokens:
            raise ValueError(f"turn of session {session_row.id} appends no tokens")
        turn = TurnRow(
            session_id=session_row.id,
            index=session_row.turn_count,
            model=model,
            status=TurnStatus.RUNNING,
            input_tokens=tokens_to_blob(list(input_tokens)),
        )
        self._s.add(turn)
        self._s.flush()
        return turn

    def record_plan(self, turn: TurnRow, *, path: ResumePathName, reason: str, counts: TurnCounts) -> None:
        turn.path = path
        turn.reason = reason
        turn.cached = counts.cached
        turn.replayed_encoder = counts.replayed_encoder
        turn.replayed_decoder = counts.replayed_decoder
        turn.prefilled = counts.prefilled
        turn.mapped = counts.mapped
        self._s.flush()

    def finish(
        self,
        turn: TurnRow,
        session_row: SessionRow,
        *,
        output_tokens: Sequence[int],
        timings: TurnTimings,
        status: TurnStatus = TurnStatus.DONE,
        persisted: bool = False,
    ) -> None:
        """Close the turn; a DONE turn extends the session's history and makes its model current."""
        if status == TurnStatus.RUNNING:
            raise ValueError("finish() needs a final status, got RUNNING")
        assert turn.session_id == session_row.id
        turn.status = status
        turn.output_tokens = tokens_to_blob(list(output_tokens))
        turn.ttft_s = timings.ttft_s
        turn.decode_tokens_per_s = timings.decode_tokens_per_s
        turn.total_s = timings.total_s
        turn.persisted = persisted
        if status == TurnStatus.DONE:
            session_row.turn_count = turn.index + 1
            session_row.history_tokens += len(turn.input_tokens) // 4 + len(output_tokens)
            session_row.model = turn.model
        else:
            # A failed or aborted turn leaves no trace in the history: free its index for the next turn.
            self._s.delete(turn)
        self._s.flush()

    def list(self, session_id: str) -> list[TurnRow]:
        stmt = select(TurnRow).where(TurnRow.session_id == session_id).order_by(TurnRow.index)
        return list(self._s.scalars(stmt))

    def last(self, session_id: str) -> TurnRow | None:
        stmt = select(TurnRow).where(TurnRow.session_id == session_id).order_by(TurnRow.index.desc()).limit(1)
        return self._s.scalars(stmt).one_or_none()

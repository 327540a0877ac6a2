"""Mapper fitting jobs: create, read, move through their phases, record progress and outcome.

A job's final phases (SUCCEEDED, REJECTED, FAILED, CANCELLED) are never left: every transition here
checks that the row is not final yet, so a late progress report of a cancelled child, or a restarted
node's recovery racing a finishing job, cannot overwrite how the job ended.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from orchestrator.db.models import FitJobPhase, FitJobRow, utcnow

__all__ = ["FitJobRepository", "FitJobSubmission", "UNFINISHED_PHASES"]

UNFINISHED_PHASES = (FitJobPhase.QUEUED, FitJobPhase.RUNNING, FitJobPhase.EVALUATING)


@dataclass(frozen=True, kw_only=True)
class FitJobSubmission:
    """What a job is asked to do, as stored (the service validates the request before it gets here)."""

    sender_model: str
    receiver_model: str
    source: Mapping[str, Any]
    budget_tokens: int
    gate: Mapping[str, Any] = field(default_factory=dict)
    actor: str = ""
    node: str = ""
    resubmitted_from: str | None = None

    def __post_init__(self) -> None:
        if not self.sender_model or not self.receiver_model:
            raise ValueError("a fitting job needs a sender and a receiver model")
        if self.budget_tokens <= 0:
            raise ValueError(f"budget_tokens={self.budget_tokens} must be positive")


class FitJobRepository:
    def __init__(self, session: Session) -> None:
        self._s = session

    def create(self, sub: FitJobSubmission, *, rows_total: int = 0) -> FitJobRow:
        row = FitJobRow(
            id=uuid.uuid4().hex,
            actor=sub.actor,
            node=sub.node,
            sender_model=sub.sender_model,
            receiver_model=sub.receiver_model,
            source=dict(sub.source),
            budget_tokens=sub.budget_tokens,
            gate=dict(sub.gate),
            phase=FitJobPhase.QUEUED,
            rows_total=rows_total,
            resubmitted_from=sub.resubmitted_from,
            metrics={},
        )
        self._s.add(row)
        self._s.flush()
        return row

    def get(self, job_id: str) -> FitJobRow | None:
        return self._s.get(FitJobRow, job_id)

    def list(self, *, limit: int = 100) -> list[FitJobRow]:
        stmt = select(FitJobRow).order_by(FitJobRow.created_at.desc(), FitJobRow.id).limit(limit)
        return list(self._s.scalars(stmt))

    def unfinished(self, node: str) -> list[FitJobRow]:
        stmt = select(FitJobRow).where(FitJobRow.node == node, FitJobRow.phase.in_(UNFINISHED_PHASES))
        return list(self._s.scalars(stmt.order_by(FitJobRow.created_at, FitJobRow.id)))

    def _unfinished_row(self, job_id: str) -> FitJobRow | None:
        row = self.get(job_id)
        return row if row is not None and not row.phase.final else None

    def set_phase(self, job_id: str, phase: FitJobPhase, *, reason: str | None = None) -> FitJobRow | None:
        """Move an unfinished job to `phase` (None when the job is gone or already final)."""
        row = self._unfinished_row(job_id)
        if row is None:
            return None
        row.phase = phase
        if reason is not None:
            row.reason = reason
        now = utcnow()
        if phase == FitJobPhase.RUNNING and row.started_at is None:
            row.started_at = now
        if phase.final:
            row.finished_at = now
            row.eta_s = None
        self._s.flush()
        return row

    def progress(self, job_id: str, *, rows_done: int, rows_total: int, eta_s: float | None) -> bool:
        """Record progress of an unfinished job; False when it is gone or already final."""
        row = self._unfinished_row(job_id)
        if row is None:
            return False
        if rows_done < 0 or rows_total < 0 or rows_done > rows_total:
            raise ValueError(f"job {job_id}: rows_done={rows_done} of rows_total={rows_total} is impossible")
        row.rows_done, row.rows_total, row.eta_s = rows_done, rows_total, eta_s
        self._s.flush()
        return True

    def finish(
        self,
        job_id: str,
        phase: FitJobPhase,
        *,
        reason: str,
        metrics: Mapping[str, float] | None = None,
        passed_gate: bool | None = None,
        mapper_id: str = "",
        artifact_uri: str = "",
    ) -> FitJobRow | None:
        """End an unfinished job in a final `phase` with its outcome (None when already final or gone)."""
        if not phase.final:
            raise ValueError(f"finish needs a final phase, got {phase}")
        row = self._unfinished_row(job_id)
        if row is None:
            return None
        if metrics is not None:
            row.metrics = {str(k): float(v) for k, v in metrics.items()}
        row.passed_gate = passed_gate
        row.mapper_id = mapper_id
        row.artifact_uri = artifact_uri
        return self.set_phase(job_id, phase, reason=reason)

    def fail_unfinished(self, node: str, reason: str) -> int:
        """Mark every unfinished job of `node` FAILED with `reason` (start-up: their children died with the
        node that ran them). Returns how many."""
        result = self._s.execute(
            update(FitJobRow)
            .where(FitJobRow.node == node, FitJobRow.phase.in_(UNFINISHED_PHASES))
            .values(phase=FitJobPhase.FAILED, reason=reason, finished_at=utcnow(), eta_s=None)
            .execution_options(synchronize_session=False)
        )
        return int(result.rowcount or 0)
